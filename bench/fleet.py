"""The fleet: what N `gpu-agent run` processes cost one real kube-apiserver, counted on the server's side.

Usage: python bench/fleet.py [--agents N] [--mode device-plugin|dra|both] [--steady-s S] [--wave W]
                             [--out bench/fleet.json] [--check]

Each agent is a real `gpu-agent run` process on the fake NVML (mock:single-h200) with its own Node, its own
ServiceAccount (bound to the DaemonSet's ClusterRole plus DRA mode's), its own config and short directory
(kubelet directory, mig.stateDir, PodResources socket path, CDI root), and no kubelet: the device plugin waits
for kubelet.sock, which costs the API server nothing. The agents start in waves of W.

Every figure is counted from kube-apiserver's audit log, with a policy that records (at Metadata level) only
the requests of the fleet's ServiceAccounts and nothing else: the rig's own admin requests (Node creation,
label edits, polls) and the API server's loopback requests are not in it. Each request is counted once (by its
audit ID), at the time the API server received it, and belongs to the agent whose ServiceAccount made it. The
log is one file kept across restarts of kube-apiserver (etcd and its data stay), so a restart does not reset
the counts the way it resets /metrics.

Phases, each judged per agent:
  start          requests until the agent's Node carries its labels (budget: at most 10);
  steady state   a window of --steady-s seconds after the fleet settled: writes (budget: 0) and requests per
                 agent-hour (the window's count scaled; budget: at most 12);
  apiserver      kube-apiserver stopped and started again, etcd kept;
  agents         every agent SIGTERMed at once, then every agent started at once (a rollout with
                 maxUnavailable 100%);
  outage         kube-apiserver stopped for 60 s, then started.
For the last three: requests from the moment the disturbance began (the first SIGTERM) until 60 s after the
API server was ready again (the agents: were started again) (budget: at most 5 per agent; the window holds the
API server's own start, when a client that does not back off meets a server that answers but is not ready
yet), the spread of those requests (the time between the first and the last of them, across the fleet;
budget: at least 10 s), and the time until every Node has its label back after an owned label
(nvidia.com/gpu.count) was removed by hand on every Node once the API server was ready (budget: 15 s after
the API server was ready again, or after the agents were started).

The JSON written to --out holds the figures (value, unit, budget, verdict) and the details; written to the default
bench/fleet.json, it also renders docs/benchmarks.md anew (bench/report.py). The exit status is 0 whatever the
verdicts, or 1 with --check when a figure misses its budget.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The rig is imported as the top-level module `apiserver`, as the integration tests import it, so that a test
# using this module and its conftest share one record of the processes the rig started.
for _path in (ROOT / "tests" / "integration", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import apiserver as rig  # noqa: E402
import yaml  # noqa: E402
from dra_rig import AGENT_RULES, REPO  # noqa: E402
from kubernetes import client as k8s  # noqa: E402

from bench import report  # noqa: E402
from tests.builders import AGENT  # noqa: E402
from tests.plugin_harness import short_dir  # noqa: E402

PRESET = "single-h200"
LABEL = "nvidia.com/gpu.count"
LABEL_VALUE = "1"
"""The value the agent writes for LABEL on PRESET (one GPU)."""
NAMESPACE = "gpu-agent-fleet"
ROLE = "gpu-agent-fleet"
NODE_PREFIX = "fleet-node-"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})

START_BUDGET = 10
STEADY_WRITES_BUDGET = 0
STEADY_HOURLY_BUDGET = 12.0
AFTER_BUDGET = 5
AFTER_WINDOW_S = 60.0
SPREAD_BUDGET_S = 10.0
REPAIR_BUDGET_S = 15.0
OUTAGE_S = 60.0
SETTLE_S = 15.0
"""How long the fleet is left alone between phases, so one phase's requests do not fall into the next."""
LABEL_TIMEOUT_S = 120.0
POLL_S = 0.25

AUDIT_POLICY = f"""\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts:{NAMESPACE}"]
  - level: None
"""


# --- the API server, audited ------------------------------------------------------------------------------


