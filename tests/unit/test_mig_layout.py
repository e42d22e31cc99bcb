"""MIG layout files: the shipped layouts, strict validation with exact messages, the profile-name grammar and
which entry selects which GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.mig.layout import (
    DeviceFilter,
    LayoutEntry,
    LayoutError,
    MigLayout,
    ProfileName,
    load_layouts,
    normalize_model_name,
    parse_layouts,
    parse_profile_name,
)
from agent.mig.planner import GpuMigState, PlanError, ProfileTable, plan_node
from agent.nvml.catalog import MODELS, GpuModel, lookup

SHIPPED = [
    "all-disabled", "all-enabled",
    "all-1g.5gb", "all-1g.5gb.me", "all-2g.10gb", "all-3g.20gb", "all-4g.20gb", "all-7g.40gb",
    "all-1g.10gb",
    "all-1g.10gb.me", "all-1g.20gb", "all-2g.20gb", "all-3g.40gb", "all-4g.40gb", "all-7g.80gb",
    "all-1g.18gb", "all-1g.18gb.me", "all-1g.35gb", "all-2g.35gb", "all-3g.71gb", "all-4g.71gb", "all-7g.141gb",
    "all-1g.12gb", "all-1g.12gb.me", "all-1g.24gb", "all-2g.24gb", "all-3g.47gb", "all-4g.47gb", "all-7g.94gb",
    "all-3g.48gb", "all-4g.48gb", "all-7g.96gb",
    "all-1g.23gb", "all-1g.23gb.me",
    "all-1g.45gb", "all-2g.45gb", "all-3g.90gb", "all-4g.90gb", "all-7g.180gb",
    "all-1g.47gb", "all-2g.47gb", "all-3g.93gb", "all-4g.93gb", "all-7g.186gb",
    "all-1g.34gb", "all-1g.34gb.me", "all-1g.67gb", "all-2g.67gb", "all-3g.135gb", "all-4g.135gb", "all-7g.269gb",
    "all-1g.35gb.me", "all-1g.70gb", "all-2g.70gb", "all-3g.139gb", "all-4g.139gb", "all-7g.278gb",
    "all-1g.24gb.me", "all-1g.24gb.gfx", "all-1g.24gb.me.all", "all-1g.24gb-me", "all-2g.48gb", "all-2g.48gb.gfx",
    "all-2g.48gb.me.all", "all-2g.48gb-me", "all-4g.96gb", "all-4g.96gb.gfx",
    "all-balanced",
]

FILTER_40GB = ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
FILTER_80GB = ["0x20B210DE", "0x20B510DE", "0x20F310DE", "0x20F510DE",
               "0x232210DE", "0x232410DE", "0x233010DE", "0x233110DE"]
FILTER_H200 = ["0x233510DE", "0x233B10DE"]
FILTER_H100_NVL = ["0x232110DE", "0x233A10DE"]
FILTER_96GB = ["0x20B610DE", "0x232910DE", "0x233D10DE", "0x234210DE"]

H100 = lookup("H100-SXM5-80GB")
A100_40 = lookup("A100-SXM4-40GB")


def _errors(text: str) -> list[str]:
    with pytest.raises(LayoutError) as caught:
        parse_layouts(text, "layouts.yaml")
    return caught.value.lines


def _ids(entry_filter: DeviceFilter | None) -> list[str]:
    assert entry_filter is not None
    return sorted(f"0x{i:08X}" for i in entry_filter.pci_device_ids)


# --- the shipped layouts -------------------------------------------------------------------------------


def test_shipped_layout_names_in_file_order() -> None:
    layouts = load_layouts()
    assert layouts.origin == "built-in default-layouts.yaml"
    assert layouts.names() == SHIPPED


def test_shipped_all_balanced_has_one_entry_per_model_group() -> None:
    entries = load_layouts().layout("all-balanced").entries
    assert [(e.devices, _ids(e.device_filter), e.mig_enabled, dict(e.mig_devices)) for e in entries] == [
        (None, FILTER_H200, True, {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1}),
        (None, FILTER_80GB, True, {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}),
        (None, FILTER_40GB, True, {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}),
        (None, ["0x290110DE"], True, {"1g.23gb": 2, "2g.45gb": 1, "3g.90gb": 1}),
        (None, ["0x294110DE"], True, {"1g.23gb": 2, "2g.47gb": 1, "3g.93gb": 1}),
        (None, ["0x318210DE"], True, {"1g.34gb": 2, "2g.67gb": 1, "3g.135gb": 1}),
        (None, ["0x31C210DE"], True, {"1g.35gb": 2, "2g.70gb": 1, "3g.139gb": 1}),
        (None, ["0x2BB510DE"], True, {"1g.24gb": 2, "2g.48gb": 1}),
        (None, FILTER_H100_NVL, True, {"1g.12gb": 2, "2g.24gb": 1, "3g.47gb": 1}),
        (None, FILTER_96GB, True, {"1g.12gb": 2, "2g.24gb": 1, "3g.48gb": 1}),
    ]


def test_shipped_all_1g_35gb_counts_per_model() -> None:
    # 1g.35gb is H200's two-slice 1g (4 fit) and GB300's one-slice 1g (7 fit).
    entries = load_layouts().layout("all-1g.35gb").entries
    assert [(_ids(e.device_filter), e.requested) for e in entries] == [
        (FILTER_H200, {"1g.35gb": 4}),
        (["0x31C210DE"], {"1g.35gb": 7}),
    ]


def test_shipped_all_1g_10gb_counts_per_model() -> None:
    entries = load_layouts().layout("all-1g.10gb").entries
    assert [(_ids(e.device_filter), e.requested) for e in entries] == [
        (FILTER_80GB, {"1g.10gb": 7}),
        (FILTER_40GB, {"1g.10gb": 4}),
    ]


def test_shipped_all_enabled_and_all_disabled() -> None:
    layouts = load_layouts()
    (enabled,) = layouts.layout("all-enabled").entries
    (disabled,) = layouts.layout("all-disabled").entries
    assert (enabled.devices, enabled.device_filter, enabled.mig_enabled, enabled.requested) == (None, None, True, {})
    assert (disabled.devices, disabled.device_filter, disabled.mig_enabled, disabled.requested) == (
        None, None, False, {},
    )


# Outcome of each shipped layout on one fresh GPU (MIG disabled) of each catalog model:
# "plan" = changes planned, "noop" = nothing to do, "alone" = no entry selects it, "fail" = PlanError.
MODEL_ORDER = ["A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-141GB", "H100-NVL", "H20", "GH200-480GB",
               "B200", "GB200", "B300-SXM6", "GB300", "RTX-PRO-6000-BSE", "L40S", "T4"]
MIG_MODELS = MODEL_ORDER[:-2]


def only(*keys: str, elsewhere: str = "fail") -> tuple[str, ...]:
    return tuple("plan" if key in keys else elsewhere for key in MODEL_ORDER)


OUTCOMES: dict[str, tuple[str, ...]] = {
    "all-disabled": ("noop",) * 14,
    "all-enabled": only(*MIG_MODELS),
    "all-1g.10gb": only("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", elsewhere="alone"),
    "all-1g.35gb": only("H200-141GB", "GB300", elsewhere="alone"),
    "all-balanced": only(*MIG_MODELS, elsewhere="alone"),
    **{name: only("A100-SXM4-40GB")
       for name in ("all-1g.5gb", "all-1g.5gb.me", "all-2g.10gb", "all-3g.20gb", "all-4g.20gb", "all-7g.40gb")},
    **{name: only("A100-SXM4-80GB", "H100-SXM5-80GB")
       for name in ("all-1g.10gb.me", "all-1g.20gb", "all-2g.20gb", "all-3g.40gb", "all-4g.40gb", "all-7g.80gb")},
    **{name: only("H200-141GB")
       for name in ("all-1g.18gb", "all-1g.18gb.me", "all-2g.35gb", "all-3g.71gb", "all-4g.71gb", "all-7g.141gb")},
    **{name: only("H100-NVL", "H20", "GH200-480GB") for name in ("all-1g.12gb", "all-1g.12gb.me", "all-2g.24gb")},
    "all-1g.24gb": only("H100-NVL", "H20", "GH200-480GB", "RTX-PRO-6000-BSE"),
    **{name: only("H100-NVL") for name in ("all-3g.47gb", "all-4g.47gb", "all-7g.94gb")},
    **{name: only("H20", "GH200-480GB") for name in ("all-3g.48gb", "all-4g.48gb", "all-7g.96gb")},
    **{name: only("B200", "GB200") for name in ("all-1g.23gb", "all-1g.23gb.me")},
    **{name: only("B200")
       for name in ("all-1g.45gb", "all-2g.45gb", "all-3g.90gb", "all-4g.90gb", "all-7g.180gb")},
    **{name: only("GB200")
       for name in ("all-1g.47gb", "all-2g.47gb", "all-3g.93gb", "all-4g.93gb", "all-7g.186gb")},
    **{name: only("B300-SXM6")
       for name in ("all-1g.34gb", "all-1g.34gb.me", "all-1g.67gb", "all-2g.67gb", "all-3g.135gb", "all-4g.135gb",
                    "all-7g.269gb")},
    **{name: only("GB300")
       for name in ("all-1g.35gb.me", "all-1g.70gb", "all-2g.70gb", "all-3g.139gb", "all-4g.139gb",
                    "all-7g.278gb")},
    **{name: only("RTX-PRO-6000-BSE")
       for name in ("all-1g.24gb.me", "all-1g.24gb.gfx", "all-1g.24gb.me.all", "all-1g.24gb-me", "all-2g.48gb",
                    "all-2g.48gb.gfx", "all-2g.48gb.me.all", "all-2g.48gb-me", "all-4g.96gb", "all-4g.96gb.gfx")},
}


# The shipped layouts parsed once for the table below (the file's parsing has tests of its own here); the parsed
# layouts are frozen, so every case sees the same values.
PARSED = load_layouts()


def _outcome(layout_name: str, model_key: str) -> str:
    layout = PARSED.layout(layout_name)
    try:
        plan = plan_node(layout, [GpuMigState.of(0, lookup(model_key))])
    except PlanError:
        return "fail"
    if plan.untouched:
        return "alone"
    if plan.noop:
        return "noop"
    # Once applied, the same layout plans nothing.
    (gpu_plan,) = plan.gpus
    applied = GpuMigState.of(0, lookup(model_key), mig_enabled=True, instances=gpu_plan.target)
    assert plan_node(layout, [applied]).noop
    return "plan"


def test_every_shipped_layout_is_covered() -> None:
    assert sorted(OUTCOMES) == sorted(SHIPPED)
    assert sorted(MODEL_ORDER) == sorted(MODELS)


@pytest.mark.parametrize("layout_name", SHIPPED)
def test_every_shipped_layout_plans_on_its_target_models(layout_name: str) -> None:
    assert tuple(_outcome(layout_name, key) for key in MODEL_ORDER) == OUTCOMES[layout_name]


@pytest.mark.parametrize(
    ("layout_name", "model_key", "instances"),
    [
        ("all-1g.5gb", "A100-SXM4-40GB", [("1g.5gb", s) for s in range(7)]),
        ("all-1g.10gb", "A100-SXM4-40GB", [("1g.10gb", s) for s in (0, 2, 4, 6)]),
        ("all-1g.10gb", "H100-SXM5-80GB", [("1g.10gb", s) for s in range(7)]),
        ("all-1g.20gb", "A100-SXM4-80GB", [("1g.20gb", s) for s in (0, 2, 4, 6)]),
        ("all-2g.35gb", "H200-141GB", [("2g.35gb", s) for s in (0, 2, 4)]),
        ("all-3g.71gb", "H200-141GB", [("3g.71gb", 0), ("3g.71gb", 4)]),
        ("all-7g.141gb", "H200-141GB", [("7g.141gb", 0)]),
        ("all-1g.18gb.me", "H200-141GB", [("1g.18gb+me", 0)]),
        ("all-1g.23gb", "B200", [("1g.23gb", s) for s in range(7)]),
        ("all-1g.47gb", "GB200", [("1g.47gb", s) for s in (0, 2, 4, 6)]),
        ("all-3g.135gb", "B300-SXM6", [("3g.135gb", 0), ("3g.135gb", 4)]),
        ("all-1g.35gb", "GB300", [("1g.35gb", s) for s in range(7)]),
        ("all-1g.24gb", "H100-NVL", [("1g.24gb", s) for s in (0, 2, 4, 6)]),
        # RTX PRO 6000: quarters of the 12-unit grid start at 0, 3, 6 and 9, halves at 0 and 6.
        ("all-1g.24gb", "RTX-PRO-6000-BSE", [("1g.24gb", s) for s in (0, 3, 6, 9)]),
        ("all-1g.24gb-me", "RTX-PRO-6000-BSE", [("1g.24gb-me", s) for s in (0, 3, 6, 9)]),
        ("all-2g.48gb.gfx", "RTX-PRO-6000-BSE", [("2g.48gb+gfx", 0), ("2g.48gb+gfx", 6)]),
        ("all-4g.96gb", "RTX-PRO-6000-BSE", [("4g.96gb", 0)]),
    ],
)
def test_shipped_single_profile_layouts_fill_the_gpu(
    layout_name: str, model_key: str, instances: list[tuple[str, int]]
) -> None:
    plan = plan_node(PARSED.layout(layout_name), [GpuMigState.of(0, lookup(model_key))])
    assert [(i.profile, i.start) for i in plan.gpus[0].create] == instances


def catalog_gaps(layouts: list[MigLayout]) -> list[str]:
    """What the catalog lacks for the layouts: an entry with a device filter must find every profile it names, in
    the counts it asks, on every catalog model the filter selects (and select one); an entry without one must fit
    whole on at least one catalog model."""
    mig_models = [m for m in MODELS.values() if m.mig_capable]
    gaps: list[str] = []
    for layout in layouts:
        for k, entry in enumerate(layout.entries):
            if not entry.requested:
                continue
            where = f"{layout.name} entry {k}"

            def lacks(model: GpuModel, entry: LayoutEntry = entry) -> list[str]:
                table = ProfileTable.of(model)
                found = {name: table.profile(name) for name in entry.requested}
                return [f"{name} x {count}" for name, count in entry.requested.items()
                        if (p := found[name]) is None or p.instance_count < count]

            if entry.device_filter is None:
                if all(lacks(m) for m in mig_models):
                    gaps.append(f"{where}: no catalog model has {', '.join(entry.requested)}")
                continue
            selected = [m for m in mig_models if entry.device_filter.matches(m.pci_device_id, m.nvml_name)]
            if not selected:
                gaps.append(f"{where}: its device filter selects no catalog model")
            gaps += [f"{where}: {m.key} lacks {', '.join(missing)}" for m in selected if (missing := lacks(m))]
    return gaps


def test_every_shipped_layout_names_only_profiles_the_catalog_has_for_its_models() -> None:
    layouts = load_layouts()
    assert catalog_gaps([layouts.layout(name) for name in layouts.names()]) == []


def test_a_layout_naming_a_profile_the_catalog_lacks_is_found() -> None:
    layouts = parse_layouts(
        "version: v1\nmig-configs:\n"
        "  typo:\n    - {devices: all, mig-enabled: true, mig-devices: {1g.23gb+mee: 1}}\n"
        "  b200-too-many:\n"
        "    - {device-filter: \"0x290110DE\", devices: all, mig-enabled: true, mig-devices: {3g.90gb: 3}}\n"
        "  unknown-id:\n"
        "    - {device-filter: \"0x999910DE\", devices: all, mig-enabled: true, mig-devices: {3g.90gb: 1}}\n",
        "layouts.yaml")
    assert catalog_gaps([layouts.layout(name) for name in layouts.names()]) == [
        "typo entry 0: no catalog model has 1g.23gb+mee",
        "b200-too-many entry 0: B200 lacks 3g.90gb x 3",
        "unknown-id entry 0: its device filter selects no catalog model",
    ]


def test_a_layout_for_another_model_fails_naming_the_profile() -> None:
    with pytest.raises(PlanError) as caught:
        plan_node(load_layouts().layout("all-2g.20gb"), [GpuMigState.of(0, lookup("H200-141GB"))])
    assert str(caught.value) == (
        "GPU 0: profile 2g.20gb does not exist on H200 "
        "(known: 1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb)"
    )


# --- loading and choosing ------------------------------------------------------------------------------

CUSTOM = """\
version: v1
mig-configs:
  half-split:
    - devices: [0, 1, 2, 3]
      mig-enabled: false
    - device-filter: "0x233010DE"     # H100 SXM5 only
      devices: [4, 5, 6, 7]
      mig-enabled: true
      mig-devices:
        "3g.40gb": 1
        "2g.20gb": 1
        "1g.10gb": 2
