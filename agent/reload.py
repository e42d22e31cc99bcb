"""Config reload: on SIGHUP, when the config file changes (a ConfigMap update swaps the mounted file), and when
the node label names another config, `ConfigReload` loads the config again, applies exactly the checks start
applies (checks.py) and publishes a good one as the next NodeState, with a ConfigApplied Event; a bad one is
refused with a ConfigRejected Event and the last good config keeps serving."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.checks import (
    StartupError,
    check_dra_sockets,
    check_on_node,
    check_paths,
    machine_type,
    start_only_changes,
)
from agent.config import (
    ConfigError,
    DraSettings,
    EmptyConfigFile,
    beside_kubelet,
    config_file,
    load_config,
    with_health_env,
)
from agent.deviceplugin.response import NodeFiles
from agent.metrics import Metrics
from agent.state import StateBus

if TYPE_CHECKING:
    from agent.daemon import AgentOptions

log = logging.getLogger("agent.daemon")
"""The agent's own lines keep the logger name they have always had (the operations guide and log filters use it)."""

CONFIG_POLL_S = 2.0


class ConfigReload:
    """Reloads the running agent's config; made by the Agent, which runs `follow` as its config-reload task."""

    def __init__(self, options: AgentOptions, bus: StateBus, files: NodeFiles, metrics: Metrics,
                 hangup: asyncio.Event, dra_made: Callable[[], DraSettings | None] = lambda: None) -> None:
        self.options = options
        self.dra_made = dra_made
        """The DRA settings the agent's DRA parts were made with; None before they are made."""
        self.bus = bus
        self.files = files
        """The device nodes and files the node has (read once at start)."""
        self.metrics = metrics
        self.hangup = hangup
        """Set by SIGHUP: reload the config file."""

    async def reload(self) -> bool:
        """Load the config again (the file, or the named config the node label asks for); a bad one is
        rejected with its reasons and the last good one keeps serving."""
        path = self.options.config_path
        if path is None:
            raise ValueError("the agent was started without a config file to reload")
        name = self.bus.current.config_request
        empty: EmptyConfigFile | None = None
        try:
            try:
                # Read and parsed on a thread: a file of up to 64 KiB of YAML costs the event loop nothing.
                loaded = await asyncio.to_thread(load_config, path, name, empty_is_defaults=False)
            except EmptyConfigFile as err:
                empty, loaded = err, err.config
            new, _ = with_health_env(beside_kubelet(loaded, self.options.kubelet_dir), os.environ)
        except ConfigError as err:
            return await self._reject(str(err))
        if new == self.bus.current.config:
            return True  # an empty file too, where the defaults are in force (an agent started on that file)
        if empty is not None:  # a failed or cut-short write, not the defaults: see EmptyConfigFile
            return await self._reject(str(empty))
        # Exactly the checks start applies (and the parts only a restart can change), with the same lines.
        try:
            check_paths(new)
            warnings = check_on_node(new, self.bus.current, self.options.kubelet_dir, self.files)
        except StartupError as err:
            return await self._reject(str(err).replace("\n", "; "))
        except ConfigError as err:
            return await self._reject("\n".join(f"{path}: {line}" for line in str(err).splitlines()))
        if (start_only := start_only_changes(self.dra_made(), new)) is not None:
            return await self._reject(f"{path}: {start_only}")
        if new.dra.enabled and self.dra_made() is None:  # a first switch to DRA mode: its sockets as start checks them
            try:
                check_dra_sockets(self.options.kubelet_dir.parent, new.dra.driver_name)
            except StartupError as err:
                return await self._reject(str(err))
        if new.health.taint != self.bus.current.config.health.taint:
            from agent.kube.selfpod import check_reloaded

            if (untolerated := await check_reloaded(self.options.kube, new.health.taint)) is not None:
                return await self._reject(untolerated)
        for line in [*warnings, *new.without_effect]:
            log.warning("%s", line)
        self.metrics.config_in_force(new.without_effect)
        source = f"{path} ({name})" if name else str(path)
        events = [("", "config-applied", f"config reloaded from {source}")]
        switched = new.dra.enabled != self.bus.current.config.dra.enabled
        if switched:  # the handover reads what pods hold before either mode offers a whole GPU again
            mode = "DRA mode" if new.dra.enabled else "device-plugin mode"
            events.append(("", "mode-switched", f"switching to {mode} with the pods on the GPUs kept"))
            log.info("switching to %s: the pods on the GPUs keep them, and what they hold stays out of the new "
                     "mode until released", mode)
        await self.bus.record(events, config=new, machine=machine_type(new.flags.gfd.machine_type_file),
                              handover=switched or self.bus.current.handover)
        log.info("config reloaded from %s", source)
        return True

    async def _reject(self, why: str) -> bool:
        """A reloaded config refused: said in the log and as a ConfigRejected Event; the last good one serves."""
        log.error("config reload rejected; keeping the last good config: %s", why)
        await self.bus.record([("", "config-rejected", f"config reload rejected: {why}")])
        return False

    async def follow(self) -> None:
        """Reload on SIGHUP, when the file changes (a ConfigMap update swaps the mounted file), and when the
        node label names another config."""
        path = self.options.config_path
        if path is None:
            return
        bus = self.bus

        def identity() -> tuple[object, ...] | None:
            try:
                st = config_file(path, bus.current.config_request).stat()
            except (OSError, ConfigError):
                return None
            return (st.st_ino, st.st_mtime_ns, st.st_size)

        # Not the file's identity now: the config in force was read before this task started, and a change in
        # between must not go unseen. The first look reads the file again (an unchanged config changes nothing).
        seen: tuple[object, ...] | None = None
        requested = bus.current.config_request
        while True:
            version = bus.current.version
            hangup = asyncio.ensure_future(self.hangup.wait())
            newer = asyncio.ensure_future(bus.wait_newer(version))
            try:
                await asyncio.wait({hangup, newer}, timeout=CONFIG_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                hangup.cancel()
                newer.cancel()
            now = identity()
            relabelled = bus.current.config_request != requested
            if self.hangup.is_set() or relabelled or (now != seen and now is not None):
                self.hangup.clear()
                seen, requested = now, bus.current.config_request
                await self.reload()
