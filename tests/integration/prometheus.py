"""A real Prometheus server and promtool, built by hack/prometheus.sh, for the metrics tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
TESTBIN = Path(os.environ.get("TESTBIN_DIR", REPO / ".cache" / "testbin"))
SCRIPT = REPO / "hack" / "prometheus.sh"
PROMETHEUS = TESTBIN / "prometheus"
PROMTOOL = TESTBIN / "promtool"


def ensure_prometheus() -> None:
    """Build (or find up to date) the pinned prometheus and promtool."""
    env = {**os.environ, "TESTBIN_DIR": str(TESTBIN)}
    result = subprocess.run(["bash", str(SCRIPT)], env=env, stdout=sys.stderr, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{SCRIPT} failed with exit code {result.returncode}")


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), *args], input=stdin, capture_output=True, text=True, check=False,
                          timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus server on loopback, and its HTTP API."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: str | None = None) -> list[dict[str, Any]]:
        """An instant query, now or at the time `at` (seconds since the epoch, as the API writes timestamps)."""
        data = self.get("/api/v1/query", query=expr, **({"time": at} if at is not None else {}))
        assert data["resultType"] == "vector", (expr, data["resultType"])
        result: list[dict[str, Any]] = data["result"]
        return result


@contextlib.contextmanager
def running_prometheus(directory: Path, targets: dict[str, int], rule_files: list[Path],
                       interval: str = "1s") -> Iterator[Prometheus]:
    """Prometheus scraping 127.0.0.1:<port> for each instance name in `targets` (the instance label is the
    name, as a node's), evaluating `rule_files`."""
    port = free_port()
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{
            "job_name": "gpu-node-agent",
            "static_configs": [{"targets": [f"127.0.0.1:{p}"], "labels": {"instance": name}}
                               for name, p in targets.items()],
        }],
    }
    config_file = directory / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    log = open(directory / "prometheus.log", "w")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [str(PROMETHEUS), f"--config.file={config_file}", f"--storage.tsdb.path={directory / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = Prometheus(port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(directory / 'prometheus.log').read_text()}")
            time.sleep(0.2)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
