"""Figures of the agent's image for linux/amd64 and linux/arm64 (`make image`), for docs/benchmarks.md: each
platform's image size (its layers as the archive holds them, gzip-compressed as a registry holds them, and
unpacked) and how long its agent takes, run from the image's root filesystem (the arm64 one under
qemu), from its start to its registration with the kubelet's device manager (the kubelet harness's own clock, on a
simulated GB200 NVL72 tray) and to print that tray (`gpu-agent simulate --json`, wall time). Written to
bench/image.json, then docs/benchmarks.md is rendered anew (bench/report.py). Reported, not budgeted.

usage: .venv/bin/python bench/image.py [RUNS]   (root, after `make image`; RUNS per platform, default 5)
"""

from __future__ import annotations

import datetime
import json
import os
import platform as host
import re
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import report  # noqa: E402
from tests.image.image_archive import INDEX_ARCHIVE, Archive, Image, unpacked  # noqa: E402

PRESET = "gb200-nvl72-tray"
HARNESS = REPO / ".cache" / "testbin" / "kubelet-harness"


def sizes(archive: Archive, image: Image) -> tuple[int, int]:
    """The image in bytes: its config and layers as the archive holds them (gzip-compressed, as a registry holds
    and sends them), and its layers unpacked (the tar streams a node's runtime extracts)."""
    stored = image.manifest["config"]["size"]
    unpacked_bytes = 0
    for layer in image.manifest["layers"]:
        stored += layer["size"]
        gunzip = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib, by its header
        blob = archive.open_blob(layer["digest"])
        while chunk := blob.read(1 << 20):
            unpacked_bytes += len(gunzip.decompress(chunk) if layer["mediaType"].endswith("+gzip") else chunk)
    return stored, unpacked_bytes


def qemu_version() -> str:
    """The version of the qemu-user-static the arm64 agent runs under, as dpkg has it."""
    done = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "qemu-user-static"], capture_output=True,
                          text=True)
    return done.stdout.strip() or "unknown"


def revision() -> str:
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "agent", "Dockerfile",
                            "requirements.lock"], capture_output=True, text=True).stdout.strip()
    return f"{rev} with uncommitted changes" if dirty else rev


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    started = time.monotonic()
    subprocess.run(["bash", str(REPO / "hack" / "kubelet-harness.sh")], check=True, stdout=sys.stderr)
    on = subprocess.run(["bash", str(REPO / "hack" / "binfmt.sh"), "on"], check=True, capture_output=True, text=True)
    archive = Archive(INDEX_ARCHIVE)
    platforms: dict[str, Any] = {}
    try:
        ref = archive.top()["annotations"]["org.opencontainers.image.ref.name"]
        print(f"{INDEX_ARCHIVE.name}: {ref}, {runs} runs per platform")
        for platform, image in sorted(archive.images().items()):
            stored, unpacked_bytes = sizes(archive, image)
            rooted = unpacked(archive, platform)
            registered, simulated = [], []
            for _ in range(runs):
                done = subprocess.run([str(HARNESS), "-devices", "4", "-register-within", "60s",
                                       "-reregister-within", "5s", "--", *rooted.plugin(PRESET)],
                                      capture_output=True, text=True, timeout=300)
                found = re.search(r"^PASS registration: .* after (\d+) ms$", done.stdout, re.M)
                assert done.returncode == 0 and found, done.stdout + done.stderr
                registered.append(int(found.group(1)) / 1000)
                start = time.monotonic()
                rooted.agent("simulate", "--node", PRESET, "--json")
                simulated.append(round(time.monotonic() - start, 3))
            platforms[platform] = {"compressed_bytes": stored, "unpacked_bytes": unpacked_bytes,
                                   "registration_s": registered, "simulate_s": simulated}
            print(f"{platform}: {stored / 1e6:.1f} MB compressed, {unpacked_bytes / 1e6:.1f} MB unpacked; start to "
                  f"registration median {statistics.median(registered):.2f} s; simulate median "
                  f"{statistics.median(simulated):.2f} s")
    finally:
        archive.close()
        subprocess.run(["bash", str(REPO / "hack" / "binfmt.sh"), "off", *on.stdout.split()], check=True)
    result = {
        "generated_by": "bench/image.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": {"nproc": os.cpu_count(), "cpu_model": report_cpu(), "host": host.machine(),
                    "qemu_user_static": qemu_version(), "load_average_at_end": list(os.getloadavg())},
        "revision": revision(),
        "image": ref,
        "preset": PRESET,
        "runs": runs,
        "platforms": platforms,
    }
    report.IMAGE.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {report.IMAGE} and {report.write()}")
    return 0


def report_cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return host.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
