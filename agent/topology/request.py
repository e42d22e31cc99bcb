"""What every preferred-allocation request shares: its validation (`check_request`, each refusal an
`AllocationError` naming the first bad id), the natural order of device ids (`replica_order`), and the small
steps of grouping offered ids by GPU and taking them (`by_gpu`, `take`). Used by gpus.py, replicas.py and
mig_devices.py."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

_Id = TypeVar("_Id", bound=Hashable)


class AllocationError(ValueError):
    """A preferred-allocation request that cannot be answered as asked."""



@functools.lru_cache(maxsize=16384)
def replica_order(device_id: str) -> tuple[tuple[int, str, int], ...]:
    """Natural sort key for device ids: digit runs compare as numbers ("gpu::2" before "gpu::10")."""
    return tuple(
        (1, "", int(part)) if part.isdigit() else (0, part, 0)
        for part in re.split(r"(\d+)", device_id)
        if part
    )


def by_gpu(ids: Iterable[str], gpu_of: Callable[[str], int],
            order: Callable[[str], Any] = replica_order) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for did in sorted(ids, key=order):
        out.setdefault(gpu_of(did), []).append(did)
    return out


def is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_request(
    available: Sequence[_Id], must_include: Sequence[_Id], size: int, known: Callable[[_Id], bool], what: str
) -> tuple[set[_Id], list[_Id]]:
    """Validate a request; return (candidates, required). Candidates include `must_include`."""
    if not is_index(size) or size < 1:
        raise AllocationError(f"size must be a positive integer, got {size!r}")
    offered, required = set(available), set(must_include)
    if len(offered) < len(available) or len(required) < len(must_include) or not all(map(known, offered | required)):
        _refuse(available, must_include, known, what)
    if len(must_include) > size:
        raise AllocationError(
            f"must_include has {len(must_include)} entries, more than the requested size {size}"
        )
    candidates = offered | required
    if size > len(candidates):
        raise AllocationError(f"size {size} is more than the {len(candidates)} candidates offered")
    return candidates, list(must_include)


def _refuse(available: Sequence[_Id], must_include: Sequence[_Id], known: Callable[[_Id], bool], what: str) -> NoReturn:
    """The AllocationError for the first unknown or repeated id, in the request's order."""
    for name, ids in (("available", available), ("must_include", must_include)):
        seen: set[_Id] = set()
        for item in ids:
            if not known(item):
                raise AllocationError(f"{name}: unknown {what} {item!r}")
            if item in seen:
                raise AllocationError(f"{name}: {what} {item!r} is listed twice")
            seen.add(item)
    raise AssertionError("an unknown or repeated id was found, and then not")


def take(offered: Mapping[int, list[str]], picked: dict[int, list[str]], gpu: int, count: int) -> None:
    """Add up to `count` of the GPU's offered ids, in order, to what is picked on it."""
    have = picked.setdefault(gpu, [])
    taken = set(have)
    for rid in offered[gpu]:
        if count <= 0:
            break
        if rid not in taken:
            have.append(rid)
            count -= 1
