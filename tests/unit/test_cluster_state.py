"""The simulated GPUs' state an earlier cluster left on the host (hack/cluster/lib.sh, `sim_state_check`, run by
up.sh): the e2e suite's cluster (CLUSTER_FRESH_STATE=1) removes it and starts from the preset, saying so; `make
cluster` starts on it, and says so. A run of the suite then never inherits the MIG layouts or faults of the last."""

from __future__ import annotations

import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "hack" / "cluster" / "lib.sh"


def check(files: list[Path], fresh: bool) -> list[str]:
    """Run sim_state_check on `files`; the lines it says."""
    env = {"PATH": "/usr/bin:/bin", "CLUSTER_RUN_DIR": "/nonexistent-run-dir"}
    if fresh:
        env["CLUSTER_FRESH_STATE"] = "1"
    result = subprocess.run(["bash", "-c", f'source "{LIB}" && sim_state_check "$@"', "_", *map(str, files)],
                            capture_output=True, text=True, env=env, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()


def test_a_fresh_cluster_removes_the_state_an_earlier_one_left_and_says_so(tmp_path: Path) -> None:
    state, lock, journal = tmp_path / "mock-nvml.json", tmp_path / "mock-nvml.json.lock", tmp_path / "mig-journal.json"
    state.write_text('{"gpus": "MIG enabled on all 8"}')
    lock.write_text("")
    dangling = tmp_path / "mock-nvml-gpus.json"
    dangling.symlink_to(tmp_path / "nowhere")
    assert check([state, lock, dangling, journal], fresh=True) == [
        f"cluster: removing the simulated GPUs' state an earlier cluster left: {state} {lock} {dangling}"]
    assert sorted(tmp_path.iterdir()) == []


def test_make_cluster_starts_on_the_state_an_earlier_one_left_and_says_so(tmp_path: Path) -> None:
    state = tmp_path / "mock-nvml.json"
    state.write_text("{}")
    assert check([state, tmp_path / "mig-journal.json"], fresh=False) == [
        f"cluster: starting on the simulated GPUs' state an earlier cluster left (MIG modes, instances and faults as "
        f"they were): {state}; CLUSTER_FRESH_STATE=1 starts from the preset instead"]
    assert state.read_text() == "{}"


def test_no_state_left_says_nothing(tmp_path: Path) -> None:
    assert check([tmp_path / "mock-nvml.json"], fresh=True) == []
