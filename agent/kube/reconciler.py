"""Makes the agent's own parts of its Node (labels, one taint, one condition) match the newest NodeState,
writing only what differs, and turns health incidents into Events."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.cordon import CORDON_ANNOTATION, CORDON_STATE_ANNOTATION, cordon_report
from agent.health.policy import NVML_UNRESPONSIVE
from agent.kube.usage import ApiCounts, Backoff
from agent.kube.view import Condition, NodeView, describe_error, is_conflict, is_expired
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.5
"""The first retry of a failed write waits 0.5 to 1 s; later ones back off (agent/kube/client.py Backoff)."""
WATCH_LIVED_S = 30.0
"""A watch that ends sooner than this (the server closed it at once, or it failed) counts as a failure."""
CONDITION_TYPE = "GPUHealthy"
EVENT_REASONS = {
    "fault": "GPUFault",
    "warning": "GPUWarning",
    "recovered": "GPURecovered",
    "config-rejected": "ConfigRejected",
    "config-applied": "ConfigApplied",
    "mode-switched": "ModeSwitched",
    "resources-withheld": "ResourcesWithheld",
    "sharing-selector-unmatched": "SharingSelectorUnmatched",
    "mig-success": "MigConfigApplied",
    "mig-failed": "MigConfigFailed",
    "mig-rebooting": "MigConfigRebooting",
    "cordoned": "GPUCordoned",
    "uncordoned": "GPUUncordoned",
    "cordon-refused": "GPUCordonRefused",
    "cordon-held": "CordonedGPUInUse",
    "cordon-free": "CordonedGPUFree",
}
LABEL_DROPPED_REASON = "LabelDropped"
OWN_TAINT_PREFIX = "gpu-node-agent.io/"
EVENT_MESSAGE_MAX = 1024
"""Event messages are kept to what `kubectl describe` shows in full (events.k8s.io caps a note at 1 kB)."""
NORMAL_INCIDENTS = frozenset({"recovered", "config-applied", "mode-switched", "mig-success", "cordoned", "uncordoned",
                              "cordon-held", "cordon-free"})
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
MIG_REASON_ANNOTATION = "nvidia.com/mig.config.state.reason"


def owned_annotation(key: str) -> bool:
    """The annotations the agent keeps (and removes when it no longer wants them): never the operator's cordon."""
    return key == MIG_REASON_ANNOTATION or (key.startswith("gpu-node-agent.io/") and key != CORDON_ANNOTATION)


class NodeClient(Protocol):
    """What the reconciler needs of the API server: the agent's own Node only."""

    async def get(self) -> NodeView: ...
    async def list(self) -> tuple[NodeView, str]: ...
    def watch(self, resource_version: str) -> AsyncIterator[NodeView | str]: ...
    async def patch_metadata(
        self, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]
    ) -> NodeView: ...
    async def set_taints(self, taints: Sequence[Mapping[str, str]], resource_version: str) -> NodeView: ...
    async def set_condition(self, condition: Condition) -> NodeView: ...
    async def event(self, reason: str, message: str, kind: str = "Normal", uid: str = "") -> None: ...
    def start_now(self) -> None: ...


@dataclass(frozen=True)
class NodeIntent:
    """What the agent wants its own parts of the Node to be."""

    labels: dict[str, str]
    taint: dict[str, str] | None
    condition: Condition
    annotations: dict[str, str]
    dropped: tuple[str, ...] = ()
    """One line per label the API server would refuse, left out of `labels` so that it blocks nothing else."""
    taint_key: str = ""
    """The key of the agent's taint under the config (health.taint.key), whether it is wanted now or not."""

    def owns_taint(self, key: str) -> bool:
        """The agent's taints: the configured key, and any in the agent's own namespace (a key used before a
        config change)."""
        return key == self.taint_key or key.startswith(OWN_TAINT_PREFIX)


_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_LABEL_NAME_RE = re.compile(_NAME)
_DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE_MAX = 63
QUOTE_MAX = 80


def _quoted(text: str) -> str:
    """A value for a message, cut before it is quoted: a label value can be any length."""
    return repr(text) if len(text) <= QUOTE_MAX else f"{text[:QUOTE_MAX]!r}... ({len(text)} characters)"


