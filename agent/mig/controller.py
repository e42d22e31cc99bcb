"""The MIG controller: applies the layout the Node asks for, withdrawing the affected GPUs while it works.

It follows `mig_request` in NodeState (fed from the Node's nvidia.com/mig.config label) and publishes
`mig_status`: pending first, then success, failed or rebooting with the reason. Every path ends in one of
those; nothing stays pending while the agent runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agent.locks import Held, mig_apply_lock
from agent.metrics import Metrics
from agent.mig.applier import ApplyResult, Journal, apply_layout, plan_layout
from agent.mig.layout import LayoutError, MigLayout, load_layouts
from agent.mig.planner import NodePlan, PlanError
from agent.nvml.backend import NvmlBackend
from agent.nvml.mig_ops import MigCallError, MigOps
from agent.nvmlthread import NvmlCall
from agent.podresources import CLAIM, DeviceHolder, PodResourcesUnavailable, holders
from agent.state import MigStatus, NodeState, StateBus
from agent.yamlfile import clip, one_line

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


class MigController:
    def __init__(self, backend: NvmlBackend, bus: StateBus, nvml: NvmlCall, metrics: Metrics | None = None,
                 claimed: Callable[[], list[DeviceHolder]] = list) -> None:
        self._metrics = metrics
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
        journal = Journal(state.config.mig.state_dir)

        def locked_apply() -> ApplyResult:
            with mig_apply_lock(state.config.mig.state_dir):
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
        interrupted = Journal(state.config.mig.state_dir).pending()
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
