"""The fake NVML's handles (ctypes pointers of pynvml's handle types whose addresses encode what they name),
the lookups from a handle to the state it names, ctypes argument conventions, and the NVLink wiring."""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any

import pynvml

from agent.nvml.catalog import GpuModel, MigProfile, Placement
from agent.nvml.fake_state import ComputeInstance, EventSet, FakeState, GpuInstance, GpuState, nvml_error
from agent.nvml.nodefile import GpuSpec

PCIE_TOPOLOGY = {
    "single": pynvml.NVML_TOPOLOGY_SINGLE,
    "multiple": pynvml.NVML_TOPOLOGY_MULTIPLE,
    "hostbridge": pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
    "node": pynvml.NVML_TOPOLOGY_NODE,
    "system": pynvml.NVML_TOPOLOGY_SYSTEM,
}

# NVSwitch wiring per GPU link count: DGX/HGX H100 boards spread 18 links over four switches (5, 4, 4, 5),
# DGX A100 boards 12 links over six (2 each).
_SWITCH_LINKS = {18: (5, 4, 4, 5), 12: (2, 2, 2, 2, 2, 2)}
_SWITCH_PCI_DEVICE_ID = {
    pynvml.NVML_DEVICE_ARCH_AMPERE: 0x1AF110DE,
    pynvml.NVML_DEVICE_ARCH_HOPPER: 0x22A310DE,
}
_SWITCH_BUS_BASE = 0xE0


_CArgObject = type(ctypes.byref(ctypes.c_uint()))


# --- handles -------------------------------------------------------------------------------------------

KIND_GPU, KIND_MIG, KIND_GI, KIND_CI, KIND_EVENT_SET = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class Ref:
    """What a handle names: kind, GPU index, GPU-instance id, compute-instance id, token."""

    kind: int
    gpu: int = 0
    gi: int = 0
    ci: int = 0
    token: int = 0

    @property
    def address(self) -> int:
        fields = (self.kind << 56) | (self.gpu << 48) | (self.gi << 40) | (self.ci << 32)
        return fields | (self.token & 0xFFFFFFFF)

    @classmethod
    def of(cls, handle: Any) -> Ref | None:
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError):
            return None
        if not address:
            return None
        return cls(
            kind=(address >> 56) & 0xFF,
            gpu=(address >> 48) & 0xFF,
            gi=(address >> 40) & 0xFF,
            ci=(address >> 32) & 0xFF,
            token=address & 0xFFFFFFFF,
        )

    def handle(self, pointer_type: Any) -> Any:
        return ctypes.cast(ctypes.c_void_p(self.address), pointer_type)


@dataclass(frozen=True)
class _LinkEnd:
    """The far end of one NVLink: another GPU (by index) or an NVSwitch (by number)."""

    to_switch: bool
    peer: int


# --- ctypes argument helpers ---------------------------------------------------------------------------


def referent(ref: Any, what: str) -> Any:
    """The ctypes object behind a ``byref()`` or ``pointer()`` argument."""
    if isinstance(ref, _CArgObject):
        return ref._obj  # type: ignore[attr-defined]
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    raise TypeError(f"{what} must be passed by reference (ctypes.byref), got {type(ref).__name__}")


def count_reference(ref: Any) -> Any:
    count = referent(ref, "count")
    if not isinstance(count, ctypes.c_uint):
        raise TypeError(f"count must refer to a ctypes.c_uint, got {type(count).__name__}")
    return count


def out_array(ref: Any, element: Any) -> tuple[Any, int | None]:
    """A pointer to write ``element`` values through, and the buffer length when it is known."""
    if ref is None:
        return None, None
    target = ref._obj if isinstance(ref, _CArgObject) else ref  # type: ignore[attr-defined]
    if isinstance(target, ctypes.Array):
        if ctypes.sizeof(target._type_) != ctypes.sizeof(element):
            raise TypeError(f"array of {target._type_.__name__} where {element.__name__} is expected")
        return ctypes.cast(target, ctypes.POINTER(element)), len(target)
    if isinstance(target, ctypes._Pointer):
        return ctypes.cast(target, ctypes.POINTER(element)), None
    if isinstance(ref, _CArgObject) and ctypes.sizeof(target) == ctypes.sizeof(element):
        return ctypes.cast(ctypes.pointer(target), ctypes.POINTER(element)), None
    raise TypeError(f"expected a ctypes array of {element.__name__}, got {type(ref).__name__}")


