"""The gpu-agent command: run | inspect | simulate | mig | fault. Errors become one clear line and a non-zero exit."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent import logsink
from agent.config import ConfigError, load_config, with_health_env
from agent.kube.usage import START_JITTER_S, process_started
from agent.nvml import MockStateError
from agent.yamlfile import one_line

EXIT_USAGE = 2
EXIT_ERROR = 1


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(fmt: str, level: int = logging.INFO) -> None:
    """Log to stderr in `fmt` (text or json) through a writer that never blocks the logging thread
    (agent/logsink.py)."""
    text = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    logsink.install(JsonFormatter() if fmt == "json" else text, level)


def _path(text: str) -> Path:
    """A path flag's value; an empty one is refused (Path("") is the working directory)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (an empty path means the working directory)")
    return Path(text)


_HOST_NAME = re.compile(r"(?=.{1,253}\.?$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def _address(text: str) -> str:
    """--metrics-address: an IPv4 or IPv6 address (an IPv6 one may be in brackets, [::1]) or a host name."""
    bracketed = text.startswith("[") and text.endswith("]")
    candidate = text[1:-1] if bracketed else text
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        # A name whose last label is a number is a mistyped IPv4 address (999.1.1.1), not a host name.
        if not bracketed and _HOST_NAME.fullmatch(text) and not text.rstrip(".").rsplit(".", 1)[-1].isdigit():
            return text
    else:
        if not bracketed or address.version == 6:
            return candidate
    raise argparse.ArgumentTypeError(f"not an IPv4 or IPv6 address or a host name: {text!r}")


def _not_negative(text: str) -> float:
    """An argparse type: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` above 0."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {'whole ' if kind is int else ''}number: {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
        return value
    return parse


def _add_nvml(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--nvml", default=default, metavar="real|mock:PRESET|mock:FILE",
                   help=f"NVML backend (default: {default})")
    p.add_argument("--mock-state", type=_path, metavar="FILE",
                   help="persist the fake NVML's mutable state (MIG, faults) in FILE")


def _version() -> str:
    """The installed package's version and the machine it runs on: `0.1.0 (aarch64)`."""
    import importlib.metadata
    import platform

    try:
        version = importlib.metadata.version("gpu-node-agent")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version} ({platform.machine()})"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="gpu-agent", description="Node agent for GPU nodes in Kubernetes.")
    top.add_argument("--version", action="version", version=f"gpu-agent {_version()}",
                     help="print the agent's version and the machine it runs on, and exit")
    sub = top.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the agent (device plugin, health)")
    run.add_argument("--config", type=_path, metavar="FILE", help="agent config file (version: v1)")
    _add_nvml(run, "real")
    run.add_argument("--kubelet-dir", type=_path, default=Path("/var/lib/kubelet/device-plugins"),
                     help="the kubelet's device-plugin directory (default: %(default)s)")
    run.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                     help="this node's name (default: $NODE_NAME)")
    kube = run.add_mutually_exclusive_group()
    kube.add_argument("--kubeconfig", type=_path, metavar="FILE", help="kubeconfig (default: in-cluster)")
    kube.add_argument("--no-kube", action="store_true", help="do not talk to the API server")
    run.add_argument("--metrics-port", type=int, default=9400,
                     help="port for /metrics, /healthz, /readyz; 0 picks a free port (default: %(default)s)")
    run.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDRESS", type=_address,
                     help="IPv4 or IPv6 address (or host name) the metrics endpoint binds to "
                          "(default: %(default)s, every IPv4 address)")
    run.add_argument("--kube-api-qps", type=_positive(float), default=5.0, metavar="QPS",
                     help="requests a second to the API server, at most, on average (default: %(default)s)")
    run.add_argument("--kube-api-burst", type=_positive(int), default=10, metavar="N",
                     help="requests to the API server at once before --kube-api-qps paces them "
                          "(default: %(default)s)")
    run.add_argument("--kube-start-jitter", type=_not_negative, default=START_JITTER_S, metavar="SECONDS",
                     help="the first request to the API server goes at a random moment within this many seconds "
                          "of the start, so that agents started together reach it spread out; a GPU fault, and "
                          "the check of the agent's own Pod, go at once (default: %(default)s; 0: none)")
    run.add_argument("--log-format", choices=("text", "json"), default="text")

    inspect = sub.add_parser("inspect", help="print what the agent sees through NVML")
    _add_nvml(inspect, "real")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")

    sim = sub.add_parser("simulate", help="run the whole agent on a simulated node and show the node")
    sim.add_argument("--node", required=True, metavar="PRESET|FILE", help="simulated node preset or file")
    sim.add_argument("--config", type=_path, metavar="FILE", help="agent config file (version: v1)")
    sim.add_argument("--mock-state", type=_path, metavar="FILE", help="persist the fake NVML's state in FILE")
    sim.add_argument("--inject-xid", action="append", default=[], metavar="GPU:XID", type=_gpu_xid,
                     help="after start, inject XID on GPU (by index); repeatable")
    sim.add_argument("--json", action="store_true", help="machine-readable output")
    mig = sub.add_parser("mig", help="plan, apply or check a MIG layout without a cluster")
    mig.add_argument("action", choices=("plan", "apply", "assert"),
                     help="plan: print the changes; apply: make them; assert: exit 0 only if applied")
    _add_nvml(mig, "real")
    mig.add_argument("--mig-config", type=_path, metavar="FILE",
                     help="layout file in the mig-parted v1 format (default: the shipped layouts)")
    mig.add_argument("--layout", required=True, metavar="NAME", help="the layout to plan, apply or check")
    mig.add_argument("--state-dir", type=_path, default=Path("/var/lib/gpu-node-agent"),
                     help="where the apply journal is kept (default: %(default)s)")
    mig.add_argument("--json", action="store_true", help="machine-readable output")
    _add_fault_parser(sub)
    return top


