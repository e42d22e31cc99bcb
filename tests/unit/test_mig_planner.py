"""MIG planning: exact placements, reasons for layouts that cannot fit, minimal per-GPU diffs and node plans."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from collections.abc import Mapping

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.mig.applier import planning_view
from agent.mig.layout import load_layouts
from agent.mig.planner import (
    GpuMigState,
    GpuPlan,
    MigInstance,
    ModeChange,
    PlanError,
    ProfileTable,
    Unplaceable,
    gpu_instances,
    place,
    plan_gpu,
    plan_node,
)
from agent.nvml.backend import NvmlBackend
from agent.nvml.catalog import Placement, lookup
from agent.nvml.fake import FakeNvml
from agent.nvml.mig_ops import MigGpuState
from agent.nvml.nodefile import load_node
from agent.nvml.records import MigDeviceInfo

H100 = lookup("H100-SXM5-80GB")
A100_40 = lookup("A100-SXM4-40GB")
H100_TABLE = ProfileTable.of(H100)
A100_40_TABLE = ProfileTable.of(A100_40)
BALANCED_80GB = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}


def _i(profile: str, start: int, size: int) -> MigInstance:
    return MigInstance(profile, start, size)


def _ones(starts: range | tuple[int, ...], name: str = "1g.10gb") -> list[MigInstance]:
    return [_i(name, s, 1) for s in starts]


# --- exact placements ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_key", "expected"),
    [
        ("H100-SXM5-80GB", [("3g.40gb", 4, 4), ("2g.20gb", 0, 2), ("1g.10gb", 2, 1), ("1g.10gb", 3, 1)]),
        ("A100-SXM4-80GB", [("3g.40gb", 4, 4), ("2g.20gb", 0, 2), ("1g.10gb", 2, 1), ("1g.10gb", 3, 1)]),
        ("A100-SXM4-40GB", [("3g.20gb", 4, 4), ("2g.10gb", 0, 2), ("1g.5gb", 2, 1), ("1g.5gb", 3, 1)]),
        ("H200-141GB", [("3g.71gb", 4, 4), ("2g.35gb", 0, 2), ("1g.18gb", 2, 1), ("1g.18gb", 3, 1)]),
    ],
)
def test_all_balanced_placements(model_key: str, expected: list[tuple[str, int, int]]) -> None:
    """Largest first with the lowest start fails (3g at 0 leaves slice 7 to 1g, which cannot use it); the
    exact search backs up to 3g at 4, the layout real GPUs get (NVIDIA/DCGM#138)."""
    model = lookup(model_key)
    layout = load_layouts().layout("all-balanced")
    entry = layout.entry_for(0, model.pci_device_id, model.nvml_name)
    assert entry is not None
    assert place(ProfileTable.of(model), entry.requested) == tuple(MigInstance(*e) for e in expected)


@pytest.mark.parametrize(
    ("requested", "expected"),
    [
        ({"3g.40gb": 1, "4g.40gb": 1}, [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]),
        ({"2g.20gb": 3, "1g.20gb": 1}, [("2g.20gb", 0, 2), ("2g.20gb", 2, 2), ("2g.20gb", 4, 2), ("1g.20gb", 6, 2)]),
        ({"4g.40gb": 1, "1g.10gb": 3}, [("4g.40gb", 0, 4), ("1g.10gb", 4, 1), ("1g.10gb", 5, 1), ("1g.10gb", 6, 1)]),
        ({"3g.40gb": 1, "1g.10gb": 4}, [("3g.40gb", 4, 4), *[("1g.10gb", s, 1) for s in range(4)]]),
        ({"1g.20gb": 1, "1g.10gb": 6}, [("1g.20gb", 6, 2), *[("1g.10gb", s, 1) for s in range(6)]]),
        ({"7g.80gb": 1}, [("7g.80gb", 0, 8)]),
        ({"1g.10gb+me": 1, "1g.10gb": 0}, [("1g.10gb+me", 0, 1)]),
        ({}, []),
    ],
)
def test_h100_placements(requested: dict[str, int], expected: list[tuple[str, int, int]]) -> None:
    assert place(H100_TABLE, requested) == tuple(MigInstance(*e) for e in expected)


@pytest.mark.parametrize(
    ("requested", "reason"),
    [
        ({"1g.10gb": 8}, "at most 7 instances of 1g.10gb, 8 requested"),
        ({"1g.10gb+me": 2, "4g.40gb": 2},
         "at most 1 instance of 4g.40gb, 2 requested; at most 1 instance of 1g.10gb+me, 2 requested"),
        ({"3g.40gb": 2, "1g.10gb": 1}, "needs 9 memory slices, GPU has 8 (3g.40gb: 2 x 4, 1g.10gb: 1 x 1)"),
        ({"4g.40gb": 1, "3g.40gb": 1, "1g.20gb": 1},
         "needs 10 memory slices, GPU has 8 (4g.40gb: 1 x 4, 3g.40gb: 1 x 4, 1g.20gb: 1 x 2)"),
        ({"4g.40gb": 1, "2g.20gb": 2},
         "4g.40gb + 2 x 2g.20gb do not fit together: 4g.40gb must use slices 0-3; 2g.20gb can use slices 0-1, "
         "2-3 or 4-5 (none of them can use slices 6, 7)"),
        ({"2g.20gb": 2, "1g.10gb": 4},
         "2 x 2g.20gb + 4 x 1g.10gb do not fit together: 2g.20gb can use slices 0-1, 2-3 or 4-5; 1g.10gb can use "
         "slice 0, 1, 2, 3, 4, 5 or 6 (none of them can use slice 7)"),
        ({"4g.40gb": 1, "1g.10gb": 4, "1g.20gb": 0},
         "4g.40gb + 4 x 1g.10gb do not fit together: 4g.40gb must use slices 0-3; 1g.10gb can use slice 0, 1, 2, "
         "3, 4, 5 or 6 (none of them can use slice 7)"),
        ({"1g.10gb": 7, "1g.10gb+me": 1},
         "7 x 1g.10gb + 1g.10gb+me do not fit together: 1g.10gb can use slice 0, 1, 2, 3, 4, 5 or 6; 1g.10gb+me "
         "can use slice 0, 1, 2, 3, 4, 5 or 6 (none of them can use slice 7)"),
        ({"1g.5gb": 1, "7g.80gb": 1},
         "profile 1g.5gb does not exist on H100 80GB HBM3 "
         "(known: 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb)"),
        ({"1c.3g.40gb": 2},
         "compute-instance profile 1c.3g.40gb is not supported: the agent creates one compute instance spanning "
         "each GPU instance (use 3g.40gb)"),
        ({"3g.40": 1, "1g.10gb": -1},
         "'3g.40': not a MIG profile name: expected <G>g.<GB>gb, optionally with a <C>c. prefix and a +<attr> or "
         "-<attr> suffix (e.g. 3g.40gb, 1c.3g.40gb, 1g.10gb+me, 1g.24gb-me); count of 1g.10gb must be >= 0, got -1"),
    ],
)
def test_h100_infeasible_reasons(requested: dict[str, int], reason: str) -> None:
    with pytest.raises(Unplaceable) as caught:
        place(H100_TABLE, requested)
    assert str(caught.value) == reason


def test_a100_40gb_infeasible_reason_uses_its_names() -> None:
    with pytest.raises(Unplaceable) as caught:
        place(A100_40_TABLE, {"4g.20gb": 1, "2g.10gb": 2})
    assert str(caught.value) == (
        "4g.20gb + 2 x 2g.10gb do not fit together: 4g.20gb must use slices 0-3; 2g.10gb can use slices 0-1, 2-3 "
        "or 4-5 (none of them can use slices 6, 7)"
    )


def test_attributes_match_in_any_order() -> None:
    two = H100_TABLE.profile("2g.20gb")
    assert two is not None
    table = ProfileTable("RTX PRO 6000", (dataclasses.replace(two, name="2g.48gb+gfx,me"),))
    assert place(table, {"2g.48gb+me,gfx": 1}) == (_i("2g.48gb+gfx,me", 0, 2),)


def test_a_profile_without_placements_is_rejected() -> None:
    two = H100_TABLE.profile("2g.20gb")
    assert two is not None
    table = ProfileTable("H100 80GB HBM3", (dataclasses.replace(two, placements=()),))
    with pytest.raises(Unplaceable) as caught:
        place(table, {"2g.20gb": 1})
    assert str(caught.value) == "profile 2g.20gb has no placement on H100 80GB HBM3"


# --- one GPU -------------------------------------------------------------------------------------------

APPLIED_BALANCED = (_i("2g.20gb", 0, 2), _i("1g.10gb", 2, 1), _i("1g.10gb", 3, 1), _i("3g.40gb", 4, 4))


def _plan(current: tuple[MigInstance, ...] | list[MigInstance], desired: Mapping[str, int] | None,
          enabled_now: bool = True, want: bool = True) -> GpuPlan:
    return plan_gpu(H100_TABLE, current, desired, mig_enabled_now=enabled_now, want_enabled=want, index=0)


def test_fresh_gpu_enables_then_creates() -> None:
    plan = _plan([], BALANCED_80GB, enabled_now=False)
    assert (plan.mode, plan.destroy, plan.keep) == (ModeChange.ENABLE, (), ())
    assert plan.actions() == [
        "GPU 0: enable MIG",
        "GPU 0: create 3g.40gb at slices 4-7",
        "GPU 0: create 2g.20gb at slices 0-1",
        "GPU 0: create 1g.10gb at slice 2",
        "GPU 0: create 1g.10gb at slice 3",
    ]
    assert plan.target == APPLIED_BALANCED


def test_already_applied_is_a_noop() -> None:
    plan = _plan(APPLIED_BALANCED, BALANCED_80GB)
    assert plan.noop
    assert plan.actions() == []
    assert plan.keep == APPLIED_BALANCED


def test_other_valid_placements_of_the_same_layout_are_kept() -> None:
    """NVML-chosen placements may differ from the planner's first choice; they are not moved."""
    current = [_i("1g.10gb", 0, 1), _i("1g.10gb", 1, 1), _i("2g.20gb", 2, 2), _i("3g.40gb", 4, 4)]
    assert _plan(current, BALANCED_80GB).noop


def test_existing_instances_are_kept_when_a_target_fits_around_them() -> None:
    plan = _plan([_i("3g.40gb", 4, 4), _i("1g.10gb", 0, 1)], BALANCED_80GB)
    assert plan.keep == (_i("1g.10gb", 0, 1), _i("3g.40gb", 4, 4))
    assert plan.destroy == ()
    assert plan.actions() == ["GPU 0: create 2g.20gb at slices 2-3", "GPU 0: create 1g.10gb at slice 1"]


def test_from_all_1g_to_balanced_keeps_two() -> None:
    plan = _plan(_ones(range(7)), BALANCED_80GB)
    assert plan.keep == tuple(_ones((2, 3)))
    assert plan.actions() == [
        "GPU 0: destroy 1g.10gb at slice 0",
        "GPU 0: destroy 1g.10gb at slice 1",
        "GPU 0: destroy 1g.10gb at slice 4",
        "GPU 0: destroy 1g.10gb at slice 5",
        "GPU 0: destroy 1g.10gb at slice 6",
        "GPU 0: create 3g.40gb at slices 4-7",
        "GPU 0: create 2g.20gb at slices 0-1",
    ]
    assert plan.target == APPLIED_BALANCED


def test_an_instance_of_an_unknown_profile_is_destroyed() -> None:
    plan = _plan([_i("profile-99", 0, 8)], {"7g.80gb": 1})
    assert plan.actions() == ["GPU 0: destroy profile-99 at slices 0-7", "GPU 0: create 7g.80gb at slices 0-7"]


def test_disable_destroys_first() -> None:
    plan = _plan(APPLIED_BALANCED, None, want=False)
    assert plan.actions() == [
        "GPU 0: destroy 2g.20gb at slices 0-1",
        "GPU 0: destroy 1g.10gb at slice 2",
        "GPU 0: destroy 1g.10gb at slice 3",
        "GPU 0: destroy 3g.40gb at slices 4-7",
        "GPU 0: disable MIG",
    ]


def test_disabled_stays_disabled() -> None:
    assert _plan([], {}, enabled_now=False, want=False).noop


def test_enabled_without_instances_destroys_them() -> None:
    plan = _plan(_ones((0, 1)), {})
    assert (plan.mode, plan.actions()) == (
        ModeChange.NONE, ["GPU 0: destroy 1g.10gb at slice 0", "GPU 0: destroy 1g.10gb at slice 1"],
    )
    assert _plan([], None).noop


def test_gpu_without_mig() -> None:
    l40s = ProfileTable.of(lookup("L40S"))
    assert plan_gpu(l40s, [], None, mig_enabled_now=False, want_enabled=False, index=3).noop
    with pytest.raises(PlanError) as caught:
        plan_gpu(l40s, [], {}, mig_enabled_now=False, want_enabled=True, index=3)
    assert (str(caught.value), caught.value.problems) == ("GPU 3: L40S does not support MIG",
                                                          ((3, "L40S does not support MIG"),))


def test_infeasible_gpu_plan_names_the_gpu() -> None:
    with pytest.raises(PlanError) as caught:
        plan_gpu(H100_TABLE, [], {"3g.40gb": 3}, mig_enabled_now=False, want_enabled=True, index=6)
    assert str(caught.value) == "GPU 6: at most 2 instances of 3g.40gb, 3 requested"


def test_inconsistent_input_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="GPU instances reported while MIG is disabled"):
        _plan(_ones((0,)), {}, enabled_now=False)
    with pytest.raises(ValueError, match="instances requested with MIG disabled"):
        _plan([], {"1g.10gb": 1}, want=False)


