"""The device plugin over real unix sockets, driven by a test kubelet, on the fake NVML."""

from __future__ import annotations

import grpc
import pytest

from agent.config import parse_config
from agent.deviceplugin.v1beta1 import api_pb2
from tests.plugin_harness import running_agent, wait_until

DGX_NUMA = [0, 0, 0, 0, 1, 1, 1, 1]


async def test_registers_and_lists_eight_healthy_gpus_with_numa() -> None:
    async with running_agent("dgx-h100") as rig:
        uuids = [g.uuid for g in rig.agent.bus.current.inventory.gpus]
        devices = rig.devices()
        assert [d.ID for d in devices] == uuids
        assert all(len(u) == 40 and u.startswith("GPU-") for u in uuids)
        assert [d.health for d in devices] == ["Healthy"] * 8
        assert [[n.ID for n in d.topology.nodes] for d in devices] == [[n] for n in DGX_NUMA]
        assert rig.kubelet.capacity() == ({"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": "8"})
        options = rig.kubelet.plugins["nvidia.com/gpu"].options
        assert options.get_preferred_allocation_available is True
        assert options.pre_start_required is False


async def test_allocate_returns_visible_devices_without_duplicates() -> None:
    async with running_agent("dgx-h100") as rig:
        ids = [d.ID for d in rig.devices()]
        stub = rig.stub()
        response = await stub.Allocate(
            api_pb2.AllocateRequest(
                container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=[ids[3], ids[1], ids[3]]),
                    api_pb2.ContainerAllocateRequest(devices_ids=[ids[7]]),
                ]
            )
        )
        assert [dict(r.envs) for r in response.container_responses] == [
            {"NVIDIA_VISIBLE_DEVICES": f"{ids[3]},{ids[1]}"},
            {"NVIDIA_VISIBLE_DEVICES": ids[7]},
        ]
        assert [list(r.cdi_devices) for r in response.container_responses] == [[], []]


@pytest.mark.parametrize(
    ("bad_id", "message"),
    [
        ("GPU-does-not-exist", "unknown device ID 'GPU-does-not-exist' for resource nvidia.com/gpu"),
        ("x" * 64, "device ID 'xxxxxxxxxxxxxxxxxxxx'... is 64 characters; IDs have at most 63"),
    ],
)
async def test_allocate_rejects_bad_ids_naming_them(bad_id: str, message: str) -> None:
    async with running_agent("single-h200") as rig:
        good = rig.devices()[0].ID
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rig.stub().Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[good, bad_id])]
                )
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == message


async def test_cdi_and_index_strategies() -> None:
    config = parse_config(
        "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, cdi]\n    deviceIDStrategy: index\n"
    )
    async with running_agent("pcie-l40s-4", config) as rig:
        ids = [d.ID for d in rig.devices()]
        response = await rig.stub().Allocate(
            api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[ids[2], ids[0]])])
        )
        (container,) = response.container_responses
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": "2,0"}
        assert [c.name for c in container.cdi_devices] == ["nvidia.com/gpu=2", "nvidia.com/gpu=0"]


async def test_preferred_allocation_honours_must_include_and_numa() -> None:
    async with running_agent("dgx-h100") as rig:
        ids = [d.ID for d in rig.devices()]
        stub = rig.stub()
        response = await stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2),
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=ids, must_include_deviceIDs=[ids[5]], allocation_size=2
                    ),
                ]
            )
        )
        assert [list(r.deviceIDs) for r in response.container_responses] == [
            [ids[0], ids[1]],
            [ids[4], ids[5]],
        ]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetPreferredAllocation(
                api_pb2.PreferredAllocationRequest(
                    container_requests=[
                        api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids[:2], allocation_size=3)
                    ]
                )
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == (
            "cannot choose 3 device(s) of nvidia.com/gpu from 2 available with 0 required"
        )


async def test_xid_marks_gpu_unhealthy_and_allocate_refuses_it() -> None:
    async with running_agent("dgx-h100") as rig:
        ids = [d.ID for d in rig.devices()]
        updates = rig.kubelet.plugins["nvidia.com/gpu"].updates
        rig.fake.inject_xid(2, 13)  # an application error: the GPU stays healthy
        rig.fake.inject_xid(2, 48)  # double-bit ECC: the GPU is unhealthy
        await wait_until(lambda: rig.devices()[2].health == "Unhealthy", what="GPU 2 unhealthy")
        assert [d.health for d in rig.devices()] == ["Healthy"] * 2 + ["Unhealthy"] + ["Healthy"] * 5
        assert rig.kubelet.plugins["nvidia.com/gpu"].updates == updates + 1
        assert rig.kubelet.capacity() == ({"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": "7"})
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rig.stub().Allocate(
                api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[ids[2]])])
            )
        assert caught.value.details() == f"device {ids[2]} of resource nvidia.com/gpu is unhealthy: XID 48"