def _gpu_xid(text: str) -> tuple[int, int]:
    gpu, sep, xid = text.partition(":")
    if not (sep and gpu.isdigit() and xid.isdigit()):
        raise argparse.ArgumentTypeError(f"expected GPU:XID with two numbers, e.g. 3:79, got {text!r}")
    return int(gpu), int(xid)


def _backend(selector: str, mock_state: Path | None) -> Any:
    from agent.nvml.backend import open_backend
    from agent.nvml.nodefile import NodeFileError

    try:
        return open_backend(selector, mock_state)
    except (NodeFileError, ValueError) as err:
        raise CliError(str(err)) from err


def cmd_run(args: argparse.Namespace) -> int:
    from agent.daemon import AgentOptions, run_until_signal

    setup_logging(args.log_format)
    config, mapped = with_health_env(load_config(args.config), os.environ)
    for line in mapped:
        logging.getLogger("agent.config").info("%s", line)
    if not args.kubelet_dir.is_dir():
        raise CliError(f"kubelet directory {args.kubelet_dir} does not exist (set --kubelet-dir)")
    if not 0 <= args.metrics_port <= 65535:
        raise CliError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    if not args.no_kube and not args.node_name:
        raise CliError("the node name is unknown: set NODE_NAME or --node-name (or run with --no-kube)")
    if args.kubeconfig is not None and not args.kubeconfig.is_file():
        raise CliError(f"kubeconfig {args.kubeconfig} does not exist")
    backend = _backend(args.nvml, args.mock_state)

    async def main() -> int:
        kube = None
        if not args.no_kube:
            from agent.kube.node import NodeApi

            try:
                kube = await NodeApi.connect(args.kubeconfig, args.node_name, args.kube_api_qps,
                                             int(args.kube_api_burst), args.kube_start_jitter,
                                             since=process_started())
            except Exception as err:  # the client raises several unrelated types for a bad config
                raise CliError(f"cannot load API server credentials: {err}") from err
            from agent.kube.selfpod import NotTolerated, check_at_start

            try:
                await check_at_start(kube, config.health.taint)
            except NotTolerated as err:
                await kube.close()
                raise CliError(str(err)) from None
        from agent.cordon import CORDON_FILE

        options = AgentOptions(
            config=config, kubelet_dir=args.kubelet_dir, metrics_port=args.metrics_port,
            metrics_host=args.metrics_address, kube=kube,
            config_path=args.config, pod_uid=os.environ.get("POD_UID") or None,
            gpu_identities=identity_file(args.nvml, args.mock_state, config.mig.state_dir),
            cordon_file=identity_file(args.nvml, args.mock_state, config.mig.state_dir, CORDON_FILE),
        )
        return await run_until_signal(backend, options)

    from agent.checks import StartupError
    from agent.nvml.backend import NvmlUnavailable

    try:
        return asyncio.run(main())
    except StartupError as err:
        raise CliError(str(err)) from None
    except NvmlUnavailable as err:
        hint = " (is the NVIDIA driver installed, and libnvidia-ml.so.1 injected into the container?)"
        raise CliError(f"{err}{hint if 'Library Not Found' in str(err) else ''}") from err