# --- a node --------------------------------------------------------------------------------------------


def _dgx(instances: dict[int, tuple[MigInstance, ...] | list[MigInstance]]) -> list[GpuMigState]:
    return [GpuMigState.of(i, H100, mig_enabled=i in instances, instances=instances.get(i, ())) for i in range(8)]


def test_node_plan_changes_only_the_gpu_that_differs() -> None:
    layout = load_layouts().layout("all-balanced")
    current: dict[int, tuple[MigInstance, ...] | list[MigInstance]] = dict.fromkeys(range(8), APPLIED_BALANCED)
    current[5] = _ones(range(7))
    plan = plan_node(layout, _dgx(current))
    assert [p.noop for p in plan.gpus] == [True] * 5 + [False] + [True] * 2
    assert not plan.noop
    assert plan.describe() == "\n".join([
        "GPU 5: destroy 1g.10gb at slice 0",
        "GPU 5: destroy 1g.10gb at slice 1",
        "GPU 5: destroy 1g.10gb at slice 4",
        "GPU 5: destroy 1g.10gb at slice 5",
        "GPU 5: destroy 1g.10gb at slice 6",
        "GPU 5: create 3g.40gb at slices 4-7",
        "GPU 5: create 2g.20gb at slices 0-1",
    ])


def test_node_plan_of_an_applied_layout_is_a_noop() -> None:
    plan = plan_node(load_layouts().layout("all-balanced"), _dgx(dict.fromkeys(range(8), APPLIED_BALANCED)))
    assert plan.noop
    assert plan.describe() == "no changes"
    assert [p.index for p in plan.gpus] == list(range(8))


