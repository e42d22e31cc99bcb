"""Pure: what one container's Allocate response carries for the devices the kubelet chose, per the config's
device-list strategies, passDeviceSpecs, MPS and the other flags of NVIDIA's config v1. The servicer answers
through `ResponseBuilder.fill`, one builder per NodeState; `container_response` builds one answer with a builder
of its own. What the node's files say (`NodeFiles`) is read once at start by nodefiles.py, not here."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.config import AgentConfig
from agent.deviceplugin.v1beta1 import api_pb2
from agent.inventory import Device, Resource
from agent.mps_client import mps_client
from agent.nvml.records import MigDeviceInfo, NodeInventory

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
DEVICE_MOUNT_ROOT = "/var/run/nvidia-container-devices"
"""volume-mounts: each device is a /dev/null mount under this directory, which NVIDIA_VISIBLE_DEVICES names."""
OPTIONAL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
IMEX_CHANNEL = "/dev/nvidia-caps-imex-channels/channel0"
CDI_PLUGIN_NAME = "gpu-node-agent"
_VISIBLE = operator.attrgetter("visible")


class RequestError(ValueError):
    """A request the kubelet sent cannot be served; the message names the offending ID."""


@dataclass(frozen=True)
class NodeFiles:
    """What the response needs from the node's files, read once at start (nodefiles.read_node_files): the
    optional control device nodes that exist, the MIG capability minors (/proc/driver/nvidia-caps/mig-minors)
    and the IMEX channel."""

    control_nodes: tuple[str, ...] = ()
    mig_minors: Mapping[str, int] = field(default_factory=dict)
    imex_channel: bool = False



def _device_nodes(chosen: list[Device], inventory: NodeInventory, files: NodeFiles,
                  minors: Mapping[str, int] | None = None,
                  migs: Mapping[str, MigDeviceInfo] | None = None) -> list[str]:
    """The device nodes a container needs for the chosen devices, as NVIDIA's plugin passes them."""
    if minors is None:
        minors = {g.uuid: g.minor for g in inventory.gpus}
    if migs is None:
        migs = {m.uuid: m for m in inventory.mig_devices}
    paths = list(dict.fromkeys(f"/dev/nvidia{minors[d.gpu_uuid]}" for d in chosen))
    for d in chosen:
        mig = migs.get(d.id.split("::")[0]) if d.kind == "mig" else None
        if mig is None:
            continue
        gpu = f"gpu{minors[d.gpu_uuid]}/gi{mig.gpu_instance_id}"
        for cap in (f"{gpu}/access", f"{gpu}/ci{mig.compute_instance_id}/access"):
            if cap in files.mig_minors:
                paths.append(f"/dev/nvidia-caps/nvidia-cap{files.mig_minors[cap]}")
    return [*dict.fromkeys(paths), *files.control_nodes]


def _mps(response: api_pb2.ContainerAllocateResponse, chosen: list[Device], resource: Resource,
         inventory: NodeInventory, config: AgentConfig) -> None:
    gpus = {d.gpu_uuid for d in chosen}
    if len(gpus) > 1:
        raise RequestError(f"MPS replicas of {resource.name} from {len(gpus)} GPUs cannot share one MPS client; "
                           "ask for replicas of one GPU")
    (gpu_uuid,) = gpus
    replicas = chosen[0].replicas
    memory = next(g.memory_mib for g in inventory.gpus if g.uuid == gpu_uuid)
    client = mps_client(config.flags.mps_root, gpu_uuid, memory, len(chosen), replicas)
    for name, value in client.env:
        response.envs[name] = value
    response.mounts.extend(api_pb2.Mount(container_path=inside, host_path=host) for inside, host in client.mounts)


