"""The versioned agent config file: schema, defaults and strict validation."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from agent.yamlfile import (
    InputFileError,
    YamlProblem,
    clip,
    listing,
    load_yaml,
    printable,
    problem_lines,
    read_text_file,
    shown,
)

DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri", "cdi")
"""How Allocate hands devices to the runtime; "cdi" is this agent's older name for "cdi-cri"."""
TAINT_KEY = r"gpu-node-agent\.io/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
NVIDIA_PREFIX = "nvidia.com/"
MIG_PREFIX = NVIDIA_PREFIX + "mig-"
"""The names of MIG devices' resources (nvidia.com/mig-<profile>); no other kind of device is advertised there."""
GPU_RESOURCE = NVIDIA_PREFIX + "gpu"
"""Whole GPUs' resource unless resources.gpus names others (and MIG devices' under migStrategy single)."""
MAX_SELECTOR = 96
"""The longest text a sharing `devices` entry may be: NVML's GPU names and MIG UUIDs are shorter."""


class ConfigError(ValueError):
    """The config cannot be used; the message names each key path and reason, one per line."""


EXPLICIT_DEFAULTS = "version: v1"
"""The config file that asks for the defaults in so many words, as a reload needs it (so does `{}`, or any mapping
that sets nothing else): a file with no settings at all is the defaults at start, but refused at a reload."""


class EmptyConfigFile(ConfigError):
    """A config file with no settings at all (`has_no_settings`) where the defaults are not taken from one: at a
    reload, where it is far more likely a write that failed or was cut short (a full disk, a truncate, a tool's
    half-written file) than a wish to go back to the defaults. `config` is what start makes of it (the defaults);
    the message is one line naming the file and how to ask for the defaults."""

    def __init__(self, path: Path, config: AgentConfig) -> None:
        self.path, self.config = path, config
        super().__init__(f"{printable(str(path))}: the file is empty (no settings): at a reload that is taken for a "
                         f"failed or partial write, not for the defaults; to apply the defaults write "
                         f"'{EXPLICIT_DEFAULTS}' in it")


def _drop_nulls(value: object) -> object:
    """A key set to null means "not set", as in NVIDIA's config files (their Helm values render nulls)."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None}
    return value


class _Strict(BaseModel):
    """A config section: unknown keys refused, and (with StrictInt, StrictBool, StrictFloat on the fields) no
    value converted from another type: "4", 2.0 and true are not whole numbers, 1 and "yes" are not booleans; a
    whole number is a number of seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _unset_nulls(cls, value: object) -> object:
        return _drop_nulls(value)


StrategyName = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri", "cdi"]


class PluginFlags(_Strict):
    pass_device_specs: StrictBool = Field(default=False, alias="passDeviceSpecs")
    """Put the GPUs' device nodes (/dev/nvidiaN, nvidiactl, nvidia-uvm...) into each Allocate response."""
    device_list_strategy: tuple[StrategyName, ...] = Field(default=("envvar",), alias="deviceListStrategy")
    """How Allocate hands devices to the runtime: NVIDIA_VISIBLE_DEVICES, /dev/null mounts under
    /var/run/nvidia-container-devices, CDI annotations, or CDI devices in the CRI field."""
    device_id_strategy: Literal["uuid", "index"] = Field(default="uuid", alias="deviceIDStrategy")
    """What NVIDIA_VISIBLE_DEVICES and CDI names carry: GPU UUIDs or GPU indices."""
    cdi_annotation_prefix: str = Field(default="cdi.k8s.io/", alias="cdiAnnotationPrefix")
    nvidia_ctk_path: str = Field(default="/usr/bin/nvidia-ctk", alias="nvidiaCTKPath")
    container_driver_root: Path = Field(default=Path("/driver-root"), alias="containerDriverRoot")
    """Where the host's nvidiaDriverRoot is mounted in the agent's container (the MPS control program is
    looked for under it)."""
    shared_devices_allocation_policy: Literal["distributed", "packed"] | None = Field(
        default=None, alias="sharedDevicesAllocationPolicy")
    """NVIDIA's name for sharing.allocationPolicy; when set it decides the policy."""

    @field_validator("device_list_strategy", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(","))
        if isinstance(value, list) and not value:
            raise ValueError("must name at least one strategy")
        return value

    @field_validator("device_list_strategy")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        canonical = [("cdi-cri" if v == "cdi" else v) for v in value]
        if len(set(canonical)) != len(canonical):
            raise ValueError("lists a strategy twice")
        return value

    @field_validator("cdi_annotation_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/", value):
            raise ValueError(f"{shown(value)} is not an annotation key prefix (a DNS subdomain followed by '/')")
        return value

    def strategies(self) -> frozenset[str]:
        """The strategies in force, with "cdi" read as "cdi-cri"."""
        return frozenset("cdi-cri" if s == "cdi" else s for s in self.device_list_strategy)


