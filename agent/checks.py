"""What start and every config reload check of the config against the node before anything is used: the
config's paths (a MIG layouts file, the MIG state directory, the PodResources socket), the socket paths the
kubelet directory leaves room for (the device plugin's; at start the DRA plugin's too), what only the node shows
(sharing conflicts, the IMEX channel), and the settings only a restart can change; a failure is a `StartupError`
or a `ConfigError` whose message is one line naming what to change. Also the machine type (the DMI product
name) that start and reload read for the labels."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from agent.config import AgentConfig, ConfigError, DraSettings
from agent.deviceplugin.response import IMEX_CHANNEL, NodeFiles
from agent.inventory import plan, sharing_conflicts
from agent.mig.layout import LayoutError, load_layouts
from agent.podresources import SocketPathError, check_socket
from agent.state import NodeState
from agent.yamlfile import InputFileError, read_text_file

log = logging.getLogger("agent.daemon")
"""The agent's own lines keep the logger name they have always had (the operations guide and log filters use it)."""


class StartupError(RuntimeError):
    """The agent cannot start as configured; the message is one line naming what to change."""


SOCKET_PATH_MAX = 107
"""AF_UNIX socket paths hold at most 107 bytes (sun_path is 108 with the terminating NUL)."""


def socket_name_length(resource: str) -> int:
    """The longest name the agent gives the device-plugin socket of a resource (gpu-agent-<resource>-<instance>-
    <serial>.sock, agent/deviceplugin/server.py `socket_name`), with room for a million serves in one process."""
    return len(f"gpu-agent-{resource.replace('/', '_').replace('.', '-')}-0123abcd-999999.sock")


def check_sockets(kubelet_dir: Path, resources: Iterable[str]) -> None:
    """Refuse a kubelet directory whose path leaves no room for the kubelet's socket or the agent's."""
    room = SOCKET_PATH_MAX - len(str(kubelet_dir)) - 1
    needs = {"the kubelet's socket": len("kubelet.sock"), **{f"{r}'s socket": socket_name_length(r) for r in resources}}
    name, need = max(needs.items(), key=lambda item: item[1])
    if need > room:
        raise StartupError(f"kubelet directory {kubelet_dir} is {len(str(kubelet_dir))} bytes long: a socket path "
                           f"holds at most {SOCKET_PATH_MAX} bytes, which leaves {max(room, 0)} for the name of "
                           f"{name}, and it needs {need} (use a shorter --kubelet-dir)")


POD_UID_LENGTH = 36
"""The length of a Pod UID (POD_UID: letters, digits and dashes, at most 36), which the DRA sockets carry in their
names while a rolling update runs two agents on the node (agent/dra/claims.py, `Paths.under`)."""


SHORTEST_DRA_DRIVER_NAME = len("a.b")
"""A DRA driver name is a DNS subdomain with at least one dot (agent/config.py, DRA_DRIVER_NAME)."""


def _dra_socket_lengths(kubelet_root: Path, driver: str) -> list[tuple[int, str]]:
    """The DRA sockets of `driver` under `kubelet_root` with a Pod UID in their names: (length in bytes, the path
    with `<pod-uid>` where the UID goes), longest first."""
    from agent.dra.claims import Paths

    uid = "0" * POD_UID_LENGTH
    paths = Paths.under(kubelet_root, driver, Path("/"), uid)
    found = [(len(os.fsencode(socket)), str(socket).replace(uid, "<pod-uid>"))
             for socket in (paths.registration, paths.endpoint)]
    return sorted(found, reverse=True)


def longest_dra_driver_name(kubelet_root: Path) -> int:
    """The longest dra.driverName whose DRA sockets fit under `kubelet_root` (the kubelet directory's parent) with
    the agent Pod's UID in their names: 27 under /var/lib/kubelet, where the registration socket
    `plugins_registry/<driver>-<pod-uid>-reg.sock` is the longer. Zero or less where none fits. The name appears
    once in each socket's path, so each byte of it is a byte of the path."""
    (longest, _), _ = _dra_socket_lengths(kubelet_root, "x")
    return SOCKET_PATH_MAX - (longest - 1)


