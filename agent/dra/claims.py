"""The claims the DRA kubelet plugin prepares, kept by UID in memory and in one checkpoint file with one CDI spec
file per claim (`ClaimStore`); where the plugin's sockets, the checkpoint and the CDI specs are (`Paths`); what
one prepared device is (`Prepared`); and `ClaimError`, a claim that cannot be prepared. The API server's side of
a claim is read through a `ClaimReader`.

The checkpoint (`plugins/<driver>/checkpoint.json`) holds every claim's state: `PrepareStarted` from before the
first change a prepare makes (a MIG device, the CDI spec) until its last, then `PrepareCompleted`; its devices;
and the MIG devices made for it with dra.dynamicMig. A SHA-256 checksum of the claims guards it; it is written
atomically, the file and its directory flushed. A version 1 checkpoint, and the `dynamic-mig.json` of the same
versions, are migrated at start; a damaged one is kept aside as `checkpoint.json.corrupt` and the agent starts
with no claims, removing nothing at start while that file is there (docs/dra.md, "The checkpoint")."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.locks import SerialLock
from agent.yamlfile import InputFileError, read_text_file, sync_directory, write_atomically

log = logging.getLogger("agent.dra.plugin")

CHECKPOINT_VERSION = 2
PREPARE_STARTED, PREPARE_COMPLETED = "PrepareStarted", "PrepareCompleted"
LEGACY_DYNAMIC_MIG = "dynamic-mig.json"
"""Where version 1 kept the MIG devices made for claims; folded into the checkpoint at start."""
CORRUPT_SUFFIX = ".corrupt"
MAX_CHECKPOINT_BYTES = 32 * 1024 * 1024
"""The largest checkpoint read: some 100,000 prepared devices."""


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
    lock: Path
    """The directory every agent of the node locks (a flock on the directory itself) around each prepare and
    unprepare: the plugin's own directory, where the checkpoint is."""

    @classmethod
    def under(cls, kubelet_root: Path, driver: str, cdi_dir: Path, pod_uid: str | None = None) -> Paths:
        """The paths of a driver's plugin. With `pod_uid` (a rolling update may run two agents on the node, each
        with its own sockets) the sockets carry the agent Pod's UID: `<driver>-<uid>-reg.sock` and
        `dra-<uid>.sock`, the names of Kubernetes' kubeletplugin helper with its RollingUpdate option; without,
        `<driver>-reg.sock` and `dra.sock`."""
        plugin_dir = kubelet_root / "plugins" / driver
        uid = f"-{pod_uid}" if pod_uid else ""
        return cls(kubelet_root / "plugins_registry" / f"{driver}{uid}-reg.sock", plugin_dir / f"dra{uid}.sock",
                   plugin_dir / "checkpoint.json", cdi_dir, plugin_dir)


@dataclass(frozen=True)
class Prepared:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


class ClaimError(Exception):
    """A claim cannot be prepared; the message says why in one line."""


class Damaged(ValueError):
    """The checkpoint cannot be used; the message says why."""


