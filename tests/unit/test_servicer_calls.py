"""The DevicePlugin service of one resource over real gRPC on a unix socket, without an agent or a kubelet:
what the kubelet gets back from each call, and what it is refused with. The server (server.plugin_server, as the
agent serves each resource) runs on an event loop of its own thread; the test calls it with grpc's blocking
client, as a kubelet in another process would."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from agent.config import parse_config
from agent.deviceplugin.response import NodeFiles
from agent.deviceplugin.v1beta1 import api_pb2
from agent.metrics import Metrics
from agent.nvml.records import DriverInfo, NodeInventory, PairLink
from agent.state import DeviceHealth, NodeState
from tests.builders import Served, allocate, gpu, node, refusal, serving

GPU = "nvidia.com/gpu"
DGX_NUMA = [0, 0, 0, 0, 1, 1, 1, 1]
"""The DGX H100's GPUs 0-3 sit on NUMA node 0, 4-7 on node 1."""


def preferred(served: Served, available: list[str], size: int, must: list[str] | None = None) -> list[str]:
    response = served.stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(container_requests=[
        api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                                    must_include_deviceIDs=must or [], allocation_size=size)]))
    (container,) = response.container_responses
    return list(container.deviceIDs)


def refused_preference(served: Served, available: list[str], size: int,
                       must: list[str] | None = None) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        preferred(served, available, size, must)
    return refusal(caught.value)


def refused_allocate(served: Served, *requests: list[str]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        allocate(served, *requests)
    return refusal(caught.value)


def counter(metrics: Metrics, name: str, resource: str = GPU) -> float | None:
    return metrics.registry.get_sample_value(name, {"resource": resource})


def test_options_offer_preferred_allocation_and_no_pre_start() -> None:
    with serving(node()) as served:
        options = served.stub.GetDevicePluginOptions(api_pb2.Empty())
        assert served.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["x"])) == \
            api_pb2.PreStartContainerResponse()
    assert (options.pre_start_required, options.get_preferred_allocation_available) == (False, True)


def test_list_and_watch_sends_the_list_then_each_change() -> None:
    with serving(node()) as served:
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        first = next(stream)
        assert [d.ID for d in first.devices] == served.ids
        assert [d.health for d in first.devices] == ["Healthy"] * 8
        assert [[n.ID for n in d.topology.nodes] for d in first.devices] == [[n] for n in DGX_NUMA]
        # A state that changes nothing this resource lists sends nothing; the next change does.
        served.update(mig_request="all-disabled")
        served.update(health={served.ids[5]: DeviceHealth(False, "XID 79")})
        second = next(stream)
        assert [d.health for d in second.devices] == ["Healthy"] * 5 + ["Unhealthy"] + ["Healthy"] * 2
        assert [d.ID for d in second.devices] == served.ids
        stream.cancel()


def test_a_resource_the_state_does_not_have_lists_no_devices() -> None:
    with serving(node(), resource="nvidia.com/mig-1g.10gb") as served:
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        assert list(next(stream).devices) == []
        assert served.servicer.devices() == ()
        stream.cancel()


def test_close_ends_every_open_stream() -> None:
    with serving(node()) as served:
        streams = [served.stub.ListAndWatch(api_pb2.Empty()) for _ in range(2)]
        assert [len(next(s).devices) for s in streams] == [8, 8]
        served.close()
        assert [list(s) for s in streams] == [[], []]


def test_a_change_published_just_before_close_still_reaches_the_stream_before_it_ends() -> None:
    with serving(node()) as served:
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        assert len(next(stream).devices) == 8

        async def change_then_close() -> None:  # as a resource vanishes and its server is stopped at once
            await served.bus.update(health={served.ids[1]: DeviceHealth(False, "XID 79")})
            served.servicer.close()

        served.loop.run(change_then_close())
        assert [d.health for d in next(stream).devices] == ["Healthy", "Unhealthy"] + ["Healthy"] * 6
        assert list(stream) == []


