"""The reason a MIG layout waits or fails while pods hold GPUs: the GPUs actually held, each pod once."""

from __future__ import annotations

from agent.config import load_config
from agent.mig.controller import _in_use
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.podresources import DeviceHolder
from agent.state import NodeState


def state() -> NodeState:
    fake = FakeNvml(load_node("dgx-h100"))
    backend = NvmlBackend(lib=fake, numa_lookup=fake.numa_node)
    backend.init()
    try:
        return NodeState(version=1, inventory=backend.inventory(), config=load_config(None))
    finally:
        backend.shutdown()


def test_one_gpu_held_through_two_replicas_names_that_gpu_and_the_pod_once() -> None:
    s = state()
    uuid = s.inventory.gpus[3].uuid
    busy = [DeviceHolder("default", "gpu-pod", "main", "nvidia.com/gpu", f"{uuid}::0"),
            DeviceHolder("default", "gpu-pod", "main", "nvidia.com/gpu", f"{uuid}::1")]
    assert _in_use(s, busy, "") == "GPU 3 is in use by default/gpu-pod"


def test_gpus_held_by_two_pods_are_listed_in_order_with_the_wait() -> None:
    s = state()
    g = s.inventory.gpus
    busy = [DeviceHolder("default", "gpu-pod", "main", "nvidia.com/gpu", g[1].uuid),
            DeviceHolder("default", "gpu-pod", "main", "nvidia.com/gpu", g[0].uuid),
            DeviceHolder("ml", "train-0", "side", "nvidia.com/gpu", g[7].uuid)]
    assert _in_use(s, busy, " after waiting 30s") == (
        "GPUs 0, 1, 7 are in use after waiting 30s by default/gpu-pod, ml/train-0"
    )