def checksum(claims: dict[str, Any]) -> str:
    """The checkpoint's checksum: SHA-256 of the claims as compact JSON with sorted keys."""
    text = json.dumps(claims, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _entry(namespace: str, name: str, state: str, devices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"namespace": namespace, "name": name, "state": state, "devices": devices or [], "mig": {}}


class ClaimStore:
    """The claims by UID, in memory and in the checkpoint file, with their CDI spec files."""

    def __init__(self, paths: Paths, driver: str) -> None:
        self._paths = paths
        self._driver = driver
        self.claims: dict[str, dict[str, Any]] = {}
        """By UID: namespace, name, state, devices (requests, pool, device, CDI ids) and mig (the MIG devices
        made for it, by device name)."""
        self._serial = SerialLock(paths.lock)
        self._seen: tuple[int, int, int] | None = None
        """The checkpoint file's identity (inode, mtime, size) when this store last read or wrote it."""
        self._load()

    @contextlib.asynccontextmanager
    async def serialized(self) -> AsyncIterator[None]:
        """Hold the node's prepare lock (a flock on `Paths.lock`, the plugin directory), shared with every agent on
        the node (two run during a rolling update), with the claims read again from the checkpoint."""
        async with self._serial.hold():
            self.refresh(always=True)
            yield

    def refresh(self, always: bool = False) -> None:
        """Read the checkpoint again: `always`, or where its file is not the one this store last read or wrote
        (another agent of the node wrote it since). One that cannot be read now leaves the claims as they are."""
        if not always and self._identity() == self._seen:
            return
        try:
            self.claims, _ = self._read(self._paths.checkpoint)
        except Damaged as err:
            log.error("%s; keeping the claims as this agent last knew them", err)
        self._seen = self._identity()

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._paths.checkpoint)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    @property
    def corrupt_copy(self) -> Path:
        return self._paths.checkpoint.with_name(self._paths.checkpoint.name + CORRUPT_SUFFIX)

    @property
    def legacy_dynamic(self) -> Path:
        return self._paths.checkpoint.with_name(LEGACY_DYNAMIC_MIG)

    @property
    def sweep_allowed(self) -> bool:
        """Whether the files and MIG devices no claim owns may be removed: not while a damaged checkpoint is
        kept aside (the claims it held are unknown, and their pods may still run)."""
        return not (self.corrupt_copy.exists()
                    or self.legacy_dynamic.with_name(LEGACY_DYNAMIC_MIG + CORRUPT_SUFFIX).exists())

    # --- reading and writing the file ---------------------------------------------------------------------

    def _load(self) -> None:
        path = self._paths.checkpoint
        try:
            self.claims, version = self._read(path)
        except Damaged as err:
            self._set_aside(path, str(err), "starting with no prepared claims")
            self.claims, version = {}, CHECKPOINT_VERSION
        migrated = version != CHECKPOINT_VERSION
        if migrated:
            log.info("migrated the DRA checkpoint %s from version %d to %d (%d claim(s))", path, version,
                     CHECKPOINT_VERSION, len(self.claims))
        folded = self._fold_legacy_dynamic()
        try:
            if migrated or folded:
                self.save()
            if folded:
                with contextlib.suppress(FileNotFoundError):
                    self.legacy_dynamic.unlink()
                sync_directory(path.parent)
        except OSError as err:
            raise ClaimError(f"cannot write the DRA checkpoint {path}: {err.strerror}") from None
        self._seen = self._identity()

    def _set_aside(self, path: Path, why: str, outcome: str) -> None:
        """Keep a damaged file as <name>.corrupt, saying so in one line."""
        kept = path.with_name(path.name + CORRUPT_SUFFIX)
        try:
            os.replace(path, kept)
        except OSError as err:
            raise ClaimError(f"{why}; cannot keep it as {kept}: {err.strerror}") from None
        log.error("%s: kept as %s; %s, and removing no CDI spec or MIG device at start while that file is there "
                  "(which claims own them is unknown)", why, kept, outcome)

    def _read(self, path: Path) -> tuple[dict[str, dict[str, Any]], int]:
        """The claims of the checkpoint at `path` in this version's shape, and the version it was written in;
        Damaged where it cannot be used."""
        what = f"the DRA checkpoint {path}"
        try:
            data = json.loads(read_text_file(path, MAX_CHECKPOINT_BYTES))
        except InputFileError as err:
            if err.reason == "no such file":
                return {}, CHECKPOINT_VERSION
            raise Damaged(f"cannot read {what}: {err.reason}") from None
        except ValueError as err:
            raise Damaged(f"cannot read {what}: not JSON ({err})") from None
        version = data.get("version") if isinstance(data, dict) else None
        claims = data.get("claims") if isinstance(data, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or not isinstance(claims, dict):
            raise Damaged(f"{what} is damaged: no version and claims")
        if version == 1:
            return {uid: _v1_claim(what, uid, entry) for uid, entry in claims.items()}, 1
        if version != CHECKPOINT_VERSION:
            raise Damaged(f"{what} is version {version}; this agent reads versions 1 and {CHECKPOINT_VERSION}")
        if data.get("checksum") != checksum(claims):
            raise Damaged(f"{what} is damaged: its checksum does not match its claims")
        for uid, entry in claims.items():
            if not (isinstance(entry, dict) and entry.get("state") in (PREPARE_STARTED, PREPARE_COMPLETED)
                    and isinstance(entry.get("devices"), list) and isinstance(entry.get("mig"), dict)):
                raise Damaged(f"{what} is damaged: claim {uid} has no state, devices and mig")
        return claims, CHECKPOINT_VERSION

    def _fold_legacy_dynamic(self) -> bool:
        """Fold version 1's dynamic-mig.json into the claims: each MIG device record goes to its claim (a claim
        the checkpoint does not have was being prepared: it is PrepareStarted). True when there was a file."""
        path = self.legacy_dynamic
        what = f"the dynamic MIG checkpoint {path}"
        try:
            data = json.loads(read_text_file(path, MAX_CHECKPOINT_BYTES))
            devices = data.get("devices") if isinstance(data, dict) and data.get("version") == 1 else None
            if not isinstance(devices, dict) or not all(isinstance(r, dict) and "/" in k for k, r in devices.items()):
                raise Damaged(f"{what} is not a version 1 dynamic MIG checkpoint")
        except InputFileError as err:
            if err.reason == "no such file":
                return False
            self._set_aside(path, f"cannot read {what}: {err.reason}", "its MIG devices are owned by no claim")
            return False
        except ValueError as err:
            self._set_aside(path, str(err) if isinstance(err, Damaged) else f"cannot read {what}: not JSON ({err})",
                            "its MIG devices are owned by no claim")
            return False
        for key, record in devices.items():
            uid, device = key.split("/", 1)
            self.claims.setdefault(uid, _entry("", "", PREPARE_STARTED))["mig"][device] = record
        log.info("folded %s into the DRA checkpoint %s (%d MIG device record(s))", path, self._paths.checkpoint,
                 len(devices))
        return True

    def save(self) -> None:
        write_atomically(self._paths.checkpoint, json.dumps(
            {"version": CHECKPOINT_VERSION, "checksum": checksum(self.claims), "claims": self.claims},
            sort_keys=True))
        self._seen = self._identity()

    # --- the claims ---------------------------------------------------------------------------------------

    def spec_path(self, uid: str) -> Path:
        return self._paths.cdi_dir / f"{self._spec_prefix}{uid}.json"

    @property
    def _spec_prefix(self) -> str:
        return f"{self._driver.replace('/', '_')}-claim-"

    def state(self, uid: str) -> str | None:
        entry = self.claims.get(uid)
        return None if entry is None else str(entry["state"])

    def get(self, uid: str) -> list[Prepared] | None:
        """The devices of claim `uid` once its prepare completed; None before."""
        entry = self.claims.get(uid)
        if entry is None or entry["state"] != PREPARE_COMPLETED:
            return None
        return [Prepared(tuple(d["requests"]), d["pool"], d["device"], tuple(d["cdi"])) for d in entry["devices"]]

    def started(self) -> list[str]:
        """The claims whose prepare was cut short (PrepareStarted)."""
        return [uid for uid, entry in self.claims.items() if entry["state"] == PREPARE_STARTED]

    def begin(self, uid: str, namespace: str, name: str, devices: list[Prepared]) -> None:
        """Record that claim `uid` is being prepared for `devices` (PrepareStarted), before any change."""
        entry = self.claims.setdefault(uid, _entry(namespace, name, PREPARE_STARTED))
        entry.update(namespace=namespace, name=name, state=PREPARE_STARTED, devices=[
            {"requests": list(d.request_names), "pool": d.pool, "device": d.device, "cdi": list(d.cdi_ids)}
            for d in devices])
        self.save()

    def complete(self, uid: str, devices: list[Prepared], spec: dict[str, Any]) -> None:
        """Write the claim's CDI spec, then record it PrepareCompleted with `devices`."""
        write_atomically(self.spec_path(uid), json.dumps(spec, indent=2) + "\n")
        entry = self.claims[uid]
        entry.update(state=PREPARE_COMPLETED, devices=[
            {"requests": list(d.request_names), "pool": d.pool, "device": d.device, "cdi": list(d.cdi_ids)}
            for d in devices])
        self.save()

    def put(self, uid: str, namespace: str, name: str, devices: list[Prepared], spec: dict[str, Any]) -> None:
        """Record claim `uid` prepared for `devices` with its CDI spec, as a prepare does it."""
        self.begin(uid, namespace, name, devices)
        self.complete(uid, devices, spec)

    def remove(self, uid: str) -> None:
        """The checkpoint forgets the claim before its CDI spec goes, so a spec gone means the claim is gone
        from the checkpoint too; a crash in between leaves only the spec, which the next start removes."""
        if self.claims.pop(uid, None) is not None:
            self.save()
        with contextlib.suppress(FileNotFoundError):
            self.spec_path(uid).unlink()

    def orphan_specs(self) -> list[Path]:
        """The CDI spec files of this driver that name no claim of the checkpoint, and the temporary files of
        writes a crash cut short."""
        try:
            names = sorted(os.listdir(self._paths.cdi_dir))
        except FileNotFoundError:
            return []
        prefix = self._spec_prefix
        found = []
        for name in names:
            if name.startswith(prefix) and name.endswith(".json"):
                if name[len(prefix):-len(".json")] not in self.claims:
                    found.append(self._paths.cdi_dir / name)
            elif name.startswith("." + prefix):
                found.append(self._paths.cdi_dir / name)
        return found

    # --- the MIG devices made for claims (dra.dynamicMig) -------------------------------------------------

    def mig_records(self) -> dict[str, dict[str, Any]]:
        """Every MIG device record, by "<claim uid>/<device>"."""
        return {f"{uid}/{device}": record for uid, entry in self.claims.items()
                for device, record in entry["mig"].items()}

    def set_mig(self, uid: str, device: str, record: dict[str, Any]) -> None:
        self.claims.setdefault(uid, _entry("", "", PREPARE_STARTED))["mig"][device] = record
        self.save()

    def drop_mig(self, uid: str, device: str) -> None:
        entry = self.claims.get(uid)
        if entry is not None and entry["mig"].pop(device, None) is not None:
            self.save()


def _v1_claim(what: str, uid: str, entry: Any) -> dict[str, Any]:
    """A version 1 claim (prepared, with its devices) in this version's shape."""
    if not isinstance(entry, dict) or not isinstance(entry.get("devices"), list):
        raise Damaged(f"{what} is damaged: claim {uid} has no devices")
    return _entry(str(entry.get("namespace", "")), str(entry.get("name", "")), PREPARE_COMPLETED,
                  list(entry["devices"]))
