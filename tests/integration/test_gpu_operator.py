"""docs/operations.md, "Beside the GPU Operator", against the agent: the ClusterPolicy switches and node labels it
names are the Operator's (facts from NVIDIA/gpu-operator: api/nvidia/v1/clusterpolicy_types.go and
controllers/state_manager.go), the agent never owns those labels, the Operator's ConfigMaps
(tests/fixtures/gpu-operator/) work unchanged, and the overlay the section shows renders with the pinned kubectl
into the DaemonSet it describes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver import REPO
from base_manifests import kubectl, ok

from agent.config import config_file, load_config
from agent.inventory import plan
from agent.labels import owned
from agent.mig.layout import load_layouts, parse_layouts
from agent.mig.planner import PlanError, plan_node
from tests.builders import code_blocks, fresh_view, node, started

OPERATIONS = REPO / "docs" / "operations.md"
FIXTURES = REPO / "tests" / "fixtures" / "gpu-operator"
OPERANDS = {"devicePlugin", "gfd", "migManager", "dcgmExporter"}
"""The ClusterPolicy fields (json names) of the four operands the agent replaces."""
DEPLOY_LABELS = {"nvidia.com/gpu.deploy.device-plugin", "nvidia.com/gpu.deploy.gpu-feature-discovery",
                 "nvidia.com/gpu.deploy.mig-manager", "nvidia.com/gpu.deploy.dcgm-exporter"}
"""The Operator's per-node switches for those operands."""


def section() -> str:
    text = OPERATIONS.read_text()
    start = text.index("## Beside the GPU Operator")
    return text[start:text.index("\n## ", start + 1)]


def blocks(language: str) -> list[str]:
    return [body for lang, body in code_blocks(section()) if lang == language]


def test_the_clusterpolicy_patch_turns_off_exactly_the_four_operands() -> None:
    (patch, overlay) = [yaml.safe_load(b) for b in blocks("yaml")]
    assert patch == {"spec": {name: {"enabled": False} for name in OPERANDS}}
    assert "resources" in overlay


def test_the_node_labels_are_the_operators_switches_and_never_the_agents() -> None:
    (labels, copies) = blocks("sh")
    switched = set(re.findall(r"(nvidia\.com/gpu\.deploy\.[a-z-]+)=false", labels))
    assert switched == DEPLOY_LABELS
    assert not any(owned(key) for key in switched)
    assert "nvidia.com/gpu.present=true" in labels
    assert "default-mig-parted-config" in copies and "time-slicing-config-all" in copies


def test_the_operators_mig_layouts_load_and_plan_like_the_shipped_ones() -> None:
    configmap = yaml.safe_load((FIXTURES / "default-mig-parted-config.yaml").read_text())
    operator = parse_layouts(configmap["data"]["config.yaml"], "default-mig-parted-config")
    shipped = load_layouts()
    assert {"all-disabled", "all-enabled", "all-1g.10gb", "all-balanced"} <= set(operator.names())
    view = fresh_view(started("dgx-h100").spec)
    for name in ("all-1g.10gb", "all-2g.20gb", "all-3g.40gb", "all-7g.80gb", "all-balanced", "all-disabled"):
        theirs = plan_node(operator.layout(name), view)
        ours = plan_node(shipped.layout(name), view)
        assert theirs.describe() == ours.describe(), name
    # A layout written for another GPU is refused the same way.
    for layouts in (operator, shipped):
        with pytest.raises(PlanError) as refused:
            plan_node(layouts.layout("all-1g.5gb"), view)
        assert "1g.5gb" in str(refused.value)


@pytest.mark.parametrize("preset", ["dgx-b200", "hgx-b300", "gb200-nvl72-tray", "gb300-nvl72-tray",
                                    "pcie-rtx-pro-6000-8", "hgx-h20", "single-gh200", "pcie-h100-nvl-pair"])
def test_every_layout_the_operator_and_the_agent_both_ship_plans_alike_on_the_newer_presets(preset: str) -> None:
    configmap = yaml.safe_load((FIXTURES / "default-mig-parted-config.yaml").read_text())
    operator = parse_layouts(configmap["data"]["config.yaml"], "default-mig-parted-config")
    shipped = load_layouts()
    view = fresh_view(started(preset).spec)

    def outcome(layouts: Any, name: str) -> str:
        try:
            return plan_node(layouts.layout(name), view).describe()
        except PlanError as err:
            return f"refused: {err}"

    common = sorted(set(operator.names()) & set(shipped.names()))
    assert len(common) == len(shipped.names())  # every shipped layout is also one of the Operator's
    planned = [name for name in common if not outcome(shipped, name).startswith(("refused", "layout"))]
    assert planned, preset
    assert {name: outcome(shipped, name) for name in common} == {name: outcome(operator, name) for name in common}


def test_the_operators_time_slicing_configmap_is_a_directory_of_named_configs(tmp_path: Path) -> None:
    configmap = yaml.safe_load((FIXTURES / "time-slicing-config-all.yaml").read_text())
    directory = tmp_path / "configs"
    directory.mkdir()
    for key, text in configmap["data"].items():
        (directory / key).write_text(text)
    # One config: chosen without a label (the Operator's devicePlugin.config.default=any), and by the label.
    assert config_file(directory) == directory / "any" == config_file(directory, "any")
    state = node().evolve(config=load_config(directory, "any"))
    assert {n: len(r.devices) for n, r in plan(state).resources.items()} == {"nvidia.com/gpu": 32}


def test_the_overlay_renders_the_daemonset_the_section_describes(tmp_path: Path) -> None:
    overlay = tmp_path / "overlays" / "operator"
    overlay.mkdir(parents=True)
    shutil.copytree(REPO / "daemonset", tmp_path / "daemonset")
    (_, kustomization) = blocks("yaml")
    (overlay / "kustomization.yaml").write_text(kustomization)
    rendered = list(yaml.safe_load_all(ok(kubectl("kustomize", str(overlay)))))
    (daemonset,) = [o for o in rendered if o["kind"] == "DaemonSet"]
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["config"]["projected"]["sources"][1]["configMap"] == {
        "name": "default-mig-parted-config", "items": [{"key": "config.yaml", "path": "mig-layouts.yaml"}]}
    assert volumes["named-configs"] == {"name": "named-configs", "configMap": {"name": "time-slicing-config-all"}}
    container = spec["containers"][0]
    assert {"name": "named-configs", "mountPath": "/etc/gpu-agent-configs", "readOnly": True} in container[
        "volumeMounts"]
    assert container["args"][:3] == ["run", "--config", "/etc/gpu-agent-configs"]
