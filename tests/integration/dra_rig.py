"""DRA on the test rig: the real kube-scheduler and kube-controller-manager (its resourceclaim controller only)
against the rig's kube-apiserver, schedulable Nodes, the DeviceClass of the agent's driver, and the agent's
own ServiceAccount with the RBAC DRA mode needs."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from apiserver import KUBE_BIN, REPO, ApiServer, _spawn, _stop_group, wait_until
from kubernetes import client as k8s

from agent.agent import Agent
from agent.config import parse_config
from agent.kube.node import NodeApi
from agent.nvml.fake import FakeNvml
from tests.plugin_harness import running_agent, short_dir
from tests.releases import emulation_to_turn_off, gates_turned_off, release_name

DRIVER = "gpu.gpu-node-agent.io"
DEVICE_CLASS = "gpu.gpu-node-agent.io"
MIG_CLASS = "mig.gpu-node-agent.io"
GROUP, VERSION = "resource.k8s.io", "v1"
NAMESPACE = "dra-test"
AGENT_NAMESPACE = "gpu-node-agent-dra"
AGENT_ACCOUNT = "gpu-node-agent"



SHIPPED = REPO / "deployments" / "dra"


def shipped(name: str) -> list[dict[str, Any]]:
    """The objects of one file of deployments/dra/."""
    return [doc for doc in yaml.safe_load_all((SHIPPED / name).read_text()) if doc]


def example(name: str) -> dict[str, Any]:
    """The claim spec of a ResourceClaimTemplate in deployments/dra/examples/."""
    spec: dict[str, Any] = shipped(f"examples/{name}")[0]["spec"]["spec"]
    return spec


AGENT_RULES = [
    *yaml.safe_load((REPO / "daemonset" / "clusterrole.yaml").read_text())["rules"],
    *shipped("clusterrole.yaml")[0]["rules"],
]
"""The DaemonSet's ClusterRole and what DRA mode adds (deployments/dra/clusterrole.yaml)."""