"""


def test_load_a_file(tmp_path: Path) -> None:
    path = tmp_path / "layouts.yaml"
    path.write_text(CUSTOM)
    layouts = load_layouts(path)
    assert (layouts.origin, layouts.names()) == (str(path), ["half-split"])
    split = layouts.layout()  # the only layout is chosen without a name
    assert split.name == "half-split"
    assert [(e.position, e.devices, e.mig_enabled, e.requested) for e in split.entries] == [
        (0, (0, 1, 2, 3), False, {}),
        (1, (4, 5, 6, 7), True, {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}),
    ]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(LayoutError) as caught:
        load_layouts(tmp_path / "nope.yaml")
    assert str(caught.value) == f"{tmp_path / 'nope.yaml'}: no such file"


def test_unknown_layout_name_lists_known() -> None:
    layouts = parse_layouts(CUSTOM, "layouts.yaml")
    with pytest.raises(LayoutError) as caught:
        layouts.layout("all-balanced")
    assert str(caught.value) == "layouts.yaml: no layout named 'all-balanced' (known: half-split)"


def test_a_name_is_needed_when_the_file_has_several_layouts() -> None:
    with pytest.raises(LayoutError) as caught:
        load_layouts().layout()
    assert str(caught.value).startswith(
        "built-in default-layouts.yaml: name a layout: the file has 68 (all-disabled, all-enabled, all-1g.5gb, "
    )


def test_mig_devices_may_be_left_out_when_enabled() -> None:
    layouts = parse_layouts("version: v1\nmig-configs:\n  enabled:\n    - {devices: all, mig-enabled: true}\n", "f")
    assert layouts.layout("enabled").entries[0].requested == {}


def test_yaml_booleans_as_layout_names_are_reported() -> None:
    # YAML 1.1 reads an unquoted `on` as true.
    assert _errors("version: v1\nmig-configs:\n  on:\n    - {devices: all, mig-enabled: true}\n") == [
        "layouts.yaml: mig-configs.True: layout name must be a string, got True (quote it)",
    ]


def test_zero_counts_are_kept_as_written_but_not_requested() -> None:
    text = "version: v1\nmig-configs:\n  x:\n    - {devices: all, mig-enabled: true, mig-devices: {7g.80gb: 1, " \
           "1g.10gb: 0}}\n"
    (entry,) = parse_layouts(text, "f").layout("x").entries
    assert (dict(entry.mig_devices), entry.requested) == ({"7g.80gb": 1, "1g.10gb": 0}, {"7g.80gb": 1})


# --- selection -----------------------------------------------------------------------------------------

SELECT = """\
version: v1
mig-configs:
  mixed:
    - devices: [0, 1]
      device-filter: ["H100 80GB HBM3"]
      mig-enabled: true
      mig-devices: {"7g.80gb": 1}
    - devices: [0, 1]
      device-filter: "0x20B010DE"
      mig-enabled: true
      mig-devices: {"7g.40gb": 1}
    - devices: [2]
      mig-enabled: false
  by-name-and-id:
    - devices: all
      device-filter: "nvidia h100 80gb hbm3"
      mig-enabled: false
    - devices: all
      device-filter: "0x233010DE"
      mig-enabled: true
