"""A MIG layout is planned with the device-plugin sockets it needs: one whose resources' sockets the kubelet
directory has no room for is refused before anything is withdrawn or changed, with the reason on the Node; the
same layout under a shorter kubelet directory, or under a migStrategy that serves it as nvidia.com/gpu, applies."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from agent.config import AgentConfig, parse_config
from agent.inventory import plan as resource_plan
from agent.mig.applier import apply_layout, plan_layout
from agent.mig.controller import after_layout
from agent.mig.layout import load_layouts
from agent.simulate import InMemoryNode
from agent.state import NodeState
from tests.builders import started
from tests.mig_rig import FRESH, LAYOUT, drive
from tests.plugin_harness import running_agent, short_dir, wait_until

LONG_KUBELET_DIR = Path("/var/lib/k8s-" + "x" * 33 + "/device-plugins")
"""61 bytes: room for nvidia.com/gpu's socket name (45 bytes), none for nvidia.com/mig-1g.10gb's (53)."""
SHORT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
APPLIED = [(True, False, 7)] * 8
"""Each GPU of the dgx-h100 once all-1g.10gb is applied: MIG on, seven GPU instances."""


def config(tmp_path: Path, strategy: str, dra: bool = False) -> AgentConfig:
    return parse_config(yaml.safe_dump({
        "version": "v1", "flags": {"migStrategy": strategy}, "dra": {"enabled": dra},
        "mig": {"stateDir": str(tmp_path / "state"), "podResourcesSocket": str(tmp_path / "pr" / "kubelet.sock")}}))


@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin", "dra"])
async def test_a_layout_whose_sockets_cannot_exist_is_refused_with_the_reason_on_the_node_and_nothing_touched(
        tmp_path: Path, dra: bool) -> None:
    # In DRA mode (without dynamic MIG) the device plugin still serves the MIG devices: refused the same way.
    assert len(str(LONG_KUBELET_DIR)) == 61  # as in the trial
    outcome = await drive(config(tmp_path, "mixed", dra), LAYOUT, lambda s: s.state != "pending",
                          kubelet_dir=LONG_KUBELET_DIR)

    reason = (f"layout {LAYOUT!r} cannot be served: kubelet directory {LONG_KUBELET_DIR} is 61 bytes long: a socket "
              "path holds at most 107 bytes, which leaves 45 for the name of nvidia.com/mig-1g.10gb's socket, and it "
              "needs 53 (use a shorter --kubelet-dir); nothing was changed on the GPUs")
    # Not retried (another layout or kubelet directory is needed): the reason carries no "next try".
    assert outcome["status"] == [LAYOUT, "failed", reason]
    assert (outcome["state_label"], outcome["annotation"]) == ("failed", reason)
    assert outcome["events"] == [["MigConfigFailed", f"MIG layout {LAYOUT}: failed: {reason}"]]
    assert [r for r in outcome["logs"] if r["level"] == "ERROR"] == [
        {"level": "ERROR", "message": f"MIG layout {LAYOUT}: failed: {reason}", "traceback": False}]
    assert outcome["gpus"] == FRESH
    assert (outcome["withdrawn"], outcome["draining"]) == (0, 0)  # no GPU was withdrawn from the kubelet either
    assert not (tmp_path / "state").exists()  # nor the journal written


@pytest.mark.parametrize(("strategy", "kubelet_dir"), [
    ("mixed", SHORT_KUBELET_DIR),
    # nvidia.com/gpu serves the MIG devices (single) or the whole GPUs (none): its socket fits.
    ("single", LONG_KUBELET_DIR),
    ("none", LONG_KUBELET_DIR),
], ids=["mixed-short-dir", "single-long-dir", "none-long-dir"])
async def test_the_same_layout_applies_where_its_sockets_fit(tmp_path: Path, strategy: str, kubelet_dir: Path) -> None:
    outcome = await drive(config(tmp_path, strategy), LAYOUT, lambda s: s.state != "pending",
                          kubelet_dir=kubelet_dir)
    assert outcome["status"] == [LAYOUT, "success", f"layout {LAYOUT!r} applied: 64 change(s)"]
    assert outcome["gpus"] == APPLIED


# (preset, layout applied first or None, layout planned)
CHANGES = [
    ("dgx-h100", None, "all-balanced"),
    ("dgx-h100", "all-balanced", "all-1g.10gb"),
    ("dgx-h100", "all-3g.40gb", "all-balanced"),
    ("dgx-h100", "all-balanced", "all-disabled"),
    ("dgx-h100", None, "all-1g.10gb.me"),
    ("single-h200", "all-balanced", "all-7g.141gb"),
    ("hgx-h200", None, "all-1g.10gb"),  # selects no GPU of an H200 node
]


@pytest.mark.parametrize("strategy", ["mixed", "single", "none"])
@pytest.mark.parametrize(("preset", "first", "name"), CHANGES)
def test_the_node_a_plan_makes_advertises_what_the_applied_node_does(
        strategy: str, preset: str, first: str | None, name: str) -> None:
    layouts = load_layouts()
    node = started(preset)
    if first is not None:
        assert apply_layout(node.ops, node.count, layouts.layout(first)).outcome == "success"
    cfg = parse_config(f"version: v1\nflags: {{migStrategy: {strategy}}}\n")
    before = NodeState(version=1, inventory=node.backend.inventory(), config=cfg)
    plan = plan_layout(node.ops, node.count, layouts.layout(name))

    assert apply_layout(node.ops, node.count, layouts.layout(name)).outcome == "success"

    def advertised(state: NodeState) -> dict[str, list[tuple[int, str]]]:
        return {r.name: [(d.gpu_index, d.kind) for d in r.devices] for r in resource_plan(state).resources.values()}

    after = NodeState(version=1, inventory=node.backend.inventory(), config=cfg)
    assert advertised(after_layout(before, plan)) == advertised(after)


async def test_the_running_agent_refuses_a_layout_its_kubelet_directory_cannot_serve() -> None:
    """The whole agent, on a 61-byte kubelet directory of its own: the label asks for all-1g.10gb under mixed, the
    Node says why it cannot be served, and the eight GPUs stay whole and offered."""
    base = short_dir()
    directory = base / ("k" * (61 - len(str(base)) - 1))
    directory.mkdir()
    assert len(str(directory)) == 61
    cfg = parse_config(yaml.safe_dump({
        "version": "v1", "flags": {"migStrategy": "mixed"},
        "mig": {"stateDir": f"{base}/state", "podResourcesSocket": f"{base}/pr.sock"}}))
    node = InMemoryNode("gpu-node-1")
    try:
        async with running_agent("dgx-h100", cfg, kube=node, directory=directory) as rig:
            await node.patch_metadata({"nvidia.com/mig.config": LAYOUT}, {})
            await wait_until(lambda: node.view.labels.get("nvidia.com/mig.config.state") == "failed", 10,
                             "the layout refused")
            assert node.view.annotations["nvidia.com/mig.config.state.reason"] == (
                f"layout {LAYOUT!r} cannot be served: kubelet directory {directory} is 61 bytes long: a socket "
                "path holds at most 107 bytes, which leaves 45 for the name of nvidia.com/mig-1g.10gb's socket, "
                "and it needs 53 (use a shorter --kubelet-dir); nothing was changed on the GPUs")
            assert len(rig.devices()) == 8
            assert set(rig.agent.plugins.plugins) == {"nvidia.com/gpu"}
    finally:
        shutil.rmtree(base, ignore_errors=True)