def test_unselected_gpus_are_left_alone() -> None:
    gpus = [GpuMigState.of(0, H100), GpuMigState.of(1, lookup("L40S")), GpuMigState.of(2, A100_40)]
    plan = plan_node(load_layouts().layout("all-1g.10gb"), gpus)
    assert plan.untouched == (1,)
    assert plan.describe().splitlines() == [
        "GPU 0: enable MIG",
        *[f"GPU 0: create 1g.10gb at slice {s}" for s in range(7)],
        "GPU 2: enable MIG",
        *[f"GPU 2: create 1g.10gb at slices {s}-{s + 1}" for s in (0, 2, 4, 6)],
    ]


def test_one_gpu_that_cannot_fit_fails_the_node_plan_naming_every_such_gpu() -> None:
    gpus = [GpuMigState.of(0, H100), GpuMigState.of(1, lookup("H200-141GB")), GpuMigState.of(2, A100_40),
            GpuMigState.of(3, lookup("L40S")), GpuMigState.of(4, lookup("A100-SXM4-80GB"))]
    with pytest.raises(PlanError) as caught:
        plan_node(load_layouts().layout("all-3g.40gb"), gpus)
    assert str(caught.value).splitlines() == [
        "GPU 1: profile 3g.40gb does not exist on H200 "
        "(known: 1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb)",
        "GPU 2: profile 3g.40gb does not exist on A100-SXM4-40GB "
        "(known: 1g.5gb, 1g.5gb+me, 1g.10gb, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb)",
        "GPU 3: L40S does not support MIG",
    ]
    assert [index for index, _ in caught.value.problems] == [1, 2, 3]