class AuditedApiServer(rig.ApiServer):
    """The rig's etcd and kube-apiserver with an audit log of the fleet's requests (`audit_log`); records when
    kube-apiserver was last started (`spawned_at`) and found ready (`ready_at`), as time.time()."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.audit_log = workdir / "audit.log"
        self._policy = workdir / "audit-policy.yaml"
        self._policy.write_text(AUDIT_POLICY)
        self.spawned_at = 0.0
        self.ready_at = 0.0

    def _start_apiserver(self) -> None:
        spawn = rig._spawn

        def audited(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
            if Path(argv[0]).name == "kube-apiserver":
                # One file for the whole run: no rotation (the size is in MB), appended to across restarts.
                argv = [*argv, f"--audit-policy-file={self._policy}", f"--audit-log-path={self.audit_log}",
                        "--audit-log-maxsize=1000000", "--audit-log-format=json"]
                self.spawned_at = time.time()
            return spawn(argv, log_path)

        rig._spawn = audited
        try:
            super()._start_apiserver()
        finally:
            rig._spawn = spawn
        self.ready_at = time.time()

    def stop_apiserver(self) -> None:
        """Stops kube-apiserver only (etcd and its data stay); start_apiserver() starts it again."""
        if self._apiserver is not None:
            rig._stop_group(self._apiserver)
            self._apiserver = None

    def start_apiserver(self) -> None:
        self._start_apiserver()


@contextlib.contextmanager
def audited(workdir: Path, nodes: tuple[str, ...]) -> Iterator[AuditedApiServer]:
    """A started AuditedApiServer with `nodes` created; stopped on the way out, whatever happened."""
    server = AuditedApiServer(workdir)
    try:
        server.start()
        core = k8s.CoreV1Api(server.admin_client())
        for node in nodes:
            core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=node, labels={"kubernetes.io/hostname": node})))
        yield server
    finally:
        server.stop()


def node_name(i: int) -> str:
    return f"{NODE_PREFIX}{i:03d}"


def node_names(n: int) -> tuple[str, ...]:
    return tuple(node_name(i) for i in range(n))


def account(i: int) -> str:
    return f"agent-{i:03d}"


def username(i: int) -> str:
    return f"system:serviceaccount:{NAMESPACE}:{account(i)}"


def agent_kubeconfigs(server: rig.ApiServer, n: int) -> list[Path]:
    """One ServiceAccount per agent, all bound to the agent's ClusterRole (the DaemonSet's rules and DRA mode's),
    and a kubeconfig with a token of each."""
    admin = server.admin_client()
    k8s.CoreV1Api(admin).create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=NAMESPACE)))
    rbac = k8s.RbacAuthorizationV1Api(admin)
    rbac.create_cluster_role({"metadata": {"name": ROLE}, "rules": AGENT_RULES})
    rbac.create_cluster_role_binding({
        "metadata": {"name": ROLE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": account(i), "namespace": NAMESPACE} for i in range(n)],
    })
    kubeconfigs = [server.service_account_kubeconfig(account(i), NAMESPACE) for i in range(n)]
    # As the DaemonSet: a Role to read the agents' own Pods, and a Pod of each agent, bound to its Node (no
    # kubelet runs it), so that each agent's start check reads its Pod as it does in a cluster.
    role = yaml.safe_load((REPO / "daemonset" / "role.yaml").read_text())
    rbac.create_namespaced_role(NAMESPACE, {"metadata": {"name": ROLE}, "rules": role["rules"]})
    rbac.create_namespaced_role_binding(NAMESPACE, {
        "metadata": {"name": ROLE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": account(i), "namespace": NAMESPACE} for i in range(n)],
    })
    tolerations = yaml.safe_load((REPO / "daemonset" / "daemonset.yaml").read_text())[
        "spec"]["template"]["spec"]["tolerations"]
    core = k8s.CoreV1Api(admin)
    for i in range(n):
        core.create_namespaced_pod(NAMESPACE, {
            "metadata": {"name": pod_name(i)},
            "spec": {"nodeName": node_name(i), "serviceAccountName": account(i),
                     "automountServiceAccountToken": False, "tolerations": tolerations,
                     "containers": [{"name": "agent", "image": "gpu-node-agent"}]},
        })
    return kubeconfigs


def pod_name(i: int) -> str:
    return f"gpu-node-agent-{i:03d}"


# --- the audit log ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    at: float
    """When the API server received it (time.time())."""
    agent: int
    verb: str
    resource: str
    code: int


class AuditLog:
    """The fleet's requests from the audit log, read incrementally; each request once, whatever its stages."""

    def __init__(self, path: Path, agents: int) -> None:
        self.path = path
        self._agents = {username(i): i for i in range(agents)}
        self._offset = 0
        self._seen: set[str] = set()
        self.requests: list[Request] = []

    def read(self) -> list[Request]:
        """Every request logged so far, in the order received."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.requests
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        for line in data[:end].splitlines():
            event = json.loads(line)
            audit_id = event["auditID"]
            agent = self._agents.get(event.get("user", {}).get("username", ""))
            if agent is None or audit_id in self._seen:
                continue
            self._seen.add(audit_id)
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            self.requests.append(Request(
                at=datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp(),
                agent=agent, verb=event.get("verb", ""), resource=resource or event.get("requestURI", ""),
                code=int((event.get("responseStatus") or {}).get("code", 0)),
            ))
        self.requests.sort(key=lambda r: r.at)
        return self.requests

    def between(self, start: float, end: float) -> list[Request]:
        return [r for r in self.read() if start <= r.at < end]


@dataclass(frozen=True)
class Tally:
    """The fleet's requests in one window."""

    agents: int
    requests: list[Request]
    window_s: float

    def per_agent(self) -> list[int]:
        counts = Counter(r.agent for r in self.requests)
        return [counts[i] for i in range(self.agents)]

    @property
    def writes(self) -> int:
        return sum(r.verb in WRITE_VERBS for r in self.requests)

    @property
    def spread_s(self) -> float:
        return round(self.requests[-1].at - self.requests[0].at, 2) if self.requests else 0.0

    def summary(self) -> dict[str, Any]:
        per_agent = self.per_agent()
        kinds = Counter(f"{r.verb} {r.resource} {r.code}" for r in self.requests)
        return {
            "window_s": round(self.window_s, 1),
            "requests": len(self.requests),
            "per_agent_max": max(per_agent, default=0),
            "per_agent_mean": round(len(self.requests) / self.agents, 2),
            "per_agent": per_agent,
            "writes": self.writes,
            "spread_s": self.spread_s,
            "by_verb_resource_code": dict(kinds.most_common()),
        }