class GatedApiServer(ApiServer):
    """The rig's etcd and kube-apiserver with `--feature-gates=<gates>` (e.g. "DRADeviceTaints=true") and,
    when given, `--runtime-config=<runtime_config>` (an alpha API version a gated feature needs).

    Gates turned off that `release` (the rig's release, as its API server says: `apiserver.release()`) has locked
    on are taken off by emulating the last release where each could be turned off (`--emulated-version`;
    tests/releases.py, `emulation_to_turn_off`): the fallback a user of that release meets, never a skipped test.
    `emulated` is that release, or None; `behaves_as()` asks the running server."""

    def __init__(self, workdir: Path, gates: str, runtime_config: str = "",
                 release: tuple[int, int] | None = None) -> None:
        super().__init__(workdir)
        self.gates = gates
        self.runtime_config = runtime_config
        self.emulated: tuple[int, int] | None = None
        if gates_turned_off(gates):
            if release is None:
                raise TypeError(f"GatedApiServer({gates!r}) turns gates off: pass the rig's release "
                                "(apiserver.release()), which may have them locked on")
            self.emulated = emulation_to_turn_off(gates, release)

    def _start_apiserver(self) -> None:
        import apiserver as rig

        spawn = rig._spawn

        def gated(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
            if Path(argv[0]).name == "kube-apiserver":
                argv = [*argv, f"--feature-gates={self.gates}"]
                if self.runtime_config:
                    argv.append(f"--runtime-config={self.runtime_config}")
                if self.emulated is not None:
                    argv.append(f"--emulated-version={release_name(self.emulated)}")
            return spawn(argv, log_path)

        rig._spawn = gated
        try:
            super()._start_apiserver()
        finally:
            rig._spawn = spawn


@contextlib.contextmanager
def gated_apiserver(workdir: Path, gates: str, runtime_config: str = "",
                    release: tuple[int, int] | None = None) -> Iterator[GatedApiServer]:
    """A started GatedApiServer, stopped on the way out whatever happened. One that emulates an earlier release
    is checked to say so in /version, and says so on the test's output."""
    rig = GatedApiServer(workdir, gates, runtime_config, release)
    try:
        rig.start()
        if rig.emulated is not None:
            assert release is not None
            assert rig.behaves_as() == rig.emulated, (rig.behaves_as(), rig.emulated)
            print(f"Kubernetes {release_name(release)} locks on a gate of {gates}: the API server emulates "
                  f"{release_name(rig.emulated)} (--emulated-version={release_name(rig.emulated)})")
        yield rig
    finally:
        rig.stop()


@dataclass
class ControlPlane:
    """kube-scheduler and kube-controller-manager, each in its own process group, with the admin identity
    (and `feature_gates` on both, when given, with `--emulated-version` where they turn off a gate the release
    locked on)."""

    apiserver: ApiServer
    workdir: Path
    feature_gates: str = ""

    def __post_init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        """Start both; return once each has logged that it runs (its flags and config taken), or raise with the
        end of the log of one that exited."""
        kubeconfig = str(self.apiserver.kubeconfig_path)
        gates = [f"--feature-gates={self.feature_gates}"] if self.feature_gates else []
        # A gate turned off that the release locked on: emulate the last release that could (as GatedApiServer).
        if gates_turned_off(self.feature_gates):
            emulated = emulation_to_turn_off(self.feature_gates, self.apiserver.release())
            if emulated is not None:
                gates.append(f"--emulated-version={release_name(emulated)}")
        started = [
            ("kube-scheduler", "Starting Kubernetes Scheduler", [
                "--leader-elect=false", "--secure-port=0", "--v=2", *gates]),
            ("kube-controller-manager", "Starting resource claim controller", [
                "--leader-elect=false", "--secure-port=0", "--controllers=resourceclaim-controller", "--v=2", *gates]),
        ]
        for name, line, args in started:
            log_path = self.workdir / f"{name}.log"
            before = log_path.stat().st_size if log_path.exists() else 0
            proc = _spawn([str(KUBE_BIN / name), f"--kubeconfig={kubeconfig}", *args], log_path)
            self._procs.append(proc)

            def running(proc: subprocess.Popen[bytes] = proc, log_path: Path = log_path, before: int = before,
                        name: str = name, line: str = line) -> bool:
                with log_path.open("rb") as log:
                    log.seek(before)
                    text = log.read().decode(errors="replace")
                if proc.poll() is not None:
                    tail = "\n".join(text.splitlines()[-20:])
                    raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail}")
                return line in text

            wait_until(running, 60, f"{name} to log {line!r}")

    def stop(self) -> None:
        for proc in self._procs:
            _stop_group(proc)
        self._procs.clear()


@contextlib.contextmanager
def control_plane(apiserver: ApiServer, workdir: Path, feature_gates: str = "") -> Iterator[ControlPlane]:
    plane = ControlPlane(apiserver, workdir, feature_gates)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


def setup_cluster(apiserver: ApiServer) -> None:
    """The DeviceClass, the test namespace and the agent's account with its ClusterRole (idempotent)."""
    admin = apiserver.admin_client()
    core, rbac = k8s.CoreV1Api(admin), k8s.RbacAuthorizationV1Api(admin)
    custom = k8s.CustomObjectsApi(admin)
    for namespace in (NAMESPACE, AGENT_NAMESPACE):
        with contextlib.suppress(k8s.ApiException):
            core.create_namespace({"metadata": {"name": namespace}})
    with contextlib.suppress(k8s.ApiException):  # no controller-manager makes it here
        core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "default"}})
    for device_class in shipped("deviceclass.yaml"):
        with contextlib.suppress(k8s.ApiException):
            custom.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", device_class)
    with contextlib.suppress(k8s.ApiException):
        rbac.create_cluster_role({"metadata": {"name": "dra-rig-agent"}, "rules": AGENT_RULES})
    with contextlib.suppress(k8s.ApiException):
        rbac.create_cluster_role_binding({
            "metadata": {"name": "dra-rig-agent"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "dra-rig-agent"},
            "subjects": [{"kind": "ServiceAccount", "name": AGENT_ACCOUNT, "namespace": AGENT_NAMESPACE}],
        })


