"""What a container needs to be one client of its GPU's MPS control daemon, for the device plugin's Allocate
answer and DRA's prepared claims alike: the daemon's pipe and log directories (per GPU under flags.mpsRoot,
mounted at /mps/pipe and /mps/log), the shared /dev/shm, and the client's share of the GPU's threads and memory.
Also where those directories are on the host, which the MPS daemons (agent/mps.py) are started with. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath, PurePosixPath
from typing import TypeVar

MPS_CONTAINER_ROOT = PurePosixPath("/mps")
"""Where a client container sees the daemon's directories."""

AnyPath = TypeVar("AnyPath", bound=PurePath)


def mps_pipe_dir(root: AnyPath, gpu_uuid: str) -> AnyPath:
    """The pipe directory of a GPU's control daemon on the host, under flags.mpsRoot."""
    return root / gpu_uuid / "pipe"


def mps_log_dir(root: AnyPath, gpu_uuid: str) -> AnyPath:
    """The log directory of a GPU's control daemon on the host, under flags.mpsRoot."""
    return root / gpu_uuid / "log"


@dataclass(frozen=True)
class MpsClient:
    """A container's edits as one MPS client: environment variables and bind mounts, in the order they are
    written."""

    env: tuple[tuple[str, str], ...]
    mounts: tuple[tuple[str, str], ...]
    """(path in the container, path on the host)."""


def mps_client(root: PurePath, gpu_uuid: str, memory_mib: int, share: int, replicas: int) -> MpsClient:
    """The edits for a client holding `share` of the `replicas` replicas of GPU `gpu_uuid` (`memory_mib` of memory),
    whose daemon's directories are under `root` (flags.mpsRoot)."""
    return mps_client_limits(root, gpu_uuid, memory_mib * share // replicas, 100 * share // replicas)


def mps_client_limits(root: PurePath, gpu_uuid: str, memory_mib: int, threads_percent: int) -> MpsClient:
    """The edits for a client of GPU `gpu_uuid` limited to `memory_mib` of pinned device memory and
    `threads_percent` of its threads (both set in the client's environment, over the daemon's defaults), whose
    daemon's directories are under `root` (flags.mpsRoot)."""
    pipe, log = MPS_CONTAINER_ROOT / "pipe", MPS_CONTAINER_ROOT / "log"
    return MpsClient(
        env=(("CUDA_MPS_PIPE_DIRECTORY", str(pipe)),
             ("CUDA_MPS_LOG_DIRECTORY", str(log)),
             ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(threads_percent)),
             ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", f"0={memory_mib}M")),
        mounts=((str(pipe), str(mps_pipe_dir(root, gpu_uuid))),
                (str(log), str(mps_log_dir(root, gpu_uuid))),
                ("/dev/shm", str(root / "shm"))),
    )