class GfdFlags(_Strict):
    oneshot: StrictBool = False
    no_timestamp: StrictBool = Field(default=False, alias="noTimestamp")
    """Leave out nvidia.com/gfd.timestamp."""
    sleep_interval: str | StrictInt | None = Field(default=None, alias="sleepInterval")
    output_file: str | None = Field(default=None, alias="outputFile")
    machine_type_file: Path = Field(default=Path("/sys/class/dmi/id/product_name"), alias="machineTypeFile")
    """Where nvidia.com/gpu.machine is read from."""


class Flags(_Strict):
    mig_strategy: Literal["none", "single", "mixed"] = Field(default="none", alias="migStrategy")
    """none: whole GPUs; single: MIG devices as nvidia.com/gpu; mixed: nvidia.com/mig-<profile> per profile."""
    fail_on_init_error: StrictBool = Field(default=True, alias="failOnInitError")
    """false: when NVML cannot be initialised, serve nothing and stay up instead of exiting."""
    mps_root: Path = Field(default=Path("/run/nvidia/mps"), alias="mpsRoot")
    """Host directory for the MPS control daemons' pipe and log directories (one per shared GPU)."""
    nvidia_driver_root: Path = Field(default=Path("/"), alias="nvidiaDriverRoot")
    nvidia_dev_root: Path | None = Field(default=None, alias="nvidiaDevRoot")
    """Host root of the GPUs' device nodes in passed device specs; defaults to nvidiaDriverRoot."""
    gdrcopy_enabled: StrictBool = Field(default=False, alias="gdrcopyEnabled")
    gds_enabled: StrictBool = Field(default=False, alias="gdsEnabled")
    mofed_enabled: StrictBool = Field(default=False, alias="mofedEnabled")
    use_node_feature_api: StrictBool = Field(default=False, alias="useNodeFeatureAPI")
    device_discovery_strategy: Literal["auto", "nvml", "tegra"] = Field(default="auto",
                                                                        alias="deviceDiscoveryStrategy")
    plugin: PluginFlags = PluginFlags()
    gfd: GfdFlags = GfdFlags()

    @property
    def dev_root(self) -> Path:
        return self.nvidia_dev_root or self.nvidia_driver_root


GpuSelector = int | str
"""A device by GPU index (0 or "0"), MIG index ("0:1"), UUID ("GPU-...", "MIG-..."), or, for whole GPUs, by
model (the NVML name or its label form, e.g. NVIDIA-H100-80GB-HBM3)."""

RESOURCE_NAME = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"


def _extended_resource(value: str) -> str:
    if not re.fullmatch(RESOURCE_NAME, value):
        raise ValueError(f"{shown(value)} is not an extended resource name (vendor-domain/name)")
    if value.split("/", 1)[0].endswith("kubernetes.io"):
        raise ValueError(f"{shown(value)} is in the reserved kubernetes.io domain")
    return value


class ReplicatedResource(_Strict):
    name: str
    """The resource whose devices are shared, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb."""
    replicas: StrictInt = Field(ge=2, le=1024)
    rename: str | None = None
    """Advertise the replicas under this resource name instead."""
    devices: Literal["all"] | int | list[GpuSelector] = "all"
    """Which devices this entry shares: all, the first N, or a list of indices, UUIDs and models."""

    @field_validator("name", "rename", mode="before")
    @classmethod
    def _nvidia_prefix(cls, value: object) -> object:
        # As in NVIDIA's files, a bare name is under nvidia.com/ ("gpu" is nvidia.com/gpu).
        if isinstance(value, str) and "/" not in value:
            return NVIDIA_PREFIX + value
        return value

    @field_validator("name", "rename")
    @classmethod
    def _resource_name(cls, value: str | None) -> str | None:
        return None if value is None else _extended_resource(value)

    @field_validator("devices", mode="before")
    @classmethod
    def _selectors(cls, value: object) -> object:
        if value == "all":
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value <= 0:
                raise ValueError(f"a count of devices must be above 0, got {shown(value)}")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("must be 'all', a count, or a non-empty list of GPU indices, UUIDs or models")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int | str) or item in ("", None):
                raise ValueError(f"{shown(item)} is not a GPU index, UUID or model")
            if isinstance(item, str) and len(item) > MAX_SELECTOR:
                raise ValueError(f"{shown(item)} is not a GPU index, UUID or model (those are at most "
                                 f"{MAX_SELECTOR} characters)")
            if isinstance(item, int) and item < 0:
                raise ValueError(f"GPU index {item} is negative")
        return value


