"""MIG apply through NVML on the fake driver: outcomes, what the hardware has afterwards, minimal changes,
mode changes, NVML errors and the journal."""

from __future__ import annotations

import ctypes
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.mig.applier import JOURNAL, ApplyResult, Journal, plan_layout
from agent.mig.layout import MigLayout, load_layouts, parse_layouts
from agent.nvml.fake import FakeNvml
from agent.yamlfile import InputFileError
from tests.builders import MigNode, started

SHIPPED = load_layouts(None)
RESET_HINT = "let the GPUs go idle and apply again, or reset the GPUs (reboot the node)"

# Test layouts for dgx-h100 (H100 80GB): one that changes GPU 0 only, and ones that cannot fit.
TEST_LAYOUTS = """\
version: v1
mig-configs:
  gpu0-sevens:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [1, 2, 3, 4, 5, 6, 7]
      mig-enabled: true
      mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
  no-fit:
    - devices: all
      mig-enabled: true
      mig-devices: {"4g.40gb": 1, "2g.20gb": 2}
  no-fit-on-gpu-3:
    - devices: [3]
      mig-enabled: true
      mig-devices: {"4g.40gb": 1, "2g.20gb": 2}
    - devices: [0, 1, 2, 4, 5, 6, 7]
      mig-enabled: true
      mig-devices: {"7g.80gb": 1}
"""
NO_FIT_REASON = ("4g.40gb + 2 x 2g.20gb do not fit together: 4g.40gb must use slices 0-3; "
                 "2g.20gb can use slices 0-1, 2-3 or 4-5 (none of them can use slices 6, 7)")


@pytest.fixture(scope="module")
def test_layouts() -> dict[str, MigLayout]:
    return dict(parse_layouts(TEST_LAYOUTS, "test-layouts.yaml").layouts)


def instances(node: MigNode) -> dict[int, list[tuple[str, int, int]]]:
    """Each GPU's GPU instances as the MIG devices show them, by start; asserts one compute instance each."""
    inventory = node.backend.inventory()
    per_gi = Counter((d.parent_index, d.gpu_instance_id) for d in inventory.mig_devices)
    assert set(per_gi.values()) <= {1}, f"GPU instances with more than one compute instance: {per_gi}"
    found: dict[int, list[tuple[str, int, int]]] = {g.index: [] for g in inventory.gpus}
    for d in inventory.mig_devices:
        found[d.parent_index].append((d.profile, d.placement_start, d.placement_size))
    # MigOps sees GPU instances that have no compute instance, which MIG devices cannot show.
    for index in found:
        state = node.ops.state(index)
        assert [i.compute_instances for i in state.instances] == [1] * len(state.instances), (index, state)
        assert sorted(found[index]) == sorted((i.profile, i.start, i.size) for i in state.instances)
    return {index: sorted(items, key=lambda i: i[1]) for index, items in found.items()}


def modes(node: MigNode) -> list[tuple[bool, bool]]:
    """(MIG enabled, mode change pending) per GPU."""
    return [(s.mig_enabled, s.mig_pending) for s in map(node.ops.state, range(node.count))]


def rebooting_reason(gpus: list[int], change: str = "enable") -> str:
    pending = "is pending (the GPU is in use or needs a reset)"
    return "; ".join(f"GPU {i}: MIG {change} {pending}" for i in gpus) + f"; {RESET_HINT}"


def selects_nothing(name: str, gpus: int) -> str:
    return (f"layout {name!r} selects no GPU on this node: none of its device filters and device lists matches "
            f"the node's {gpus} GPU{'' if gpus == 1 else 's'}; nothing changed")


# --- exact placements (every shipped layout on every preset: tests/unit/test_shipped_layouts.py) -------


def test_balanced_on_dgx_h100_has_the_exact_instances() -> None:
    node = started("dgx-h100")
    result = node.apply(SHIPPED.layout("all-balanced"))
    assert (result.outcome, result.reason) == ("success", "layout 'all-balanced' applied: 40 change(s)")
    balanced = [("2g.20gb", 0, 2), ("1g.10gb", 2, 1), ("1g.10gb", 3, 1), ("3g.40gb", 4, 4)]
    assert instances(node) == dict.fromkeys(range(8), balanced)
    assert len(node.backend.inventory().mig_devices) == 32
    assert len({d.uuid for d in node.backend.inventory().mig_devices}) == 32


