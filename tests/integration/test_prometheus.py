"""A real Prometheus (built by hack/prometheus.sh) scraping running agents on the fake NVML: every query of
dcgm-exporter's published Grafana dashboard and of the project's dashboard, and every shipped alert rule, returns
series for the simulated node; pod attribution as Prometheus stores it; promtool on the rules and on /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pynvml
import pytest
import yaml
from prometheus import PROMETHEUS, PROMTOOL, ensure_prometheus, promtool, running_prometheus

from agent.agent import Agent
from agent.config import parse_config
from agent.kube.node import ApiError
from agent.kube.view import NodeView
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import load_node
from agent.podresources_v1 import api_pb2 as pr
from agent.podresources_v1 import api_pb2_grpc as pr_grpc
from agent.simulate import InMemoryNode
from tests.builders import serving_pod_resources
from tests.plugin_harness import Rig as AgentRig
from tests.plugin_harness import carve_mig, running_agent, short_dir, wait_until

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "daemonset" / "monitoring" / "gpu-node-agent-rules.yaml"
RULE_TESTS = REPO / "tests" / "prometheus" / "rules.test.yaml"
DCGM_DASHBOARD = REPO / "tests" / "fixtures" / "dcgm-exporter" / "dcgm-exporter-dashboard.json"
OUR_DASHBOARD = REPO / "docs" / "grafana-dashboard.json"
CHARGEBACK_DASHBOARD = REPO / "docs" / "grafana-chargeback-dashboard.json"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def binaries() -> None:
    if not (PROMETHEUS.exists() and PROMTOOL.exists()):
        ensure_prometheus()
    ensure_prometheus()  # up to date: a fraction of a second


class PodResources(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources v1 Lister, serving whatever pods the test says hold devices: by pod name (in the
    namespace "ml") or by "<namespace>/<pod>"."""

    def __init__(self) -> None:
        self.pods: dict[str, list[str]] = {}

    async def List(self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(pod_resources=[
            pr.PodResources(name=pod.rpartition("/")[2], namespace=pod.rpartition("/")[0] or "ml",
                            containers=[pr.ContainerResources(name="main", devices=[
                                pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=ids)])])
            for pod, ids in self.pods.items()
        ])


class Node:
    def __init__(self, agent: Agent, fake: FakeNvml) -> None:
        self.agent, self.fake = agent, fake

    @property
    def port(self) -> int:
        assert self.agent.http is not None
        return self.agent.http.port

    def uuids(self) -> list[str]:
        return [g.uuid for g in self.agent.bus.current.inventory.gpus]


class ForgetfulApiServer(InMemoryNode):
    """A Node the agent can read but never watch: every watch is refused as expired (410 Gone), as by an API
    server that keeps no history. The agent lists again, backs off once it keeps happening, and counts both."""

    async def watch(self, resource_version: str) -> AsyncIterator[NodeView]:
        raise ApiError(410, "Expired", f"too old resource version: {resource_version}")
        yield  # an async generator, as the real watch is


SCRAPED_S = 45.0
"""How long a figure may take to reach Prometheus (scrape and rule intervals included)."""


def agent_config(directory: Path, **mig: object) -> Any:
    return parse_config(yaml.safe_dump({
        "version": "v1",
        "flags": {"migStrategy": "mixed"},
        "health": {"sampleIntervalSeconds": 0.2},
        "telemetry": {"intervalSeconds": 1},
        "mig": {"stateDir": f"{directory}/state", "podResourcesSocket": f"{directory}/pr/pr.sock", **mig},
    }))


QUADS = """\
version: v1
driver: {version: "570.133.20", cuda: "12.8"}
gpus:
""" + "".join(f"  - {{model: A100-SXM4-80GB, numa_node: {i // 4}}}\n" for i in range(8)) + "links:\n" + "".join(
    f"  - {{gpus: [{a}, {b}], nvlink: 4}}\n" for q in (0, 4) for a in range(q, q + 4) for b in range(a + 1, q + 4))
"""Eight A100s in two NVLink quads (each GPU's 12 links, 4 to each of the other three of its quad), a quad per NUMA
node: a pod on one GPU of each quad leaves 6 free, no 4 of them joined by NVLink, though 4 of the node's are."""


@dataclass
class Rig:
    node1: Node
    node2: Node
    node3: Node
    node4: Node
    lister: PodResources
    on_node1: AgentRig
    directory: Path

    async def restart_kubelet(self) -> None:
        """A kubelet restart on gpu-node-1: its sockets go, a new one serves, the agent registers again."""
        await self.on_node1.restart_kubelet()
        await self.on_node1.kubelet.wait_for(set(self.node1.agent.devices()), 10)