"""


@pytest.mark.parametrize(
    ("index", "pci_id", "name", "position"),
    [
        (0, 0x233010DE, "NVIDIA H100 80GB HBM3", 0),
        (1, 0x233010DE, "NVIDIA H100 80GB HBM3", 0),
        (1, 0x20B010DE, "NVIDIA A100-SXM4-40GB", 1),
        (0, 0x20B210DE, "NVIDIA A100-SXM4-80GB", None),  # no filter matches the model
        (2, 0x233010DE, "NVIDIA H100 80GB HBM3", 2),  # no filter: any model
        (3, 0x233010DE, "NVIDIA H100 80GB HBM3", None),  # index not listed
    ],
)
def test_entry_for(index: int, pci_id: int, name: str, position: int | None) -> None:
    entry = parse_layouts(SELECT, "f").layout("mixed").entry_for(index, pci_id, name)
    assert (entry.position if entry else None) == position


def test_model_names_compare_without_case_spacing_or_vendor() -> None:
    assert normalize_model_name("NVIDIA  H100 80GB HBM3") == "h100 80gb hbm3"
    assert normalize_model_name("h100 80GB hbm3") == "h100 80gb hbm3"
    assert normalize_model_name("Tesla T4") == "tesla t4"


def test_gpu_selected_by_a_name_filter_and_an_id_filter_is_an_error() -> None:
    layout = parse_layouts(SELECT, "f").layout("by-name-and-id")
    assert layout.entry_for(0, 0x20B010DE, "NVIDIA A100-SXM4-40GB") is None
    with pytest.raises(LayoutError) as caught:
        layout.entry_for(0, 0x233010DE, "NVIDIA H100 80GB HBM3")
    assert str(caught.value) == (
        "f: mig-configs.by-name-and-id: GPU 0 (NVIDIA H100 80GB HBM3) is selected by entries [0] and [1] of "
        "layout by-name-and-id; each GPU may be selected by one entry only"
    )
    with pytest.raises(PlanError) as plan_error:
        plan_node(layout, [GpuMigState.of(0, A100_40), GpuMigState.of(1, H100)])
    assert str(plan_error.value) == (
        "GPU 1: selected by entries [0] and [1] of layout by-name-and-id; each GPU may be selected by one entry only"
    )


# --- error messages ------------------------------------------------------------------------------------


def test_not_a_mapping() -> None:
    assert _errors("- all-disabled\n") == ["layouts.yaml: must be a mapping with 'version: v1', got list"]


def test_invalid_yaml_and_duplicate_keys() -> None:
    assert _errors("version: v1\nmig-configs: [\n") == [
        "layouts.yaml: invalid YAML: expected the node content, but found '<stream end>' (line 3, column 1)"
    ]
    text = "version: v1\nmig-configs:\n  a:\n    - {devices: all, mig-enabled: false}\n  a:\n    - {devices: all}\n"
    assert _errors(text) == ["layouts.yaml: invalid YAML: duplicate key 'a' (line 5, column 3)"]


def test_top_level() -> None:
    assert _errors("version: v2\nmig-config: {}\n") == [
        "layouts.yaml: version: must be 'v1', got 'v2'",
        "layouts.yaml: mig-configs: required key is missing",
        "layouts.yaml: mig-config: unknown key",
    ]
    assert _errors("mig-configs: {}\n") == [
        "layouts.yaml: version: required key is missing",
        "layouts.yaml: mig-configs: must have at least 1 layout",
    ]
    assert _errors("version: v1\nmig-configs: [a]\n") == [
        "layouts.yaml: mig-configs: must be a mapping of layout names to entry lists, got ['a']",
    ]


def test_layouts_and_entry_lists() -> None:
    text = """\
