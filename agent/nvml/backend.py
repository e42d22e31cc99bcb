"""Reads the node through NVML into the records of agent/nvml/records.py; one implementation for the real library
and the fake. NVML's own errors stay inside agent/nvml/: what leaves is NvmlUnavailable, MigCallError or a
record."""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pynvml

from agent.nvml.catalog import MODELS, MigProfile, Placement
from agent.nvml.records import DriverInfo, GpuInfo, HealthReading, MigDeviceInfo, NodeInventory, PairLink, XidEvent

PCIE_LEVELS: dict[int, str] = {
    pynvml.NVML_TOPOLOGY_INTERNAL: "single",
    pynvml.NVML_TOPOLOGY_SINGLE: "single",
    pynvml.NVML_TOPOLOGY_MULTIPLE: "multiple",
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: "hostbridge",
    pynvml.NVML_TOPOLOGY_NODE: "node",
    pynvml.NVML_TOPOLOGY_SYSTEM: "system",
}

ARCHITECTURES: dict[int, str] = {
    2: "kepler",
    3: "maxwell",
    4: "pascal",
    5: "volta",
    6: "turing",
    7: "ampere",
    8: "ada",
    9: "hopper",
    10: "blackwell",
}

WHOLE_GPU = 0xFFFFFFFF
"""gpuInstanceId/computeInstanceId of an event that concerns the whole GPU."""

NumaLookup = Callable[[str], int | None]