async def test_lost_gpu_goes_unhealthy_and_comes_back_after_clean_samples() -> None:
    config = parse_config("version: v1\nhealth:\n  sampleIntervalSeconds: 0.05\n  recoveryChecks: 3\n")
    async with running_agent("pcie-l40s-4", config) as rig:
        rig.fake.set_gpu_lost(1)
        await wait_until(lambda: rig.devices()[1].health == "Unhealthy", what="GPU 1 unhealthy")
        assert [d.health for d in rig.devices()] == ["Healthy", "Unhealthy", "Healthy", "Healthy"]
        state = rig.agent.bus.current
        assert state.node_fault() == "GPU is lost (fallen off the bus)"
        rig.fake.set_gpu_lost(1, False)
        await wait_until(lambda: rig.devices()[1].health == "Healthy", what="GPU 1 healthy again")
        kinds = [(i.kind, i.message) for i in rig.agent.bus.current.incidents]
        assert kinds == [("fault", "GPU is lost (fallen off the bus)"),
                         ("recovered", "recovered from GPU is lost (fallen off the bus)")]


async def test_reregisters_after_kubelet_restart() -> None:
    async with running_agent("dgx-h100") as rig:
        first = rig.kubelet.plugins["nvidia.com/gpu"].endpoint
        await rig.restart_kubelet()
        await rig.kubelet.wait_for({"nvidia.com/gpu"}, 1.0)
        second = rig.kubelet.plugins["nvidia.com/gpu"].endpoint
        assert second != first
        assert (rig.directory / second).is_socket()
        assert not (rig.directory / first).exists()
        assert len(rig.devices()) == 8
        assert rig.kubelet.capacity() == ({"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": "8"})


async def test_reserves_when_its_socket_is_removed() -> None:
    async with running_agent("single-h200") as rig:
        first = rig.kubelet.plugins["nvidia.com/gpu"].endpoint
        (rig.directory / first).unlink()
        await wait_until(lambda: rig.kubelet.plugins["nvidia.com/gpu"].endpoint != first, 1.0, "re-registration")
        second = rig.kubelet.plugins["nvidia.com/gpu"].endpoint
        assert (rig.directory / second).is_socket()
        await rig.kubelet.wait_for({"nvidia.com/gpu"}, 1.0)


async def test_waits_for_an_absent_kubelet() -> None:
    async with running_agent("single-h200", kubelet_first=False) as rig:
        assert rig.agent.ready() == (False, "not registered with the kubelet")
        await rig.kubelet.start()
        await rig.kubelet.wait_for({"nvidia.com/gpu"}, 2.0)
        await wait_until(lambda: rig.agent.ready() == (True, "ok"), 1.0, "readiness")


async def preferred(rig: object, available: list[str], size: int, must: list[str] | None = None) -> list[str]:
    response = await rig.stub().GetPreferredAllocation(  # type: ignore[attr-defined]
        api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must or [], allocation_size=size)])
    )
    return list(response.container_responses[0].deviceIDs)


async def test_two_gpus_on_nvlink_bridged_pairs_get_a_bridge() -> None:
    async with running_agent("a100-pcie-nvlink-pairs") as rig:
        ids = [d.ID for d in rig.devices()]
        assert await preferred(rig, ids, 2) == [ids[0], ids[1]]
        # With GPU 0 taken, the other bridged pair beats GPU 1 with a GPU across the bridge.
        assert await preferred(rig, ids[1:], 2) == [ids[2], ids[3]]
        assert await preferred(rig, ids, 2, must=[ids[3]]) == [ids[2], ids[3]]


async def test_four_gpus_on_dgx_h100_stay_on_one_numa_node() -> None:
    async with running_agent("dgx-h100") as rig:
        ids = [d.ID for d in rig.devices()]
        assert await preferred(rig, ids, 4) == ids[:4]
        assert await preferred(rig, [ids[i] for i in (0, 2, 4, 5, 6, 7)], 4) == ids[4:]
        assert await preferred(rig, ids, 4, must=[ids[6]]) == ids[4:]