version: v1
mig-configs:
  empty: []
  5: []
  not-a-list: {devices: all}
  all-1g.10gb+me:
    - {devices: all, mig-enabled: false}
  bad name:
    - {devices: all, mig-enabled: false}
  scalar-entry:
    - 3
"""
    assert _errors(text) == [
        "layouts.yaml: mig-configs.empty: must have at least 1 entry",
        "layouts.yaml: mig-configs.5: layout name must be a string, got 5 (quote it)",
        "layouts.yaml: mig-configs.not-a-list: must be a list of entries, got {'devices': 'all'}",
        "layouts.yaml: mig-configs.all-1g.10gb+me: layout names write '+' as '.' (e.g. all-1g.10gb.me): "
        "a name must be a label value",
        "layouts.yaml: mig-configs.bad name: a layout name must be a label value: at most 63 letters, digits, "
        "'-', '_' or '.', starting and ending with a letter or digit",
        "layouts.yaml: mig-configs.scalar-entry[0]: must be a mapping, got 3",
    ]


def test_entry_keys_and_devices() -> None:
    text = """\
version: v1
mig-configs:
  custom:
    - devices: 7
      mig-enabled: "yes"
      mig-device: {}
    - mig-enabled: true
    - devices: [0, -1, 0, x, true]
      mig-enabled: false
    - devices: []
      mig-enabled: false
    - devices: some
      mig-enabled: false