class ReplicatedResources(_Strict):
    rename_by_default: StrictBool = Field(default=False, alias="renameByDefault")
    """Advertise replicas as <name>.shared unless an entry gives `rename`."""
    fail_requests_greater_than_one: StrictBool = Field(default=False, alias="failRequestsGreaterThanOne")
    resources: list[ReplicatedResource] = Field(default_factory=list)


MAX_MPS_REPLICAS = 100
"""MPS gives each client a whole percentage of the GPU's threads (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 100 //
replicas), so more than 100 replicas would each get 0%."""


class MpsResource(ReplicatedResource):
    @field_validator("replicas")
    @classmethod
    def _whole_percent(cls, value: int) -> int:
        if value > MAX_MPS_REPLICAS:
            raise ValueError(f"got {value}; MPS gives each replica a whole percentage of the GPU's threads, so at "
                             f"most {MAX_MPS_REPLICAS} replicas")
        return value


class MpsSharing(ReplicatedResources):
    fail_requests_greater_than_one: StrictBool = Field(default=True, alias="failRequestsGreaterThanOne")
    """On by default for MPS, as upstream: each request is one client's share of a GPU."""
    resources: list[MpsResource] = Field(default_factory=list)  # type: ignore[assignment]

    @field_validator("resources")
    @classmethod
    def _whole_gpus_only(cls, value: list[MpsResource]) -> list[MpsResource]:
        for entry in value:
            if entry.name != GPU_RESOURCE:
                raise ValueError(f"MPS shares whole GPUs only (nvidia.com/gpu), not {entry.name}")
        return value


TimeSlicing = ReplicatedResources


class Sharing(_Strict):
    time_slicing: ReplicatedResources = Field(default_factory=ReplicatedResources, alias="timeSlicing")
    mps: MpsSharing | None = None
    """Share GPUs through one MPS control daemon per GPU; exclusive with timeSlicing."""
    allocation_policy: Literal["distributed", "packed"] = Field(default="distributed", alias="allocationPolicy")
    """Which replicas GetPreferredAllocation prefers: spread over GPUs, or packed onto the fewest."""

    @model_validator(mode="after")
    def _one_strategy(self) -> Sharing:
        if self.mps is not None and self.mps.resources and self.time_slicing.resources:
            raise ValueError("timeSlicing and mps both share resources; a node uses one sharing strategy")
        return self

    @property
    def strategy(self) -> Literal["none", "time-slicing", "mps"]:
        if self.mps is not None and self.mps.resources:
            return "mps"
        return "time-slicing" if self.time_slicing.resources else "none"

    @property
    def replicated(self) -> ReplicatedResources:
        """The sharing section in force (NVIDIA's rule: mps when given, else timeSlicing)."""
        return self.mps if self.mps is not None and self.mps.resources else self.time_slicing


class ResourcePattern(_Strict):
    pattern: str
    """A shell-style wildcard ('*' only) over the GPU's NVML name, or over the MIG profile name."""
    name: str

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        if not value:
            raise ValueError("the pattern is empty")
        return value

    @field_validator("name", mode="before")
    @classmethod
    def _nvidia_name(cls, value: object) -> object:
        if isinstance(value, str) and not value.startswith(NVIDIA_PREFIX):
            value = NVIDIA_PREFIX + value
        return value

    @field_validator("name")
    @classmethod
    def _valid(cls, value: str) -> str:
        if len(value) > 63:
            raise ValueError(f"{shown(value)} is longer than 63 characters")
        if not re.fullmatch(r"nvidia\.com/[a-z0-9]([-a-z0-9.]*[a-z0-9])?", value):
            raise ValueError(f"{shown(value)} is not a resource name under nvidia.com/ (lower case, digits, '-', '.')")
        return value

    def matches(self, text: str) -> bool:
        """Whether the pattern matches the whole of `text`: '*' matches any run of characters (none too), every
        other character itself (case counts). Matched left to right, going back only to the last '*', so it takes
        at most len(pattern) * len(text) steps, however many stars there are."""
        pattern = self.pattern
        p = t = 0
        star, resume = -1, 0
        while t < len(text):
            if p < len(pattern) and pattern[p] == "*":
                star, resume = p, t
                p += 1
            elif p < len(pattern) and pattern[p] == text[t]:
                p, t = p + 1, t + 1
            elif star >= 0:
                resume += 1
                p, t = star + 1, resume
            else:
                return False
        return pattern[p:].strip("*") == ""


class Resources(_Strict):
    gpus: list[ResourcePattern] = Field(default_factory=list)
    """Whole GPUs by NVML name; when given, a GPU that matches no pattern is not advertised."""
    mig: list[ResourcePattern] = Field(default_factory=list)
    """MIG devices by profile name; when given, a MIG device that matches no pattern is not advertised."""