def test_a_profile_missing_on_the_model_fails_with_the_planner_reason() -> None:
    node = started("dgx-h100")
    result = node.apply(SHIPPED.layout("all-1g.5gb"))
    known = "1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb"
    line = f"profile 1g.5gb does not exist on H100 80GB HBM3 (known: {known})"
    assert result == ApplyResult("all-1g.5gb", "failed", "layout 'all-1g.5gb' cannot be applied: "
                                 + "\n".join(f"GPU {i}: {line}" for i in range(8)))


# --- layouts that cannot be applied change nothing --------------------------------------------------------


@pytest.mark.parametrize(
    ("layout_name", "reason"),
    [
        ("no-fit", "\n".join(f"GPU {i}: {NO_FIT_REASON}" for i in range(8))),
        # One GPU that cannot take its entry stops the whole node: the others are not touched either.
        ("no-fit-on-gpu-3", f"GPU 3: {NO_FIT_REASON}"),
    ],
)
def test_impossible_layout_is_refused_and_changes_nothing(
    tmp_path: Path, test_layouts: dict[str, MigLayout], layout_name: str, reason: str
) -> None:
    state_file = tmp_path / "nvml.json"
    node = started("dgx-h100", state_file)
    assert node.apply(SHIPPED.layout("all-balanced")).outcome == "success"
    before = state_file.read_bytes()
    steps: list[str] = []

    result = node.apply(test_layouts[layout_name], Journal(tmp_path / "state"), steps)

    assert result == ApplyResult(layout_name, "failed", f"layout {layout_name!r} cannot be applied: {reason}")
    assert steps == []
    assert state_file.read_bytes() == before
    assert not (tmp_path / "state" / JOURNAL).exists()


# --- minimal change ---------------------------------------------------------------------------------------


def test_a_layout_that_changes_gpu_0_touches_only_gpu_0(test_layouts: dict[str, MigLayout]) -> None:
    node = started("dgx-h100")
    node.apply(SHIPPED.layout("all-balanced"))
    before = instances(node)
    steps: list[str] = []

    result = node.apply(test_layouts["gpu0-sevens"], steps=steps)

    assert (result.outcome, result.reason) == ("success", "layout 'gpu0-sevens' applied: 7 change(s)")
    # The two 1g instances at slices 2 and 3 already sit where seven 1g instances go: they stay.
    assert steps == [
        "GPU 0: destroy 2g.20gb at slices 0-1",
        "GPU 0: destroy 3g.40gb at slices 4-7",
        "GPU 0: create 1g.10gb at slice 0",
        "GPU 0: create 1g.10gb at slice 1",
        "GPU 0: create 1g.10gb at slice 4",
        "GPU 0: create 1g.10gb at slice 5",
        "GPU 0: create 1g.10gb at slice 6",
    ]
    after = instances(node)
    assert after[0] == [("1g.10gb", s, 1) for s in range(7)]
    assert {i: after[i] for i in range(1, 8)} == {i: before[i] for i in range(1, 8)}


def test_a_layout_that_selects_no_gpu_of_the_node_changes_nothing() -> None:
    # all-1g.10gb names H100/A100 models only; an H200 node is left as it is.
    node = started("hgx-h200")
    result = node.apply(SHIPPED.layout("all-1g.10gb"))
    assert (result.outcome, result.reason) == ("success", selects_nothing("all-1g.10gb", 8))
    assert result.plan is not None and result.plan.untouched == tuple(range(8))
    assert modes(node) == [(False, False)] * 8


# --- MIG mode changes -------------------------------------------------------------------------------------


def test_hopper_enables_mig_at_once() -> None:
    node = started("single-h200")
    steps: list[str] = []
    result = node.apply(SHIPPED.layout("all-enabled"), steps=steps)
    assert (result.outcome, result.reason, steps) == (
        "success", "layout 'all-enabled' applied: 1 change(s)", ["GPU 0: enable MIG"])
    assert modes(node) == [(True, False)]
    assert instances(node) == {0: []}