# --- the agents ---------------------------------------------------------------------------------------------


def agent_config(directory: Path, dra: bool) -> str:
    """The agent's config: its state, PodResources socket and CDI root inside its own directory."""
    text = f"version: v1\nmig:\n  stateDir: {directory}/state\n  podResourcesSocket: {directory}/pod-resources.sock\n"
    if dra:
        text += f"dra:\n  enabled: true\n  cdiRoot: {directory}/cdi\n"
    return text


@dataclass
class Fleet:
    """N agent processes, each with its own Node, kubeconfig and short directory; stop() ends them all."""

    kubeconfigs: list[Path]
    dra: bool
    directories: list[Path] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    stopped: dict[int, int | None] = field(default_factory=dict)
    """The exit codes of the last stop() (None: still running after its grace, killed)."""

    def __post_init__(self) -> None:
        for _ in self.kubeconfigs:
            directory = short_dir()
            self.directories.append(directory)
            (directory / "device-plugins").mkdir(parents=True)
            (directory / "config.yaml").write_text(agent_config(directory, self.dra))

    def __len__(self) -> int:
        return len(self.kubeconfigs)

    def argv(self, i: int) -> list[str]:
        directory = self.directories[i]
        return [*AGENT, "run", "--nvml", f"mock:{PRESET}", "--config", str(directory / "config.yaml"),
                "--kubelet-dir", str(directory / "device-plugins"), "--node-name", node_name(i),
                "--kubeconfig", str(self.kubeconfigs[i]), "--metrics-port", "0"]

    def start(self, indices: range | list[int]) -> None:
        for i in indices:
            # env(1) execs the agent in the same process: its Pod as the downward API would name it.
            pod = ["env", f"POD_NAME={pod_name(i)}", f"POD_NAMESPACE={NAMESPACE}"]
            self.procs[i] = rig._spawn([*pod, *self.argv(i)], self.directories[i] / "agent.log")

    def stop(self, grace: float = 20.0) -> dict[int, int | None]:
        """SIGTERM to every agent at once, SIGKILL to those still running after `grace`; their exit codes."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        codes: dict[int, int | None] = {}
        for i, proc in self.procs.items():
            try:
                codes[i] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[i] = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs.clear()
        self.stopped = codes
        return codes

    def exited(self) -> dict[int, int]:
        """The agents that ended on their own, with their exit codes."""
        return {i: code for i, proc in self.procs.items() if (code := proc.poll()) is not None}

    def rss_bytes(self) -> list[int]:
        sizes = []
        for proc in self.procs.values():
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        sizes.append(int(line.split()[1]) * 1024)
        return sizes

    def log_tail(self, i: int, lines: int = 15) -> str:
        path = self.directories[i] / "agent.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def remove(self) -> None:
        self.stop()
        for directory in self.directories:
            shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def fleet(kubeconfigs: list[Path], dra: bool) -> Iterator[Fleet]:
    """A Fleet (not started); every agent stopped and every directory removed on the way out."""
    agents = Fleet(kubeconfigs, dra)
    try:
        yield agents
    finally:
        agents.remove()


# --- the Nodes, through the admin client ----------------------------------------------------------------------


class Nodes:
    """The fleet's Nodes as the admin client sees them (these requests are not in the audit log)."""

    def __init__(self, server: rig.ApiServer, n: int) -> None:
        self.names = node_names(n)
        self._core = k8s.CoreV1Api(server.admin_client())

    def labels(self) -> dict[str, str | None]:
        """Each Node's value of LABEL (None where it has none); {} while the API server does not answer."""
        try:
            items = self._core.list_node(_request_timeout=5).items
        except Exception:  # the server is restarting or away: nothing seen this time
            return {}
        found = {n.metadata.name: (n.metadata.labels or {}).get(LABEL) for n in items}
        return {name: found.get(name) for name in self.names if name in found}

    def remove_label(self) -> None:
        """Removes LABEL from every Node by hand, as a user would with kubectl label."""
        for name in self.names:
            self._core.patch_node(name, {"metadata": {"labels": {LABEL: None}}})

    def wait_labelled(self, names: tuple[str, ...] | list[str], timeout: float,
                      on_poll: Callable[[], None] = lambda: None) -> dict[str, float]:
        """When each Node was first seen with LABEL=LABEL_VALUE (time.time()); those never seen are missing."""
        seen: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while len(seen) < len(names) and time.monotonic() < deadline:
            now = time.time()
            labels = self.labels()
            for name in names:
                if name not in seen and labels.get(name) == LABEL_VALUE:
                    seen[name] = now
            on_poll()
            time.sleep(POLL_S)
        return seen