class Imex(_Strict):
    channel_ids: list[StrictInt] = Field(default_factory=list, alias="channelIDs")
    required: StrictBool = False

    @field_validator("channel_ids")
    @classmethod
    def _only_zero(cls, value: list[int]) -> list[int]:
        if value not in ([], [0]):
            raise ValueError(f"must be [] or [0], got {shown(value)}")
        return value


Action = Literal["ignore", "warn", "unhealthy", "node-fatal"]

DEFAULT_XID_ACTIONS: dict[int, Action] = {
    **{x: "ignore" for x in (13, 31, 43, 45, 68, 109)},  # application errors: the GPU stays usable
    **{x: "warn" for x in (63, 92, 94)},  # row remap pending, single-bit storm, contained ECC error
    **{x: "node-fatal" for x in (79, 151, 160)},  # off the bus, key rotation, channel retirement: reboot
}


class CheckActions(_Strict):
    gpu_lost: Action = Field(default="node-fatal", alias="gpuLost")
    ecc_uncorrected: Action = Field(default="unhealthy", alias="eccUncorrected")
    remapped_rows_failure: Action = Field(default="unhealthy", alias="remappedRowsFailure")
    remapped_rows_pending: Action = Field(default="warn", alias="remappedRowsPending")
    retired_pages_pending: Action = Field(default="warn", alias="retiredPagesPending")
    thermal_throttle: Action = Field(default="warn", alias="thermalThrottle")
    power_brake: Action = Field(default="warn", alias="powerBrake")
    nvml_unresponsive: Action = Field(default="node-fatal", alias="nvmlUnresponsive")
    """An NVML call past its deadline (health.nvmlDeadlineSeconds): the GPU it concerns, or every GPU for a call
    that concerns none."""


class TaintSettings(_Strict):
    key: str = "gpu-node-agent.io/gpu-fault"
    """The agent only ever owns taints under its own domain."""
    effect: Literal["NoSchedule", "NoExecute", "PreferNoSchedule"] = "NoSchedule"


    @field_validator("key")
    @classmethod
    def _own_domain(cls, value: str) -> str:
        if not re.fullmatch(TAINT_KEY, value):
            raise ValueError(f"{shown(value)} is not a taint key under gpu-node-agent.io/ (the agent owns only those)")
        return value


class HealthSettings(_Strict):
    xid_default: Action = Field(default="unhealthy", alias="xidDefault")
    """What an XID not listed in `xid` does."""
    xid: dict[Annotated[int, Field(ge=1, le=1023)], Action] = Field(default_factory=lambda: dict(DEFAULT_XID_ACTIONS))
    """Per-XID actions; listed XIDs replace the defaults for those XIDs, the others keep theirs."""
    checks: CheckActions = CheckActions()
    sample_interval_seconds: StrictFloat = Field(default=5.0, ge=0.05, le=3600, alias="sampleIntervalSeconds")
    recovery_checks: StrictInt = Field(default=3, ge=1, le=1000, alias="recoveryChecks")
    """Consecutive clean samples after the last fault before a GPU is healthy again."""
    nvml_deadline_seconds: StrictFloat = Field(default=10.0, ge=0.5, le=3600, alias="nvmlDeadlineSeconds")
    """How long an NVML read may take before it counts as stuck (checks.nvmlUnresponsive)."""
    node_fatal_unhealthy_gpus: StrictInt = Field(default=0, ge=0, alias="nodeFatalUnhealthyGpus")
    """Taint the node when at least this many GPUs are unhealthy; 0 turns this off."""
    taint: TaintSettings = TaintSettings()

    @field_validator("xid", mode="before")
    @classmethod
    def _numeric_keys(cls, value: object) -> object:
        if isinstance(value, dict):
            for key in value:
                if isinstance(key, bool) or not isinstance(key, int):
                    raise ValueError(f"XIDs are numbers 1..1023, got the key {shown(key)}")
        return value

    @field_validator("xid", mode="after")
    @classmethod
    def _merge_defaults(cls, value: dict[int, Action]) -> dict[int, Action]:
        return {**DEFAULT_XID_ACTIONS, **value}

    def xid_action(self, xid: int) -> Action:
        return self.xid.get(xid, self.xid_default)


