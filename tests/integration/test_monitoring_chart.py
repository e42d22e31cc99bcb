"""The chart's Prometheus Operator objects through the pinned helm (hack/helm.sh): off by default; serviceMonitor.*
and prometheusRule.* values shape a ServiceMonitor (with the Service it selects) and a PrometheusRule carrying the
shipped rules unrendered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.releases import kube_release

REPO = Path(__file__).resolve().parents[2]
TESTBIN = Path(os.environ.get("TESTBIN_DIR", REPO / ".cache" / "testbin"))
HELM = TESTBIN / "helm"
CHART = REPO / "deployments" / "helm" / "gpu-node-agent"
RULES = REPO / "daemonset" / "monitoring" / "gpu-node-agent-rules.yaml"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", autouse=True)
def helm() -> None:
    env = {**os.environ, "TESTBIN_DIR": str(TESTBIN)}
    result = subprocess.run(["bash", str(REPO / "hack" / "helm.sh")], env=env, stdout=sys.stderr, check=False)
    assert result.returncode == 0, "hack/helm.sh failed"


def render(*sets: str) -> list[dict[str, Any]]:
    # No cluster is asked: render for the rig's release, as the chart's kubeVersion (>= 1.35) needs offline.
    args = [str(HELM), "template", "gpu-node-agent", str(CHART), "--namespace", "gpu-node-agent",
            "--kube-version", f"{kube_release()}.0"]
    for value in sets:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def kinds(objects: list[dict[str, Any]]) -> set[str]:
    return {o["kind"] for o in objects}


def test_off_by_default() -> None:
    assert not kinds(render()) & {"ServiceMonitor", "PrometheusRule"}


def test_a_servicemonitor_scrapes_the_agents_through_a_headless_service() -> None:
    objects = render("serviceMonitor.enabled=true", "serviceMonitor.interval=15s",
                     "serviceMonitor.additionalLabels.release=kube-prometheus")
    [monitor] = [o for o in objects if o["kind"] == "ServiceMonitor"]
    [service] = [o for o in objects if o["kind"] == "Service"]
    [daemonset] = [o for o in objects if o["kind"] == "DaemonSet"]
    assert "PrometheusRule" not in kinds(objects)
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "15s")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"] for c in daemonset["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in container_ports


def test_a_prometheusrule_carries_the_shipped_rules() -> None:
    objects = render("prometheusRule.enabled=true", "prometheusRule.additionalLabels.role=alert-rules")
    [rule] = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert "ServiceMonitor" not in kinds(objects)
    assert rule["metadata"]["labels"]["role"] == "alert-rules"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    summaries = [r["annotations"]["summary"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert "GPU {{ $labels.gpu }} on {{ $labels.instance }} has fallen off the bus" in summaries