@asynccontextmanager
async def cluster() -> AsyncIterator[Rig]:
    """gpu-node-1: a DGX H100 registered with its kubelet, with PodResources; gpu-node-2: an H200 whose kubelet
    never answers the device plugin (the agent is not ready) and whose MIG label asks for a layout while a pod
    holds its GPU (the apply fails); gpu-node-3: an H200 whose only GPU is in MIG mode with no MIG device yet
    (nothing to advertise) and whose API server refuses every watch as expired; gpu-node-4: two NVLink quads with a
    pod on one GPU of each (its free GPUs fragmented)."""
    directory = short_dir()
    other, third, fourth = directory / "other", directory / "third", directory / "fourth"
    fake2 = FakeNvml(load_node("single-h200"))
    fourth.mkdir()
    (fourth / "quads.yaml").write_text(QUADS)
    fake4 = FakeNvml(load_node(str(fourth / "quads.yaml")))
    lister, lister2, lister4 = PodResources(), PodResources(), PodResources()
    lister2.pods = {"holder-0": [fake2.spec.gpus[0].uuid]}
    lister4.pods = {"quad-0": [fake4.spec.gpus[0].uuid], "quad-1": [fake4.spec.gpus[4].uuid]}
    servers = []
    for where, serving in ((directory, lister), (other, lister2), (fourth, lister4)):
        (where / "pr").mkdir(parents=True)
        server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(serving, server)
        server.add_insecure_port(f"unix://{where}/pr/pr.sock")
        await server.start()
        servers.append(server)
    (third / "pr").mkdir(parents=True)  # its kubelet has not made its PodResources socket
    fake3 = FakeNvml(load_node("single-h200"))
    carve_mig(fake3, 0, [])
    node2 = InMemoryNode("gpu-node-2")
    try:
        async with (
            running_agent("dgx-h100", agent_config(directory), metrics_port=0, directory=directory) as one,
            running_agent("single-h200", agent_config(other), fake=fake2, kube=node2, kubelet_first=False,
                          metrics_port=0, directory=other) as two,
        ):
            await node2.patch_metadata({"nvidia.com/mig.config": "all-1g.18gb"}, {})
            async with (
                running_agent("single-h200", agent_config(third), fake=fake3, kubelet_first=False,
                              kube=ForgetfulApiServer("gpu-node-3"), metrics_port=0, directory=third) as three,
                running_agent("quads", agent_config(fourth), fake=fake4, metrics_port=0, directory=fourth) as four,
            ):
                yield Rig(Node(one.agent, one.fake), Node(two.agent, fake2), Node(three.agent, fake3),
                          Node(four.agent, fake4), lister, one, directory)
    finally:
        for server in servers:
            await server.stop(None)
        shutil.rmtree(directory, ignore_errors=True)