def placement_arg(ref: Any) -> Placement:
    if ref is None:
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    struct = referent(ref, "placement")
    if ctypes.sizeof(struct) != ctypes.sizeof(pynvml.c_nvmlGpuInstancePlacement_t):
        raise TypeError(f"placement must be a c_nvmlGpuInstancePlacement_t, got {type(struct).__name__}")
    value = ctypes.cast(ctypes.pointer(struct), ctypes.POINTER(pynvml.c_nvmlGpuInstancePlacement_t)).contents
    return Placement(int(value.start), int(value.size))


def text_arg(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class FakeHandles(FakeState):
    """Handles and the lookups from a handle to what it names; NVLink wiring."""

    _links: list[list[_LinkEnd | None]]
    """The far end of each NVLink of each GPU; set by FakeNvml.__init__."""

    # --- lookups -----------------------------------------------------------------------------------

    def _hangs(self, args: tuple[Any, ...]) -> bool:
        """Every call while the driver hangs, and a call about a hung GPU: one given its handle (or that of one
        of its MIG devices, GPU or compute instances) or its index."""
        if self._state.driver_hung:
            return True
        if not args:
            return False
        first = args[0]
        if isinstance(first, int) and not isinstance(first, bool):
            index: int | None = first
        else:
            ref = Ref.of(first) if isinstance(first, ctypes._Pointer) else None
            kinds = (KIND_GPU, KIND_MIG, KIND_GI, KIND_CI)
            index = ref.gpu if ref is not None and ref.kind in kinds else None
        return index is not None and 0 <= index < len(self.spec.gpus) and self._gpu_state(index).hung

    def _gpu_state(self, index: int) -> GpuState:
        return self._state.gpus[self.spec.gpus[index].uuid]

    def _check_gpu_index(self, index: int) -> GpuSpec:
        if not 0 <= index < len(self.spec.gpus):
            raise IndexError(f"GPU index {index} out of range 0..{len(self.spec.gpus) - 1}")
        return self.spec.gpus[index]

    def _ref(self, handle: Any, kinds: tuple[int, ...]) -> Ref:
        ref = Ref.of(handle)
        if ref is None or ref.kind not in kinds or ref.gpu >= len(self.spec.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ref

    def _device(self, handle: Any, *, allow_mig: bool = False, check_lost: bool = True) -> Ref:
        """Decode a device handle (a GPU, or a MIG device where allowed); a lost GPU raises GpuIsLost."""
        ref = self._ref(handle, (KIND_GPU, KIND_MIG) if allow_mig else (KIND_GPU,))
        if ref.kind == KIND_MIG:
            self._mig_parts(ref)
        if check_lost and self._gpu_state(ref.gpu).lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return ref

    def _mig_parts(self, ref: Ref) -> tuple[GpuInstance, ComputeInstance]:
        gi = self._gpu_state(ref.gpu).gi(ref.gi)
        ci = gi.ci(ref.ci) if gi is not None else None
        if gi is None or ci is None or ci.token != ref.token:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gi, ci

    def _gi(self, handle: Any) -> tuple[Ref, GpuInstance]:
        ref = self._ref(handle, (KIND_GI,))
        gi = self._gpu_state(ref.gpu).gi(ref.gi)
        if gi is None or gi.token != ref.token:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpu_state(ref.gpu).lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return ref, gi

    def _ci(self, handle: Any) -> tuple[Ref, GpuInstance, ComputeInstance]:
        ref = self._ref(handle, (KIND_CI,))
        gi, ci = self._mig_parts(ref)
        if self._gpu_state(ref.gpu).lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return ref, gi, ci

    def _model(self, ref: Ref) -> GpuModel:
        return self.spec.gpus[ref.gpu].model

    def _gpu_handle(self, index: int) -> Any:
        return Ref(KIND_GPU, gpu=index).handle(pynvml.c_nvmlDevice_t)

    def _gi_handle(self, index: int, gi: GpuInstance) -> Any:
        return Ref(KIND_GI, gpu=index, gi=gi.id, token=gi.token).handle(pynvml.c_nvmlGpuInstance_t)

    def _ci_handle(self, index: int, gi: GpuInstance, ci: ComputeInstance) -> Any:
        ref = Ref(KIND_CI, gpu=index, gi=gi.id, ci=ci.id, token=ci.token)
        return ref.handle(pynvml.c_nvmlComputeInstance_t)

    def _mig_handle(self, index: int, gi: GpuInstance, ci: ComputeInstance) -> Any:
        ref = Ref(KIND_MIG, gpu=index, gi=gi.id, ci=ci.id, token=ci.token)
        return ref.handle(pynvml.c_nvmlDevice_t)

    def _next_token(self) -> int:
        token = self._state.next_token
        self._state.next_token = token % 0xFFFFFFFF + 1
        return token

    def _profile_for(self, gi: GpuInstance, model: GpuModel) -> MigProfile:
        profile = model.profile_by_id(gi.profile_id)
        assert profile is not None, f"GPU instance {gi.id} has profile {gi.profile_id} unknown to {model.key}"
        return profile

    def _mig_devices(self, index: int) -> list[tuple[GpuInstance, ComputeInstance]]:
        """The GPU's MIG devices in enumeration order: by GPU-instance id, then compute-instance id."""
        state = self._gpu_state(index)
        return [(gi, ci) for gi in sorted(state.gpu_instances, key=lambda g: g.id)
                for ci in sorted(gi.compute_instances, key=lambda c: c.id)]

    def mig_uuid(self, gpu_index: int, gi_id: int, ci_id: int) -> str:
        """The UUID the fake gives the MIG device (GPU instance ``gi_id``, compute instance ``ci_id``)."""
        parent = uuidlib.UUID(self._check_gpu_index(gpu_index).uuid.removeprefix("GPU-"))
        return f"MIG-{uuidlib.uuid5(parent, f'{gi_id}/{ci_id}')}"

    # --- NVLink wiring -----------------------------------------------------------------------------

    def _wire_nvlinks(self, gpu: GpuSpec) -> list[_LinkEnd | None]:
        """Each link of the GPU and its far end; None for a link that goes nowhere (inactive)."""
        links = gpu.model.nvlink_links
        if links == 0:
            return []
        ends: list[_LinkEnd | None] = []
        if self.spec.nvswitch:
            for switch, count in enumerate(_SWITCH_LINKS.get(links, (links,))):
                ends.extend([_LinkEnd(True, switch)] * count)
        else:
            for peer, count in self.spec.nvlink_peers(gpu.index):
                ends.extend([_LinkEnd(False, peer)] * count)
        return ends + [None] * (links - len(ends))

    def _pci_info(self, gpu: GpuSpec) -> Any:
        return self._pci_struct(gpu.pci_bus_id, gpu.model.pci_device_id)

    @staticmethod
    def _pci_struct(bus_id: str, device_id: int) -> Any:
        domain, bus, rest = bus_id.split(":")
        device, _ = rest.split(".")
        info = pynvml.nvmlPciInfo_t()
        info.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{rest}".encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(device, 16)
        info.pciDeviceId = device_id
        info.pciSubSystemId = 0
        info.busId = bus_id.encode()
        return info

    def _switch_pci_info(self, gpu: GpuSpec, switch: int) -> Any:
        bus_id = f"00000000:{_SWITCH_BUS_BASE + switch:02X}:00.0"
        return self._pci_struct(bus_id, _SWITCH_PCI_DEVICE_ID.get(gpu.model.architecture, 0x22A310DE))

    def _link_end(self, handle: Any, link: int) -> tuple[GpuSpec, _LinkEnd | None]:
        ref = self._device(handle)
        gpu = self.spec.gpus[ref.gpu]
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if link >= gpu.model.nvlink_links:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, self._links[ref.gpu][link]

    def _active_link(self, handle: Any, link: int) -> tuple[GpuSpec, _LinkEnd]:
        gpu, end = self._link_end(handle, link)
        if end is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, end

    def _event_set(self, handle: Any) -> EventSet:
        ref = Ref.of(handle)
        event_set = None
        if ref is not None and ref.kind == KIND_EVENT_SET:
            event_set = self._event_sets.get(ref.token)
        if event_set is None or event_set.freed:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return event_set