class TelemetrySettings(_Strict):
    dcgm_metrics: StrictBool = Field(default=True, alias="dcgmMetrics")
    """Serve dcgm-exporter's default counters (DCGM_FI_*) on /metrics; off for clusters that keep dcgm-exporter."""
    interval_seconds: StrictFloat = Field(default=10.0, ge=1, le=3600, alias="intervalSeconds")
    """How often NVML is read for them (and the kubelet asked which pods hold which devices); scrapes read the
    last pass."""
    idle_utilization_threshold: StrictFloat = Field(default=0.05, ge=0, le=1, alias="idleUtilizationThreshold")
    """A device held by a pod counts as idle (gpu_agent_*_idle_gpu_seconds) while its utilization, 0 to 1, is under
    this; 0: never idle."""
    chargeback_by_pod: StrictBool = Field(default=False, alias="chargebackByPod")
    """Count GPU-seconds per pod too (gpu_agent_pod_*gpu_seconds), beside the counts per namespace."""


class MigSettings(_Strict):
    layouts_file: Path | None = Field(default=None, alias="layoutsFile")
    """MIG layouts in the mig-parted v1 format; None uses the layouts shipped with the agent."""
    state_dir: Path = Field(default=Path("/var/lib/gpu-node-agent"), alias="stateDir")
    """Where the apply journal lives; must survive agent restarts."""
    pod_resources_socket: Path = Field(
        default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"), alias="podResourcesSocket"
    )
    """The kubelet's PodResources socket. Where the config does not set it, the one beside the agent's kubelet
    directory (`beside_kubelet`): <kubelet root>/pod-resources/kubelet.sock."""
    busy_policy: Literal["fail", "wait"] = Field(default="fail", alias="busyPolicy")
    """When pods hold devices of a GPU to change: fail at once naming them, or wait for them to end."""
    busy_wait_seconds: StrictFloat = Field(default=300.0, ge=0, le=86400, alias="busyWaitSeconds")
    nvml_deadline_seconds: StrictFloat = Field(default=300.0, ge=10, le=86400, alias="nvmlDeadlineSeconds")
    """How long the NVML calls of one MIG apply (its planning, changes and check) may take together before they
    count as stuck (health.checks.nvmlUnresponsive)."""


DRA_DRIVER_NAME = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+"


class SharedCapacity(_Strict):
    enabled: StrictBool = False
    """Publish each GPU that sharing.mps shares as one device that several claims share by capacity (`memory` in
    bytes, `compute` in percent of the SMs), instead of as its replicas; each claim is made an MPS client with
    the memory and threads it was allocated. Needs DRAConsumableCapacity on the API server and the scheduler."""
    memory_step_mib: StrictInt = Field(default=1024, ge=1, alias="memoryStepMiB")
    """Memory is allocated in multiples of this (the smallest share too); a request is rounded up to one."""
    compute_step_percent: StrictInt = Field(default=1, ge=1, le=100, alias="computeStepPercent")
    """Compute is allocated in multiples of this many percent of the SMs; a request is rounded up to one."""


class DraSettings(_Strict):
    enabled: StrictBool = False
    """DRA mode: publish the GPUs in a ResourceSlice (resource.k8s.io/v1) instead of registering the
    nvidia.com/gpu device plugin."""
    driver_name: str = Field(default="gpu.gpu-node-agent.io", alias="driverName")
    """The DRA driver name (a DNS subdomain): the slice's driver, the attributes' domain, the DeviceClass's."""
    cdi_root: Path = Field(default=Path("/var/run/cdi"), alias="cdiRoot")
    """Where the CDI specs of prepared claims are written (the container runtime's CDI spec directory)."""
    dynamic_mig: StrictBool = Field(default=False, alias="dynamicMig")
    """Publish every possible MIG placement of the GPUs in MIG mode (with shared counters, where the API server
    keeps them: DRAPartitionableDevices) and create each MIG device when a claim is prepared; the MIG manager
    then refuses nvidia.com/mig.config."""
    shared_capacity: SharedCapacity = Field(default_factory=SharedCapacity, alias="sharedCapacity")
    """GPUs that MPS shares published as devices with consumable capacity (DRAConsumableCapacity)."""

    @field_validator("driver_name")
    @classmethod
    def _driver_name(cls, value: str) -> str:
        if len(value) > 63 or not re.fullmatch(DRA_DRIVER_NAME, value):
            raise ValueError(f"{shown(value)} is not a DRA driver name (a lower-case DNS subdomain of at most 63 "
                             "characters with at least one dot, e.g. gpu.example.com)")
        return value


NO_EFFECT: dict[str, str] = {
    "flags.useNodeFeatureAPI": "labels are written to the Node object itself; no NodeFeature objects are made",
    "flags.plugin.nvidiaCTKPath": "the agent writes no CDI specs; the runtime uses the node's own CDI specs",
    "flags.gfd.oneshot": "labels are kept up to date for as long as the agent runs",
    "flags.gfd.sleepInterval": "labels follow each change as it happens, not an interval",
    "flags.gfd.outputFile": "labels are written to the Node object, not to a file",
}
"""Keys of NVIDIA's config v1 that are accepted but change nothing here, and why."""