def test_a_fifth_stream_is_refused_until_one_ends() -> None:
    with serving(node()) as served:
        streams = [served.stub.ListAndWatch(api_pb2.Empty()) for _ in range(4)]
        assert [len(next(s).devices) for s in streams] == [8] * 4
        fifth = served.stub.ListAndWatch(api_pb2.Empty())
        with pytest.raises(grpc.RpcError) as caught:
            next(fifth)
        assert refusal(caught.value) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         "ListAndWatch for nvidia.com/gpu already has 4 open streams")
        streams[0].cancel()
        for attempt in range(200):  # the server sees the cancellation a moment later
            again = served.stub.ListAndWatch(api_pb2.Empty())
            try:
                assert len(next(again).devices) == 8
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
                assert attempt < 199, "no stream was freed by the cancellation"
        for s in [*streams[1:], again]:
            s.cancel()


def test_preferred_allocation_keeps_to_one_numa_node_and_honours_must_include() -> None:
    with serving(node()) as served:
        ids = served.ids
        assert preferred(served, ids, 4) == ids[:4]
        assert preferred(served, ids, 2, must=[ids[6]]) == [ids[4], ids[6]]
        assert set(preferred(served, ids, 4, must=[ids[6]])) == set(ids[4:])
        # Repeated IDs count once.
        assert set(preferred(served, [ids[0], ids[0], ids[1]], 2)) == {ids[0], ids[1]}


def test_preferred_allocation_refuses_what_cannot_be_chosen() -> None:
    with serving(node()) as served:
        ids = served.ids
        bad = grpc.StatusCode.INVALID_ARGUMENT
        assert refused_preference(served, ids[:2], 3) == (
            bad, "cannot choose 3 device(s) of nvidia.com/gpu from 2 available with 0 required")
        assert refused_preference(served, ids[:2], 0) == (
            bad, "cannot choose 0 device(s) of nvidia.com/gpu from 2 available with 0 required")
        assert refused_preference(served, ids[:4], 1, must=ids[:2]) == (
            bad, "cannot choose 1 device(s) of nvidia.com/gpu from 4 available with 2 required")
        assert refused_preference(served, ids[:2], 1, must=[ids[3]]) == (
            bad, f"must-include device {ids[3]} of nvidia.com/gpu is not among the available devices")
        assert refused_preference(served, [*ids[:2], "GPU-nope"], 1) == (
            bad, "unknown device ID 'GPU-nope' for resource nvidia.com/gpu")
        assert refused_preference(served, ids[:2], 1, must=["GPU-nope"]) == (
            bad, "unknown device ID 'GPU-nope' for resource nvidia.com/gpu")
        # Exactly as many as there are, and all of them required, is fine.
        assert preferred(served, ids[:2], 2, must=ids[:2]) == ids[:2]


def test_preferred_allocation_offers_unhealthy_devices_the_kubelet_lists() -> None:
    with serving(node()) as served:
        ids = served.ids
        served.update(health={ids[1]: DeviceHealth(False, "XID 48")})
        assert preferred(served, ids[:2], 2) == ids[:2]


def test_ids_longer_than_63_characters_are_refused_by_length() -> None:
    long_id = "G" * 64
    with serving(node()) as served:
        assert refused_allocate(served, [long_id]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "device ID 'GGGGGGGGGGGGGGGGGGGG'... is 64 characters; IDs have at most 63")
        assert refused_preference(served, [long_id], 1)[1] == (
            "device ID 'GGGGGGGGGGGGGGGGGGGG'... is 64 characters; IDs have at most 63")
        # 63 characters is the longest ID there is: unknown, not too long.
        assert refused_allocate(served, ["G" * 63])[1] == f"unknown device ID '{'G' * 63}' for resource nvidia.com/gpu"


