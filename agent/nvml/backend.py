"""Reads the node through NVML into the records of agent/nvml/records.py; one implementation for the real library
and the fake. `NvmlBackend` owns NVML's initialisation, the device handles, the inventory, health readings and
XID events; `open_backend` chooses the library. MIG reads and changes are in mig_ops.py, sysfs facts in
sysfs.py. NVML's own errors stay inside agent/nvml/: what leaves is NvmlUnavailable, MigCallError or a
record."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import uuid as uuidlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from agent.nvml.records import (
    FABRIC_STATES,
    DriverInfo,
    FabricInfo,
    GpuInfo,
    HealthReading,
    MigDeviceInfo,
    NodeInventory,
    PairLink,
    XidEvent,
    unknown_gpu,
)
from agent.nvml.sysfs import dev_imex_channels, sysfs_numa_node, sysfs_pci_class

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
ImexLookup = Callable[[], tuple[int, ...]]

class EventSetGone(RuntimeError):
    """NVML no longer knows the event set (it answered Invalid Argument or Uninitialized to a wait): a new one
    must be registered. Any other failed wait leaves the set registered, and the events it receives kept."""


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used: no driver, no library, or initialisation failed."""


def nvml_text(value: Any) -> str:
    """A string NVML returned (bytes with a trailing NUL, or str) as text."""
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
    imex_lookup: ImexLookup = dev_imex_channels
    remembered: dict[int, GpuInfo] = field(default_factory=dict)
    """What was last read of each GPU, by NVML index: a lost GPU is listed with it (`GpuInfo.lost`). Filled by
    every inventory that read a GPU, and before `init` by the caller with what an earlier agent read
    (agent/nvml/identity.py)."""
    _handles: list[Any | None] = field(default_factory=list)
    """The device handle of each GPU NVML counts, by NVML index; None where NVML would not give it."""
    _uuid_by_handle: dict[int | None, str] = field(default_factory=dict)
    """GPU UUIDs by handle address, noted when each handle is taken: an event from a GPU that is off the bus still
    names it."""
    _initialised: bool = False

    def init(self) -> None:
        """Initialise NVML and count the GPUs. Their handles are taken when each is first read (`handle`), so a GPU
        whose lookup hangs holds up no other; a GPU whose handle NVML will not give (GPU_IS_LOST, or any other
        error) is kept by its index, without a handle: it is in the inventory as lost, and its handle is asked for
        again whenever it is read."""
        try:
            self.lib.nvmlInit()
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML initialisation failed: {err}") from err
        self._initialised = True
        try:
            count = int(self.lib.nvmlDeviceGetCount())
        except pynvml.NVMLError as err:
            with contextlib.suppress(pynvml.NVMLError):
                self.lib.nvmlShutdown()
            self._initialised = False
            raise NvmlUnavailable(f"NVML cannot count the GPUs: {err}") from err
        self._handles = [None] * count  # taken by the first read of each GPU (`handle`), each on its own

    def _take_handle(self, index: int) -> Any | None:
        """NVML's handle of GPU `index`, taken anew (None where NVML will not give it), and its UUID noted."""
        try:
            handle = self.lib.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError:
            handle = None
        self._handles[index] = handle
        if handle is not None:
            with contextlib.suppress(pynvml.NVMLError):
                self._uuid_by_handle[_address(handle)] = nvml_text(self.lib.nvmlDeviceGetUUID(handle))
        return handle

    @property
    def count(self) -> int:
        """How many GPUs NVML counts, lost ones included."""
        return len(self._handles)

    @property
    def handles(self) -> Sequence[Any | None]:
        """The device handle of each GPU NVML counts, by NVML index, None for one NVML would not give (for the
        other readers of agent/nvml/: dcgm-exporter's fields)."""
        return self._handles

    def handle(self, index: int) -> Any:
        """The handle of the GPU of NVML index `index`; NVMLError GPU_IS_LOST where NVML will not give one."""
        handle = self._handles[index]
        if handle is None:
            handle = self._take_handle(index)
            if handle is None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def refresh_handle(self, index: int) -> None:
        """Take the handle of the GPU of NVML index `index` again: NVML enumerates handles anew after a MIG mode
        change."""
        self._take_handle(index)

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
            version=nvml_text(self.lib.nvmlSystemGetDriverVersion()),
            cuda=f"{cuda // 1000}.{(cuda % 1000) // 10}",
        )

    def inventory(self) -> NodeInventory:
        """Every GPU NVML counts, each under its NVML index (`GpuInfo.index`, its position in `gpus`): a GPU that
        cannot be read is there as lost, so no other GPU ever takes its place or its index."""
        return self.inventory_of(tuple(self.read_gpu(i) for i in range(len(self._handles))))

    def inventory_of(self, gpus: tuple[GpuInfo, ...]) -> NodeInventory:
        """The node's inventory with these GPUs (one per NVML index, as `read_gpu` or `unanswered` gave them):
        the driver, the links between the GPUs that answer, their MIG devices and the IMEX channels."""
        return NodeInventory(
            driver=self.driver(),
            gpus=gpus,
            links=self._links(gpus),
            mig_devices=tuple(d for g in gpus if g.mig_enabled and not g.lost for d in self._mig_devices_or_none(g)),
            imex_channels=self.imex_lookup(),
        )

    def read_gpu(self, index: int) -> GpuInfo:
        """The GPU as NVML tells it; where NVML will not (no handle, or an error from any call the inventory
        makes), what was last read of it, marked lost (`unanswered`)."""
        try:
            gpu = self._gpu(index, self.handle(index))
        except pynvml.NVMLError:
            return self.unanswered(index)
        self.remembered[index] = gpu
        return gpu

    def unanswered(self, index: int) -> GpuInfo:
        """GPU `index` as what was last read of it, marked lost (nothing but its index where nothing was): for a GPU
        NVML cannot read, or whose read did not return within its deadline."""
        known = self.remembered.get(index)
        if known is None:
            return unknown_gpu(index)
        return dataclasses.replace(known, lost=True, mig_enabled=False, mig_pending=False, fabric=None)

    def _mig_devices_or_none(self, gpu: GpuInfo) -> list[MigDeviceInfo]:
        """The GPU's MIG devices; none where it stopped answering since it was read."""
        try:
            return self.mig_devices(gpu.index)
        except pynvml.NVMLError:
            return []

    def _gpu(self, index: int, h: Any) -> GpuInfo:
        lib = self.lib
        bus_id = nvml_text(lib.nvmlDeviceGetPciInfo(h).busId)
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
            uuid=nvml_text(lib.nvmlDeviceGetUUID(h)),
            name=nvml_text(lib.nvmlDeviceGetName(h)),
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
            fabric=self._fabric(h),
        )

    def _fabric(self, h: Any) -> FabricInfo | None:
        """The GPU's fabric through nvmlDeviceGetGpuFabricInfoV (its v2 struct); where the driver predates it
        (FUNCTION_NOT_FOUND), through nvmlDeviceGetGpuFabricInfo. None where neither call is supported: a GPU
        without a fabric (NOT_SUPPORTED) or a driver with neither call."""
        lib = self.lib
        info: Any = pynvml.c_nvmlGpuFabricInfoV_t()
        try:
            lib.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
        except pynvml.NVMLError_NotSupported:
            return None
        except pynvml.NVMLError_FunctionNotFound:
            info = pynvml.c_nvmlGpuFabricInfo_t()
            try:
                lib.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
                return None
        state = int(info.state)
        return FabricInfo(
            cluster_uuid=str(uuidlib.UUID(bytes=bytes(info.clusterUuid))),
            clique_id=int(info.cliqueId),
            state=FABRIC_STATES[state] if 0 <= state < len(FABRIC_STATES) else f"state-{state}",
            status=int(info.status),
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
            remote = nvml_text(lib.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            yield kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, _norm_bus_id(remote)

    def _links(self, gpus: tuple[GpuInfo, ...]) -> tuple[PairLink, ...]:
        """The NVLink and PCIe link of every pair of GPUs; a lost GPU reaches none (no NVLink, "system")."""
        by_bus = {_norm_bus_id(g.pci_bus_id): g.index for g in gpus if not g.lost}
        direct: dict[tuple[int, int], int] = {}
        to_switch = [0] * len(gpus)
        answering = set(by_bus.values())
        for g in gpus:
            if g.index not in answering:
                continue
            try:
                ends = list(self._nvlinks(self.handle(g.index)))
            except pynvml.NVMLError:  # it stopped answering since it was read
                answering.discard(g.index)
                continue
            for is_switch, remote in ends:
                if is_switch:
                    to_switch[g.index] += 1
                elif remote in by_bus:
                    key = (g.index, by_bus[remote])
                    direct[key] = direct.get(key, 0) + 1
        links = []
        for a in range(len(gpus)):
            for b in range(a + 1, len(gpus)):
                if a not in answering or b not in answering:
                    links.append(PairLink(a, b, 0, "system"))
                    continue
                try:
                    level = self.lib.nvmlDeviceGetTopologyCommonAncestor(self._handles[a], self._handles[b])
                except pynvml.NVMLError:
                    links.append(PairLink(a, b, 0, "system"))
                    continue
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
            names[int(info.id)] = nvml_text(info.name).removeprefix("MIG ")
        return names

    def mig_devices(self, index: int) -> list[MigDeviceInfo]:
        """The MIG devices (GPU and compute instances) NVML lists on GPU `index`."""
        lib = self.lib
        h = self.handle(index)
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
                    uuid=nvml_text(lib.nvmlDeviceGetUUID(mh)),
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
        try:
            h = self.handle(index)
            uuid = nvml_text(lib.nvmlDeviceGetUUID(h))
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
            if h is None:  # lost: NVML has no handle to register
                continue
            try:
                supported = int(lib.nvmlDeviceGetSupportedEventTypes(h))
                mask = supported & (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError)
                if mask:
                    lib.nvmlDeviceRegisterEvents(h, mask, event_set)
            except pynvml.NVMLError:  # not supported, lost, or failing: its events are not to be had
                continue
        return event_set

    def wait_event(self, event_set: Any, timeout_ms: int) -> XidEvent | None:
        """Block up to timeout_ms for one event; None on timeout. Call off the event loop."""
        try:
            data = self.lib.nvmlEventSetWait_v2(event_set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        except (pynvml.NVMLError_InvalidArgument, pynvml.NVMLError_Uninitialized) as err:
            raise EventSetGone(f"waiting for NVML events: {err}") from None
        # A double-bit ECC event carries no XID; it is the condition XID 48 reports.
        double_bit = int(data.eventType) == pynvml.nvmlEventTypeDoubleBitEccError
        xid = 48 if double_bit else int(data.eventData)
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        uuid = self._uuid_by_handle.get(_address(data.device))
        return XidEvent(
            gpu_uuid=uuid if uuid is not None else nvml_text(self.lib.nvmlDeviceGetUUID(data.device)),
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
    """A backend over the fake NVML, with the sysfs facts (NUMA node, PCI class) and the IMEX channel device
    nodes the fake's node gives."""
    return NvmlBackend(lib=fake, numa_lookup=fake.numa_node, pci_class_lookup=fake.pci_class,
                       imex_lookup=fake.imex_channels)