class AgentConfig(_Strict):
    version: Literal["v1"] = "v1"
    """NVIDIA's files may leave it out; v1 is the only version."""
    flags: Flags = Flags()
    resources: Resources = Resources()
    sharing: Sharing = Sharing()
    imex: Imex = Imex()
    health: HealthSettings = HealthSettings()
    mig: MigSettings = MigSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    dra: DraSettings = DraSettings()
    _without_effect: tuple[str, ...] = PrivateAttr(default=())

    @property
    def allocation_policy(self) -> Literal["distributed", "packed"]:
        """How shared replicas are preferred: flags.plugin.sharedDevicesAllocationPolicy when set, else
        sharing.allocationPolicy."""
        return self.flags.plugin.shared_devices_allocation_policy or self.sharing.allocation_policy

    @property
    def without_effect(self) -> tuple[str, ...]:
        """One line per key of the file that is accepted but has no effect here, naming it and why."""
        return self._without_effect


DEFAULT_CONFIG = AgentConfig(version="v1")


_LIMITS = {"greater_than_equal": "at least {ge}", "less_than_equal": "at most {le}", "greater_than": "above {gt}",
           "less_than": "below {lt}"}
_TYPES = {"int_type": "a whole number", "int_parsing": "a whole number", "int_from_float": "a whole number",
          "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
          "bool_parsing": "true or false", "string_type": "text", "list_type": "a list", "dict_type": "a mapping",
          "model_type": "a mapping", "model_attributes_type": "a mapping", "path_type": "a path"}
"""pydantic's error types in the project's own words."""
_MAX_REASON = 200
"""A message pydantic words itself is cut to this length (it may quote a value)."""


def _reason(e: Any) -> str:
    kind, ctx = e["type"], e.get("ctx") or {}
    if kind in _LIMITS:
        return f"got {shown(e['input'])}; must be {_LIMITS[kind].format(**ctx)}"
    if kind in _TYPES:
        return f"got {shown(e['input'])}; must be {_TYPES[kind]}"
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "value_error":
        return clip(str(e["msg"]).removeprefix("Value error, "), _MAX_REASON)
    if kind == "literal_error":
        return f"got {shown(e['input'])}; " + clip(str(e["msg"]).replace("Input should be", "expected"), _MAX_REASON)
    return clip(str(e["msg"]), _MAX_REASON)


def _format(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        reason = _reason(e)
        path = ""
        for part in e["loc"]:
            if part == "[key]":
                reason = f"bad key: {reason}"
            elif isinstance(part, int):
                path += f"[{part}]"
            elif "[" in str(part) or str(part).startswith("function-"):
                continue  # a union or validator branch pydantic names in the location: not a key
            else:
                path += ("." if path else "") + clip(str(part))
        path = path or "(top level)"
        lines.append(printable(f"{origin}: {path}: {reason}"))
    return problem_lines(lines)


def parse_config(text: str, origin: str = "config") -> AgentConfig:
    try:
        data = load_yaml(text)
    except YamlProblem as err:
        raise ConfigError(f"{origin}: {err}") from None
    if data is None:
        data = {}  # an empty file: the defaults, as upstream
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping with 'version: v1' at the top level")
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, origin)) from err
    collisions = _name_collisions(config) + _capacity_problems(config)
    if collisions:
        raise ConfigError(problem_lines(printable(f"{origin}: {path}: {reason}") for path, reason in collisions))
    config._without_effect = _keys_without_effect(data, origin)
    return config


def _name_collisions(config: AgentConfig) -> list[tuple[str, str]]:
    """(key path, reason) for each resource name the config gives to a second kind of device: one resource holds
    whole GPUs, MIG devices or the replicas of one resource, never two of them (inventory.plan withholds what
    only the node shows)."""
    problems: list[tuple[str, str]] = []
    gpus, mig = config.resources.gpus, config.resources.mig
    whole = {p.name: f" (resources.gpus[{i}])" for i, p in reversed(list(enumerate(gpus)))} or {GPU_RESOURCE: ""}
    """The names whole GPUs go to, each with the first entry that gives it."""
    for i, p in enumerate(gpus):
        if p.name.startswith(MIG_PREFIX):
            problems.append((f"resources.gpus[{i}].name", f"{p.name} is under {MIG_PREFIX}, the names of MIG "
                                                          "devices; whole GPUs need another name"))
    if config.flags.mig_strategy == "mixed":
        for i, p in enumerate(mig):
            if p.name in whole:
                problems.append((f"resources.mig[{i}].name", f"{p.name} is the name of whole GPUs{whole[p.name]}; "
                                 "with migStrategy mixed MIG devices need a name of their own"))
    path = "sharing.mps" if config.sharing.strategy == "mps" else "sharing.timeSlicing"
    entries = config.sharing.replicated.resources
    others = {
        **{e.name: f"the name of another resource ({path}.resources[{j}].name)"
           for j, e in reversed(list(enumerate(entries)))},
        **{p.name: f"the name of MIG devices (resources.mig[{j}])" for j, p in reversed(list(enumerate(mig)))},
        **{name: f"the name of whole GPUs{where}" for name, where in whole.items()},
    }
    """What each name the config gives a resource is, the first giving it named (whole GPUs before MIG devices
    before sharing entries)."""
    for i, e in enumerate(entries):
        if e.rename is None or e.rename == e.name:
            continue
        where = f"{path}.resources[{i}].rename"
        if e.rename.startswith(MIG_PREFIX) and not e.name.startswith(MIG_PREFIX):
            problems.append((where, f"{e.rename} is under {MIG_PREFIX}, the names of MIG devices; replicas of "
                                    f"{e.name} need another name"))
        elif e.rename in others:
            problems.append((where, f"{e.rename} is {others[e.rename]}; replicas of {e.name} need a name of their "
                                    "own"))
    return problems