def test_allocate_answers_each_container_and_counts_the_devices() -> None:
    with serving(node()) as served:
        ids = served.ids
        response = allocate(served, [ids[3], ids[1]], [ids[6], ids[6]])
        assert [dict(r.envs) for r in response.container_responses] == [
            {"NVIDIA_VISIBLE_DEVICES": f"{ids[3]},{ids[1]}"},
            {"NVIDIA_VISIBLE_DEVICES": ids[6]},
        ]
        assert counter(served.metrics, "gpu_agent_allocations_total") == 3.0
        assert counter(served.metrics, "gpu_agent_allocate_errors_total") is None


def test_allocate_refuses_empty_unknown_and_unhealthy_and_counts_refusals() -> None:
    with serving(node()) as served:
        ids = served.ids
        served.update(health={ids[2]: DeviceHealth(False, "XID 48"), ids[4]: DeviceHealth(False)})
        bad = grpc.StatusCode.INVALID_ARGUMENT
        assert refused_allocate(served, [ids[0]], []) == (bad, "allocate request for nvidia.com/gpu names no devices")
        assert refused_allocate(served, [ids[0], "GPU-x"]) == (
            bad, "unknown device ID 'GPU-x' for resource nvidia.com/gpu")
        assert refused_allocate(served, [ids[2]]) == (
            bad, f"device {ids[2]} of resource nvidia.com/gpu is unhealthy: XID 48")
        assert refused_allocate(served, [ids[4]]) == (bad, f"device {ids[4]} of resource nvidia.com/gpu is unhealthy")
        assert counter(served.metrics, "gpu_agent_allocate_errors_total") == 4.0