def identity_file(nvml: str, mock_state: Path | None, state_dir: Path, name: str = "gpus.json") -> Path | None:
    """Where `gpu-agent run` keeps what it read of each GPU (agent/nvml/identity.py; `name` gpus.json) or the GPUs
    cordoned on its Node (agent/cordon.py; cordon.json): `name` in the MIG state directory on a real node; on a
    simulated one, <mock-state stem>-<name> beside its --mock-state file, whose GPUs they are (none without one:
    such a node starts anew every time)."""
    if nvml == "real":
        return state_dir / name
    return None if mock_state is None else mock_state.with_name(f"{mock_state.stem}-{name}")


def inspect_view(backend: Any) -> dict[str, Any]:
    from agent.nvml.backend import NvmlBackend
    from agent.nvml.records import node_clique
    from agent.topology.prefer import topology_of

    def read(b: NvmlBackend) -> dict[str, Any]:
        inv = b.inventory()
        clique = node_clique(inv.gpus)
        health = [b.health(g.index) for g in inv.gpus]
        topo = topology_of(inv)
        return {
            "driver": {"version": inv.driver.version, "cuda": inv.driver.cuda},
            "gpus": [
                {
                    "index": g.index, "uuid": g.uuid, "name": g.name, "pci_bus_id": g.pci_bus_id,
                    "minor": g.minor, "memory_mib": g.memory_mib, "architecture": g.architecture,
                    "compute_capability": f"{g.compute_capability[0]}.{g.compute_capability[1]}",
                    "numa_node": g.numa_node, "mig_capable": g.mig_capable, "mig_enabled": g.mig_enabled,
                    "mig_pending": g.mig_pending, "lost": g.lost,
                    "fabric": None if g.fabric is None else {
                        "cluster_uuid": g.fabric.cluster_uuid, "clique_id": g.fabric.clique_id,
                        "state": g.fabric.state, "status": g.fabric.status, "attached": g.fabric.attached},
                }
                for g in inv.gpus
            ],
            "clique": clique.value,
            "clique_problem": clique.problem,
            "imex_channels": list(inv.imex_channels),
            "links": [{"gpus": [link.a, link.b], "nvlink": link.nvlink, "pcie": link.pcie} for link in inv.links],
            "pair_scores": topo.pair_scores(),
            "mig_devices": [
                {"uuid": m.uuid, "gpu": m.parent_index, "profile": m.profile, "gpu_instance": m.gpu_instance_id,
                 "compute_instance": m.compute_instance_id, "memory_mib": m.memory_mib,
                 "placement": {"start": m.placement_start, "size": m.placement_size}}
                for m in inv.mig_devices
            ],
            "health": [
                {"gpu": g.index, "lost": h.lost, "ecc_uncorrected_volatile": h.ecc_uncorrected_volatile,
                 "remapped_rows_pending": h.remapped_rows_pending, "remapped_rows_failure": h.remapped_rows_failure,
                 "retired_pages_pending": h.retired_pages_pending}
                for g, h in zip(inv.gpus, health, strict=True)
            ],
            "_topology": topo,
        }

    from agent.daemon import nvml_sync
    from agent.nvml.backend import NvmlUnavailable

    try:
        view: dict[str, Any] = nvml_sync(backend, read)
    except NvmlUnavailable as err:
        raise CliError(str(err)) from err
    return view


