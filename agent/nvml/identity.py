"""What the agent last read of each GPU, kept in the state directory (`gpus.json`, beside the MIG journal) so
that a GPU already lost when a later agent starts (a rolling update, an OOM kill, a node reboot) is still in the
inventory under its own NVML index, with its UUID, name and bus ID, rather than missing.

The file is the agent's own: written atomically whenever what NVML reads of the GPUs that answer differs from
it, read with the size limit and the refusals of every input file. A damaged or foreign file is one warning and
is not used (the GPUs that answer are read from NVML all the same; a lost one is then known by its index only).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from agent.nvml.records import GpuInfo
from agent.yamlfile import InputFileError, read_text_file, write_atomically

log = logging.getLogger(__name__)

IDENTITY_FILE = "gpus.json"
"""Its name in the MIG state directory (a simulated node keeps its own beside its --mock-state file)."""
MAX_IDENTITY_BYTES = 256 * 1024
"""Far above a 64-GPU node's file (about 300 bytes a GPU)."""
MAX_GPUS = 1024


class _Gpu(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: StrictInt = Field(ge=0, lt=MAX_GPUS)
    uuid: StrictStr = Field(min_length=1, max_length=96)
    name: StrictStr = Field(max_length=96)
    pci_bus_id: StrictStr = Field(max_length=32)
    minor: StrictInt = Field(ge=0, lt=1 << 20)
    memory_mib: StrictInt = Field(ge=0, lt=1 << 32)
    architecture: StrictStr = Field(max_length=32)
    compute_capability: tuple[StrictInt, StrictInt]
    numa_node: StrictInt | None = None
    mig_capable: StrictBool = False
    pci_class: StrictInt | None = None
    brand: StrictInt | None = None


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: StrictInt = Field(ge=1, le=1)
    gpus: list[_Gpu] = Field(max_length=MAX_GPUS)


def _record(gpu: GpuInfo) -> _Gpu:
    return _Gpu(index=gpu.index, uuid=gpu.uuid, name=gpu.name, pci_bus_id=gpu.pci_bus_id, minor=gpu.minor,
                memory_mib=gpu.memory_mib, architecture=gpu.architecture,
                compute_capability=gpu.compute_capability, numa_node=gpu.numa_node, mig_capable=gpu.mig_capable,
                pci_class=gpu.pci_class, brand=gpu.brand)


def load_identities(path: Path) -> dict[int, GpuInfo]:
    """The GPUs an earlier agent read (the file `path`), by NVML index, as lost GpuInfo; {} where there is no
    file, and where it cannot be used (one warning naming the file and why)."""
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        data = _File.model_validate(json.loads(read_text_file(path, MAX_IDENTITY_BYTES)))
        if len({g.index for g in data.gpus}) != len(data.gpus):
            raise ValueError("a GPU index is listed twice")
    except InputFileError as err:
        log.warning("the GPUs an earlier agent read are not used: %s", err)
        return {}
    except (ValueError, ValidationError) as err:
        if isinstance(err, ValidationError):
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            why = f"{err.error_count()} problem(s), first {where}: {first['msg']}"
        else:
            why = str(err).splitlines()[0]
        log.warning("the GPUs an earlier agent read are not used: %s: not the agent's GPU file (%s)", path, why)
        return {}
    return {g.index: GpuInfo(index=g.index, uuid=g.uuid, name=g.name, pci_bus_id=g.pci_bus_id, minor=g.minor,
                             memory_mib=g.memory_mib, architecture=g.architecture,
                             compute_capability=g.compute_capability, numa_node=g.numa_node,
                             mig_capable=g.mig_capable, mig_enabled=False, mig_pending=False,
                             pci_class=g.pci_class, brand=g.brand, lost=True)
            for g in data.gpus}


def save_identities(path: Path, remembered: dict[int, GpuInfo]) -> bool:
    """Write what is known of each GPU to the file `path` when it differs from it; True when it was written. A
    failure is one warning: the agent serves all the same."""
    text = _File(format=1, gpus=[_record(remembered[i]) for i in sorted(remembered)]).model_dump_json(indent=1)
    try:
        if read_text_file(path, MAX_IDENTITY_BYTES) == text:
            return False
    except InputFileError:
        pass  # none yet, or not one the agent wrote: replaced
    try:
        write_atomically(path, text)
    except OSError as err:
        log.warning("cannot keep the GPUs' identities in %s: %s", path, err.strerror or err)
        return False
    return True