def test_shared_resource_with_fail_requests_greater_than_one() -> None:
    config = ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    failRequestsGreaterThanOne: true\n"
              "    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n")
    with serving(node(config=config), resource="nvidia.com/gpu.shared") as served:
        first = served.ids[0]
        assert refused_allocate(served, [f"{first}::0", f"{first}::1"]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid request: maximum request size for shared resource nvidia.com/gpu.shared is 1; found 2")
        (container,) = allocate(served, [f"{first}::1"]).container_responses
        assert dict(container.envs)["NVIDIA_VISIBLE_DEVICES"] == first


def test_shared_resource_without_the_flag_takes_two_replicas() -> None:
    config = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
    with serving(node(config=config)) as served:
        first, second = served.ids[:2]
        (container,) = allocate(served, [f"{first}::0", f"{second}::1"]).container_responses
        assert dict(container.envs)["NVIDIA_VISIBLE_DEVICES"] == f"{first},{second}"


def test_preferred_replicas_spread_over_gpus_or_pack_onto_one() -> None:
    replicas = "    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
    with serving(node(config="version: v1\nsharing:\n  timeSlicing:\n" + replicas)) as served:
        first, second = served.ids[:2]
        every = [f"{uuid}::{n}" for uuid in served.ids for n in range(4)]
        assert preferred(served, every, 2) == [f"{first}::0", f"{second}::0"]
        assert preferred(served, every, 2, must=[f"{second}::3"]) == [f"{first}::0", f"{second}::3"]
    packed = "version: v1\nflags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\nsharing:\n  timeSlicing:\n"
    with serving(node(config=packed + replicas)) as served:
        first = served.ids[0]
        every = [f"{uuid}::{n}" for uuid in served.ids for n in range(4)]
        assert preferred(served, every, 2) == [f"{first}::0", f"{first}::1"]


def test_preferred_mps_replicas_stay_on_one_gpu() -> None:
    state = node(config="version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n")
    state = state.evolve(mps={g.uuid: "" for g in state.inventory.gpus})
    with serving(state) as served:
        first = served.ids[0]
        every = [f"{uuid}::{n}" for uuid in served.ids for n in range(4)]
        assert preferred(served, every, 3) == [f"{first}::0", f"{first}::1", f"{first}::2"]


def test_preferred_mig_devices_fill_one_gpu() -> None:
    state = node(config="version: v1\nflags:\n  migStrategy: mixed\n",
                 mig={0: [("1g.10gb", i) for i in range(3)], 1: [("1g.10gb", i) for i in range(2)]})
    migs = [m.uuid for m in state.inventory.mig_devices]
    with serving(state, resource="nvidia.com/mig-1g.10gb") as served:
        # Two fit on GPU 1 exactly, which keeps GPU 0's three together.
        assert set(preferred(served, migs, 2)) == set(migs[3:5])
        assert set(preferred(served, migs, 3)) == set(migs[:3])


def test_a_sixth_stream_is_refused_after_one_of_five_ended() -> None:
    with serving(node()) as served:
        streams = [served.stub.ListAndWatch(api_pb2.Empty()) for _ in range(4)]
        assert [len(next(s).devices) for s in streams] == [8] * 4
        streams[0].cancel()
        for attempt in range(200):  # the server sees the cancellation a moment later
            again = served.stub.ListAndWatch(api_pb2.Empty())
            try:
                assert len(next(again).devices) == 8
                break
            except grpc.RpcError:
                assert attempt < 199, "no stream was freed by the cancellation"
        # Four are open again: one more is refused.
        with pytest.raises(grpc.RpcError) as caught:
            next(served.stub.ListAndWatch(api_pb2.Empty()))
        assert refusal(caught.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in [*streams[1:], again]:
            s.cancel()


def test_list_and_watch_sends_nothing_for_a_state_that_changes_no_device() -> None:
    with serving(node()) as served:
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        next(stream)
        served.update(health={served.ids[5]: DeviceHealth(False, "XID 79")})
        assert [d.health for d in next(stream).devices].count("Unhealthy") == 1
        served.update(mig_request="all-disabled")
        served.update(health={})
        assert [d.health for d in next(stream).devices] == ["Healthy"] * 8
        stream.cancel()


def test_gpus_without_a_numa_node_are_listed_without_topology() -> None:
    state = NodeState(version=1, inventory=NodeInventory(driver=DriverInfo("570.133.20", "12.8"),
                                                         gpus=(gpu(0, None), gpu(1, None)), links=()))
    with serving(state) as served:
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        assert [d.HasField("topology") for d in next(stream).devices] == [False, False]
        stream.cancel()


def test_calls_after_a_change_see_the_new_state() -> None:
    with serving(node()) as served:
        ids = served.ids
        assert preferred(served, ids, 1) == [ids[0]]
        (first,) = allocate(served, [ids[2]]).container_responses
        assert dict(first.envs) == {"NVIDIA_VISIBLE_DEVICES": ids[2]}
        served.update(health={ids[2]: DeviceHealth(False, "XID 48")})
        assert refused_allocate(served, [ids[2]])[1] == (
            f"device {ids[2]} of resource nvidia.com/gpu is unhealthy: XID 48")
        # An unhealthy device may still be offered and required in a preference: the kubelet decides.
        assert preferred(served, ids[1:3], 2, must=[ids[2]]) == ids[1:3]
        # A state that changes none of the devices: the same answers.
        served.update(mig_request="all-disabled")
        assert refused_allocate(served, [ids[2]])[1] == (
            f"device {ids[2]} of resource nvidia.com/gpu is unhealthy: XID 48")
        assert dict(allocate(served, [ids[1]]).container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": ids[1]}
        # A new config: the responses follow it.
        flags = parse_config("version: v1\nflags:\n  gdrcopyEnabled: true\n  plugin:\n"
                             "    deviceListStrategy: volume-mounts\n").flags
        served.update(config=served.bus.current.config.model_copy(update={"flags": flags}), health={})
        (second,) = allocate(served, [ids[2]]).container_responses
        assert dict(second.envs) == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices",
                                     "NVIDIA_GDRCOPY": "enabled"}


def test_device_specs_include_the_node_files_the_servicer_was_given() -> None:
    config = "version: v1\nflags:\n  plugin:\n    passDeviceSpecs: true\n"
    with serving(node(config=config), files=NodeFiles(control_nodes=("/dev/nvidiactl",))) as served:
        (container,) = allocate(served, [served.ids[3]]).container_responses
        assert [d.container_path for d in container.devices] == ["/dev/nvidia3", "/dev/nvidiactl"]
    with serving(node(config=config)) as served:
        (container,) = allocate(served, [served.ids[3]]).container_responses
        assert [d.container_path for d in container.devices] == ["/dev/nvidia3"]


def test_a_call_refused_at_its_second_container_counts_no_allocation() -> None:
    with serving(node()) as served:
        ids = served.ids
        assert refused_allocate(served, [ids[0], ids[1]], ["GPU-x"]) == (
            grpc.StatusCode.INVALID_ARGUMENT, "unknown device ID 'GPU-x' for resource nvidia.com/gpu")
        assert counter(served.metrics, "gpu_agent_allocations_total") is None
        assert counter(served.metrics, "gpu_agent_allocate_errors_total") == 1.0
        allocate(served, [ids[2]], [ids[3], ids[4]])
        assert refused_allocate(served, [ids[5]], [])[1] == "allocate request for nvidia.com/gpu names no devices"
        assert counter(served.metrics, "gpu_agent_allocations_total") == 3.0


def four_a100s(numa: list[int], nvlink_pairs: list[tuple[int, int]], minors: list[int]) -> NodeInventory:
    """Four A100s with the given NUMA nodes, NVLink pairs (12 links each, the rest over the system) and minors."""
    links = tuple(PairLink(a, b, 12 if (a, b) in nvlink_pairs else 0, "single" if (a, b) in nvlink_pairs else "system")
                  for a in range(4) for b in range(a + 1, 4))
    return NodeInventory(driver=DriverInfo("570.133.20", "12.8"),
                         gpus=tuple(replace(gpu(i, numa[i]), minor=minors[i]) for i in range(4)), links=links)


def test_a_new_inventory_reaches_preferences_and_device_specs() -> None:
    config = parse_config("version: v1\nflags:\n  plugin:\n    passDeviceSpecs: true\n")
    before = four_a100s([0, 0, 1, 1], [(0, 1), (2, 3)], [0, 1, 2, 3])
    with serving(NodeState(version=1, inventory=before, config=config)) as served:
        ids = served.ids
        assert preferred(served, ids, 2, must=[ids[0]]) == [ids[0], ids[1]]
        (container,) = allocate(served, [ids[1]]).container_responses
        assert [d.container_path for d in container.devices] == ["/dev/nvidia1"]
        # The same GPUs, re-cabled and renumbered: GPU 0's NVLink and NUMA partner is now GPU 2, GPU 1 is minor 3.
        after = four_a100s([0, 1, 0, 1], [(0, 2), (1, 3)], [0, 3, 2, 1])
        served.update(inventory=after)
        assert preferred(served, ids, 2, must=[ids[0]]) == [ids[0], ids[2]]
        (container,) = allocate(served, [ids[1]]).container_responses
        assert [d.container_path for d in container.devices] == ["/dev/nvidia3"]


def test_mps_memory_is_that_of_the_gpu_the_replicas_are_on() -> None:
    inventory = NodeInventory(driver=DriverInfo("570.133.20", "12.8"),
                              gpus=(gpu(0, 0), replace(gpu(1, 0), memory_mib=40960)), links=())
    config = parse_config("version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n")
    state = NodeState(version=1, inventory=inventory, config=config, mps={g.uuid: "" for g in inventory.gpus})
    with serving(state) as served:
        second = served.ids[1]
        (container,) = allocate(served, [f"{second}::0"]).container_responses
        assert container.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
        (container,) = allocate(served, [f"{served.ids[0]}::2"]).container_responses
        assert container.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