def cmd_inspect(args: argparse.Namespace) -> int:
    from agent.topology.render import render_matrix

    view = inspect_view(_backend(args.nvml, args.mock_state))
    topo = view.pop("_topology")
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    print(f"Driver {view['driver']['version']}  CUDA {view['driver']['cuda']}")
    print(f"{'GPU':<4} {'Name':<26} {'UUID':<41} {'Bus':<17} {'Memory':>9} {'NUMA':>4}  MIG")
    for g in view["gpus"]:
        mig = "enabled" if g["mig_enabled"] else ("disabled" if g["mig_capable"] else "n/a")
        numa = "-" if g["numa_node"] is None else g["numa_node"]
        print(f"{g['index']:<4} {g['name'][:26]:<26} {g['uuid']:<41} {g['pci_bus_id']:<17} "
              f"{g['memory_mib']:>5} MiB {numa:>4}  {mig}")
    print()
    print(render_matrix(topo))
    fabrics = [(g["index"], g["fabric"]) for g in view["gpus"] if g["fabric"] is not None]
    if fabrics:
        print()
        print("NVLink fabric:")
        for index, f in fabrics:
            attached = "attached" if f["attached"] else "not attached"
            print(f"  GPU {index}: cluster {f['cluster_uuid']}  clique {f['clique_id']}  {f['state']}  "
                  f"status {f['status']}  {attached}")
        print(f"  clique: {view['clique'] or view['clique_problem'] or 'none (no GPU attached)'}")
    if view["imex_channels"]:
        print(f"IMEX channels: {', '.join(map(str, view['imex_channels']))}")
    if view["mig_devices"]:
        print()
        print("MIG devices:")
        for m in view["mig_devices"]:
            print(f"  GPU {m['gpu']}  {m['profile']:<10} {m['uuid']}  start={m['placement']['start']}")
    print()
    print("Health:")
    for h in view["health"]:
        state = "LOST" if h["lost"] else "ok"
        print(f"  GPU {h['gpu']}: {state}  uncorrected ECC (volatile): {h['ecc_uncorrected_volatile']}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from agent.checks import StartupError
    from agent.nvml.backend import NvmlUnavailable
    from agent.simulate import SimulationError, describe, simulate

    setup_logging("text", logging.ERROR)
    config = load_config(args.config)
    backend = _backend(f"mock:{args.node}", args.mock_state)
    signals: list[int] = []

    async def run() -> dict[str, Any]:
        # SIGTERM and SIGINT cancel the simulation: it stops the agent and removes its directory on the way out.
        task = asyncio.current_task()
        assert task is not None

        def stop(signum: int) -> None:
            if not signals:
                task.cancel()
            signals.append(signum)

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop, sig)
        return await simulate(backend, config, node_name=_node_name(args.node), inject_xids=args.inject_xid)

    try:
        view = asyncio.run(run())
    except asyncio.CancelledError:
        if not signals:
            raise
        return 128 + signals[0]
    except (NvmlUnavailable, SimulationError, StartupError) as err:
        raise CliError(str(err)) from None
    logsink.flush()  # what was logged comes before the output
    print(json.dumps(view, indent=2) if args.json else describe(view))
    return 0


def _node_name(source: str) -> str:
    return f"sim-{Path(source).stem}" if source.endswith((".yaml", ".yml")) else f"sim-{source}"


