"""The handover between the device plugin and DRA on a node whose mode changes while pods run (docs/dra.md,
"Switching a node live"): which GPUs and MIG devices pods hold through the mode the node left, published as
`NodeState.held` and followed until they are released. In DRA mode they are the device plugin's allocations
that the kubelet's PodResources API still reports (their pods run on as they were: the kubelet keeps its
allocations when a device plugin stops serving a resource); in device-plugin mode the devices of the DRA
claims still prepared. The mode in force offers none of them until they are released, and neither mode offers
whole GPUs from the change until the first read after it (`NodeState.handover`), so no GPU is handed out twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from agent.dra.slices import plugin_resources
from agent.inventory import PlanCache
from agent.podresources import CLAIM, DeviceHolder, PodResourcesUnavailable, allocations
from agent.state import NodeState, StateBus

log = logging.getLogger(__name__)

POLL_S = 2.0
"""How often the held devices are read again while any are held (a local call: the kubelet's PodResources
socket, or the DRA checkpoint)."""
SETTLE_S = 0.5
"""How long a switch to DRA mode waits before it reads what the kubelet allocated through the device plugin: from
the switch on the plugin lists none of the devices DRA takes over and refuses to allocate them, and an Allocate
the kubelet sent before it is in the kubelet's record by then."""
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0


class Handover:
    """Keeps `NodeState.held` (and clears `NodeState.handover`); the Agent runs `run` as its handover task."""

    def __init__(self, bus: StateBus, plans: PlanCache, claims: Callable[[], list[DeviceHolder] | None]) -> None:
        self._bus = bus
        self._plans = plans
        self._claims = claims
        """The devices of the prepared DRA claims; None where the agent has no DRA kubelet plugin."""

    async def run(self) -> None:
        bus = self._bus
        delay = RETRY_FIRST_S
        failing = ""
        mode = bus.current.config.dra.enabled
        while True:
            state = bus.current
            dra = state.config.dra.enabled
            switched, mode = dra != mode, dra
            if switched and dra:
                # The device plugin served the GPUs until this state: an Allocate the kubelet sent before it is
                # in the kubelet's record once this much has passed.
                await asyncio.sleep(SETTLE_S)
            claims = None if dra else self._claims()  # read once a pass: it looks at the DRA checkpoint
            if state.handover or state.held or claims is not None:
                try:
                    held = await self._read(state) if dra else self._prepared(state, claims or [])
                except PodResourcesUnavailable as err:
                    if str(err) != failing:
                        log.warning("cannot read which GPUs pods hold through the device plugin (%s): %s until "
                                    "it answers; retrying", err, "no whole GPU is offered" if state.handover
                                    else "the GPUs held before stay out of the ResourceSlice")
                        failing = str(err)
                    await asyncio.sleep(delay)
                    delay = min(RETRY_MAX_S, delay * 2)
                    continue
                delay, failing = RETRY_FIRST_S, ""
                if bus.current.version != state.version:
                    continue  # the state moved on while the kubelet was asked: read it again for the newer one
                if state.handover or held != state.held:
                    self._say(state, held, dra)
                    await bus.update(held=held, handover=False)
                    continue
            polling = bool(state.held) or claims is not None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S if polling else None):
                    await bus.wait_newer(state.version)

    def _owned(self, state: NodeState) -> dict[str, str]:
        """Every GPU and MIG device of the node by UUID, with the GPU it is on."""
        gpus = {g.index: g.uuid for g in state.inventory.gpus}
        return {**{uuid: uuid for uuid in gpus.values()},
                **{m.uuid: gpus[m.parent_index] for m in state.inventory.mig_devices if m.parent_index in gpus}}

    async def _read(self, state: NodeState) -> frozenset[str]:
        """DRA mode: the node's devices the kubelet reports as allocated through a resource the device plugin no
        longer serves."""
        socket = state.config.mig.pod_resources_socket
        if not socket.exists():
            return frozenset()  # no kubelet on this node: nothing can be held
        still = self._still_served(state)
        owned = self._owned(state)
        return frozenset(uuid for h in await allocations(socket)
                         if h.resource != CLAIM and h.resource not in still
                         and (uuid := h.device_id.split("::", 1)[0]) in owned)

    def _still_served(self, state: NodeState) -> set[str]:
        resources = self._plans(state).resources
        return plugin_resources(resources, True, state.config.dra.dynamic_mig)

    def _prepared(self, state: NodeState, claims: list[DeviceHolder]) -> frozenset[str]:
        """Device-plugin mode: the node's devices the prepared DRA claims (`claims`) hold."""
        owned = self._owned(state)
        return frozenset(h.device_id for h in claims if h.device_id in owned)

    def _say(self, state: NodeState, held: frozenset[str], dra: bool) -> None:
        through = "the device plugin" if dra else "DRA claims"
        mode = "the ResourceSlice" if dra else "the device plugin"
        if state.handover:
            log.info("%s mode: %s", "DRA" if dra else "device-plugin",
                     f"{len(held)} device(s) held through {through} stay out of {mode} until released: "
                     f"{', '.join(sorted(held))}" if held else f"no device is held through {through}")
        for uuid in sorted(state.held - held):
            log.info("%s released: offered through %s again", uuid, mode)