class ResponseBuilder:
    """Builds the Allocate responses of one NodeState: what depends only on the config, the inventory and the
    node's files (the strategies, the flags, the device node minors) is worked out once, so a call does only
    the work its devices need. The state is immutable, so one builder serves every call on that state."""

    def __init__(self, inventory: NodeInventory, config: AgentConfig, files: NodeFiles = NodeFiles(),
                 response_id: Callable[[], str] = lambda: str(uuid.uuid4())) -> None:
        self.inventory, self.config, self.files = inventory, config, files
        self._response_id = response_id
        flags = config.flags
        strategies = flags.plugin.strategies()
        self._imex = bool(config.imex.channel_ids) and files.imex_channel
        self._cdi_prefix = (f"{flags.plugin.cdi_annotation_prefix}{CDI_PLUGIN_NAME}_"
                            if "cdi-annotations" in strategies else None)
        self._cdi_cri = "cdi-cri" in strategies
        self._flag_envs = [name for enabled, name in ((flags.gdrcopy_enabled, "NVIDIA_GDRCOPY"),
                                                      (flags.gds_enabled, "NVIDIA_GDS"),
                                                      (flags.mofed_enabled, "NVIDIA_MOFED")) if enabled]
        self._cdi_only = strategies <= {"cdi-annotations", "cdi-cri"}
        self._envvar = "envvar" in strategies
        self._volume_mounts = "volume-mounts" in strategies
        self._device_specs = flags.plugin.pass_device_specs
        self._dev_root = flags.dev_root
        self._minors = {g.uuid: g.minor for g in inventory.gpus}
        self._migs = {m.uuid: m for m in inventory.mig_devices}

    def fill(self, response: api_pb2.ContainerAllocateResponse, chosen: list[Device], resource: Resource) -> None:
        """Write what the runtime needs for the chosen devices into `response` (a new, empty message);
        replicas of one GPU collapse into that GPU."""
        visible = list(dict.fromkeys(map(_VISIBLE, chosen)))
        imex = self._imex
        if self._cdi_prefix is not None or self._cdi_cri:
            cdi = [f"nvidia.com/gpu={v}" for v in visible] + (["nvidia.com/imex-channel=0"] if imex else [])
            if self._cdi_prefix is not None:
                response.annotations[f"{self._cdi_prefix}{self._response_id()}"] = ",".join(cdi)
            if self._cdi_cri:
                response.cdi_devices.extend(api_pb2.CDIDevice(name=name) for name in cdi)
        if resource.sharing == "mps":
            _mps(response, chosen, resource, self.inventory, self.config)
        for name in self._flag_envs:
            response.envs[name] = "enabled"
        if self._cdi_only:
            return  # CDI alone: the runtime injects everything from the CDI specs
        if self._envvar:
            response.envs[VISIBLE_DEVICES] = ",".join(visible)
            if imex:
                response.envs["NVIDIA_IMEX_CHANNELS"] = "0"
        if self._volume_mounts:
            response.envs[VISIBLE_DEVICES] = DEVICE_MOUNT_ROOT
            names = visible + (["imex/0"] if imex else [])
            response.mounts.extend(api_pb2.Mount(container_path=f"{DEVICE_MOUNT_ROOT}/{name}", host_path="/dev/null")
                                   for name in names)
        if self._device_specs:
            paths = (_device_nodes(chosen, self.inventory, self.files, self._minors, self._migs)
                     + ([IMEX_CHANNEL] if imex else []))
            root = self._dev_root
            response.devices.extend(
                api_pb2.DeviceSpec(container_path=p, host_path=str(root / p.lstrip("/")), permissions="rw")
                for p in paths
            )


def container_response(chosen: list[Device], resource: Resource, inventory: NodeInventory, config: AgentConfig,
                       files: NodeFiles = NodeFiles(), response_id: Callable[[], str] = lambda: str(uuid.uuid4()),
                       ) -> api_pb2.ContainerAllocateResponse:
    """What the runtime needs for the chosen devices; replicas of one GPU collapse into that GPU."""
    response = api_pb2.ContainerAllocateResponse()
    ResponseBuilder(inventory, config, files, response_id).fill(response, chosen, resource)
    return response
