"""`gpu-agent mig plan|apply|assert` as a user runs it: output, exit codes, JSON and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.mig.layout import load_layouts

AGENT = [sys.executable, "-m", "agent.cli"]
H200_BALANCED_STEPS = [
    "GPU 0: enable MIG",
    "GPU 0: create 3g.71gb at slices 4-7",
    "GPU 0: create 2g.35gb at slices 0-1",
    "GPU 0: create 1g.18gb at slice 2",
    "GPU 0: create 1g.18gb at slice 3",
]
H200_BALANCED = [
    {"profile": "2g.35gb", "start": 0, "size": 2},
    {"profile": "1g.18gb", "start": 2, "size": 1},
    {"profile": "1g.18gb", "start": 3, "size": 1},
    {"profile": "3g.71gb", "start": 4, "size": 4},
]


def gpu_agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AGENT, *args], capture_output=True, text=True, timeout=60)


def mig(action: str, node: str, state: Path, layout: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return gpu_agent("mig", action, "--nvml", f"mock:{node}", "--mock-state", str(state), "--layout", layout,
                     *extra)


def applied(node: str, state: Path, layout: str, state_dir: Path) -> None:
    done = mig("apply", node, state, layout, "--state-dir", str(state_dir))
    assert done.returncode == 0, done.stdout + done.stderr


# --- plan -------------------------------------------------------------------------------------------------


def test_plan_on_a_fresh_node_prints_the_changes_and_creates_no_state(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    done = mig("plan", "dgx-h100", state, "all-balanced")
    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert lines[:6] == [
        "GPU 0: enable MIG",
        "GPU 0: create 3g.40gb at slices 4-7",
        "GPU 0: create 2g.20gb at slices 0-1",
        "GPU 0: create 1g.10gb at slice 2",
        "GPU 0: create 1g.10gb at slice 3",
        "GPU 1: enable MIG",
    ]
    assert len(lines) == 40
    assert not state.exists()


def test_plan_changes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    applied("dgx-h100", state, "all-1g.10gb", tmp_path / "state")
    before = state.read_bytes()

    done = mig("plan", "dgx-h100", state, "all-balanced", "--state-dir", str(tmp_path / "state"))

    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert lines[:8] == [
        "GPU 0: destroy 1g.10gb at slice 0",
        "GPU 0: destroy 1g.10gb at slice 1",
        "GPU 0: destroy 1g.10gb at slice 4",
        "GPU 0: destroy 1g.10gb at slice 5",
        "GPU 0: destroy 1g.10gb at slice 6",
        "GPU 0: create 3g.40gb at slices 4-7",
        "GPU 0: create 2g.20gb at slices 0-1",
        "GPU 1: destroy 1g.10gb at slice 0",
    ]
    assert len(lines) == 56
    assert state.read_bytes() == before
    assert mig("assert", "dgx-h100", state, "all-1g.10gb").returncode == 0


def test_plan_of_an_applied_layout_says_no_changes(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    applied("single-h200", state, "all-balanced", tmp_path / "state")
    done = mig("plan", "single-h200", state, "all-balanced")
    assert (done.returncode, done.stdout, done.stderr) == (0, "no changes\n", "")


# --- apply and assert -------------------------------------------------------------------------------------


NOTHING_ON_L40S = ("layout 'all-balanced' selects no GPU on this node: none of its device filters and device lists "
                   "matches the node's 4 GPUs; nothing changed")


def test_a_layout_that_selects_no_gpu_says_so_in_plan_apply_and_assert(tmp_path: Path) -> None:
    # all-balanced (as in NVIDIA's mig-parted examples) filters by the PCI ids of MIG-capable GPUs; an L40S is
    # none of them.
    state, state_dir = tmp_path / "nvml.json", tmp_path / "state"
    planned = mig("plan", "pcie-l40s-4", state, "all-balanced")
    assert (planned.returncode, planned.stdout, planned.stderr) == (0, NOTHING_ON_L40S + "\n", "")
    done = mig("apply", "pcie-l40s-4", state, "all-balanced", "--state-dir", str(state_dir))
    assert (done.returncode, done.stdout, done.stderr) == (0, f"success: {NOTHING_ON_L40S}\n", "")
    checked = mig("assert", "pcie-l40s-4", state, "all-balanced")
    assert (checked.returncode, checked.stdout) == (0, NOTHING_ON_L40S + "\n")
    as_json = json.loads(mig("plan", "pcie-l40s-4", state, "all-balanced", "--json").stdout)
    assert (as_json["selects_nothing"], as_json["untouched"], as_json["gpus"]) == (NOTHING_ON_L40S, [0, 1, 2, 3], [])
    selecting = json.loads(mig("plan", "single-h200", state, "all-balanced", "--json").stdout)
    assert selecting["selects_nothing"] is None


def test_apply_prints_each_step_then_success_and_assert_agrees(tmp_path: Path) -> None:
    state, state_dir = tmp_path / "nvml.json", tmp_path / "state"
    done = mig("apply", "single-h200", state, "all-balanced", "--state-dir", str(state_dir))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [*H200_BALANCED_STEPS, "success: layout 'all-balanced' applied: 5 change(s)"]
    assert list(state_dir.iterdir()) == []  # the journal is gone once the apply ended

    again = mig("apply", "single-h200", state, "all-balanced", "--state-dir", str(state_dir))
    assert (again.returncode, again.stdout) == (0, "success: layout 'all-balanced' is already applied\n")

    checked = mig("assert", "single-h200", state, "all-balanced")
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "layout 'all-balanced' is applied\n", "")


def test_assert_of_another_layout_exits_1_with_what_is_left_to_do(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    applied("single-h200", state, "all-balanced", tmp_path / "state")
    done = mig("assert", "single-h200", state, "all-7g.141gb")
    assert (done.returncode, done.stderr) == (1, "")
    assert done.stdout.splitlines() == [
        "layout 'all-7g.141gb' is not applied; to do:",
        "GPU 0: destroy 2g.35gb at slices 0-1",
        "GPU 0: destroy 1g.18gb at slice 2",
        "GPU 0: destroy 1g.18gb at slice 3",
        "GPU 0: destroy 3g.71gb at slices 4-7",
        "GPU 0: create 7g.141gb at slices 0-7",
    ]


def test_assert_on_a_fresh_node_exits_1(tmp_path: Path) -> None:
    done = mig("assert", "single-h200", tmp_path / "nvml.json", "all-enabled")
    assert (done.returncode, done.stdout) == (1, "layout 'all-enabled' is not applied; to do:\nGPU 0: enable MIG\n")


def test_a_layout_the_gpus_cannot_take_fails_every_action(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    reason = ("GPU 0: profile 1g.10gb+me does not exist on H200 (known: 1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, "
              "3g.71gb, 4g.71gb, 7g.141gb)")
    for action in ("plan", "assert"):
        done = mig(action, "single-h200", state, "all-1g.10gb.me")
        assert (done.returncode, done.stdout) == (1, f"layout 'all-1g.10gb.me' cannot be applied:\n{reason}\n")
    done = mig("apply", "single-h200", state, "all-1g.10gb.me", "--state-dir", str(tmp_path / "state"))
    assert (done.returncode, done.stdout) == (1, f"failed: layout 'all-1g.10gb.me' cannot be applied: {reason}\n")
    assert not state.exists()
    assert not (tmp_path / "state").exists()


def test_apply_on_ampere_reports_rebooting_and_exits_1(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    done = mig("apply", "dgx-a100", state, "all-balanced", "--state-dir", str(tmp_path / "state"))
    assert (done.returncode, done.stderr) == (1, "")
    waits = "; ".join(f"GPU {i}: MIG enable is pending (the GPU is in use or needs a reset)" for i in range(8))
    assert done.stdout.splitlines() == [
        *(f"GPU {i}: enable MIG" for i in range(8)),
        f"rebooting: {waits}; let the GPUs go idle and apply again, or reset the GPUs (reboot the node)",
    ]


def test_apply_with_an_unusable_state_dir_is_one_line_and_changes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    (tmp_path / "a-file").write_text("")
    state_dir = tmp_path / "a-file" / "state"
    done = mig("apply", "single-h200", state, "all-balanced", "--state-dir", str(state_dir))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 1 and str(state_dir) in lines[0], lines
    assert not state.exists()


# --- JSON -------------------------------------------------------------------------------------------------


def test_plan_json(tmp_path: Path) -> None:
    done = mig("plan", "single-h200", tmp_path / "nvml.json", "all-balanced", "--json")
    assert done.returncode == 0
    assert json.loads(done.stdout) == {
        "layout": "all-balanced",
        "feasible": True,
        "applied": False,
        "untouched": [],
        "steps": H200_BALANCED_STEPS,
        "selects_nothing": None,
        "gpus": [{
            "gpu": 0,
            "mode": "enable",
            "destroy": [],
            "create": [H200_BALANCED[3], H200_BALANCED[0], H200_BALANCED[1], H200_BALANCED[2]],
            "target": H200_BALANCED,
        }],
    }


def test_plan_json_of_a_layout_that_cannot_fit(tmp_path: Path) -> None:
    done = mig("plan", "single-h200", tmp_path / "nvml.json", "all-7g.80gb", "--json")
    assert done.returncode == 1
    assert json.loads(done.stdout) == {
        "layout": "all-7g.80gb",
        "feasible": False,
        "problems": [{"gpu": 0, "reason": "profile 7g.80gb does not exist on H200 (known: 1g.18gb, 1g.18gb+me, "
                                          "1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb)"}],
    }


def test_apply_json_is_one_json_document(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    done = mig("apply", "single-h200", state, "all-balanced", "--state-dir", str(tmp_path / "state"), "--json")
    assert done.returncode == 0
    # A machine reads stdout as JSON: progress lines must not be mixed into it.
    document: Any = json.loads(done.stdout)
    assert document == {"layout": "all-balanced", "outcome": "success",
                        "reason": "layout 'all-balanced' applied: 5 change(s)"}


def test_assert_json_after_apply(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    applied("single-h200", state, "all-balanced", tmp_path / "state")
    done = mig("assert", "single-h200", state, "all-balanced", "--json")
    assert done.returncode == 0
    assert json.loads(done.stdout) == {
        "layout": "all-balanced",
        "feasible": True,
        "applied": True,
        "untouched": [],
        "steps": [],
        "selects_nothing": None,
        "gpus": [{"gpu": 0, "mode": "none", "destroy": [], "create": [], "target": H200_BALANCED}],
    }


# --- bad input --------------------------------------------------------------------------------------------


def test_an_unknown_layout_names_the_layout_and_the_file(tmp_path: Path) -> None:
    done = mig("plan", "dgx-h100", tmp_path / "nvml.json", "all-9g.99gb")
    names = load_layouts().names()
    # Up to 40 names are listed, then how many more there are.
    known = ", ".join(names[:40]) + (f" and {len(names) - 40} more" if len(names) > 40 else "")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (f"gpu-agent mig: error: built-in default-layouts.yaml: no layout named 'all-9g.99gb' "
                           f"(known: {known})\n")

    layouts = tmp_path / "layouts.yaml"
    layouts.write_text("version: v1\nmig-configs:\n  mine:\n    - devices: all\n      mig-enabled: false\n")
    done = mig("apply", "dgx-h100", tmp_path / "nvml.json", "theirs", "--mig-config", str(layouts),
               "--state-dir", str(tmp_path / "state"))
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"gpu-agent mig: error: {layouts}: no layout named 'theirs' (known: mine)\n"
    assert not (tmp_path / "nvml.json").exists()


@pytest.mark.parametrize(
    ("text", "problems"),
    [
        ('version: v1\nmig-configs:\n  mine:\n    - devices: all\n      mig-enabled: true\n'
         '      mig-devices: {"1g.10gb": seven}\n',
         ["mig-configs.mine[0].mig-devices.1g.10gb: count must be an integer, got 'seven'"]),
        ("version: v1\nmig-configs:\n  mine:\n    - devices: all\n      mig-enable: true\n",
         ["mig-configs.mine[0].mig-enabled: required key is missing", "mig-configs.mine[0].mig-enable: unknown key"]),
    ],
)
def test_a_malformed_layout_file_is_one_line_naming_the_key(tmp_path: Path, text: str, problems: list[str]) -> None:
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text(text)
    done = mig("apply", "dgx-h100", tmp_path / "nvml.json", "mine", "--mig-config", str(layouts),
               "--state-dir", str(tmp_path / "state"))
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "gpu-agent mig: error: " + "; ".join(f"{layouts}: {p}" for p in problems) + "\n"
    assert not (tmp_path / "nvml.json").exists()


def test_a_missing_layout_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"
    done = mig("plan", "dgx-h100", tmp_path / "nvml.json", "mine", "--mig-config", str(missing))
    assert (done.returncode, done.stdout, done.stderr) == (1, "", f"gpu-agent mig: error: {missing}: no such file\n")


# --- the acceptance check ---------------------------------------------------------------------------------


def test_all_1g_10gb_on_dgx_h100_is_56_mixed_mig_devices(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    done = mig("apply", "dgx-h100", state, "all-1g.10gb", "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "success: layout 'all-1g.10gb' applied: 64 change(s)"
    assert mig("assert", "dgx-h100", state, "all-1g.10gb").returncode == 0

    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags:\n  migStrategy: mixed\n")
    shown = gpu_agent("simulate", "--node", "dgx-h100", "--mock-state", str(state), "--config", str(config),
                      "--json")
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["node"]["capacity"] == {"nvidia.com/mig-1g.10gb": "56"}
    assert view["node"]["allocatable"] == {"nvidia.com/mig-1g.10gb": "56"}
    devices = view["devices"]["nvidia.com/mig-1g.10gb"]
    assert len({d["id"] for d in devices}) == 56
    assert all(d["id"].startswith("MIG-") and d["health"] == "Healthy" for d in devices)