def create_schedulable_node(apiserver: ApiServer, name: str) -> None:
    """A Node the scheduler places pods on: Ready, with room for pods (no kubelet runs for it)."""
    core = k8s.CoreV1Api(apiserver.admin_client())
    core.create_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
    room = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_node_status(name, {"status": {"capacity": room, "allocatable": room, "conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ready",
         "lastHeartbeatTime": now, "lastTransitionTime": now}]}})
    # The API server taints a new Node not-ready; the node lifecycle controller, not run here, would lift it.
    core.patch_node(name, {"spec": {"taints": None}})


def delete_node(apiserver: ApiServer, name: str) -> None:
    core = k8s.CoreV1Api(apiserver.admin_client())
    with contextlib.suppress(k8s.ApiException):
        core.delete_node(name)


def slices_of(apiserver: ApiServer, node: str) -> list[dict[str, Any]]:
    custom = k8s.CustomObjectsApi(apiserver.admin_client())
    listed = custom.list_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                               field_selector=f"spec.nodeName={node}")
    return list(listed["items"])


def create_claim(apiserver: ApiServer, name: str, spec: dict[str, Any]) -> None:
    custom = k8s.CustomObjectsApi(apiserver.admin_client())
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "resourceclaims", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": spec})


def create_template(apiserver: ApiServer, name: str, spec: dict[str, Any]) -> None:
    custom = k8s.CustomObjectsApi(apiserver.admin_client())
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "resourceclaimtemplates", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": spec}})


def create_pod(apiserver: ApiServer, name: str, claim: str | None = None, template: str | None = None) -> None:
    """A pod with one claim (a ResourceClaim by name or one made from a template), for the scheduler."""
    source = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
    core = k8s.CoreV1Api(apiserver.admin_client())
    core.create_namespaced_pod(NAMESPACE, {"metadata": {"name": name}, "spec": {
        "resourceClaims": [{"name": "gpus", **source}],
        "containers": [{"name": "main", "image": "registry.invalid/cuda:test",
                        "resources": {"claims": [{"name": "gpus"}]}}],
    }})


def pod(apiserver: ApiServer, name: str) -> Any:
    return k8s.CoreV1Api(apiserver.admin_client()).read_namespaced_pod(name, NAMESPACE)


def claim_of_pod(apiserver: ApiServer, pod_name: str) -> dict[str, Any] | None:
    """The ResourceClaim a pod uses (by name, or the one made for it from its template); None before it exists."""
    seen = pod(apiserver, pod_name)
    custom = k8s.CustomObjectsApi(apiserver.admin_client())
    spec_claim = seen.spec.resource_claims[0]
    name = spec_claim.resource_claim_name
    if name is None:
        statuses = (seen.status.resource_claim_statuses or []) if seen.status else []
        name = next((s.resource_claim_name for s in statuses if s.name == "gpus"), None)
        if name is None:
            return None
    found: dict[str, Any] = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "resourceclaims", name)
    return found


def allocated(apiserver: ApiServer, pod_name: str, timeout: float = 60.0) -> tuple[str, list[tuple[str, str, str]]]:
    """Once the scheduler allocated the pod's claim: the node it bound the pod to and the claim's results as
    (request, pool, device)."""
    result: dict[str, Any] = {}

    def done() -> bool:
        claim = claim_of_pod(apiserver, pod_name)
        bound = pod(apiserver, pod_name).spec.node_name
        if claim is None or not bound or not (claim.get("status") or {}).get("allocation"):
            return False
        result.update(claim=claim, node=bound)
        return True

    wait_until(done, timeout, f"the claim of pod {pod_name} to be allocated")
    results = result["claim"]["status"]["allocation"]["devices"]["results"]
    assert {r["driver"] for r in results} == {DRIVER}
    return result["node"], sorted((r["request"], r["pool"], r["device"]) for r in results)


