"""The one line a failed image build ends with (hack/cluster/lib.sh, build_failure), over build logs as pip writes
them when the lock cannot serve a platform: a wheel whose hash the lock lacks, no wheel for the platform at all,
and a build that failed elsewhere."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WHEEL = "PyYAML-6.0.2-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl"
HASH_MISSING = f"""STEP 5/11: RUN python -m venv /opt/gpu-node-agent  && /opt/gpu-node-agent/bin/pip install \
--require-hashes --no-deps --only-binary=:all: -r requirements.lock
Collecting aiohttp==3.12.15 (from -r requirements.lock (line 7))
  Downloading aiohttp-3.12.15-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl (1.7 MB)
ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE. If you have updated the package \
versions, please update the hashes. Otherwise, examine the package contents carefully; someone may have tampered \
with them.
    pyyaml==6.0.2 from https://files.pythonhosted.org/packages/a2/{WHEEL}#sha256=0a1b (from -r requirements.lock \
(line 90)):
        Expected sha256 1f71ea527786de97d1a0cc0eacd1defc0985dcf6b3f17bb77dcfc8c34bec4dc5
             Got        0a1b
Error: building at STEP "RUN python -m venv /opt/gpu-node-agent ...": exit status 1
"""
NO_WHEEL = """Collecting grpcio==1.85.3 (from -r requirements.lock (line 30))
ERROR: Could not find a version that satisfies the requirement grpcio==1.85.3 (from versions: none)
ERROR: No matching distribution found for grpcio==1.85.3
Error: building at STEP "RUN python -m venv /opt/gpu-node-agent ...": exit status 1
"""
OTHER = """STEP 2/11: WORKDIR /src
Error: creating build container: no space left on device
"""


@pytest.mark.parametrize(("log", "line"), [
    (HASH_MISSING, f"requirements.lock has no hash for {WHEEL}, the wheel pip picked for linux/arm64"),
    (NO_WHEEL, "pip on linux/arm64: Could not find a version that satisfies the requirement grpcio==1.85.3 "
               "(from versions: none)"),
    (OTHER, "Error: creating build container: no space left on device"),
])
def test_a_failed_build_is_one_line_naming_the_wheel_and_the_platform(tmp_path: Path, log: str, line: str) -> None:
    path = tmp_path / "agent-arm64.log"
    path.write_text(log)
    done = subprocess.run(["bash", "-c", 'source hack/cluster/lib.sh && build_failure linux/arm64 "$1"', "-",
                           str(path)], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "KUBE": ""})
    assert (done.returncode, done.stdout, done.stderr) == (0, line + "\n", "")