def _capacity_problems(config: AgentConfig) -> list[tuple[str, str]]:
    """(key path, reason) where dra.sharedCapacity is on without MPS sharing: the capacity it publishes is
    enforced by making each claim an MPS client, so only a GPU that an MPS daemon serves can be shared by it."""
    if config.dra.shared_capacity.enabled and config.sharing.strategy != "mps":
        return [("dra.sharedCapacity.enabled", "needs sharing.mps: a GPU shared by capacity is enforced by its MPS "
                                               "daemon (add sharing.mps.resources for nvidia.com/gpu, or turn it "
                                               "off)")]
    return []


def _keys_without_effect(data: dict[str, object], origin: str) -> tuple[str, ...]:
    lines = []
    for path, why in NO_EFFECT.items():
        node: object = data
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            lines.append(f"{origin}: {path} is accepted but has no effect: {why}")
    if isinstance(flags := data.get("flags"), dict) and flags.get("deviceDiscoveryStrategy") == "tegra":
        lines.append(f"{origin}: flags.deviceDiscoveryStrategy 'tegra' has no effect: GPUs are always found "
                     "through NVML")
    return tuple(lines)


def named_configs(directory: Path) -> dict[str, Path]:
    """The configs of a directory (a mounted ConfigMap): every regular file not starting with '.', by its
    name without a .yaml or .yml suffix."""
    found = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        found[entry.name.removesuffix(".yaml").removesuffix(".yml")] = entry
    return found


def config_file(path: Path, name: str | None = None) -> Path:
    """The file to read: `path` itself, or in a directory of named configs the one called `name` (from the
    node label nvidia.com/device-plugin.config), else `default`, else the only one."""
    if not path.is_dir():
        if name is not None:
            raise ConfigError(f"{path}: a config named {name!r} is asked for, but {path} is a single file")
        return path
    try:
        configs = named_configs(path)
    except OSError as err:
        raise ConfigError(f"{path}: cannot list configs: {err.strerror}") from err
    known = listing(configs)
    if name is not None:
        if name not in configs:
            raise ConfigError(f"{path}: no config named {name!r} (known: {known})")
        return configs[name]
    if "default" in configs:
        return configs["default"]
    if len(configs) == 1:
        return next(iter(configs.values()))
    raise ConfigError(f"{path}: no config named 'default' and no node label choosing one (known: {known})")


def has_no_settings(text: str) -> bool:
    """Whether a config file's text holds no settings at all: 0 bytes, only whitespace and comments, or a YAML
    null (`---` alone, `null`, `~`). A mapping, even `{}` or `version: v1` alone, asks for the defaults."""
    try:
        return load_yaml(text) is None
    except YamlProblem:
        return False


def load_config(path: Path | None, name: str | None = None, *, empty_is_defaults: bool = True) -> AgentConfig:
    """The config at `path` (a file, or a directory of named configs), or the defaults when none is given. A file
    with no settings at all is the defaults, unless `empty_is_defaults` is False (a reload): then EmptyConfigFile."""
    if path is None:
        return DEFAULT_CONFIG
    chosen = config_file(path, name)
    try:
        text = read_text_file(chosen)
    except InputFileError as err:
        raise ConfigError(f"{chosen}: cannot read config: {err.reason}") from None
    config = parse_config(text, str(chosen))
    # Only a file that gives the defaults can have no settings: the text is parsed again only then.
    if not empty_is_defaults and config == DEFAULT_CONFIG and has_no_settings(text):
        raise EmptyConfigFile(chosen, config)
    return config