"""
    assert _errors(text) == [
        "layouts.yaml: mig-configs.custom[0].mig-enabled: must be true or false, got 'yes'",
        "layouts.yaml: mig-configs.custom[0].mig-device: unknown key",
        "layouts.yaml: mig-configs.custom[0].devices: must be 'all' or a list of GPU indices; write [7] for one GPU",
        "layouts.yaml: mig-configs.custom[1].devices: required key is missing",
        "layouts.yaml: mig-configs.custom[2].devices[1]: GPU index must be an integer >= 0, got -1",
        "layouts.yaml: mig-configs.custom[2].devices[2]: GPU 0 is listed twice",
        "layouts.yaml: mig-configs.custom[2].devices[3]: GPU index must be an integer >= 0, got 'x'",
        "layouts.yaml: mig-configs.custom[2].devices[4]: GPU index must be an integer >= 0, got True",
        "layouts.yaml: mig-configs.custom[3].devices: must list at least one GPU index (or be 'all')",
        "layouts.yaml: mig-configs.custom[4].devices: must be 'all' or a list of GPU indices, got 'some'",
    ]


def test_device_filters() -> None:
    text = """\
version: v1
mig-configs:
  custom:
    - devices: [0]
      device-filter: "0x2330"
      mig-enabled: false
    - devices: [1]
      device-filter: ["0x233010DE:0x16C110DE", 5, "", "H100 80GB HBM3", "0x233010de"]
      mig-enabled: false
    - devices: [2]
      device-filter: []
      mig-enabled: false
    - devices: [3]
      device-filter: {a: 1}
      mig-enabled: false