def test_disabling_mig_destroys_the_instances_first() -> None:
    node = started("single-h200")
    node.apply(SHIPPED.layout("all-balanced"))
    steps: list[str] = []

    result = node.apply(SHIPPED.layout("all-disabled"), steps=steps)

    assert (result.outcome, result.reason) == ("success", "layout 'all-disabled' applied: 5 change(s)")
    assert steps == [
        "GPU 0: destroy 2g.35gb at slices 0-1",
        "GPU 0: destroy 1g.18gb at slice 2",
        "GPU 0: destroy 1g.18gb at slice 3",
        "GPU 0: destroy 3g.71gb at slices 4-7",
        "GPU 0: disable MIG",
    ]
    assert modes(node) == [(False, False)]
    assert node.backend.inventory().mig_devices == ()


def test_ampere_enable_waits_for_a_reset_gpu_by_gpu() -> None:
    node = started("a100-pcie-nvlink-pairs")
    layout = SHIPPED.layout("all-balanced")
    steps: list[str] = []

    result = node.apply(layout, steps=steps)

    assert (result.outcome, result.reason) == (
        "rebooting",
        rebooting_reason([0, 1, 2, 3]),
    )
    assert steps == ["GPU 0: enable MIG", "GPU 1: enable MIG", "GPU 2: enable MIG", "GPU 3: enable MIG"]
    assert modes(node) == [(False, True)] * 4

    node.fake.reset_gpu(0)
    node.fake.reset_gpu(1)
    result = node.apply(layout)
    assert (result.outcome, result.reason) == ("rebooting", rebooting_reason([2, 3]))
    balanced = [("2g.20gb", 0, 2), ("1g.10gb", 2, 1), ("1g.10gb", 3, 1), ("3g.40gb", 4, 4)]
    assert instances(node) == {0: balanced, 1: balanced, 2: [], 3: []}

    node.fake.reset_gpu(2)
    node.fake.reset_gpu(3)
    result = node.apply(layout)
    assert (result.outcome, result.reason) == ("success", "layout 'all-balanced' applied: 8 change(s)")
    assert instances(node) == dict.fromkeys(range(4), balanced)


def test_ampere_disable_destroys_then_waits_for_a_reset() -> None:
    node = started("dgx-a100")
    node.apply(SHIPPED.layout("all-balanced"))
    for i in range(8):
        node.fake.reset_gpu(i)
    assert node.apply(SHIPPED.layout("all-balanced")).outcome == "success"
    steps: list[str] = []

    result = node.apply(SHIPPED.layout("all-disabled"), steps=steps)

    assert (result.outcome, result.reason) == ("rebooting", rebooting_reason(list(range(8)), "disable"))
    assert steps[:5] == [
        "GPU 0: destroy 2g.10gb at slices 0-1",
        "GPU 0: destroy 1g.5gb at slice 2",
        "GPU 0: destroy 1g.5gb at slice 3",
        "GPU 0: destroy 3g.20gb at slices 4-7",
        "GPU 0: disable MIG",
    ]
    assert len(steps) == 40
    assert modes(node) == [(True, True)] * 8
    assert instances(node) == {i: [] for i in range(8)}

    for i in range(8):
        node.fake.reset_gpu(i)
    result = node.apply(SHIPPED.layout("all-disabled"))
    assert (result.outcome, result.reason) == ("success", "layout 'all-disabled' is already applied")
    assert modes(node) == [(False, False)] * 8


def test_a_layout_with_mig_on_cancels_a_pending_disable() -> None:
    # An Ampere node told to disable MIG, then told to go back to a MIG layout before any reset, must not
    # lose MIG at the next reboot: the pending disable has to be taken back.
    node = started("a100-pcie-nvlink-pairs")
    balanced = SHIPPED.layout("all-balanced")
    node.apply(balanced)
    for i in range(4):
        node.fake.reset_gpu(i)
    node.apply(balanced)
    assert node.apply(SHIPPED.layout("all-disabled")).outcome == "rebooting"

    result = node.apply(balanced)

    assert result.outcome == "success"
    assert modes(node) == [(True, False)] * 4
    node.fake.reboot()
    assert modes(node) == [(True, False)] * 4


def test_a_busy_hopper_gpu_keeps_its_mode_until_it_is_idle() -> None:
    node = started("single-h200")
    node.fake.set_gpu_busy(0)
    layout = SHIPPED.layout("all-balanced")
    steps: list[str] = []

    result = node.apply(layout, steps=steps)

    assert (result.outcome, result.reason, steps) == ("rebooting", rebooting_reason([0]), ["GPU 0: enable MIG"])
    assert modes(node) == [(False, True)]
    assert instances(node) == {0: []}

    # Once its clients are gone a Hopper GPU switches without a reset: applying again finishes the job.
    node.fake.set_gpu_busy(0, False)
    result = node.apply(layout)
    assert (result.outcome, result.reason) == ("success", "layout 'all-balanced' applied: 5 change(s)")
    assert instances(node) == {0: [("2g.35gb", 0, 2), ("1g.18gb", 2, 1), ("1g.18gb", 3, 1), ("3g.71gb", 4, 4)]}