P = ParamSpec("P")
R = TypeVar("R")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used: no driver, no library, or initialisation failed."""


def sysfs_numa_node(bus_id: str, root: Path = Path("/sys/bus/pci/devices")) -> int | None:
    """Linux NUMA node of a PCI device, or None when the platform reports none.

    NVML's busId carries an 8-digit domain ("00000000:17:00.0"); sysfs uses 4 digits ("0000:17:00.0").
    """
    bdf = bus_id.lower()
    domain, sep, rest = bdf.partition(":")
    if sep and len(domain) == 8:
        bdf = domain[4:] + ":" + rest
    try:
        value = int((root / bdf / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def sysfs_pci_class(bus_id: str, root: Path = Path("/sys/bus/pci/devices")) -> int | None:
    """The PCI class code of a device from sysfs (``class``, e.g. 0x030200), or None when unreadable."""
    bdf = bus_id.lower()
    domain, sep, rest = bdf.partition(":")
    if sep and len(domain) == 8:
        bdf = domain[4:] + ":" + rest
    try:
        return int((root / bdf / "class").read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


def _address(handle: Any) -> int | None:
    """The address an NVML device handle points at: the same device gives the same address."""
    return ctypes.cast(handle, ctypes.c_void_p).value


def _norm_bus_id(bus_id: str) -> str:
    return bus_id.lower()


@dataclass
class NvmlBackend:
    """Reads the node through a pynvml-shaped library: the pynvml module itself or the fake."""

    lib: Any
    numa_lookup: NumaLookup = sysfs_numa_node
    pci_class_lookup: NumaLookup = sysfs_pci_class
    _handles: list[Any] = field(default_factory=list)
    _uuid_by_handle: dict[int | None, str] = field(default_factory=dict)
    """GPU UUIDs by handle address, read at init: an event from a GPU that is off the bus still names it."""
    _initialised: bool = False
    lost_at_start: list[int] = field(default_factory=list)
    """NVML indices of GPUs that were lost when NVML was initialised."""

    def init(self) -> None:
        try:
            self.lib.nvmlInit()
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML initialisation failed: {err}") from err
        self._initialised = True
        self._handles = []
        self.lost_at_start = []
        for i in range(self.lib.nvmlDeviceGetCount()):
            try:
                handle = self.lib.nvmlDeviceGetHandleByIndex(i)
                self._uuid_by_handle[_address(handle)] = _text(self.lib.nvmlDeviceGetUUID(handle))
                self._handles.append(handle)
            except pynvml.NVMLError_GpuIsLost:
                # A GPU already off the bus has no handle and no UUID to advertise; it is reported, not served.
                self.lost_at_start.append(i)

    def problem(self) -> str | None:
        """Why the library cannot serve right now, where it can tell (the fake's unusable state file); None
        otherwise."""
        problem = getattr(self.lib, "state_problem", None)
        return problem if isinstance(problem, str) else None

    def shutdown(self) -> None:
        if self._initialised:
            with contextlib.suppress(pynvml.NVMLError):
                self.lib.nvmlShutdown()
            self._initialised = False

    # -- inventory ---------------------------------------------------------------------------------

    def driver(self) -> DriverInfo:
        cuda = int(self.lib.nvmlSystemGetCudaDriverVersion())
        return DriverInfo(
            version=_text(self.lib.nvmlSystemGetDriverVersion()),
            cuda=f"{cuda // 1000}.{(cuda % 1000) // 10}",
        )

    def inventory(self) -> NodeInventory:
        gpus = tuple(self._gpu(i, h) for i, h in enumerate(self._handles))
        # GpuInfo.index is the position among served GPUs, which the NVML index equals unless one was lost.
        return NodeInventory(
            driver=self.driver(),
            gpus=gpus,
            links=self._links(gpus),
            mig_devices=tuple(d for g in gpus if g.mig_enabled for d in self._mig_devices(g.index)),
        )

    def _gpu(self, index: int, h: Any) -> GpuInfo:
        lib = self.lib
        bus_id = _text(lib.nvmlDeviceGetPciInfo(h).busId)
        major, minor = lib.nvmlDeviceGetCudaComputeCapability(h)
        mig_capable, mig_enabled, mig_pending = False, False, False
        try:
            current, pending = lib.nvmlDeviceGetMigMode(h)
            mig_capable = True
            mig_enabled = current == pynvml.NVML_DEVICE_MIG_ENABLE
            mig_pending = pending != current
        except pynvml.NVMLError_NotSupported:
            pass
        try:
            virtualization = int(lib.nvmlDeviceGetVirtualizationMode(h))
        except pynvml.NVMLError_NotSupported:
            virtualization = pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE
        try:
            brand: int | None = int(lib.nvmlDeviceGetBrand(h))
        except pynvml.NVMLError_NotSupported:
            brand = None
        return GpuInfo(
            index=index,
            uuid=_text(lib.nvmlDeviceGetUUID(h)),
            name=_text(lib.nvmlDeviceGetName(h)),
            pci_bus_id=bus_id,
            minor=int(lib.nvmlDeviceGetMinorNumber(h)),
            memory_mib=int(lib.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024),
            architecture=ARCHITECTURES.get(int(lib.nvmlDeviceGetArchitecture(h)), "unknown"),
            compute_capability=(int(major), int(minor)),
            numa_node=self.numa_lookup(bus_id),
            mig_capable=mig_capable,
            mig_enabled=mig_enabled,
            mig_pending=mig_pending,
            pci_class=self.pci_class_lookup(bus_id),
            virtualization_mode=virtualization,
            brand=brand,
        )

    def _nvlinks(self, h: Any) -> Iterator[tuple[bool, str]]:
        """Active NVLinks of a GPU as (to_switch, remote bus id)."""
        lib = self.lib
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if lib.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
                # NotSupported on GPUs without NVLink; InvalidArgument past the GPU's last link.
                if link == 0:
                    return
                continue
            try:
                kind = lib.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
            except pynvml.NVMLError_NotSupported:
                kind = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
            remote = _text(lib.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            yield kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, _norm_bus_id(remote)

    def _links(self, gpus: tuple[GpuInfo, ...]) -> tuple[PairLink, ...]:
        by_bus = {_norm_bus_id(g.pci_bus_id): g.index for g in gpus}
        direct: dict[tuple[int, int], int] = {}
        to_switch = [0] * len(gpus)
        for g in gpus:
            for is_switch, remote in self._nvlinks(self._handles[g.index]):
                if is_switch:
                    to_switch[g.index] += 1
                elif remote in by_bus:
                    key = (g.index, by_bus[remote])
                    direct[key] = direct.get(key, 0) + 1
        links = []
        for a in range(len(gpus)):
            for b in range(a + 1, len(gpus)):
                level = self.lib.nvmlDeviceGetTopologyCommonAncestor(self._handles[a], self._handles[b])
                # GPUs behind NVSwitches reach each other over as many links as the less-connected one has.
                nvlink = direct.get((a, b), 0) + min(to_switch[a], to_switch[b])
                links.append(PairLink(a, b, nvlink, PCIE_LEVELS.get(int(level), "system")))
        return tuple(links)

    def _gi_profile_names(self, h: Any) -> dict[int, str]:
        names: dict[int, str] = {}
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = self.lib.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            except pynvml.NVMLError:
                continue
            names[int(info.id)] = _text(info.name).removeprefix("MIG ")
        return names

    def _mig_devices(self, index: int) -> list[MigDeviceInfo]:
        lib = self.lib
        h = self._handles[index]
        names = self._gi_profile_names(h)
        devices = []
        for slot in range(int(lib.nvmlDeviceGetMaxMigDeviceCount(h))):
            try:
                mh = lib.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
            except pynvml.NVMLError_NotFound:
                continue
            gi_id = int(lib.nvmlDeviceGetGpuInstanceId(mh))
            gi_info = lib.nvmlGpuInstanceGetInfo(lib.nvmlDeviceGetGpuInstanceById(h, gi_id))
            attrs = lib.nvmlDeviceGetAttributes(mh)
            devices.append(
                MigDeviceInfo(
                    uuid=_text(lib.nvmlDeviceGetUUID(mh)),
                    parent_index=index,
                    gpu_instance_id=gi_id,
                    compute_instance_id=int(lib.nvmlDeviceGetComputeInstanceId(mh)),
                    profile=names.get(int(gi_info.profileId), f"profile-{int(gi_info.profileId)}"),
                    memory_mib=int(lib.nvmlDeviceGetMemoryInfo(mh).total) // (1024 * 1024),
                    placement_start=int(gi_info.placement.start),
                    placement_size=int(gi_info.placement.size),
                    multiprocessors=int(attrs.multiprocessorCount),
                    gi_slices=int(attrs.gpuInstanceSliceCount),
                    ci_slices=int(attrs.computeInstanceSliceCount),
                    copy_engines=int(attrs.sharedCopyEngineCount),
                    decoders=int(attrs.sharedDecoderCount),
                    encoders=int(attrs.sharedEncoderCount),
                    jpegs=int(attrs.sharedJpegCount),
                    ofas=int(attrs.sharedOfaCount),
                    attribute_memory_mib=int(attrs.memorySizeMB),
                )
            )
        return sorted(devices, key=lambda d: (d.placement_start, d.compute_instance_id))

    # -- health ------------------------------------------------------------------------------------

    def health(self, index: int) -> HealthReading:
        """Sample one GPU's health signals; a GPU that has fallen off the bus reads as lost."""
        lib = self.lib
        h = self._handles[index]
        try:
            uuid = _text(lib.nvmlDeviceGetUUID(h))
        except pynvml.NVMLError_GpuIsLost:
            return HealthReading(uuid="", lost=True)

        def probe(call: Callable[[], Any]) -> Any:
            try:
                return call()
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission, pynvml.NVMLError_NotFound):
                return None

        try:
            ecc = probe(
                lambda: lib.nvmlDeviceGetTotalEccErrors(
                    h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            )
            retired = probe(lambda: lib.nvmlDeviceGetRetiredPagesPendingStatus(h))
            remapped = probe(lambda: lib.nvmlDeviceGetRemappedRows(h))
            reasons = probe(lambda: lib.nvmlDeviceGetCurrentClocksEventReasons(h))
            temperature = probe(lambda: lib.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU))
            power_mw = probe(lambda: lib.nvmlDeviceGetPowerUsage(h))
            memory = probe(lambda: lib.nvmlDeviceGetMemoryInfo(h))
            utilization = probe(lambda: lib.nvmlDeviceGetUtilizationRates(h))
        except pynvml.NVMLError_GpuIsLost:
            return HealthReading(uuid=uuid, lost=True)
        except pynvml.NVMLError as err:
            return HealthReading(uuid=uuid, unreadable=str(err))
        return HealthReading(
            uuid=uuid,
            ecc_uncorrected_volatile=None if ecc is None else int(ecc),
            retired_pages_pending=None if retired is None else bool(retired),
            remapped_rows_pending=None if remapped is None else bool(remapped[2]),
            remapped_rows_failure=None if remapped is None else bool(remapped[3]),
            clock_event_reasons=None if reasons is None else int(reasons),
            temperature_c=None if temperature is None else int(temperature),
            power_w=None if power_mw is None else int(power_mw) / 1000,
            memory_used_mib=None if memory is None else int(memory.used) // (1024 * 1024),
            utilization_pct=None if utilization is None else int(utilization.gpu),
        )

    # -- events ------------------------------------------------------------------------------------

    def open_events(self) -> Any:
        """Register every GPU that supports it for XID events; returns the event set."""
        lib = self.lib
        event_set = lib.nvmlEventSetCreate()
        for h in self._handles:
            try:
                supported = int(lib.nvmlDeviceGetSupportedEventTypes(h))
                mask = supported & (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError)
                if mask:
                    lib.nvmlDeviceRegisterEvents(h, mask, event_set)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_GpuIsLost):
                continue
        return event_set

    def wait_event(self, event_set: Any, timeout_ms: int) -> XidEvent | None:
        """Block up to timeout_ms for one event; None on timeout. Call off the event loop."""
        try:
            data = self.lib.nvmlEventSetWait_v2(event_set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        # A double-bit ECC event carries no XID; it is the condition XID 48 reports.
        double_bit = int(data.eventType) == pynvml.nvmlEventTypeDoubleBitEccError
        xid = 48 if double_bit else int(data.eventData)
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        uuid = self._uuid_by_handle.get(_address(data.device))
        return XidEvent(
            gpu_uuid=uuid if uuid is not None else _text(self.lib.nvmlDeviceGetUUID(data.device)),
            xid=xid,
            gpu_instance_id=None if gi == WHOLE_GPU else gi,
            compute_instance_id=None if ci == WHOLE_GPU else ci,
        )

    def close_events(self, event_set: Any) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            self.lib.nvmlEventSetFree(event_set)


def open_backend(selector: str, mock_state: Path | None = None) -> NvmlBackend:
    """Build the backend named by --nvml: "real", "mock:PRESET" or "mock:FILE"."""
    if selector == "real":
        return NvmlBackend(lib=pynvml)
    kind, sep, source = selector.partition(":")
    if kind != "mock" or not sep or not source:
        raise ValueError(f"--nvml must be 'real', 'mock:PRESET' or 'mock:FILE', got {selector!r}")
    from agent.nvml.fake import FakeNvml
    from agent.nvml.nodefile import load_node

    fake = FakeNvml(load_node(source), mock_state)
    return fake_backend(fake)


def fake_backend(fake: Any) -> NvmlBackend:
    """A backend over the fake NVML, with the sysfs facts (NUMA node, PCI class) the fake's node gives."""
    return NvmlBackend(lib=fake, numa_lookup=fake.numa_node, pci_class_lookup=fake.pci_class)


# -- MIG: reading GPU instances and changing them (only agent/mig/ calls these) --------------------------


@dataclass(frozen=True)
class GpuInstanceInfo:
    gpu_instance_id: int
    profile: str
    start: int
    size: int
    compute_instances: int


@dataclass(frozen=True)
class MigGpuState:
    """One GPU's MIG state as NVML reports it, for planning a layout."""

    index: int
    name: str
    pci_device_id: int
    mig_capable: bool
    mig_enabled: bool
    mig_pending: bool
    profiles: tuple[MigProfile, ...]
    instances: tuple[GpuInstanceInfo, ...]


class MigResetRequired(RuntimeError):
    """The MIG mode change is pending until the GPU is reset."""


class MigCallError(RuntimeError):
    """An NVML call of a MIG read or change failed; the message is NVML's (e.g. "Insufficient Resources")."""


def _mig_call(method: Callable[P, R]) -> Callable[P, R]:
    """MigOps' public methods: an NVML error leaves as MigCallError."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except pynvml.NVMLError as err:
            raise MigCallError(str(err)) from err

    return call


_CI_FULL_PROFILE = {1: "1", 2: "2", 3: "3", 4: "4", 6: "6", 7: "7", 8: "8"}


def _ci_profile_index(slices: int) -> int:
    return int(getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{_CI_FULL_PROFILE.get(slices, '1')}_SLICE"))


class MigOps:
    """MIG reads and writes through the backend's library; methods run on the NVML thread.

    A failing NVML call raises MigCallError with NVML's message, so callers need no pynvml.
    """

    def __init__(self, backend: NvmlBackend) -> None:
        self._b = backend

    @property
    def lib(self) -> Any:
        return self._b.lib

    def _handle(self, index: int) -> Any:
        return self._b._handles[index]

    def _refresh_handle(self, index: int) -> None:
        # Handles are re-enumerated after a MIG mode change.
        self._b._handles[index] = self.lib.nvmlDeviceGetHandleByIndex(index)

    def _profiles_from_nvml(self, h: Any) -> tuple[MigProfile, ...]:
        lib = self.lib
        profiles = []
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = lib.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            except pynvml.NVMLError:
                continue
            count = ctypes.c_uint(0)
            lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, int(info.id), None, ctypes.byref(count))
            array = (pynvml.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
            lib.nvmlDeviceGetGpuInstancePossiblePlacements(h, int(info.id), array, ctypes.byref(count))
            slices = int(info.sliceCount)
            ci_index = _ci_profile_index(slices)
            profiles.append(MigProfile(
                name=_text(info.name).removeprefix("MIG "), index=index, id=int(info.id), slice_count=slices,
                instance_count=int(info.instanceCount), memory_size_mib=int(info.memorySizeMB),
                multiprocessor_count=int(info.multiprocessorCount),
                placements=tuple(Placement(int(p.start), int(p.size)) for p in array[: count.value]),
                ci_profile_index=ci_index, ci_profile_id=ci_index, copy_engines=int(info.copyEngineCount),
                decoders=int(info.decoderCount), encoders=int(info.encoderCount), jpegs=int(info.jpegCount),
                ofas=int(info.ofaCount),
            ))
        return tuple(profiles)

    @_mig_call
    def state(self, index: int) -> MigGpuState:
        lib = self.lib
        h = self._handle(index)
        name = _text(lib.nvmlDeviceGetName(h))
        pci_device_id = int(lib.nvmlDeviceGetPciInfo(h).pciDeviceId)
        try:
            current, pending = lib.nvmlDeviceGetMigMode(h)
        except pynvml.NVMLError_NotSupported:
            return MigGpuState(index, name, pci_device_id, False, False, False, (), ())
        enabled = current == pynvml.NVML_DEVICE_MIG_ENABLE
        if enabled:
            profiles = self._profiles_from_nvml(h)
        else:
            # Placements can be listed only with MIG on: plan from the known table of this model.
            profiles = next((m.mig_profiles for m in MODELS.values() if m.nvml_name == name), ())
        return MigGpuState(index, name, pci_device_id, True, enabled, pending != current, profiles,
                           self._instances(h, profiles) if enabled else ())

    def _gpu_instances(self, h: Any, profile: MigProfile) -> list[Any]:
        count = ctypes.c_uint(profile.instance_count)
        array = (pynvml.c_nvmlGpuInstance_t * max(1, profile.instance_count))()
        self.lib.nvmlDeviceGetGpuInstances(h, profile.id, array, ctypes.byref(count))
        return list(array[: count.value])

    def _compute_instances(self, gi: Any, slices: int) -> list[Any]:
        lib = self.lib
        info = lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, _ci_profile_index(slices), 0)
        count = ctypes.c_uint(int(info.instanceCount))
        array = (pynvml.c_nvmlComputeInstance_t * max(1, count.value))()
        lib.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), array, ctypes.byref(count))
        return list(array[: count.value])

    def _instances(self, h: Any, profiles: tuple[MigProfile, ...]) -> tuple[GpuInstanceInfo, ...]:
        found = []
        for profile in profiles:
            for gi in self._gpu_instances(h, profile):
                info = self.lib.nvmlGpuInstanceGetInfo(gi)
                found.append(GpuInstanceInfo(
                    int(info.id), profile.name, int(info.placement.start), int(info.placement.size),
                    len(self._compute_instances(gi, profile.slice_count)),
                ))
        return tuple(sorted(found, key=lambda i: i.start))

    def _find(self, index: int, start: int) -> tuple[Any, MigProfile]:
        h = self._handle(index)
        for profile in self.state(index).profiles:
            for gi in self._gpu_instances(h, profile):
                if int(self.lib.nvmlGpuInstanceGetInfo(gi).placement.start) == start:
                    return gi, profile
        raise LookupError(f"GPU {index} has no GPU instance at slice {start}")

    @_mig_call
    def destroy(self, index: int, start: int) -> None:
        """Destroy the GPU instance at `start` and its compute instances."""
        gi, profile = self._find(index, start)
        for ci in self._compute_instances(gi, profile.slice_count):
            self.lib.nvmlComputeInstanceDestroy(ci)
        self.lib.nvmlGpuInstanceDestroy(gi)

    @_mig_call
    def set_mode(self, index: int, enabled: bool) -> None:
        """Switch MIG on or off; MigResetRequired when the change waits for a GPU reset."""
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        self.lib.nvmlDeviceSetMigMode(self._handle(index), mode)
        self._refresh_handle(index)
        current, _ = self.lib.nvmlDeviceGetMigMode(self._handle(index))
        if current != mode:
            raise MigResetRequired(
                f"GPU {index}: MIG {'enable' if enabled else 'disable'} is pending (the GPU is in use or needs a reset)"
            )

    @_mig_call
    def create(self, index: int, profile_name: str, start: int) -> None:
        """Create a GPU instance of `profile_name` at `start`, with one compute instance spanning it."""
        h = self._handle(index)
        profile = next(p for p in self.state(index).profiles if p.name == profile_name)
        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, profile.memory_slices)
        gi = self.lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile.id, ctypes.byref(placement))
        self._ensure_compute_instance(gi, profile)

    def _ensure_compute_instance(self, gi: Any, profile: MigProfile) -> None:
        if not self._compute_instances(gi, profile.slice_count):
            info = self.lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, _ci_profile_index(profile.slice_count), 0)
            self.lib.nvmlGpuInstanceCreateComputeInstance(gi, int(info.id))

    @_mig_call
    def ensure_compute_instances(self, index: int) -> None:
        """Give every GPU instance a compute instance (one may be missing after an interrupted apply)."""
        h = self._handle(index)
        for profile in self.state(index).profiles:
            for gi in self._gpu_instances(h, profile):
                self._ensure_compute_instance(gi, profile)