def unschedulable(apiserver: ApiServer, pod_name: str, timeout: float = 60.0) -> str:
    """Once the scheduler tried and failed: its message in the pod's PodScheduled condition."""
    found: list[str] = []

    def tried() -> bool:
        seen = pod(apiserver, pod_name)
        for condition in (seen.status.conditions or []) if seen.status else []:
            if condition.type == "PodScheduled" and condition.status == "False":
                found.append(condition.message or "")
                return condition.reason == "Unschedulable"
        return False

    wait_until(tried, timeout, f"the scheduler to find no place for pod {pod_name}")
    return found[-1]


def remove_workloads(apiserver: ApiServer) -> None:
    """Delete the test namespace's pods (at once: no kubelet runs them), claims and templates, so that a pod a
    test left pending is not scheduled onto the next test's node."""
    admin = apiserver.admin_client()
    core, custom = k8s.CoreV1Api(admin), k8s.CustomObjectsApi(admin)
    core.delete_collection_namespaced_pod(NAMESPACE, grace_period_seconds=0)
    for plural in ("resourceclaims", "resourceclaimtemplates"):
        custom.delete_collection_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural)
    wait_until(lambda: not core.list_namespaced_pod(NAMESPACE).items, 30, f"the pods of {NAMESPACE} to go")


@contextlib.asynccontextmanager
async def dra_agent(apiserver: ApiServer, kubeconfig: Path, node: str, preset: str, root: Path | None = None,
                    fake: FakeNvml | None = None, keep: bool = False, config: str = "", dra: str = "",
                    recovery_checks: int = 15) -> AsyncIterator[tuple[Agent, FakeNvml]]:
    """The agent in DRA mode on a simulated node, for a schedulable Node `node` made for it (unless `keep`
    and it exists). `root` (a fresh short directory by default) is the kubelet's root (device-plugins,
    plugins_registry, plugins/<driver>/), as long as /var/lib/kubelet, so that the DRA sockets with a Pod UID in
    their names would fit as on a node (the agent refuses a driver name whose sockets could not:
    agent/checks.py, check_dra_sockets); the CDI directory (cdi), the MIG state and the PodResources socket are
    there too.
    `config` adds top-level sections to the agent's config, `dra` keys to its dra section (", dynamicMig: true").
    Health is sampled every 0.1 s, and a fault ends after `recovery_checks` clean samples (1.5 s by default: long
    enough for a test to see what the fault did before it ends by itself)."""
    if not (keep and await asyncio.to_thread(node_exists, apiserver, node)):
        await asyncio.to_thread(create_schedulable_node, apiserver, node)
    directory = root or short_dir()
    kubelet_dir = directory / "device-plugins"
    kubelet_dir.mkdir(parents=True, exist_ok=True)
    in_force = parse_config(f"version: v1\ndra: {{enabled: true, cdiRoot: {directory}/cdi{dra}}}\n"
                            f"mig: {{stateDir: {directory}/state, podResourcesSocket: {directory}/pr.sock}}\n"
                            f"health: {{sampleIntervalSeconds: 0.1, recoveryChecks: {recovery_checks}}}\n{config}")
    api = await NodeApi.connect(kubeconfig, node)
    try:
        async with running_agent(preset, in_force, kube=api, fake=fake, kubelet_first=False,
                                 directory=kubelet_dir) as rig:
            assert rig.agent.dra is not None
            await asyncio.wait_for(rig.agent.dra.slices.published.wait(), 20)
            try:
                yield rig.agent, rig.fake
            finally:
                if not keep:
                    await asyncio.to_thread(remove_workloads, apiserver)
    finally:
        if root is None:
            shutil.rmtree(directory, ignore_errors=True)
        if not keep:
            await asyncio.to_thread(delete_node, apiserver, node)


def node_exists(apiserver: ApiServer, name: str) -> bool:
    try:
        k8s.CoreV1Api(apiserver.admin_client()).read_node(name)
    except k8s.ApiException as err:
        if err.status == 404:
            return False
        raise
    return True