def test_gpu_instances_from_mig_devices() -> None:
    def device(parent: int, gi: int, ci: int, profile: str, start: int, size: int) -> MigDeviceInfo:
        return MigDeviceInfo(f"MIG-{parent}-{gi}-{ci}", parent, gi, ci, profile, 0, start, size)

    devices = [device(0, 1, 0, "3g.40gb", 4, 4), device(0, 1, 1, "3g.40gb", 4, 4), device(0, 3, 0, "2g.20gb", 0, 2),
               device(1, 0, 0, "7g.80gb", 0, 8)]
    assert gpu_instances(devices, 0) == (_i("2g.20gb", 0, 2), _i("3g.40gb", 4, 4))
    assert gpu_instances(devices, 1) == (_i("7g.80gb", 0, 8),)


def test_plans_apply_on_the_fake_driver_and_read_back_as_planned() -> None:
    """Every created placement is one the (fake) driver accepts; after applying, the layout plans nothing."""
    lib = FakeNvml(load_node("dgx-h100"))
    backend = NvmlBackend(lib=lib, numa_lookup=lib.numa_node)
    backend.init()
    layout = load_layouts().layout("all-balanced")
    before = [GpuMigState.of(i, H100) for i in range(2)]
    for gpu_plan in plan_node(layout, before).gpus:
        h = lib.nvmlDeviceGetHandleByIndex(gpu_plan.index)
        assert gpu_plan.mode is ModeChange.ENABLE
        assert lib.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
        for instance in gpu_plan.create:
            profile = H100_TABLE.profile(instance.profile)
            assert profile is not None
            profile_id = lib.nvmlDeviceGetGpuInstanceProfileInfo(h, profile.index).id
            placement = pynvml.c_nvmlGpuInstancePlacement_t(instance.start, instance.size)
            gi = lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.byref(placement))
            ci_id = lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, profile.ci_profile_index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED).id
            lib.nvmlGpuInstanceCreateComputeInstance(gi, ci_id)
    inventory = backend.inventory()
    after = [GpuMigState.of(g.index, H100, g.mig_enabled, gpu_instances(inventory.mig_devices, g.index))
             for g in inventory.gpus[:2]]
    assert [g.instances for g in after] == [APPLIED_BALANCED, APPLIED_BALANCED]
    assert plan_node(layout, after).noop