def beside_kubelet(config: AgentConfig, kubelet_dir: Path) -> AgentConfig:
    """`config` with `mig.podResourcesSocket`, where the config does not set it, the kubelet's beside the device
    plugin directory the agent serves (`kubelet_dir`, --kubelet-dir): <kubelet root>/pod-resources/kubelet.sock, as
    the DRA sockets are under <kubelet root>. The default --kubelet-dir gives the default path; a kubelet with
    another root (k0s, MicroK8s) needs --kubelet-dir alone. It still counts as not set (check_paths)."""
    mig = config.mig
    socket = kubelet_dir.parent / "pod-resources" / "kubelet.sock"
    if "pod_resources_socket" in mig.model_fields_set or mig.pod_resources_socket == socket:
        return config
    moved = MigSettings.model_construct(mig.model_fields_set, **{**dict(mig), "pod_resources_socket": socket})
    return config.model_copy(update={"mig": moved})


DISABLE_HEALTH_ENV = "DP_DISABLE_HEALTHCHECKS"
"""NVIDIA's device plugin: `all` (or anything holding `xids`) turns health checks off; else XIDs to ignore,
separated by commas, beside the application errors it always ignores."""
ENABLE_HEALTH_ENV = "DP_ENABLE_HEALTHCHECKS"
"""NVIDIA's device plugin: XIDs that mark a GPU unhealthy whatever DP_DISABLE_HEALTHCHECKS says."""
MAX_HEALTH_ENV = 4096
"""The longest value either variable may have (a list of every XID is shorter)."""


def _env_xids(name: str, value: str) -> tuple[bool, list[int]]:
    """(whether the value turns every check off, its XIDs); ConfigError for anything else."""
    if len(value) > MAX_HEALTH_ENV:
        raise ConfigError(f"{name}: {len(value)} characters, more than the {MAX_HEALTH_ENV} it may have")
    everything, xids = False, []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        if part.lower() in ("all", "xids"):
            everything = True
        elif part.isascii() and part.isdigit() and 1 <= int(part) <= 1023:
            xids.append(int(part))
        else:
            raise ConfigError(f"{name}: {shown(part)} is not an XID (a number 1..1023), 'all' or 'xids'; "
                              "expected XIDs separated by commas")
    return everything, xids


def with_health_env(config: AgentConfig, env: Mapping[str, str]) -> tuple[AgentConfig, list[str]]:
    """The config with NVIDIA's device-plugin health variables applied over its health policy, and one line for
    each variable that changed it (for the log). DP_DISABLE_HEALTHCHECKS=all makes every XID and every periodic
    check `ignore` (health checking off, as there); listed XIDs become `ignore`. An XID in
    DP_ENABLE_HEALTHCHECKS (`all`: every XID) keeps its action when that marks the GPU unhealthy or worse and is
    `unhealthy` otherwise, whatever the first says. A value that is not one of these: ConfigError, one line."""
    disable, enable = env.get(DISABLE_HEALTH_ENV, ""), env.get(ENABLE_HEALTH_ENV, "")
    everything, ignored = _env_xids(DISABLE_HEALTH_ENV, disable)
    enable_all, enabled = _env_xids(ENABLE_HEALTH_ENV, enable)
    if enable_all:
        enabled = sorted({*config.health.xid, *ignored, *enabled})
    if not (everything or ignored or enabled or enable_all):
        return config, []
    health = config.health
    xid = dict(health.xid)
    said = []
    if everything:
        xid = {x: "ignore" for x in xid}
        checks = health.checks.model_copy(update={name: "ignore" for name in CheckActions.model_fields})
        health = health.model_copy(update={"xid_default": "ignore", "checks": checks})
        said.append(f"{DISABLE_HEALTH_ENV}={disable}: every XID and health check ignored")
    else:
        xid.update({x: "ignore" for x in ignored})
        if ignored:
            said.append(f"{DISABLE_HEALTH_ENV}={disable}: XIDs {', '.join(map(str, sorted(set(ignored))))} "
                        "ignored")
    def enabled_action(before: Action) -> Action:
        return before if before in ("unhealthy", "node-fatal") else "unhealthy"

    for x in enabled:
        xid[x] = enabled_action(config.health.xid_action(x))
    if enable_all:
        health = health.model_copy(update={"xid_default": enabled_action(config.health.xid_default)})
        said.append(f"{ENABLE_HEALTH_ENV}={enable}: every XID marks its GPU unhealthy or worse")
    elif enabled:
        said.append(f"{ENABLE_HEALTH_ENV}={enable}: " + ", ".join(
            f"XID {x} {xid[x]}" for x in sorted(set(enabled))))
    return config.model_copy(update={"health": health.model_copy(update={"xid": xid})}), said