# --- NVML errors in the middle of an apply ----------------------------------------------------------------

# (failing call, layout applied first or None for a fresh node, the step during which it fails)
MID_APPLY_ERRORS = [
    ("nvmlDeviceSetMigMode", None, "GPU 0: enable MIG"),
    ("nvmlDeviceCreateGpuInstanceWithPlacement", None, "GPU 0: create 3g.40gb at slices 4-7"),
    ("nvmlGpuInstanceCreateComputeInstance", None, "GPU 0: create 3g.40gb at slices 4-7"),
    ("nvmlComputeInstanceDestroy", "all-1g.10gb", "GPU 0: destroy 1g.10gb at slice 0"),
    ("nvmlGpuInstanceDestroy", "all-1g.10gb", "GPU 0: destroy 1g.10gb at slice 0"),
]


def _interrupted(node: MigNode, function: str, first: str | None, journal: Journal) -> tuple[ApplyResult | None, str]:
    """all-balanced with ``function`` failing once; the result (None if apply raised) and the last step."""
    if first is not None:
        assert node.apply(SHIPPED.layout(first)).outcome == "success"
    node.fake.fail_next(function, pynvml.NVML_ERROR_UNKNOWN)
    steps: list[str] = []
    try:
        result: ApplyResult | None = node.apply(SHIPPED.layout("all-balanced"), journal, steps)
    except pynvml.NVMLError:
        result = None
    return result, steps[-1]


@pytest.mark.parametrize(("function", "first", "failing_step"), MID_APPLY_ERRORS)
def test_an_nvml_error_mid_apply_ends_in_a_failed_result(
    tmp_path: Path, function: str, first: str | None, failing_step: str
) -> None:
    node = started("dgx-h100")
    result, last_step = _interrupted(node, function, first, Journal(tmp_path))
    assert last_step == failing_step
    # apply_layout promises that every path ends in a result; the reason names the step and the error.
    assert result is not None, f"apply_layout raised instead of returning a failed result ({function})"
    assert result.outcome == "failed"
    assert failing_step in result.reason and "Unknown Error" in result.reason, result.reason
    # The apply did not finish: the journal still names the layout for the next start.
    assert Journal(tmp_path).pending() == "all-balanced"


@pytest.mark.parametrize(("function", "first", "failing_step"), MID_APPLY_ERRORS)
def test_applying_again_after_an_nvml_error_converges(
    tmp_path: Path, function: str, first: str | None, failing_step: str
) -> None:
    node = started("dgx-h100")
    journal = Journal(tmp_path)
    _, last_step = _interrupted(node, function, first, journal)
    assert last_step == failing_step
    assert journal.pending() == "all-balanced"

    result = node.apply(SHIPPED.layout("all-balanced"), journal)

    assert result.outcome == "success"
    balanced = [("2g.20gb", 0, 2), ("1g.10gb", 2, 1), ("1g.10gb", 3, 1), ("3g.40gb", 4, 4)]
    assert instances(node) == dict.fromkeys(range(8), balanced)
    assert journal.pending() is None


def _destroy_compute_instance(fake: FakeNvml, gpu: int, start: int) -> None:
    """Leave the GPU instance at ``start`` without its compute instance, as a crash between the two does."""
    h = fake.nvmlDeviceGetHandleByIndex(gpu)
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            profile = fake.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
        except pynvml.NVMLError:
            continue
        count = ctypes.c_uint(int(profile.instanceCount))
        gis = (pynvml.c_nvmlGpuInstance_t * max(1, count.value))()
        fake.nvmlDeviceGetGpuInstances(h, profile.id, gis, ctypes.byref(count))
        for gi in gis[: count.value]:
            if fake.nvmlGpuInstanceGetInfo(gi).placement.start != start:
                continue
            ci_profile = fake.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, _ci_index(int(profile.sliceCount)), pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            cis: Any = (pynvml.c_nvmlComputeInstance_t * 1)()
            ci_count = ctypes.c_uint(1)
            fake.nvmlGpuInstanceGetComputeInstances(gi, ci_profile.id, cis, ctypes.byref(ci_count))
            fake.nvmlComputeInstanceDestroy(cis[0])
            return
    raise AssertionError(f"GPU {gpu} has no GPU instance at slice {start}")