# --- the exact search against brute force --------------------------------------------------------------

TABLES = {"H100-SXM5-80GB": H100_TABLE, "A100-SXM4-40GB": A100_40_TABLE}
Solution = list[tuple[str, Placement]]


def brute_force(table: ProfileTable, requested: Mapping[str, int]) -> list[Solution]:
    """Every way to place the request: each combination of distinct placements per profile, kept when no two
    instances share a memory slice."""
    per_profile: list[list[Solution]] = []
    for name, count in requested.items():
        profile = table.profile(name)
        assert profile is not None
        if count > profile.instance_count:
            return []
        per_profile.append([[(name, p) for p in combo] for combo in itertools.combinations(profile.placements, count)])
    solutions = []
    for pick in itertools.product(*per_profile):
        flat = [item for group in pick for item in group]
        slices = [s for _, p in flat for s in range(p.start, p.start + p.size)]
        if len(slices) == len(set(slices)):
            solutions.append(flat)
    return solutions


def canonical(table: ProfileTable, instances: Solution) -> tuple[tuple[str, int], ...]:
    """Larger profiles first (memory slices, then compute slices, then name), then by start."""
    def key(item: tuple[str, int]) -> tuple[int, int, str, int]:
        profile = table.profile(item[0])
        assert profile is not None
        return (-profile.memory_slices, -profile.slice_count, profile.name, item[1])

    return tuple(sorted(((name, p.start) for name, p in instances), key=key))