def check_dra_sockets(kubelet_root: Path, driver: str) -> None:
    """Refuse a dra.driverName whose DRA sockets (the registration socket and the DRA service's) cannot exist under
    `kubelet_root`: with the agent Pod's UID in their names, whether or not this agent has one, since the next
    rolling update gives it one. The one place start (agent/daemon.py) and reload (agent/reload.py) check it."""
    fits = longest_dra_driver_name(kubelet_root)
    if len(driver) <= fits:
        return
    (length, socket), _ = _dra_socket_lengths(kubelet_root, driver)
    if fits >= SHORTEST_DRA_DRIVER_NAME:
        room = f"at most {fits} fit"
        change = f"a dra.driverName of at most {fits} characters, or a shorter kubelet directory"
    else:
        room, change = "no DRA driver name fits", "a shorter kubelet directory"
    raise StartupError(f"dra.driverName {driver} is {len(driver)} characters, and {room} under {kubelet_root}: with "
                       f"the agent Pod's UID in its name (as in a rolling update), its socket {socket} would be "
                       f"{length} bytes long, and a socket path holds at most {SOCKET_PATH_MAX} (use {change})")


def check_paths(config: AgentConfig) -> None:
    """Refuse, before anything starts, the config's paths that would fail only later: a MIG layouts file that
    cannot be used, a MIG state directory that cannot be written, a PodResources socket path that cannot be the
    kubelet's (one not there yet is a warning)."""
    mig = config.mig
    try:
        warning = check_socket(mig.pod_resources_socket, configured="pod_resources_socket" in mig.model_fields_set)
    except SocketPathError as err:
        raise StartupError(str(err)) from None
    if mig.layouts_file is not None:
        try:
            load_layouts(mig.layouts_file)
        except LayoutError as err:
            raise StartupError(f"mig.layoutsFile: {err}".replace("\n", "; ")) from None
    # Without touching anything: the directory, or the nearest directory above it that exists (where the
    # journal's directory would be made on the first apply), must be a directory the agent can write.
    existing = mig.state_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StartupError(f"mig.stateDir {mig.state_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StartupError(f"mig.stateDir {mig.state_dir}: {existing} is not writable")
    if warning is not None:
        logging.getLogger("agent.podresources").warning("%s", warning)


def check_on_node(config: AgentConfig, state: NodeState, kubelet_dir: Path, files: NodeFiles) -> list[str]:
    """Refuse a config that only the node shows cannot work: a device selected by two sharing entries, a resource
    name too long for its socket path in the kubelet directory, imex.required without the IMEX channel. The
    same checks at start and at every reload. Returns the warnings to log."""
    conflicts = sharing_conflicts(state, config)
    if conflicts:
        raise ConfigError("\n".join(conflicts))
    check_sockets(kubelet_dir, plan(dataclasses.replace(state, config=config)).resources)
    if config.imex.channel_ids and not files.imex_channel:
        if config.imex.required:
            raise ConfigError(f"imex.required is true but the IMEX channel {IMEX_CHANNEL} does not exist")
        return [f"imex.channelIDs asks for channel 0, but {IMEX_CHANNEL} does not exist; no channel is added"]
    return []


def start_only_changes(made: DraSettings | None, new: AgentConfig) -> str | None:
    """Why `new` cannot replace the config in force in a running agent, or None. `dra.enabled` switches the
    node's mode while it runs (agent/handover.py). The rest of the DRA section (the driver's name, its CDI
    directory, dynamic MIG, shares by capacity) makes the DRA parts, which the agent makes once: at start in
    DRA mode or at the first switch to it; `made` is what they were made with, None before. Once made, that
    part of the section changes only with a restart."""
    if made is None or not new.dra.enabled:
        return None
    changed = [f"dra.{field.alias or name}" for name, field in type(new.dra).model_fields.items()
               if name != "enabled" and getattr(new.dra, name) != getattr(made, name)]
    if not changed:
        return None
    return (f"{', '.join(changed)} cannot change while the agent runs (its DRA driver was made with the value in "
            "force); restart the agent to apply it")


DEFAULT_MACHINE_TYPE_FILE = Path("/sys/class/dmi/id/product_name")
MACHINE_TYPE_MAX_BYTES = 4096
"""A DMI product name is a short line; a larger file is not a machine type."""


def machine_type(path: Path) -> str:
    """The machine type as GPU feature discovery reads it (flags.gfd.machineTypeFile, by default the DMI product
    name); "unknown" when the file cannot be read."""
    try:
        # The bounded reader of every input file: a FIFO or device there is refused, never waited on.
        text = read_text_file(path, MACHINE_TYPE_MAX_BYTES).strip()
    except InputFileError as err:
        # Machines without DMI (some VMs) have no product name: only a file someone configured is worth a warning.
        level = logging.INFO if path == DEFAULT_MACHINE_TYPE_FILE else logging.WARNING
        log.log(level, "cannot read the machine type from %s: %s; nvidia.com/gpu.machine is unknown", path,
                err.reason)
        return "unknown"
    return text or "unknown"