"""
    assert _errors(text) == [
        "layouts.yaml: mig-configs.custom[0].device-filter: a PCI device id is 0x and 8 hex digits, device id "
        "then vendor id (e.g. 0x233010DE), got '0x2330'",
        "layouts.yaml: mig-configs.custom[1].device-filter[0]: subsystem-qualified ids are not supported; use the "
        "device id alone (0x233010DE), or a model name",
        "layouts.yaml: mig-configs.custom[1].device-filter[1]: must be a string, got 5 (quote it)",
        "layouts.yaml: mig-configs.custom[1].device-filter[2]: must be a PCI device id (e.g. 0x233010DE) or a GPU "
        "model name (e.g. H100 80GB HBM3), got ''",
        "layouts.yaml: mig-configs.custom[2].device-filter: must name at least one PCI device id or model",
        "layouts.yaml: mig-configs.custom[3].device-filter: must be a string or a list of strings, got {'a': 1}",
    ]


def test_mig_devices() -> None:
    text = """\
version: v1
mig-configs:
  all-balanced:
    - devices: [0]
      mig-enabled: false
      mig-devices: {1g.10gb: 1}
    - devices: [1]
      mig-enabled: true
      mig-devices:
        3g.40gb: -1
        1g.10gb: true
        2g.20gb: "2"
        3g.40: 1
        4c.3g.40gb: 1
        3c.3g.40gb: 1
    - devices: [2]
      mig-enabled: true
      mig-devices:
        7: 1
        1g.10gb+me,me: 1
        1g.10gb+: 1
        1g.10gb-me,gfx: 1
        1g.10gb+9x: 1
        0g.5gb: 1
        1g.10gb+me..all: 1
    - devices: [3]
      mig-enabled: true
      mig-devices: {1g.10gb: 0, 2g.20gb: 0}
    - devices: [4]
      mig-enabled: true
      mig-devices: []