def _ci_index(slices: int) -> int:
    return int(getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE"))


def test_a_gpu_instance_left_without_compute_instance_is_completed() -> None:
    node = started("single-h200")
    layout = SHIPPED.layout("all-balanced")
    node.apply(layout)
    _destroy_compute_instance(node.fake, 0, 4)
    assert [(i.start, i.compute_instances) for i in node.ops.state(0).instances] == [(0, 1), (2, 1), (3, 1), (4, 0)]
    assert plan_layout(node.ops, 1, layout).noop

    result = node.apply(layout)

    assert result.outcome == "success"
    assert instances(node) == {0: [("2g.35gb", 0, 2), ("1g.18gb", 2, 1), ("1g.18gb", 3, 1), ("3g.71gb", 4, 4)]}
    assert node.apply(layout).reason == "layout 'all-balanced' is already applied"


# --- the journal ------------------------------------------------------------------------------------------


def test_journal_round_trip(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "state")
    assert journal.pending() is None
    journal.begin("all-balanced", "built-in default-layouts.yaml")
    assert journal.pending() == "all-balanced"
    record = json.loads((tmp_path / "state" / JOURNAL).read_text())
    assert (record["layout"], record["layouts_file"]) == ("all-balanced", "built-in default-layouts.yaml")
    assert Journal(tmp_path / "state").pending() == "all-balanced"  # what the next process reads
    journal.end()
    assert journal.pending() is None
    assert list((tmp_path / "state").iterdir()) == []
    journal.end()  # ending twice is harmless


NO_LAYOUT = 'not a MIG journal: it names no layout (a string under "layout")'


@pytest.mark.parametrize(("content", "reason"), [
    ("", "is empty, not a MIG journal"),
    ("{not json", "not JSON: Expecting property name enclosed in double quotes (line 1, column 2)"),
    ("[1, 2]", NO_LAYOUT),
    ('{"layout": 3}', NO_LAYOUT),
    ('{"other": "x"}', NO_LAYOUT),
    ('{"layout": "all balanced"}', "not a MIG journal: its layout 'all balanced': a layout name must be a label "
                                   "value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a "
                                   "letter or digit"),
    ("[" * 60_000, "not JSON: nested too deeply"),
    ("9" * 5_000, "not JSON: Exceeds the limit (4300 digits) for integer string conversion"),
])
def test_a_journal_that_names_no_layout_is_refused_in_one_line_naming_it(
        tmp_path: Path, content: str, reason: str) -> None:
    # An apply may have been interrupted, but which layout is unknown: never taken for "no interrupted apply".
    (tmp_path / JOURNAL).write_text(content)
    with pytest.raises(InputFileError) as refused:
        Journal(tmp_path).pending()
    assert str(refused.value) == f"{tmp_path / JOURNAL}: {reason}"


def test_a_finished_apply_leaves_no_journal(tmp_path: Path) -> None:
    node = started("dgx-h100")
    journal = Journal(tmp_path)
    assert node.apply(SHIPPED.layout("all-balanced"), journal).outcome == "success"
    assert not (tmp_path / JOURNAL).exists()


def test_a_stale_journal_is_cleared_when_the_layout_is_already_applied(tmp_path: Path) -> None:
    node = started("dgx-h100")
    node.apply(SHIPPED.layout("all-balanced"))
    journal = Journal(tmp_path)
    journal.begin("all-balanced", "built-in default-layouts.yaml")
    result = node.apply(SHIPPED.layout("all-balanced"), journal)
    assert result.reason == "layout 'all-balanced' is already applied"
    assert journal.pending() is None


def test_an_interrupted_apply_leaves_a_journal_naming_the_layout(tmp_path: Path) -> None:
    node = started("dgx-h100")
    journal = Journal(tmp_path)
    _interrupted(node, "nvmlDeviceCreateGpuInstanceWithPlacement", None, journal)
    record = json.loads((tmp_path / JOURNAL).read_text())
    assert (record["layout"], record["layouts_file"]) == ("all-balanced", "built-in default-layouts.yaml")