class ApplyInterrupted(Exception):
    """A signal asked `mig apply` to stop; it stops between two changes."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signum


def cmd_mig(args: argparse.Namespace) -> int:
    from agent.locks import Held, mig_apply_lock
    from agent.mig.applier import Journal, apply_layout, plan_layout, planned_steps
    from agent.mig.layout import LayoutError, load_layouts
    from agent.mig.planner import PlanError
    from agent.nvml.backend import NvmlUnavailable
    from agent.nvml.mig_ops import MigCallError, MigOps

    try:
        layout = load_layouts(args.mig_config).layout(args.layout)
    except LayoutError as err:
        raise CliError(one_line(str(err))) from err
    except OSError as err:
        raise CliError(f"cannot read {args.mig_config}: {err.strerror}") from err
    backend = _backend(args.nvml, args.mock_state)
    try:
        backend.init()
    except NvmlUnavailable as err:
        raise CliError(str(err)) from err
    try:
        ops = MigOps(backend)
        gpus = len(backend.inventory().gpus)
        if args.action == "apply":
            out = sys.stderr if args.json else sys.stdout
            taken: list[str] = []
            signals: list[int] = []

            def step(description: str) -> None:
                # Called before each change: a SIGINT or SIGTERM stops the apply here, between two changes.
                if signals:
                    raise ApplyInterrupted(signals[0])
                taken.append(description)
                print(description, file=out, flush=True)

            def apply() -> Any:
                previous = {sig: signal.signal(sig, lambda n, _: signals.append(n))
                            for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    return apply_layout(ops, gpus, layout, Journal(args.state_dir), step=step)
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

            try:
                try:
                    plan_layout(ops, gpus, layout)
                except PlanError:
                    result = apply()  # it fails the same way before touching anything, even the state dir
                else:
                    with mig_apply_lock(args.state_dir):
                        result = apply()
            except Held as err:
                raise CliError(str(err)) from None
            except ApplyInterrupted as err:
                name = signal.Signals(err.signal).name
                last = f" (the last: {taken[-1]})" if taken else ""
                print(f"gpu-agent mig: interrupted by {name} after {len(taken)} change(s){last}; layout "
                      f"{layout.name!r} is partly applied and its journal is in {args.state_dir}: run `gpu-agent mig "
                      f"apply --layout {layout.name}` again to finish (`gpu-agent mig plan --layout {layout.name}` "
                      "shows what is left)", file=sys.stderr)
                return 128 + err.signal
            except OSError as err:
                raise CliError(f"cannot keep the apply journal in {args.state_dir}: {err.strerror}") from err
            if args.json:
                print(json.dumps({"layout": result.layout, "outcome": result.outcome, "reason": result.reason}))
            else:
                print(f"{result.outcome}: {result.reason}")
            return 0 if result.outcome == "success" else EXIT_ERROR
        try:
            plan = plan_layout(ops, gpus, layout)
        except PlanError as err:
            if args.json:
                print(json.dumps({"layout": layout.name, "feasible": False,
                                  "problems": [{"gpu": i, "reason": r} for i, r in err.problems]}))
            else:
                print(f"layout {layout.name!r} cannot be applied:\n{err}")
            return EXIT_ERROR
        steps = planned_steps(ops, gpus, plan)
        done = not steps
        if args.json:
            print(json.dumps({
                "layout": layout.name, "feasible": True, "applied": done, "untouched": list(plan.untouched),
                "steps": steps, "selects_nothing": plan.selects_nothing,
                "gpus": [{"gpu": p.index, "mode": p.mode.value,
                          "destroy": [vars(i) for i in p.destroy], "create": [vars(i) for i in p.create],
                          "target": [vars(i) for i in p.target]} for p in plan.gpus],
            }, indent=2))
        elif args.action == "plan":
            print("\n".join(steps) or plan.describe())
        else:
            print(plan.selects_nothing or f"layout {layout.name!r} is applied" if done else
                  f"layout {layout.name!r} is not applied; to do:\n" + "\n".join(steps))
        return 0 if args.action == "plan" or done else EXIT_ERROR
    except MigCallError as err:
        raise CliError(f"NVML error: {err}") from None
    finally:
        backend.shutdown()


FAULTS = {
    "xid": "raise an XID critical-error event on GPU (VALUE: the XID number)",
    "lost": "make GPU fall off the bus: NVML gives no handle for it, and every call about it fails with GpuIsLost",
    "lost-handle": "make GPU fall off the bus as NVML also shows it: its handle is given, every call on it fails "
                   "with GpuIsLost",
    "ecc": "set GPU's volatile uncorrected ECC error count (VALUE: the count)",
    "hang": "make every NVML call about GPU (or, with GPU 'all', every call) block until unhang",
    "unhang": "let the calls hang blocked return (GPU, or 'all' for the driver)",
    "clear": "undo lost and uncorrected ECC on GPU (an XID is an event: the agent's recovery checks clear it)",
}


def _add_fault_parser(sub: Any) -> None:
    fault = sub.add_parser(
        "fault", help="inject a GPU fault into a running agent's fake NVML (through its --mock-state file)",
        description="Change the fake NVML's state in the --mock-state file that a running `gpu-agent run "
                    "--nvml mock:...` shares; that agent picks the change up at its next NVML call. "
                    + "; ".join(f"{name}: {what}" for name, what in FAULTS.items()) + ".")
    fault.add_argument("--nvml", required=True, metavar="mock:PRESET|mock:FILE",
                       help="the same mock node as the running agent's --nvml")
    fault.add_argument("--mock-state", required=True, type=_path, metavar="FILE",
                       help="the running agent's --mock-state file")
    fault.add_argument("action", choices=tuple(FAULTS), help="what to do to the GPU")
    fault.add_argument("gpu", metavar="GPU", help="GPU index ('all' for hang and unhang: the whole driver)")
    fault.add_argument("value", nargs="?", metavar="VALUE", help="XID number (xid) or error count (ecc)")


def cmd_fault(args: argparse.Namespace) -> int:
    if not args.nvml.startswith("mock:"):
        raise CliError(f"--nvml must name the mock node (mock:PRESET or mock:FILE), got {args.nvml!r}")
    whole_driver = args.gpu == "all" and args.action in ("hang", "unhang")
    if not args.gpu.isdigit() and not whole_driver:
        raise CliError(f"GPU must be a GPU index (a number){' or all' if args.action in ('hang', 'unhang') else ''}, "
                       f"got {args.gpu!r}")
    needs_value = args.action in ("xid", "ecc")
    if needs_value and (args.value is None or not args.value.isdigit()):
        raise CliError(f"{args.action} needs a VALUE that is a number, got {args.value!r}")
    if not needs_value and args.value is not None:
        raise CliError(f"{args.action} takes no VALUE, got {args.value!r}")
    if not args.mock_state.parent.is_dir():
        raise CliError(f"the directory of --mock-state {args.mock_state} does not exist")
    backend = _backend(args.nvml, args.mock_state)
    fake = backend.lib
    gpu, value = (-1 if whole_driver else int(args.gpu)), int(args.value or 0)
    try:
        if args.action in ("hang", "unhang"):
            fake.set_hung(None if whole_driver else gpu, args.action == "hang")
        elif args.action == "xid":
            fake.inject_xid(gpu, value)
        elif args.action in ("lost", "lost-handle"):
            fake.set_gpu_lost(gpu, True, keep_handle=args.action == "lost-handle")
        elif args.action == "ecc":
            fake.set_ecc_uncorrected(gpu, value)
        else:
            fake.set_gpu_lost(gpu, False)
            fake.set_ecc_uncorrected(gpu, 0)
    except (IndexError, ValueError) as err:
        raise CliError(str(err)) from err
    except OSError as err:
        raise CliError(f"cannot write {args.mock_state}: {err.strerror}") from err
    shown = f" {value}" if needs_value else ""
    print(f"{'driver' if whole_driver else f'GPU {gpu}'}: {args.action}{shown} written to {args.mock_state}")
    return 0


COMMANDS = {"run": cmd_run, "inspect": cmd_inspect, "simulate": cmd_simulate, "mig": cmd_mig, "fault": cmd_fault}


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        # The reader went away (`gpu-agent inspect | head`): stop quietly, as other command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (CliError, ConfigError, MockStateError) as err:
        logsink.stderr_line(f"gpu-agent {args.command}: error: {err}")
        return EXIT_USAGE if isinstance(err, ConfigError) else EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    finally:
        logsink.flush()  # what is still queued, waiting at most logsink.FLUSH_S


if __name__ == "__main__":
    sys.exit(main())