"""
    grammar = ("not a MIG profile name: expected <G>g.<GB>gb, optionally with a <C>c. prefix and a +<attr> or "
               "-<attr> suffix (e.g. 3g.40gb, 1c.3g.40gb, 1g.10gb+me, 1g.24gb-me)")
    at = "layouts.yaml: mig-configs.all-balanced"
    assert _errors(text) == [
        f"{at}[0].mig-devices: only allowed with mig-enabled: true",
        f"{at}[1].mig-devices.3g.40gb: count must be >= 0, got -1",
        f"{at}[1].mig-devices.1g.10gb: count must be an integer, got True",
        f"{at}[1].mig-devices.2g.20gb: count must be an integer, got '2'",
        f"{at}[1].mig-devices.3g.40: {grammar}",
        f"{at}[1].mig-devices.4c.3g.40gb: a compute instance (4c) cannot be larger than its GPU instance (3g)",
        f"{at}[1].mig-devices.3c.3g.40gb: write 3g.40gb: a <C>c. prefix names a compute instance smaller than its "
        "GPU instance",
        f"{at}[2].mig-devices.7: key must be a string, got 7 (quote it)",
        f"{at}[2].mig-devices.1g.10gb+me,me: attribute 'me' is listed twice",
        f"{at}[2].mig-devices.1g.10gb+: an attribute after '+' is empty",
        f"{at}[2].mig-devices.1g.10gb-me,gfx: only one attribute may follow '-'",
        f"{at}[2].mig-devices.1g.10gb+9x: attribute '9x' must be letters and digits (dots inside), starting with "
        "a letter",
        f"{at}[2].mig-devices.0g.5gb: {grammar}",
        f"{at}[2].mig-devices.1g.10gb+me..all: attribute 'me..all' must be letters and digits (dots inside), "
        "starting with a letter",
        f"{at}[3].mig-devices: all counts are 0; write mig-devices: {{}} for MIG enabled without instances",
        f"{at}[4].mig-devices: must be a mapping, got []",
    ]


def test_entries_selecting_the_same_gpus() -> None:
    text = """\
