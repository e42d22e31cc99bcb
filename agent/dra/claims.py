"""The claims the DRA kubelet plugin has prepared, kept by UID in memory and in a checkpoint file that is
written before each answer, with one CDI spec file per claim (`ClaimStore`); where the plugin's sockets, the
checkpoint and the CDI specs are (`Paths`); what one prepared device is (`Prepared`); and `ClaimError`, a claim
that cannot be prepared. The API server's side of a claim is read through a `ClaimReader`."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.yamlfile import CheckpointError, read_checkpoint, write_atomically, write_checkpoint

CHECKPOINT_VERSION = 1


class ClaimReader(Protocol):
    async def claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class Paths:
    registration: Path
    """The registration socket in the kubelet's plugins_registry directory."""
    endpoint: Path
    """The DRA service's socket."""
    checkpoint: Path
    cdi_dir: Path

    @classmethod
    def under(cls, kubelet_root: Path, driver: str, cdi_dir: Path) -> Paths:
        plugin_dir = kubelet_root / "plugins" / driver
        return cls(kubelet_root / "plugins_registry" / f"{driver}-reg.sock", plugin_dir / "dra.sock",
                   plugin_dir / "checkpoint.json", cdi_dir)


@dataclass(frozen=True)
class Prepared:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


class ClaimError(Exception):
    """A claim cannot be prepared; the message says why in one line."""


class ClaimStore:
    """The prepared claims by UID, in memory and in the checkpoint file, with their CDI spec files."""

    def __init__(self, paths: Paths, driver: str) -> None:
        self._paths = paths
        self._driver = driver
        self.claims: dict[str, dict[str, Any]] = {}
        self._load()

    def _load(self) -> None:
        try:
            self.claims = read_checkpoint(self._paths.checkpoint, "the DRA checkpoint", "claims", CHECKPOINT_VERSION)
        except CheckpointError as err:
            raise ClaimError(str(err)) from None

    def _save(self) -> None:
        write_checkpoint(self._paths.checkpoint, "claims", CHECKPOINT_VERSION, self.claims)

    def spec_path(self, uid: str) -> Path:
        return self._paths.cdi_dir / f"{self._driver.replace('/', '_')}-claim-{uid}.json"

    def get(self, uid: str) -> list[Prepared] | None:
        entry = self.claims.get(uid)
        if entry is None:
            return None
        return [Prepared(tuple(d["requests"]), d["pool"], d["device"], tuple(d["cdi"])) for d in entry["devices"]]

    def put(self, uid: str, namespace: str, name: str, devices: list[Prepared], spec: dict[str, Any]) -> None:
        write_atomically(self.spec_path(uid), json.dumps(spec, indent=2) + "\n")
        self.claims[uid] = {"namespace": namespace, "name": name, "devices": [
            {"requests": list(d.request_names), "pool": d.pool, "device": d.device, "cdi": list(d.cdi_ids)}
            for d in devices]}
        self._save()

    def remove(self, uid: str) -> None:
        """The checkpoint forgets the claim before its CDI spec goes, so a spec gone means the claim is gone
        from the checkpoint too; a crash in between leaves only the spec, which the kubelet's retry removes."""
        if self.claims.pop(uid, None) is not None:
            self._save()
        with contextlib.suppress(FileNotFoundError):
            self.spec_path(uid).unlink()
