"""The MIG controller: applies the layout the Node asks for, withdrawing the affected GPUs while it works.

It follows `mig_request` in NodeState (fed from the Node's nvidia.com/mig.config label) and publishes
`mig_status`: pending first, then success, failed or rebooting with the reason. Every path ends in one of
those; nothing stays pending while the agent runs.

Before anything is withdrawn or changed, a layout is refused when the node it would make cannot be served: a
resource the device plugin would advertise after it whose socket path the kubelet directory has no room for
(`unservable`). A disk that cannot keep the journal or the apply lock in mig.stateDir fails the apply as a disk
error naming the path, with nothing changed on the GPUs. A journal that cannot be read at start is named in one
line, and, with no label to follow, on the Node: the agent does not guess which layout it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from agent.checks import StartupError, check_sockets
from agent.dra.slices import plugin_resources
from agent.inventory import plan as resource_plan
from agent.locks import Held, mig_apply_lock
from agent.metrics import Metrics
from agent.mig.applier import ApplyResult, Journal, StateDirError, apply_layout, plan_layout
from agent.mig.layout import LayoutError, MigLayout, load_layouts
from agent.mig.planner import ModeChange, NodePlan, PlanError
from agent.nvml.backend import NvmlBackend
from agent.nvml.mig_ops import MigCallError, MigOps
from agent.nvml.records import MigDeviceInfo
from agent.nvmlthread import NvmlCall
from agent.podresources import CLAIM, DeviceHolder, PodResourcesUnavailable, holders
from agent.state import MigStatus, NodeState, StateBus
from agent.yamlfile import InputFileError, clip, one_line, printable

log = logging.getLogger(__name__)


BUSY_POLL_S = 2.0
RETRY_DELAYS_S = (30.0, 60.0, 120.0, 300.0, 600.0)
"""A layout that failed for a passing reason (pods holding the GPUs, an NVML error, another apply) is tried again
after these delays while the label stays; then only a new label value retries. An unknown layout or one the GPUs
cannot take is not retried."""
REBOOT_CHECK_S = 60.0
"""How often a layout waiting for a GPU reset (rebooting) checks whether the GPUs took their MIG mode."""
NO_MORE_TRIES = "no more tries until the label changes"
DYNAMIC_MIG = ("not applied: dra.dynamicMig is on, so DRA claims create and destroy this node's MIG devices; "
               "remove the nvidia.com/mig.config label or turn dra.dynamicMig off")


def dynamic_mig(state: NodeState) -> bool:
    """Whether DRA owns the MIG layout (dra.enabled and dra.dynamicMig): the label is refused."""
    return state.config.dra.enabled and state.config.dra.dynamic_mig


def _in_use(state: NodeState, busy: list[DeviceHolder], waited: str) -> str:
    """Why the layout must wait: the GPUs that pods actually hold (a MIG device or a shared replica counts for
    its GPU), and each of those pods once."""
    gpu_of = {g.uuid: g.index for g in state.inventory.gpus}
    gpu_of.update({m.uuid: m.parent_index for m in state.inventory.mig_devices})
    held = sorted({gpu_of[base] for h in busy if (base := h.device_id.split("::", 1)[0]) in gpu_of})
    pods = ", ".join(dict.fromkeys(f"ResourceClaim {h.namespace}/{h.pod}" if h.resource == CLAIM
                                   else f"{h.namespace}/{h.pod}" for h in busy))
    which = f"GPU {held[0]} is" if len(held) == 1 else f"GPUs {', '.join(map(str, held))} are"
    return f"{which} in use{waited} by {pods}"


def after_layout(state: NodeState, plan: NodePlan) -> NodeState:
    """The node as `plan` leaves it, to plan the resources it will advertise (agent.inventory.plan, the one place
    resource names are made): each GPU the layout selects with its MIG mode and one MIG device per GPU instance
    of its target (the apply gives each GPU instance one compute instance spanning it), the other GPUs and their
    MIG devices as they are; no GPU draining."""
    planned = {p.index: p for p in plan.gpus}
    gpus = []
    devices = [m for m in state.inventory.mig_devices if m.parent_index not in planned]
    for gpu in state.inventory.gpus:
        gpu_plan = planned.get(gpu.index)
        if gpu_plan is None:
            gpus.append(gpu)
            continue
        enabled = gpu.mig_enabled if gpu_plan.mode is ModeChange.NONE else gpu_plan.mode is ModeChange.ENABLE
        gpus.append(dataclasses.replace(gpu, mig_enabled=enabled, mig_pending=False))
        if enabled:
            devices += [MigDeviceInfo(f"MIG-planned-{gpu.index}-{i.start}", gpu.index, i.start, 0, i.profile, 0,
                                      i.start, i.size) for i in gpu_plan.target]
    devices.sort(key=lambda m: (m.parent_index, m.placement_start))
    inventory = dataclasses.replace(state.inventory, gpus=tuple(gpus), mig_devices=tuple(devices))
    return dataclasses.replace(state, inventory=inventory, draining=frozenset())


def unservable(state: NodeState, plan: NodePlan, kubelet_dir: Path) -> str | None:
    """Why the device plugin could not serve the node `plan` makes, or None: a resource it would advertise (under
    the config's migStrategy, resource patterns and sharing) whose socket path the kubelet directory leaves no
    room for (agent.checks.check_sockets, as start and reload check the node as it is). Only what the device
    plugin serves counts (agent.dra.slices.plugin_resources): in DRA mode whole GPUs are the DRA driver's."""
    resources = resource_plan(after_layout(state, plan)).resources
    dra = state.config.dra
    try:
        check_sockets(kubelet_dir, sorted(plugin_resources(resources, dra.enabled or state.handover,
                                                            dra.dynamic_mig)))
    except StartupError as err:
        return (f"layout {plan.layout!r} cannot be served: {err}; nothing was changed on the GPUs")
    return None


class MigController:
    def __init__(self, backend: NvmlBackend, bus: StateBus, nvml: NvmlCall, metrics: Metrics | None = None,
                 claimed: Callable[[], list[DeviceHolder]] = list, kubelet_dir: Path | None = None) -> None:
        self._metrics = metrics
        self._kubelet_dir = kubelet_dir
        """The device plugin's directory (--kubelet-dir): a layout whose resources' sockets would not fit in it is
        refused (`unservable`); None: not checked."""
        self._claimed = claimed
        """In DRA mode the devices of the claims the kubelet plugin has prepared (the PodResources API lists only
        the device plugin's)."""
        self._started = 0.0
        self._settled = False
        """The last failure cannot pass by trying again (an unknown layout, one the GPUs cannot take)."""
        self._backend = backend
        self._ops = MigOps(backend)
        self._bus = bus
        self._nvml = nvml

    async def _finish(self, result: ApplyResult, draining: frozenset[str] = frozenset()) -> None:
        """Publish the outcome, the inventory read anew and the GPUs drained for the apply given back."""
        try:
            inventory = await self._nvml(self._backend.inventory)
        except Exception as err:  # the driver itself fails: the outcome is published all the same
            log.warning("MIG layout %s: cannot read the inventory after the apply: %s", clip(result.layout), err)
            inventory = self._bus.current.inventory
        kind = {"success": "mig-success", "failed": "mig-failed", "rebooting": "mig-rebooting"}[result.outcome]
        log.log(logging.INFO if result.outcome == "success" else logging.ERROR, "MIG layout %s: %s: %s",
                clip(result.layout), result.outcome, result.reason)
        if self._metrics:
            self._metrics.mig_reconfigurations.labels(outcome=result.outcome).inc()
            self._metrics.mig_seconds.observe(asyncio.get_running_loop().time() - self._started)
        await self._bus.record(
            [("", kind, f"MIG layout {result.layout}: {result.outcome}: {result.reason}")],
            inventory=inventory,
            draining=self._bus.current.draining - draining,
            mig_status=MigStatus(result.layout, result.outcome, result.reason),
        )

    def _layout(self, state: NodeState, name: str) -> MigLayout:
        return load_layouts(state.config.mig.layouts_file).layout(name)

    async def _wait_for_pods(self, state: NodeState, plan: NodePlan, *, say_unchecked: bool = True) -> str | None:
        """None once no pod holds a device of the GPUs to change; otherwise why the apply must not go on.
        `say_unchecked`: warn when there is no PodResources socket to ask."""
        settings = state.config.mig
        changing = {p.index for p in plan.gpus if not p.noop}
        gpus = [g for g in state.inventory.gpus if g.index in changing]
        ids = {g.uuid for g in gpus} | {m.uuid for m in state.inventory.mig_devices if m.parent_index in changing}
        ask_kubelet = settings.pod_resources_socket.exists()
        if not ask_kubelet and say_unchecked:
            log.warning("no kubelet PodResources socket at %s: not checking for pods on the GPUs",
                        settings.pod_resources_socket)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (settings.busy_wait_seconds if settings.busy_policy == "wait" else 0)
        while True:
            busy = [h for h in self._claimed() if h.device_id in ids]
            try:
                if ask_kubelet:
                    busy += await holders(settings.pod_resources_socket, ids)
            except PodResourcesUnavailable as err:
                return f"cannot check which pods use the GPUs: {err}"
            if not busy:
                return None
            if loop.time() >= deadline:
                waited = f" after waiting {settings.busy_wait_seconds:g}s" if settings.busy_policy == "wait" else ""
                return _in_use(state, busy, waited)
            await asyncio.sleep(BUSY_POLL_S)

    async def apply(self, name: str) -> MigStatus:
        state = self._bus.current
        self._settled = False
        log.info("MIG layout %s requested", clip(name))
        self._started = asyncio.get_running_loop().time()
        await self._bus.update(mig_status=MigStatus(name, "pending"))
        gpus = len(state.inventory.gpus)
        try:
            layout = self._layout(state, name)
            plan = await self._nvml(lambda: plan_layout(self._ops, gpus, layout), what="planning the MIG layout")
        except (LayoutError, OSError, PlanError) as err:
            reason = one_line(str(err))
            self._settled = True  # the layouts file or the GPUs rule it out: trying again changes nothing
            await self._finish(ApplyResult(name, "failed", reason))
            return self._status()
        except MigCallError as err:  # a GPU NVML cannot read (lost): tried again with the usual backoff
            await self._finish(ApplyResult(name, "failed", f"cannot plan the layout: {one_line(str(err))}"))
            return self._status()
        if self._kubelet_dir is not None:
            why = unservable(self._bus.current, plan, self._kubelet_dir)
            if why is not None:
                self._settled = True  # trying again changes nothing: another layout or kubelet directory does
                await self._finish(ApplyResult(name, "failed", why))
                return self._status()
        changing = frozenset(g.uuid for g in state.inventory.gpus
                             if any(p.index == g.index and not p.noop for p in plan.gpus))
        if changing:
            fail_at_once = state.config.mig.busy_policy == "fail"
            if fail_at_once:
                # Pods that hold the GPUs fail the layout before anything is withdrawn: the kubelet (and the Node's
                # Allocatable) keep the devices of the running pods through this try and each retry.
                why = await self._wait_for_pods(self._bus.current, plan)
                if why is not None:
                    await self._finish(ApplyResult(name, "failed", why))
                    return self._status()
            # Withdraw the GPUs' devices, then look for pods (again): from now on the kubelet places none on them,
            # and one it placed before is seen.
            await self._bus.update(draining=self._bus.current.draining | changing)
            why = await self._wait_for_pods(self._bus.current, plan, say_unchecked=not fail_at_once)
            if why is not None:
                await self._finish(ApplyResult(name, "failed", why), changing)
                return self._status()
        state_dir = state.config.mig.state_dir
        journal = Journal(state_dir)

        def locked_apply() -> ApplyResult:
            with contextlib.ExitStack() as stack:
                try:
                    stack.enter_context(mig_apply_lock(state_dir))
                except OSError as err:  # the directory cannot be made or opened: the disk, not NVML
                    return ApplyResult(name, "failed", f"{StateDirError('use the directory', state_dir, err)}; "
                                                       "nothing was changed on the GPUs")
                return apply_layout(self._ops, gpus, layout, journal, step=log.info)

        try:
            result = await self._nvml(locked_apply, what=f"the MIG apply of {clip(name)}",
                                      deadline_s=state.config.mig.nvml_deadline_seconds)
        except Held as err:  # someone runs `gpu-agent mig apply` on this node
            result = ApplyResult(name, "failed", str(err))
        except Exception as err:  # an NVML error mid-apply: report it; the next apply converges from there
            log.exception("MIG apply of %s failed", name)
            result = ApplyResult(name, "failed", f"NVML error during apply: {err}")
        await self._finish(result, changing)
        return self._status()

    def _status(self) -> MigStatus:
        status = self._bus.current.mig_status
        assert status is not None
        return status

    async def run(self) -> None:
        """Apply each new request; at start, finish an apply a crash interrupted when no request names one."""
        state = self._bus.current
        handled: str | None = None
        if dynamic_mig(state):
            log.info("dra.dynamicMig is on: the MIG manager applies no nvidia.com/mig.config label on this node")
        try:
            interrupted = Journal(state.config.mig.state_dir).pending()
        except InputFileError as err:
            interrupted = None
            await self._unreadable_journal(state, err)
        if interrupted is not None and state.mig_request is None and not dynamic_mig(state):
            log.warning("finishing the interrupted MIG apply of %s", interrupted)
            await self.apply(interrupted)
        retries = 0
        while True:
            state = self._bus.current
            if state.mig_request is not None and state.mig_request != handled:
                handled, retries = state.mig_request, 0
                if dynamic_mig(state):
                    self._settled = True
                    log.error("MIG layout %s: %s", clip(handled), DYNAMIC_MIG)
                    await self._bus.update(mig_status=MigStatus(handled, "failed", DYNAMIC_MIG))
                    continue
                await self.apply(handled)
                continue
            status = state.mig_status
            if status is None or status.layout != handled or status.state not in ("failed", "rebooting"):
                await self._bus.wait_newer(state.version)
                continue
            if status.state == "rebooting":
                if await self._waits_for_reset(handled):
                    continue  # the label changed meanwhile
                log.info("MIG layout %s: a GPU took its pending MIG mode; applying again", clip(status.layout))
            else:
                if self._settled:
                    await self._bus.wait_newer(state.version)
                    continue
                if retries >= len(RETRY_DELAYS_S):
                    if not status.reason.endswith(NO_MORE_TRIES):
                        await self._say(status, NO_MORE_TRIES)
                    await self._bus.wait_newer(self._bus.current.version)
                    continue
                delay = RETRY_DELAYS_S[retries]
                await self._say(status, f"next try in {delay:g}s (retry {retries + 1} of {len(RETRY_DELAYS_S)})")
                try:
                    async with asyncio.timeout(delay):
                        await self._request_changes(handled)
                    continue  # the label changed (or went): that request wins
                except TimeoutError:
                    pass
                retries += 1
                log.warning("MIG layout %s failed; trying again (retry %d of %d)", clip(status.layout), retries,
                            len(RETRY_DELAYS_S))
            if self._metrics:
                self._metrics.mig_retries.labels(outcome=status.state).inc()
            await self.apply(status.layout)

    async def _unreadable_journal(self, state: NodeState, err: InputFileError) -> None:
        """A journal that cannot be read says an apply may have been interrupted, not which layout: one line names
        the file and what is wrong. A label the agent follows applies its layout (planned from the hardware, it
        finishes whatever was left, and its journal replaces the file); with none, the Node says so (state
        `failed`, the reason, a MigConfigFailed Event) and the GPUs stay as they are: the agent does not guess."""
        journal = f"the MIG journal {printable(str(err.path))} cannot be read ({err.reason})"
        if dynamic_mig(state):
            log.warning("%s; ignored: dra.dynamicMig is on, so DRA claims make this node's MIG devices", journal)
            return
        if state.mig_request is not None:
            log.warning("%s; applying the labelled layout %s, which replaces it", journal, clip(state.mig_request))
            return
        reason = (f"{journal}: a MIG apply may have been interrupted, and which layout it was applying is unknown; "
                  "nothing was changed on the GPUs. Set the nvidia.com/mig.config label to the layout the GPUs "
                  "should have (its apply finishes from what the GPUs have and replaces the file), or remove the file")
        log.error("%s", reason)
        await self._bus.record([("", "mig-failed", reason)], mig_status=MigStatus("", "failed", reason))

    async def _say(self, status: MigStatus, note: str) -> None:
        await self._bus.update(mig_status=MigStatus(status.layout, status.state, f"{status.reason}; {note}"))

    async def _waits_for_reset(self, handled: str | None) -> bool:
        """Wait until a GPU with a pending MIG mode has taken it (a GPU reset or a reboot); True when the label
        changed first."""
        while True:
            try:
                async with asyncio.timeout(REBOOT_CHECK_S):
                    await self._request_changes(handled)
                return True
            except TimeoutError:
                pass
            inventory = await self._nvml(self._backend.inventory)
            if not any(g.mig_pending for g in inventory.gpus):
                return False

    async def _request_changes(self, handled: str | None) -> None:
        version = self._bus.current.version
        while True:
            state = await self._bus.wait_newer(version)
            if state.mig_request != handled:
                return
            version = state.version