version: v1
mig-configs:
  custom:
    - {devices: all, mig-enabled: false}
    - {devices: [0, 1], mig-enabled: false}
  twice-all:
    - {devices: all, mig-enabled: false}
    - {devices: all, mig-enabled: true}
  filtered:
    - {devices: all, device-filter: ["0x233010DE", "0x20B010DE"], mig-enabled: false}
    - {devices: [2, 3], device-filter: ["0x20b010de"], mig-enabled: false}
    - {devices: all, device-filter: "0x233510DE", mig-enabled: false}
    - {devices: [5], mig-enabled: false}
  disjoint:
    - {devices: [0, 1], device-filter: "0x233010DE", mig-enabled: false}
    - {devices: [0, 1], device-filter: "0x233510DE", mig-enabled: false}
    - {devices: [0, 1], device-filter: "H100 80GB HBM3", mig-enabled: false}  # a name against ids: told per GPU
    - {devices: [2, 3], mig-enabled: false}
    - {devices: [4], mig-enabled: false}
"""
    tail = "each GPU may be selected by one entry only"
    assert _errors(text) == [
        f"layouts.yaml: mig-configs.custom[1]: selects GPUs 0, 1, which entry [0] selects too; {tail}",
        f"layouts.yaml: mig-configs.twice-all[1]: selects every GPU, which entry [0] selects too; {tail}",
        f"layouts.yaml: mig-configs.filtered[1]: selects GPUs 2, 3 of the filtered models, which entry [0] selects "
        f"too; {tail}",
        f"layouts.yaml: mig-configs.filtered[3]: selects GPU 5 of the filtered models, which entry [0] selects "
        f"too; {tail}",
        f"layouts.yaml: mig-configs.filtered[3]: selects GPU 5 of the filtered models, which entry [2] selects "
        f"too; {tail}",
    ]


# --- profile-name grammar ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed", "gpu_instance"),
    [
        ("3g.40gb", ProfileName(3, 3, 40), "3g.40gb"),
        ("7g.141gb", ProfileName(7, 7, 141), "7g.141gb"),
        ("1c.3g.40gb", ProfileName(1, 3, 40), "3g.40gb"),
        ("1g.10gb+me", ProfileName(1, 1, 10, ("me",)), "1g.10gb+me"),
        ("1g.24gb+me.all", ProfileName(1, 1, 24, ("me.all",)), "1g.24gb+me.all"),
        ("2g.48gb+gfx,me", ProfileName(2, 2, 48, ("gfx", "me")), "2g.48gb+gfx,me"),
        ("1g.24gb-me", ProfileName(1, 1, 24, (), "me"), "1g.24gb-me"),
    ],
)
def test_profile_names(text: str, parsed: ProfileName, gpu_instance: str) -> None:
    assert parse_profile_name(text) == parsed
    assert parse_profile_name(text).gpu_instance == gpu_instance
    assert parse_profile_name(text).is_compute_instance == (text == "1c.3g.40gb")


def test_canonical_profile_name_sorts_attributes() -> None:
    assert parse_profile_name("2g.48gb+me,gfx").canonical == "2g.48gb+gfx,me"
    assert parse_profile_name("1c.2g.48gb+me,gfx").canonical == "1c.2g.48gb+gfx,me"


@pytest.mark.parametrize("text", ["", "3g", "g.40gb", "3g.40GB", "3g.40gb ", " 3g.40gb", "03g.40gb", "3g.0gb",
                                  "mig-3g.40gb", "3g.40gb.me"])
def test_malformed_profile_names(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_profile_name(text)
    assert str(caught.value).startswith("not a MIG profile name: expected <G>g.<GB>gb")


def test_custom_node_layout_plans_explicit_placements() -> None:
    """The format example of docs/mig.md, planned on a DGX H100 with MIG off everywhere."""
    layout = parse_layouts(CUSTOM, "f").layout("half-split")
    plan = plan_node(layout, [GpuMigState.of(i, H100) for i in range(8)])
    assert plan.untouched == ()
    assert [p.noop for p in plan.gpus] == [True] * 4 + [False] * 4
    assert plan.gpus[4].actions() == [
        "GPU 4: enable MIG",
        "GPU 4: create 3g.40gb at slices 4-7",
        "GPU 4: create 2g.20gb at slices 0-1",
        "GPU 4: create 1g.10gb at slice 2",
        "GPU 4: create 1g.10gb at slice 3",
    ]


def test_every_gpu_selected_twice_is_named() -> None:
    layout = parse_layouts(SELECT, "f").layout("by-name-and-id")
    with pytest.raises(PlanError) as caught:
        plan_node(layout, [GpuMigState.of(0, H100), GpuMigState.of(1, A100_40), GpuMigState.of(2, H100)])
    why = "selected by entries [0] and [1] of layout by-name-and-id; each GPU may be selected by one entry only"
    assert str(caught.value) == f"GPU 0: {why}\nGPU 2: {why}"