def dashboard_queries(path: Path) -> list[str]:
    board = json.loads(path.read_text())

    def panels(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [p for item in items for p in [item, *panels(item.get("panels", []))]]

    return [t["expr"] for p in panels(board["panels"]) for t in p.get("targets", []) if t.get("expr")]


def grafana(expr: str, instance: str) -> str:
    """A dashboard expression as Grafana sends it with the node picked and every GPU: variables substituted."""
    return (expr.replace("$instance", instance).replace("$node", instance).replace("$gpu", ".+")
            .replace("$__rate_interval", "1m").replace("$__range", "5m"))




async def test_a_real_prometheus_sees_every_dashboard_query_and_every_alert() -> None:
    async with cluster() as rig:
        node1, lister = rig.node1, rig.lister
        gpus = node1.uuids()
        lister.pods = {"trainer-0": [gpus[2], gpus[5]], "idle-0": [gpus[6]]}
        fake = node1.fake
        fake.inject_xid(0, 79)  # node-fatal class
        fake.inject_xid(1, 13)  # application class
        fake.inject_xid(3, 63)  # warning class
        fake.set_ecc_uncorrected(4, 1)  # a double-bit error: XID 48 (unhealthy class) and the ECC count
        fake.set_remapped_rows(2, failure=True)
        fake.set_clocks_event_reasons(3, pynvml.nvmlClocksEventReasonHwThermalSlowdown
                                      | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown)
        fake.set_temperature(3, 90)
        fake.set_workload(5, 0.9, 0.99)  # trainer-0 fills GPU 5's memory
        fake.set_workload(6, 0.0)  # idle-0 holds GPU 6 and does nothing with it
        fake.set_gpu_lost(7)
        targets = {"gpu-node-1": node1.port, "gpu-node-2": rig.node2.port, "gpu-node-3": rig.node3.port,
                   "gpu-node-4": rig.node4.port}
        with running_prometheus(rig.directory, targets, [RULES]) as prom:
            # Four kubelet restarts once Prometheus watches: each one a registration again.
            await wait_until(lambda: prom.query('gpu_agent_kubelet_registrations_total{instance="gpu-node-1"}'),
                             SCRAPED_S, "the first registration scraped", blocking=True)
            for _ in range(4):
                await rig.restart_kubelet()

            # Per-pod attribution as Prometheus stores it: trainer-0 on exactly GPUs 2 and 5.
            def trainer_gpus() -> list[str]:
                series = prom.query('DCGM_FI_DEV_GPU_UTIL{instance="gpu-node-1",pod="trainer-0"}')
                return sorted(s["metric"]["gpu"] for s in series)

            assert await wait_until(lambda: trainer_gpus() == ["2", "5"], SCRAPED_S, "trainer-0 on GPUs 2 and 5",
                                    blocking=True)
            [labels] = [s["metric"] for s in prom.query('DCGM_FI_DEV_FB_USED{instance="gpu-node-1",gpu="2"}')]
            assert (labels["namespace"], labels["container"], labels["UUID"], labels["Hostname"] != "") == (
                "ml", "main", gpus[2], True)

            def returns_series(expr: str) -> bool:
                return bool(prom.query(expr))

            # Every query of dcgm-exporter's dashboard returns series for the simulated node, and its variables'
            # label_values list the nodes and GPUs.
            dcgm_queries = dashboard_queries(DCGM_DASHBOARD)
            assert len(dcgm_queries) == 8
            for expr in dcgm_queries:
                query = grafana(expr, "gpu-node-1")
                assert await wait_until(lambda q=query: returns_series(q), SCRAPED_S, query, blocking=True), query
            def instances() -> list[str]:
                found: list[str] = prom.get("/api/v1/label/instance/values", **{"match[]": "DCGM_FI_DEV_GPU_TEMP"})
                return found

            assert await wait_until(lambda: instances() == ["gpu-node-1", "gpu-node-2", "gpu-node-3", "gpu-node-4"],
                                    SCRAPED_S,
                                    "every node's GPUs", blocking=True)
            gpu_values = prom.get("/api/v1/label/gpu/values",
                                  **{"match[]": 'DCGM_FI_DEV_GPU_TEMP{instance="gpu-node-1"}'})
            assert gpu_values == [str(i) for i in range(7)]  # GPU 7 is lost: no series
            # The project's dashboard: every query is valid PromQL, and each that reads dcgm-exporter's names
            # (its GPU panels) returns series.
            for expr in dashboard_queries(OUR_DASHBOARD):
                query = grafana(expr, "gpu-node-1|gpu-node-2")
                await asyncio.to_thread(prom.query, query)
                if "DCGM_FI_" in query or "xid_errors" in query:
                    assert await wait_until(lambda q=query: returns_series(q), SCRAPED_S, query, blocking=True), query
            tensor = prom.query('DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance="gpu-node-1"}')
            assert len(tensor) == 7

            # The alerts users write against dcgm-exporter's names.
            for expr in ('DCGM_FI_DEV_XID_ERRORS{instance="gpu-node-1"} > 0',
                         'DCGM_FI_DEV_GPU_TEMP{instance="gpu-node-1"} > 85',
                         'DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) > 0.95',
                         'DCGM_FI_DEV_ROW_REMAP_FAILURE > 0',
                         'avg_over_time(DCGM_FI_DEV_GPU_UTIL{pod!=""}[5m]) < 5'):
                assert await wait_until(lambda e=expr: returns_series(e), SCRAPED_S, expr, blocking=True), expr
            [xid] = prom.query('DCGM_FI_DEV_XID_ERRORS{instance="gpu-node-1",gpu="0"}')
            assert (xid["value"][1], xid["metric"]["err_msg"]) == ("79", "GPU has fallen off the bus")

            # Every shipped alert: its expression returns series, and Prometheus itself has it pending or firing.
            rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
            for rule in rules:
                assert await wait_until(lambda r=rule: returns_series(r["expr"]), SCRAPED_S, rule["alert"],
                                        blocking=True), rule["alert"]

            def alerting() -> set[str]:
                return {s["metric"]["alertname"] for s in prom.query("ALERTS")}

            assert await wait_until(lambda: alerting() >= {r["alert"] for r in rules}, SCRAPED_S,
                                    "every alert pending or firing", blocking=True)
            where = {r["alert"]: sorted({(s["metric"]["instance"] if "instance" in s["metric"] else
                                          s["metric"].get("Hostname", "")) for s in prom.query(r["expr"])})
                     for r in rules}
            assert where["GPUAgentNotReady"] == ["gpu-node-2", "gpu-node-3"]
            assert where["GPUMigReconfigurationFailed"] == ["gpu-node-2"]
            assert where["GPULost"] == ["gpu-node-1"]
            assert where["GPUKubeletRegistrationsFlapping"] == ["gpu-node-1"]
            assert where["GPUAgentAdvertisesNothing"] == ["gpu-node-3"]
            assert where["GPUAgentAPIErrors"] == ["gpu-node-3"]
            assert where["GPUAgentRelistStorm"] == ["gpu-node-3"]
            # Six free on gpu-node-4, at most three of them NVLink-joined (the rule's arithmetic is unit-tested in
            # tests/prometheus/rules.test.yaml); the other nodes have fewer than four free.
            assert where["GPUFreeButFragmented"] == ["gpu-node-4"]
            assert [(s["metric"]["instance"], s["value"][1])
                    for s in prom.query("instance:gpu_agent_free_gpus:fragmented_nvlink4")] == [("gpu-node-4", "6")]

            # The PromQL in docs/metrics.md is valid (Prometheus would answer an error otherwise).
            blocks = re.findall(r"```promql\n(.*?)```", (REPO / "docs" / "metrics.md").read_text(), re.S)
            assert blocks
            for block in blocks:
                await asyncio.to_thread(prom.query, " ".join(block.split()))

            # The pod ends: its labels leave the series at the next pass and scrape.
            lister.pods = {"idle-0": [gpus[6]]}
            assert await wait_until(lambda: trainer_gpus() == [], SCRAPED_S, "trainer-0 gone", blocking=True)
            assert await wait_until(lambda: len(prom.query('DCGM_FI_DEV_GPU_UTIL{instance="gpu-node-1",gpu="2"}'))
                                    == 1, SCRAPED_S, "GPU 2 back to one series", blocking=True)


class ManualClock:
    """A monotonic clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_chargeback_dashboard_adds_up_what_prometheus_stored() -> None:
    """The GPU-seconds counters as a real Prometheus stores them, and every query of the chargeback dashboard over
    them. The agent's GPU-seconds are counted on a clock the test moves, so the totals are known exactly; each
    query is evaluated at the last scrape, as Grafana evaluates an instant query at the end of its range."""
    directory = short_dir()
    (directory / "pr").mkdir(parents=True)
    try:
        async with serving_pod_resources(directory / "pr" / "pr.sock", PodResources()) as lister, \
                running_agent("dgx-h100", agent_config(directory), metrics_port=0, directory=directory) as one:
            agent, fake = one.agent, one.fake
            assert agent.http is not None
            clock = ManualClock()
            agent.telemetry.clock = clock
            gpus = [g.uuid for g in agent.bus.current.inventory.gpus]
            fake.set_workload(0, 0.9)
            fake.set_workload(1, 0.0)  # research holds GPU 1 and leaves it idle
            fake.set_workload(2, 0.7)
            with running_prometheus(directory, {"gpu-node-1": agent.http.port}, []) as prom:
                lister.pods = {"research/train": [gpus[0], gpus[1]], "batch/job": [gpus[2]]}

                def held() -> dict[str, float]:
                    return {s["metric"]["namespace"]: float(s["value"][1])
                            for s in prom.query('gpu_agent_namespace_gpu_seconds_total{instance="gpu-node-1"}')}

                # Both namespaces' series stored at 0 before any second is counted.
                await wait_until(lambda: held() == {"research": 0.0, "batch": 0.0}, SCRAPED_S,
                                 "both namespaces at 0", blocking=True)
                # Four times 1.5 s, each counted by the next pass (1.5 s is under the cap of 2 intervals).
                for _ in range(4):
                    passes = agent.telemetry.passes
                    clock.now += 1.5
                    await wait_until(lambda p=passes: agent.telemetry.passes >= p + 2, 10, "a pass after the move")
                # research: 2 GPUs x 6 s = 12 GPU-seconds, 6 of them idle (GPU 1); batch: 1 GPU x 6 s, busy.
                await wait_until(lambda: held() == {"research": 12.0, "batch": 6.0}, SCRAPED_S, "12 and 6 stored",
                                 blocking=True)
                [last] = prom.query('timestamp(gpu_agent_namespace_gpu_seconds_total{namespace="research"})')
                at = last["value"][1]

                def answer(expr: str) -> dict[str, float]:
                    query = expr.replace("$node", "gpu-node-1").replace("$__range", "1h").replace("$cost", "2.5")
                    return {s["metric"].get("namespace", ""): float(s["value"][1]) for s in prom.query(query, at)}

                expected = {
                    # The four stats: research 12 + batch 6 = 18 GPU-seconds, 6 idle; at 2.5 a GPU-hour.
                    "GPU-hours": [{"": 18 / 3600}],
                    "Idle GPU-hours": [{"": 6 / 3600}],
                    "Cost": [{"": 18 / 3600 * 2.5}],
                    "Idle cost": [{"": 6 / 3600 * 2.5}],
                    # The table: GPU-hours, idle GPU-hours, idle share, cost, idle cost, per namespace.
                    "Per namespace": [
                        {"research": 12 / 3600, "batch": 6 / 3600},
                        {"research": 6 / 3600, "batch": 0.0},
                        {"research": 0.5, "batch": 0.0},
                        {"research": 12 / 3600 * 2.5, "batch": 6 / 3600 * 2.5},
                        {"research": 6 / 3600 * 2.5, "batch": 0.0},
                    ],
                }
                board = json.loads(CHARGEBACK_DASHBOARD.read_text())
                answers = {p["title"]: [answer(t["expr"]) for t in p["targets"]] for p in board["panels"]}
                assert answers == expected
                variables = {v["name"]: v["type"] for v in board["templating"]["list"]}
                assert variables == {"datasource": "datasource", "node": "query", "cost": "textbox"}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def metrics_of(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


SAMPLE_NAME = re.compile(r"^(?:# (?:HELP|TYPE) )?([A-Za-z_:][A-Za-z0-9_:]*)")


def only(text: str, prefix: str) -> str:
    return "".join(line + "\n" for line in text.splitlines()
                   if (m := SAMPLE_NAME.match(line)) and m[1].startswith(prefix))


async def test_promtool_checks_the_agents_exposition() -> None:
    async with cluster() as rig:
        node1 = rig.node1
        rig.lister.pods = {"trainer-0": [node1.uuids()[1]]}
        while node1.agent.telemetry.passes < 2:
            await asyncio.sleep(0.1)
        text = await asyncio.to_thread(metrics_of, node1.port)
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE{" in text and "gpu_agent_gpu_healthy{" in text
    # The whole exposition parses.
    whole = promtool("check", "metrics", "--extended", "--lint=none", stdin=text)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    # The agent's own family passes every lint.
    own = promtool("check", "metrics", stdin=only(text, "gpu_agent_"))
    assert own.returncode == 0, own.stdout + own.stderr
    # dcgm-exporter's names break three lints by design, and only those: its counters have no _total suffix,
    # one counter is named ..._COUNTER, and its modelName label is camelCase. Kept, so existing dashboards and
    # alerts work unchanged.
    dcgm = promtool("check", "metrics", stdin=only(text, "DCGM_"))
    problems = sorted({line.strip() for line in (dcgm.stdout + dcgm.stderr).splitlines() if line.strip()})
    counters = sorted(n for n in re.findall(r"# TYPE (\S+) counter", text) if n.startswith("DCGM_"))
    assert counters == ["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
                        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"]
    families = set(re.findall(r"# TYPE (DCGM_\S+) ", text))
    assert len(families) == 25
    expected = sorted({f'{n} counter metrics should have "_total" suffix' for n in counters}
                      | {f"{n} label names should be written in 'snake_case' not 'camelCase'" for n in families}
                      | {"DCGM_FI_DEV_PCIE_REPLAY_COUNTER metric name should not include type 'counter'"})
    assert problems == expected, "\n".join(problems)


def test_promtool_checks_and_unit_tests_the_shipped_rules() -> None:
    check = promtool("check", "rules", str(RULES))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 22 rules found" in check.stdout
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_a_broken_rule_fails_the_rule_tests(tmp_path: Path) -> None:
    """The rule tests can fail: with GPULost's threshold changed they do."""
    broken = tmp_path / "rules.yaml"
    broken.write_text(RULES.read_text().replace("gpu_agent_gpu_lost == 1", "gpu_agent_gpu_lost == 2"))
    suite = tmp_path / "rules.test.yaml"
    suite.write_text(RULE_TESTS.read_text().replace("../../daemonset/monitoring/gpu-node-agent-rules.yaml",
                                                    str(broken)))
    tested = promtool("test", "rules", str(suite))
    assert tested.returncode != 0
    assert "alertname: GPULost" in tested.stdout + tested.stderr