def label_problem(key: str, value: str) -> str | None:
    """Why the API server would refuse the label `key=value` (Kubernetes' label syntax), or None when it is
    valid: a key is an optional DNS-subdomain prefix of at most 253 characters and a name of at most 63; a
    value is empty or at most 63 characters of [A-Za-z0-9-_.] beginning and ending with a letter or digit."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not (len(prefix) <= 253 and _DNS_SUBDOMAIN_RE.fullmatch(prefix)):
        return f"the key {_quoted(key)} has an invalid prefix"
    if not (len(name) <= LABEL_VALUE_MAX and _LABEL_NAME_RE.fullmatch(name)):
        return f"the key {_quoted(key)} is not a valid label name"
    if value and not (len(value) <= LABEL_VALUE_MAX and _LABEL_NAME_RE.fullmatch(value)):
        return (f"the value {_quoted(value)} is not a valid label value (at most {LABEL_VALUE_MAX} characters of "
                "A-Z, a-z, 0-9, '-', '_' and '.', beginning and ending with a letter or digit)")
    return None


@dataclass(frozen=True)
class TaintPolicy:
    key: str
    effect: str
    unhealthy_threshold: int = 0


def node_intent(state: NodeState, labels: dict[str, str], taint: TaintPolicy) -> NodeIntent:
    fault = state.node_fault(taint.unhealthy_threshold)
    unhealthy = sorted(h.reason for h in state.health.values() if not h.healthy)
    total = len(state.inventory.gpus)
    if fault is not None:
        reason = "NvmlUnresponsive" if fault.startswith(NVML_UNRESPONSIVE) else "NodeGPUFault"
        condition = Condition(CONDITION_TYPE, "False", reason, fault)
    elif unhealthy:
        condition = Condition(CONDITION_TYPE, "False", "GPUUnhealthy",
                              f"{len(unhealthy)} of {total} GPUs unhealthy: {', '.join(unhealthy)}")
    else:
        condition = Condition(CONDITION_TYPE, "True", "GPUsHealthy", f"all {total} GPUs healthy")
    own_taint = {"key": taint.key, "value": "true", "effect": taint.effect} if fault is not None else None
    annotations = {}
    if state.mig_status is not None:
        labels = {**labels, MIG_STATE_LABEL: state.mig_status.state}
        if state.mig_status.reason:
            # An annotation value has no length limit worth worrying about here; keep it readable.
            annotations[MIG_REASON_ANNOTATION] = state.mig_status.reason[:4096]
    if state.cordoned:
        annotations[CORDON_STATE_ANNOTATION] = cordon_report(state)
    # A label the API server refuses would fail the whole patch: it is left out, and said so.
    dropped = tuple(f"label {key}: {problem}; not written" for key, value in sorted(labels.items())
                    if (problem := label_problem(key, value)) is not None)
    if dropped:
        labels = {k: v for k, v in labels.items() if label_problem(k, v) is None}
    return NodeIntent(labels, own_taint, condition, annotations, dropped, taint.key)


def label_diff(
    current: Mapping[str, str], desired: Mapping[str, str], owned: Callable[[str], bool]
) -> dict[str, str | None]:
    """The merge patch that makes the owned labels equal `desired`: changed or new keys, and None for owned
    keys that are no longer desired. Keys the agent does not own never appear."""
    patch: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    patch.update({k: None for k in current if owned(k) and k not in desired})
    return patch


def taints_with(
    current: tuple[Mapping[str, str], ...], owned: Callable[[str], bool], own: dict[str, str] | None
) -> list[dict[str, str]]:
    """The node's taint list with the agent's own taint set or removed; every other taint kept as it is."""
    kept = [dict(t) for t in current if not owned(t.get("key", ""))]
    return kept + ([own] if own is not None else [])


class NodeReconciler:
    """Consumer of NodeState: follows the state bus and the Node watch, converging after either changes.

    While the API server is unreachable it retries with backoff and jitter; the device plugin is unaffected.
    """

    def __init__(
        self,
        api: NodeClient,
        bus: StateBus,
        intent: Callable[[NodeState], NodeIntent],
        owned: Callable[[str], bool],
        on_error: Callable[[], None] = lambda: None,
        counts: ApiCounts | None = None,
    ) -> None:
        self._on_error = on_error
        self._counts = counts or ApiCounts()
        """Where watch restarts and relists are counted (the API client's, for /metrics)."""
        self._api = api
        self._bus = bus
        self._intent = intent
        self._owned = owned
        self._node: NodeView | None = None
        self._lock = asyncio.Lock()
        self._emitted = 0
        self._shown = 0
        self._shown_changed = asyncio.Condition()
        self._dirty = asyncio.Event()
        """Set by each new view of the Node: converge with it."""
        self._dropped: tuple[str, ...] = ()
        """The labels last reported as left out."""

    @property
    def converged_version(self) -> int:
        """The newest NodeState version whose intent the Node shows (labels, annotations, taint, condition and
        its Events written); 0 before the first convergence."""
        return self._shown

    @property
    def busy(self) -> bool:
        """Whether a view of the Node the watch handed over still waits to be converged with, or a convergence is
        under way (what a test waits out before it reads "no writes" as "looked and found nothing to write")."""
        return self._dirty.is_set() or self._lock.locked()

    async def converged_at(self, version: int) -> int:
        """Return once the Node shows the intent of NodeState `version` or of a newer one; returns the version
        it shows."""
        async with self._shown_changed:
            await self._shown_changed.wait_for(lambda: self._shown >= version)
            return self._shown

    @property
    def node(self) -> NodeView | None:
        """The Node as last read or watched; None before the first read."""
        return self._node

    async def converge(self) -> None:
        async with self._lock:
            if self._node is None:
                return
            state = self._bus.current
            want = self._intent(state)
            await self._report_dropped(want.dropped)
            # Health first, and each write on its own: a refused label patch must not keep the taint or the
            # condition from the Node. The first failure is raised once the others were tried.
            failure: Exception | None = None
            for write in (self._converge_taint, self._converge_condition, self._converge_metadata):
                try:
                    await write(want)
                except Exception as err:  # retried by the caller, with backoff
                    failure = failure or err
            if failure is not None:
                raise failure
            await self._emit_events(state)
            if state.version > self._shown:
                async with self._shown_changed:
                    self._shown = state.version
                    self._shown_changed.notify_all()

    async def _report_dropped(self, dropped: tuple[str, ...]) -> None:
        """Say once, in the log and as a Warning Event, which labels are left out and why."""
        if dropped == self._dropped:
            return
        assert self._node is not None
        for line in dropped:
            if line not in self._dropped:
                log.warning("%s", line)
                await self._api.event(LABEL_DROPPED_REASON, line[:EVENT_MESSAGE_MAX], "Warning", self._node.uid)
        self._dropped = dropped

    async def _converge_metadata(self, want: NodeIntent) -> None:
        assert self._node is not None
        patch = label_diff(self._node.labels, want.labels, self._owned)
        notes = label_diff(self._node.annotations, want.annotations, owned_annotation)
        if patch or notes:
            log.info("patching node labels %s and annotations %s", patch, notes)
            self._node = await self._api.patch_metadata(patch, notes)

    async def _converge_condition(self, want: NodeIntent) -> None:
        assert self._node is not None
        have = self._node.conditions.get(CONDITION_TYPE)
        if have is None or (have.status, have.reason, have.message) != (
            want.condition.status, want.condition.reason, want.condition.message
        ):
            self._node = await self._api.set_condition(want.condition)

    async def _converge_taint(self, want: NodeIntent) -> None:
        assert self._node is not None
        while True:
            mine = [dict(t) for t in self._node.taints if want.owns_taint(t.get("key", ""))]
            if mine == ([want.taint] if want.taint else []):
                return
            taints = taints_with(self._node.taints, want.owns_taint, want.taint)
            try:
                log.info("setting node taints: %s", taints)
                self._node = await self._api.set_taints(taints, self._node.resource_version)
                return
            except Exception as err:
                if not is_conflict(err):
                    raise
                # Someone else changed the node since we read it: read again and re-apply only our taint.
                self._node = await self._api.get()

    async def _emit_events(self, state: NodeState) -> None:
        assert self._node is not None
        for incident in state.incidents:
            if incident.seq <= self._emitted:
                continue
            if incident.seq > self._emitted + 1:
                missed = incident.seq - self._emitted - 1
                await self._api.event("EventsDropped", f"{missed} earlier GPU agent event(s) could not be recorded "
                                      "in time (the history keeps the newest 64, for up to an hour)", "Warning",
                                      self._node.uid)
                self._emitted = incident.seq - 1
            kind = "Normal" if incident.kind in NORMAL_INCIDENTS else "Warning"
            reason = EVENT_REASONS.get(incident.kind, "GPUAgent")
            message = f"GPU {incident.gpu_uuid}: {incident.message}" if incident.gpu_uuid else incident.message
            if len(message) > EVENT_MESSAGE_MAX:
                message = message[: EVENT_MESSAGE_MAX - 15] + " ... (shortened)"
            await self._api.event(reason, message, kind, self._node.uid)
            self._emitted = incident.seq

    def _start_now_on_fault(self) -> None:
        """A GPU or node fault goes to the Node at once, whatever is left of the client's start jitter."""
        if self._intent(self._bus.current).condition.status != "True":
            self._api.start_now()

    async def _follow_state(self) -> None:
        """Converge whenever the state has a newer version or a new view of the Node came in; a failed converge
        is retried with its own backoff, so that writes never hold up the watch, nor the watch the writes."""
        version = self._bus.current.version
        while True:
            self._start_now_on_fault()
            newer = asyncio.ensure_future(self._bus.wait_newer(version))
            seen = asyncio.ensure_future(self._dirty.wait())
            try:
                await asyncio.wait({newer, seen}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                newer.cancel()
                seen.cancel()
            self._dirty.clear()
            version = self._bus.current.version
            await _retrying(self.converge, self._on_error)

    async def _seen(self, view: NodeView) -> None:
        """Take a new view of the Node: feed its requests (MIG layout, named config) into the state, and have
        the Node converged."""
        self._node = view
        mig_request = view.labels.get(MIG_CONFIG_LABEL) or None
        config_request = view.labels.get(CONFIG_LABEL) or None
        cordon_request = view.annotations.get(CORDON_ANNOTATION, "")
        state = self._bus.current
        if ((mig_request, config_request, cordon_request)
                != (state.mig_request, state.config_request, state.cordon_request)):
            await self._bus.update(mig_request=mig_request, config_request=config_request,
                                   cordon_request=cordon_request)
        self._dirty.set()

    async def _follow_node(self) -> None:
        """List, converge, then watch and converge on each change, as client-go's reflector does: each watch
        resumes from the last version handled (bookmarks included), a list is made again only when the server
        no longer has that version (410 Gone), and a watch that fails or ends within WATCH_LIVED_S counts as a
        failure and waits out a jittered backoff, reset only by a watch that lived. One warning per episode of
        failures, one line when it ends. Never returns."""
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        version: str | None = None
        expired_in_a_row = 0
        while True:
            err: Exception | None = None
            opened = loop.time()
            try:
                if version is None:
                    view, version = await self._api.list()
                    await self._seen(view)
                async for item in self._api.watch(version):
                    if isinstance(item, str):
                        version = item  # a bookmark: nothing changed up to this version
                        continue
                    await self._seen(item)
                    version = item.resource_version
            except asyncio.CancelledError:
                raise
            except Exception as caught:
                err = caught
            lived = loop.time() - opened >= WATCH_LIVED_S
            if err is not None and is_expired(err):
                # The server no longer has the version (it restarted, or the watch was away too long): list
                # again, at once the first time; a server that keeps answering 410 is a failure like any other.
                version = None
                self._counts.relists["nodes"] += 1
                self._counts.watch_restarts[("nodes", "expired")] += 1
                expired_in_a_row += 1
                if expired_in_a_row == 1:
                    log.info("node watch: the API server no longer has version; listing again")
                    continue
            else:
                expired_in_a_row = 0
            if err is None and lived:
                # The server ended a watch that lived (its timeout): watch again from where it ended.
                self._counts.watch_restarts[("nodes", "timeout")] += 1
                if backoff.failures:
                    log.info("node watch is back after %d failure(s)", backoff.failures)
                backoff.succeeded()
                continue
            self._counts.watch_restarts[("nodes", "closed" if err is None else "error")] += 1
            self._on_error()
            delay = backoff.next_delay(err)
            if backoff.failures == 1:
                why = (f"ended after {loop.time() - opened:.1f}s" if err is None else
                       f"failed ({describe_error(err)})")
                log.warning("node watch %s; watching again in %.1fs, backing off while it fails", why, delay)
            await asyncio.sleep(delay)

    async def run(self) -> None:
        await asyncio.gather(self._follow_node(), self._follow_state())


async def _retrying(step: Callable[[], Awaitable[object]], on_error: Callable[[], None]) -> None:
    """Run one step until it succeeds, with jittered exponential backoff between failures; one warning for the
    first failure, one line when it succeeds after failing."""
    backoff = Backoff(first_min=BACKOFF_MIN_S, first_max=2 * BACKOFF_MIN_S)
    while True:
        try:
            await step()
            if backoff.failures:
                log.info("node update succeeded after %d failure(s)", backoff.failures)
            return
        except asyncio.CancelledError:
            raise
        except Exception as err:
            on_error()
            delay = backoff.next_delay(err)
            if backoff.failures == 1:
                log.warning("node update failed (%s); retrying in %.1fs, backing off while it fails",
                            describe_error(err), delay)
            await asyncio.sleep(delay)