@st.composite
def requests(draw: st.DrawFn) -> tuple[ProfileTable, dict[str, int]]:
    table = TABLES[draw(st.sampled_from(sorted(TABLES)))]
    profiles = draw(st.lists(st.sampled_from(table.profiles), unique=True, max_size=4))
    # Up to one more than the profile allows, so that count limits are exercised too.
    return table, {p.name: draw(st.integers(1, p.instance_count + 1)) for p in profiles}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_planner_finds_a_placement_iff_brute_force_does(case: tuple[ProfileTable, dict[str, int]]) -> None:
    table, requested = case
    solutions = brute_force(table, requested)
    try:
        found = place(table, requested)
    except Unplaceable:
        assert solutions == []
        return
    assert solutions
    planned = [(i.profile, Placement(i.start, i.size)) for i in found]
    assert canonical(table, planned) in {canonical(table, s) for s in solutions}
    # The lowest starts, larger profiles first.
    assert canonical(table, planned) == min(canonical(table, s) for s in solutions)


@st.composite
def changes(draw: st.DrawFn) -> tuple[ProfileTable, Solution, dict[str, int]]:
    table, before = draw(requests().filter(lambda case: bool(brute_force(*case))))
    current = draw(st.sampled_from(brute_force(table, before)))
    _, after = draw(requests().filter(lambda case: case[0] is table))
    return table, current, after


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(changes())
def test_plan_keeps_as_many_existing_instances_as_any_placement_can(
    case: tuple[ProfileTable, Solution, dict[str, int]],
) -> None:
    table, current_solution, desired = case
    current = [MigInstance(name, p.start, p.size) for name, p in current_solution]
    solutions = brute_force(table, desired)
    try:
        plan = plan_gpu(table, current, desired, mig_enabled_now=True, want_enabled=True)
    except PlanError:
        assert solutions == []
        return
    have = {(i.profile, i.start) for i in current}

    def kept(solution: Solution) -> int:
        return sum((name, p.start) in have for name, p in solution)

    best = min(solutions, key=lambda s: (-kept(s), canonical(table, s)))
    assert len(plan.keep) == kept(best)
    assert canonical(table, [(i.profile, Placement(i.start, i.size)) for i in plan.target]) == canonical(table, best)
    assert set(plan.destroy) == set(current) - set(plan.target)
    # Applying the plan and planning again changes nothing.
    assert plan_gpu(table, plan.target, desired, mig_enabled_now=True, want_enabled=True).noop


def test_every_problem_of_a_request_is_named_in_one_line() -> None:
    two = H100_TABLE.profile("2g.20gb")
    one = H100_TABLE.profile("1g.10gb")
    assert two is not None and one is not None
    table = ProfileTable("H100 80GB HBM3", (one, dataclasses.replace(two, placements=())))
    with pytest.raises(Unplaceable) as caught:
        place(table, {"1g.10gb": -1, "1c.2g.20gb": 1, "5g.50gb": 1, "2g.20gb": 1, "1g.10gb+me": -2})
    assert str(caught.value) == (
        "count of 1g.10gb must be >= 0, got -1; compute-instance profile 1c.2g.20gb is not supported: the agent "
        "creates one compute instance spanning each GPU instance (use 2g.20gb); profile 5g.50gb does not exist on "
        "H100 80GB HBM3 (known: 1g.10gb, 2g.20gb); profile 2g.20gb has no placement on H100 80GB HBM3; "
        "count of 1g.10gb+me must be >= 0, got -2")


