"""The DCGM family in Prometheus text format, as dcgm-exporter writes it.

Rendered directly rather than through prometheus_client: dcgm-exporter's counters carry no ``_total`` suffix
(``# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter`` with samples of that very name), which prometheus_client
would add. Only the last pass's snapshot is read.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from functools import cache
from importlib import resources

import yaml

from agent.nvml import fields as nv
from agent.nvml.records import GpuInfo
from agent.state import NodeState
from agent.telemetry.collector import Holder, Snapshot
from agent.telemetry.fields import FIELDS

UNKNOWN_XID = "Unknown Error"


@cache
def xid_messages() -> dict[int, str]:
    text = resources.files("agent.telemetry").joinpath("xid-messages.yaml").read_text()
    return {int(k): str(v) for k, v in yaml.safe_load(text).items()}


def xid_message(code: int) -> str:
    return xid_messages().get(code, UNKNOWN_XID)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _labels(pairs: list[tuple[str, str]]) -> str:
    return ",".join(f'{k}="{escape(v)}"' for k, v in pairs if v != "")


def hostname() -> str:
    """What dcgm-exporter puts in Hostname: the node name it is given (NODE_NAME), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def render(snapshot: Snapshot, state: NodeState, host: str) -> bytes:
    """The exposition text of the DCGM family for one snapshot."""
    gpus: dict[int, GpuInfo] = {g.index: g for g in state.inventory.gpus}
    driver = state.inventory.driver.version
    series: dict[str, list[str]] = {f.name: [] for f in FIELDS if f.kind != "label"}
    for reading in snapshot.readings:
        gpu = gpus.get(reading.gpu_index)
        if gpu is None or gpu.uuid != reading.gpu_uuid:
            continue
        base = [("gpu", str(gpu.index)), ("UUID", gpu.uuid), ("pci_bus_id", gpu.pci_bus_id),
                ("device", f"nvidia{gpu.index}"), ("modelName", gpu.name)]
        if reading.mig is not None:
            base += [("GPU_I_PROFILE", reading.mig.profile), ("GPU_I_ID", str(reading.mig.gpu_instance_id))]
        base += [("Hostname", host), (nv.DRIVER_VERSION, driver)]
        holders: tuple[Holder | None, ...] = snapshot.holders.get(reading.uuid, ()) or (None,)
        values = dict(reading.values)
        if reading.mig is None:
            values[nv.XID_ERRORS] = snapshot.last_xid.get(gpu.uuid, 0)
        for name, value in values.items():
            if name not in series:
                continue
            extra: list[tuple[str, str]] = []
            if name == nv.XID_ERRORS:
                extra = [("err_code", str(int(value))), ("err_msg", xid_message(int(value)))]
            for holder in holders:
                who = [] if holder is None else [
                    ("pod", holder.pod), ("namespace", holder.namespace), ("container", holder.container)]
                series[name].append(f"{name}{{{_labels(base + extra + who)}}} {number(value)}")
    out: list[str] = []
    for f in FIELDS:
        lines = series.get(f.name)
        if not lines:
            continue
        out.append(f"# HELP {f.name} {f.help}")
        out.append(f"# TYPE {f.name} {f.kind}")
        out.extend(lines)
    return ("\n".join(out) + "\n").encode() if out else b""


def renderer(snapshot: Callable[[], Snapshot], state: Callable[[], NodeState],
             enabled: Callable[[], bool], host: str | None = None) -> Callable[[], bytes]:
    name = host or hostname()

    def render_now() -> bytes:
        return render(snapshot(), state(), name) if enabled() else b""

    return render_now

