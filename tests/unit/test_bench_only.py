"""bench/run.py --only: a section name it does not know is refused before anything is measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_unknown_section_is_refused_naming_the_choices(tmp_path: Path) -> None:
    out = tmp_path / "only.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--only", "floor,flor", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        "run.py: error: --only: unknown section(s) flor; choose from preferred, allocate, many_clients, "
        "many_devices, health, telemetry, mig_apply, floor, process, apiserver, nvml_stuck, cluster")
    assert not out.exists()