def test_one_profile_under_two_spellings_counts_both() -> None:
    two = H100_TABLE.profile("2g.20gb")
    assert two is not None
    table = ProfileTable("RTX PRO 6000", (dataclasses.replace(two, name="2g.48gb+gfx,me"),))
    assert place(table, {"2g.48gb+me,gfx": 1, "2g.48gb+gfx,me": 1}) == (
        _i("2g.48gb+gfx,me", 0, 2), _i("2g.48gb+gfx,me", 2, 2))


def test_a_plan_that_disables_mig_targets_no_instances() -> None:
    plan = plan_gpu(H100_TABLE, APPLIED_BALANCED, None, mig_enabled_now=True, want_enabled=False, index=3)
    assert (plan.mode, plan.destroy, plan.create, plan.target) == (ModeChange.DISABLE, APPLIED_BALANCED, (), ())
    assert plan.actions()[-1] == "GPU 3: disable MIG"


def test_a_plan_names_gpu_0_unless_told_otherwise() -> None:
    plan = plan_gpu(H100_TABLE, [], {"7g.80gb": 1}, mig_enabled_now=False, want_enabled=True)
    assert plan.actions() == ["GPU 0: enable MIG", "GPU 0: create 7g.80gb at slices 0-7"]


def test_of_the_placements_keeping_as_many_instances_the_lowest_is_taken() -> None:
    # 4g.40gb must use slices 0-3, so the 1g.10gb at slice 3 goes; the one at 5 is kept, and the other 1g.10gb
    # takes the lowest free slice, 4 (6 would keep as many).
    have = [_i("1g.10gb", 3, 1), _i("1g.10gb", 5, 1)]
    assert place(H100_TABLE, {"4g.40gb": 1, "1g.10gb": 2}, prefer=have) == (
        _i("4g.40gb", 0, 4), _i("1g.10gb", 4, 1), _i("1g.10gb", 5, 1))


def test_a_mig_gpu_whose_model_the_catalog_lacks_is_refused_in_one_line_naming_it() -> None:
    # NVML reports a MIG mode (disabled), so the GPU is MIG capable, but with MIG off the agent plans from its
    # catalog, which has no table for this product.
    unknown = GpuMigState(2, "NVIDIA Z900", 0x3FFF10DE, (), mig_enabled=False, mig_capable=True)
    reason = ("cannot plan MIG on Z900 (PCI device id 0x3FFF10DE): its MIG profile table is missing from the "
              "agent's GPU catalog, and NVML lists placements only with MIG enabled")
    for name in ("all-enabled", "all-1g.10gb.me"):
        with pytest.raises(PlanError) as caught:
            plan_node(load_layouts().layout(name), [GpuMigState.of(0, H100), unknown])
        assert str(caught.value).splitlines()[-1] == f"GPU 2: {reason}", name
    # Nothing is asked of it by all-disabled (MIG is off already): no plan, no error.
    assert plan_node(load_layouts().layout("all-disabled"), [unknown]).noop


def test_planning_view_keeps_whether_nvml_reports_a_mig_mode() -> None:
    states = [MigGpuState(0, "NVIDIA Z900", 0x3FFF10DE, True, False, False, (), ()),
              MigGpuState(1, "NVIDIA L40S", 0x26B910DE, False, False, False, (), ())]
    with pytest.raises(PlanError) as caught:
        plan_node(load_layouts().layout("all-enabled"), planning_view(states))
    assert str(caught.value).splitlines() == [
        "GPU 0: cannot plan MIG on Z900 (PCI device id 0x3FFF10DE): its MIG profile table is missing from the "
        "agent's GPU catalog, and NVML lists placements only with MIG enabled",
        "GPU 1: L40S does not support MIG",
    ]
