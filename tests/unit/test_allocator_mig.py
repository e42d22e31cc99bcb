"""The preferred allocation of MIG devices (agent/topology/mig_devices.py): one NUMA node before two, the fewest
GPUs within it, the GPUs that fit exactly first, must-include devices, ties, and the checks on what the caller passes
in. Every expectation is worked out by hand from the policy in mig_devices.py's docstrings."""

from __future__ import annotations

import pytest

from agent.topology.mig_devices import preferred_mig
from agent.topology.request import AllocationError


def mig_devices() -> dict[str, tuple[int, int | None]]:
    """GPU0: 3 devices, GPU1: 2 (NUMA node 0); GPU2: 4, GPU3: 1 (node 1)."""
    layout = {0: (3, 0), 1: (2, 0), 2: (4, 1), 3: (1, 1)}
    return {f"mig-{g}-{i}": (g, node) for g, (count, node) in layout.items() for i in range(count)}


# --- which GPUs and NUMA nodes serve a request


def test_mig_one_gpu_on_the_first_node_that_fits_exactly() -> None:
    devices = mig_devices()
    # Both nodes can serve 2 from one GPU; node 0 comes first, and GPU1 fits exactly (GPU0 stays whole).
    assert preferred_mig(devices, list(devices), [], 2) == ["mig-1-0", "mig-1-1"]


def test_mig_fewest_gpus_within_one_node() -> None:
    devices = mig_devices()
    # Node 0 needs GPUs 0 and 1 for 4 devices; node 1 serves them from GPU2 alone.
    assert preferred_mig(devices, list(devices), [], 4) == ["mig-2-0", "mig-2-1", "mig-2-2", "mig-2-3"]


def test_mig_spans_nodes_only_when_needed() -> None:
    devices = mig_devices()
    assert preferred_mig(devices, list(devices), [], 6) == [
        "mig-1-0",
        "mig-1-1",
        "mig-2-0",
        "mig-2-1",
        "mig-2-2",
        "mig-2-3",
    ]
    available = [d for d in devices if not d.startswith("mig-2-")]
    assert preferred_mig(devices, available, [], 4) == ["mig-0-0", "mig-0-1", "mig-0-2", "mig-1-0"]


def test_mig_one_node_that_cannot_serve_does_not_push_the_request_onto_two() -> None:
    # Node 0 has one GPU with two devices, node 1 two such GPUs: three devices fit on node 1 alone.
    devices = {f"mig-{g}-{i}": (g, 0 if g == 0 else 1) for g in range(3) for i in range(2)}
    assert preferred_mig(devices, list(devices), [], 3) == ["mig-1-0", "mig-1-1", "mig-2-0"]


def test_mig_request_bigger_than_any_gpu_starts_on_the_lowest_of_the_largest() -> None:
    devices = {f"mig-{g}-{i}": (g, 0) for g in range(3) for i in range(2)}
    assert preferred_mig(devices, list(devices), [], 5) == ["mig-0-0", "mig-0-1", "mig-1-0", "mig-1-1", "mig-2-0"]


def test_mig_devices_without_numa_node_form_one_node() -> None:
    devices: dict[str, tuple[int, int | None]] = {"a": (0, None), "b": (1, None), "c": (2, 0), "d": (2, 0)}
    assert preferred_mig(devices, list(devices), [], 2) == ["c", "d"]
    assert preferred_mig(devices, ["a", "b", "c"], [], 2) == ["a", "b"]


# --- must-include devices


def test_mig_must_include() -> None:
    devices = mig_devices()
    assert preferred_mig(devices, list(devices), ["mig-3-0"], 2) == ["mig-2-0", "mig-3-0"]
    assert preferred_mig(devices, list(devices), ["mig-0-2"], 2) == ["mig-0-0", "mig-0-2"]


def test_mig_must_include_gpus_give_only_what_the_request_still_needs() -> None:
    devices = {f"mig-{g}-{i}": (g, 0) for g in range(2) for i in range(3)}
    # One device of each GPU is required; the third comes from GPU 0, the lower index.
    assert preferred_mig(devices, list(devices), ["mig-0-0", "mig-1-0"], 3) == ["mig-0-0", "mig-0-1", "mig-1-0"]
    # Five: GPU 0 is filled first, then GPU 1 gives the one more needed.
    assert preferred_mig(devices, list(devices), ["mig-0-0", "mig-1-0"], 5) == [
        "mig-0-0", "mig-0-1", "mig-0-2", "mig-1-0", "mig-1-1"]


# --- ties and order


def test_mig_ties_go_to_the_lowest_numa_node_and_devices_without_one_last() -> None:
    no_node = {"mig-a-0": (0, None), "mig-a-1": (0, None), "mig-b-0": (1, 0), "mig-b-1": (1, 0)}
    assert preferred_mig(no_node, list(no_node), [], 2) == ["mig-b-0", "mig-b-1"]
    # Nodes 8 and 1: node 1 comes first by number, whatever order a set of them iterates in.
    numbered = {"mig-a-0": (0, 8), "mig-a-1": (0, 8), "mig-b-0": (1, 1), "mig-b-1": (1, 1)}
    assert preferred_mig(numbered, list(numbered), [], 2) == ["mig-b-0", "mig-b-1"]


def test_mig_answer_is_in_natural_order() -> None:
    devices = {f"mig-0-{i}": (0, 0) for i in (2, 10, 11)}
    assert preferred_mig(devices, list(devices), [], 3) == ["mig-0-2", "mig-0-10", "mig-0-11"]


# --- invalid requests


def test_mig_rejects_bad_input() -> None:
    devices = mig_devices()
    with pytest.raises(AllocationError, match="must_include: unknown MIG device id 'nope'"):
        preferred_mig(devices, list(devices), ["nope"], 1)
    with pytest.raises(AllocationError, match="GPU 0 is given two NUMA nodes"):
        preferred_mig({"a": (0, 0), "b": (0, 1)}, ["a"], [], 1)
    with pytest.raises(AllocationError, match="size must be a positive integer"):
        preferred_mig(devices, list(devices), [], 0)


def test_mig_device_with_a_bad_parent_index_is_named() -> None:
    with pytest.raises(AllocationError) as caught:
        preferred_mig({"mig-a": (-1, 0)}, ["mig-a"], [], 1)
    assert str(caught.value) == "MIG device 'mig-a': parent GPU index -1 is not a non-negative integer"