def wait_until_time(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


# --- the phases ---------------------------------------------------------------------------------------------


@dataclass
class After:
    """A disturbance: the fleet's requests from when it began until AFTER_WINDOW_S after the API server (or the
    fleet) was back, and the label repairs."""

    began: float
    back: float
    tally: Tally
    repaired_s: dict[str, float]
    """Per Node: seconds from `back` until its label was seen again; Nodes never repaired are missing."""

    def summary(self, nodes: int) -> dict[str, Any]:
        before = [r for r in self.tally.requests if r.at < self.back]
        return {
            **self.tally.summary(),
            "back_after_s": round(self.back - self.began, 1),
            "before_back": len(before),
            "repaired_max_s": max(self.repaired_s.values(), default=None),
            "not_repaired": nodes - len(self.repaired_s),
            "repaired_s": self.repaired_s,
        }


def after(audit: AuditLog, nodes: Nodes, agents: int, began: float, back: float, edit: bool = True) -> After:
    """Removes the label from every Node (unless `edit` is False: done already), waits for the repairs, and
    counts the fleet's requests from `began` until AFTER_WINDOW_S after `back`."""
    if edit:
        nodes.remove_label()
    seen = nodes.wait_labelled(nodes.names, back + AFTER_WINDOW_S - time.time())
    repaired = {name: round(at - back, 2) for name, at in seen.items()}
    end = back + AFTER_WINDOW_S
    wait_until_time(end)
    return After(began, back, Tally(agents, audit.between(began, end), end - began), repaired)


def apiserver_restart(server: AuditedApiServer, audit: AuditLog, nodes: Nodes, agents: int) -> After:
    """kube-apiserver stopped and started again at once (etcd kept)."""
    began = time.time()
    server.restart()
    return after(audit, nodes, agents, began, server.ready_at)


def outage(server: AuditedApiServer, audit: AuditLog, nodes: Nodes, agents: int, seconds: float = OUTAGE_S) -> After:
    """kube-apiserver stopped for `seconds`, then started (etcd kept)."""
    began = time.time()
    server.stop_apiserver()
    time.sleep(seconds)
    server.start_apiserver()
    return after(audit, nodes, agents, began, server.ready_at)


def agents_restart(agents: Fleet, audit: AuditLog, nodes: Nodes) -> After:
    """Every agent SIGTERMed at once; the label removed by hand while none runs; every agent started at once (the
    fleet is "back" when they were started)."""
    began = time.time()
    agents.stop()
    nodes.remove_label()
    back = time.time()
    agents.start(range(len(agents)))
    return after(audit, nodes, len(agents), began, back, edit=False)


@dataclass
class Start:
    per_agent: list[int]
    labelled_s: list[float]
    never_labelled: list[str]
    rss_bytes: list[int]
    wall_s: float

    def summary(self) -> dict[str, Any]:
        return {
            "per_agent_max": max(self.per_agent, default=0),
            "per_agent_mean": round(sum(self.per_agent) / max(1, len(self.per_agent)), 2),
            "per_agent": self.per_agent,
            "labelled_s_max": max(self.labelled_s, default=None),
            "never_labelled": self.never_labelled,
            "rss_total_mb": round(sum(self.rss_bytes) / 1e6, 1),
            "rss_per_agent_mb": round(sum(self.rss_bytes) / 1e6 / max(1, len(self.rss_bytes)), 1),
            "wall_s": round(self.wall_s, 1),
        }


def start(agents: Fleet, audit: AuditLog, nodes: Nodes, wave: int) -> Start:
    """Starts the agents in waves of `wave`, each wave once the one before has labelled its Nodes; counts each
    agent's requests from its start until its Node was seen labelled."""
    def alive() -> None:
        if dead := agents.exited():
            i, code = next(iter(dead.items()))
            raise RuntimeError(f"agent {i} exited with code {code} while starting:\n{agents.log_tail(i)}")

    began = time.time()
    started: dict[int, float] = {}
    labelled: dict[int, float] = {}
    for first in range(0, len(agents), wave):
        batch = range(first, min(first + wave, len(agents)))
        now = time.time()
        agents.start(batch)
        started.update(dict.fromkeys(batch, now))
        seen = nodes.wait_labelled([nodes.names[i] for i in batch], LABEL_TIMEOUT_S, alive)
        labelled.update({i: seen[nodes.names[i]] for i in batch if nodes.names[i] in seen})
    requests = audit.read()
    # An agent whose Node was never labelled: every request it made.
    per_agent = [sum(1 for r in requests if r.agent == i and started[i] <= r.at <= labelled.get(i, float("inf")))
                 for i in range(len(agents))]
    return Start(
        per_agent=per_agent,
        labelled_s=[round(labelled[i] - started[i], 2) for i in sorted(labelled)],
        never_labelled=[nodes.names[i] for i in range(len(agents)) if i not in labelled],
        rss_bytes=agents.rss_bytes(),
        wall_s=time.time() - began,
    )


def measure(n: int, dra: bool, steady_s: float, wave: int, workdir: Path,
            progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every phase for a fleet of `n` agents; the details that figures() turns into rows."""
    mode = "dra" if dra else "device-plugin"
    names = node_names(n)
    began = time.monotonic()
    with audited(workdir, names) as server:
        kubeconfigs = agent_kubeconfigs(server, n)
        audit = AuditLog(server.audit_log, n)
        nodes = Nodes(server, n)
        details: dict[str, Any] = {"mode": mode, "agents": n, "preset": PRESET, "wave": wave,
                                   "versions": rig.pinned_versions()}
        with fleet(kubeconfigs, dra) as agents:
            progress(f"{mode}: starting {n} agents in waves of {wave} ...")
            details["start"] = start(agents, audit, nodes, wave).summary()
            time.sleep(SETTLE_S)

            progress(f"{mode}: {steady_s:.0f} s of steady state ...")
            t0 = time.time()
            time.sleep(steady_s)
            t1 = time.time()
            details["steady"] = Tally(n, audit.between(t0, t1), t1 - t0).summary()

            progress(f"{mode}: kube-apiserver restart (etcd kept) ...")
            details["apiserver_restart"] = apiserver_restart(server, audit, nodes, n).summary(n)
            time.sleep(SETTLE_S)

            progress(f"{mode}: every agent restarted at once ...")
            details["agents_restart"] = agents_restart(agents, audit, nodes).summary(n)
            details["agents_restart"]["sigterm_exit_codes"] = dict(Counter(str(c) for c in agents.stopped.values()))
            time.sleep(SETTLE_S)

            progress(f"{mode}: kube-apiserver away for {OUTAGE_S:.0f} s ...")
            details["outage"] = outage(server, audit, nodes, n).summary(n)
            details["rss_end_bytes"] = agents.rss_bytes()
            details["exited"] = agents.exited()
        details["audit_log_bytes"] = server.audit_log.stat().st_size if server.audit_log.exists() else 0
    details["duration_s"] = round(time.monotonic() - began, 1)
    return details


# --- the figures --------------------------------------------------------------------------------------------

PHASES = {
    "apiserver_restart": ("kube-apiserver restarted (etcd kept)", "from its SIGTERM until 60 s after it was ready",
                          "after it was ready"),
    "agents_restart": ("every agent restarted at once", "from their SIGTERM until 60 s after they were started",
                       "after they were started"),
    "outage": (f"kube-apiserver away {OUTAGE_S:.0f} s", "from its SIGTERM until 60 s after it was ready",
               "after it was ready"),
}
"""Each disturbance: its name, its window (from the moment it began until AFTER_WINDOW_S after the API server, or
the fleet, was back), and what the repair time counts from."""


def figures(details: dict[str, Any], figure: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows for the results, made with bench/run.py's `figure` (and its row shape for an at-least budget)."""

    def at_least(key: str, label: str, value: float, unit: str, limit: float) -> dict[str, Any]:
        row = figure(key, label, value, unit, "==", limit)
        row["budget"]["op"] = ">="
        row["verdict"] = "pass" if value >= limit else "fail"
        return row

    mode, n = details["mode"], details["agents"]
    key = f"fleet.{mode}"
    where = f"{n} agents, {mode} mode ({PRESET})"
    start, steady = details["start"], details["steady"]
    window = f"{steady['window_s']:.0f} s window"
    hourly = round(steady["requests"] / n * 3600 / steady["window_s"], 2)
    rows = [
        figure(f"{key}.start.requests", f"Start: API requests per agent until its Node is labelled, max, {where}",
               start["per_agent_max"], "requests", "<=", START_BUDGET),
        figure(f"{key}.start.requests_mean", f"Start: API requests per agent until its Node is labelled, mean, "
               f"{where}", start["per_agent_mean"], "requests", "report"),
        figure(f"{key}.start.labelled", f"Start: agent started to its Node labelled, max, {where}",
               LABEL_TIMEOUT_S if start["never_labelled"] else start["labelled_s_max"], "s", "report"),
        figure(f"{key}.rss.total", f"RSS of all agents after start, {where}", start["rss_total_mb"], "MB", "report"),
        figure(f"{key}.rss.per_agent", f"RSS per agent after start, mean, {where}", start["rss_per_agent_mb"], "MB",
               "report"),
        figure(f"{key}.steady.writes", f"Steady state: API writes, all agents ({window}), {where}",
               steady["writes"], "writes", "==", STEADY_WRITES_BUDGET),
        figure(f"{key}.steady.requests", f"Steady state: API requests per agent-hour ({window}, scaled), {where}",
               hourly, "requests/h", "<=", STEADY_HOURLY_BUDGET),
    ]
    for phase, (name, span, since) in PHASES.items():
        after = details[phase]
        # A label never put back counts as the whole window.
        repaired = after["repaired_max_s"] if after["not_repaired"] == 0 else AFTER_WINDOW_S
        rows += [
            figure(f"{key}.{phase}.requests", f"{name}: API requests per agent {span}, max, {where}",
                   after["per_agent_max"], "requests", "<=", AFTER_BUDGET),
            figure(f"{key}.{phase}.requests_mean", f"{name}: API requests per agent {span}, mean, {where}",
                   after["per_agent_mean"], "requests", "report"),
            at_least(f"{key}.{phase}.spread", f"{name}: spread of the fleet's requests (first to last) {span}, "
                     f"{where}", after["spread_s"], "s", SPREAD_BUDGET_S),
            figure(f"{key}.{phase}.repair", f"{name}: an owned label removed by hand on every Node, back on all, "
                   f"seconds {since}, {where}", repaired, "s", "<=", REPAIR_BUDGET_S),
        ]
    rows.append(figure(f"{key}.rss.total_end", f"RSS of all agents at the end, {where}",
                       round(sum(details["rss_end_bytes"]) / 1e6, 1), "MB", "report"))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The figures for a terminal: verdict, value, unit and budget, then what the figure is."""

    def budget(row: dict[str, Any]) -> str:
        b = row["budget"]
        return "" if b is None else b if isinstance(b, str) else f"{b['op']} {b['limit']:g}"

    lines = [f"{'verdict':<7} {'value':>10} {'unit':<11} {'budget':<8} figure"]
    lines += [f"{row['verdict']:<7} {row['value']:>10g} {row['unit']:<11} {budget(row):<8} {row['figure']}"
              for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--agents", type=int, default=50, help="how many agents (default: %(default)s)")
    parser.add_argument("--mode", choices=("device-plugin", "dra", "both"), default="both")
    parser.add_argument("--steady-s", type=float, default=300.0,
                        help="the steady-state window in seconds (default: %(default)s)")
    parser.add_argument("--wave", type=int, default=5, help="agents started together at first (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=report.FLEET)
    parser.add_argument("--check", action="store_true", help="exit 1 when a figure misses its budget")
    args = parser.parse_args()
    if args.agents < 1 or args.wave < 1 or args.steady_s <= 0:
        parser.error("--agents and --wave must be at least 1 and --steady-s more than 0")
    from bench.run import figure

    rig.ensure_testbin()
    modes = [False, True] if args.mode == "both" else [args.mode == "dra"]
    rows: list[dict[str, Any]] = []
    runs = []
    started = time.monotonic()
    for dra in modes:
        with tempfile.TemporaryDirectory(prefix="gpu-agent-fleet-") as tmp:
            details = measure(args.agents, dra, args.steady_s, args.wave, Path(tmp), lambda s: print(s, flush=True))
        runs.append(details)
        rows += figures(details, figure)
    results = {
        "generated_by": "bench/fleet.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": {"nproc": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "figures": rows,
        "passed": all(row["verdict"] != "fail" for row in rows),
        "details": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(rows))
    if args.out == report.FLEET:
        print(f"rendered {report.write()}")
    failed = [row for row in rows if row["verdict"] == "fail"]
    print(f"{len(rows)} figures, {len(failed)} over budget; written to {args.out} ({results['duration_s']:.0f} s)")
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
