"""The shipped alert rules and Prometheus Operator objects: one set of rules in three places, the classes the rules
must cover, a rule test for each alert, and a PodMonitor that finds the DaemonSet's pods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "daemonset" / "monitoring"
RULES = MONITORING / "gpu-node-agent-rules.yaml"
CHART = REPO / "deployments" / "helm" / "gpu-node-agent"
RULE_TESTS = REPO / "tests" / "prometheus" / "rules.test.yaml"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rules() -> list[dict[str, Any]]:
    """The alert rules."""
    return [r for g in load(RULES)["groups"] for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict[str, Any]]:
    return [r for g in load(RULES)["groups"] for r in g["rules"] if "record" in r]


def test_the_plain_file_the_prometheusrule_and_the_chart_carry_the_same_rules() -> None:
    groups = load(RULES)["groups"]
    operator = load(MONITORING / "prometheusrule.yaml")
    assert (operator["apiVersion"], operator["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert operator["spec"]["groups"] == groups
    assert load(CHART / "files" / "prometheus-rules.yaml")["groups"] == groups


def test_the_rules_cover_what_operators_alert_on() -> None:
    by_name = {r["alert"]: r for r in rules()}
    assert set(by_name) == {
        "GPUXidNodeFatal", "GPUXidUnhealthy", "GPUXidWarning", "GPUXidApplicationError",  # XID classes
        "GPUEccUncorrectedErrors", "GPURowRemapFailure", "GPUThermalViolation", "GPUHighTemperature",
        "GPUPowerViolation", "GPULost", "GPUMemoryNearlyFull", "GPUIdleWhileHeld",
        "GPUUnhealthy", "GPUAgentNotReady", "GPUKubeletRegistrationsFlapping", "GPUAgentAdvertisesNothing",
        "GPUAgentAPIErrors", "GPUAgentRelistStorm", "GPUMigReconfigurationFailed",
        "GPUFreeButFragmented",
    }
    for rule in by_name.values():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


def test_the_xid_classes_split_every_xid_the_health_policy_names() -> None:
    from agent.config import DEFAULT_XID_ACTIONS

    def codes(alert: str) -> set[int]:
        expr = next(r["expr"] for r in rules() if r["alert"] == alert)
        return {int(x) for x in expr.split('xid=~"', 1)[1].split('"', 1)[0].split("|")}

    by_action: dict[str, set[int]] = {}
    for xid, action in DEFAULT_XID_ACTIONS.items():
        by_action.setdefault(action, set()).add(xid)
    assert codes("GPUXidNodeFatal") == by_action["node-fatal"]
    assert codes("GPUXidWarning") == by_action["warn"]
    assert codes("GPUXidApplicationError") == by_action["ignore"]
    unhealthy = next(r["expr"] for r in rules() if r["alert"] == "GPUXidUnhealthy")
    excluded = {int(x) for x in unhealthy.split('xid!~"', 1)[1].split('"', 1)[0].split("|")}
    assert excluded == by_action["node-fatal"] | by_action["warn"] | by_action["ignore"]


def test_every_alert_has_a_rule_test_that_fires_it_and_one_where_it_stays_silent() -> None:
    suite = load(RULE_TESTS)
    assert suite["rule_files"] == ["../../daemonset/monitoring/gpu-node-agent-rules.yaml"]
    fired: set[str] = set()
    evaluated: set[str] = set()
    for test in suite["tests"]:
        for case in test["alert_rule_test"]:
            evaluated.add(case["alertname"])
            if case.get("exp_alerts"):
                fired.add(case["alertname"])
    names = {r["alert"] for r in rules()}
    assert fired == names
    assert evaluated == names
    # Every test feeds some series that fire nothing: each rule's silence is checked alongside its firing.
    silent_series = 0
    for test in suite["tests"]:
        fired_labels = [a["exp_labels"] for case in test["alert_rule_test"] for a in case.get("exp_alerts") or []]
        for series in test["input_series"]:
            gpu = series["series"].split('gpu="', 1)[1].split('"', 1)[0] if 'gpu="' in series["series"] else None
            if gpu is not None and not any(labels.get("gpu") == gpu for labels in fired_labels):
                silent_series += 1
    assert silent_series >= 8


def test_every_recording_rule_is_named_by_its_convention_and_has_an_expression_test() -> None:
    """level:metric:operations, the metric one the agent serves; each recorded series queried by a rule test."""
    recorded = [r["record"] for r in recording_rules()]
    assert recorded == ["instance:gpu_agent_free_gpus:fragmented_nvlink4",
                        "cluster:gpu_agent_free_gpus:stranded_ratio_nvlink4"]
    for rule in recording_rules():
        assert set(rule) == {"record", "expr"}, rule["record"]
    queried = {case["expr"] for test in load(RULE_TESTS)["tests"] for case in test.get("promql_expr_test", [])}
    assert set(recorded) <= queried


def test_the_component_adds_a_podmonitor_for_the_daemonsets_pods() -> None:
    component = load(MONITORING / "kustomization.yaml")
    assert (component["apiVersion"], component["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")
    assert component["resources"] == ["podmonitor.yaml", "prometheusrule.yaml"]
    base = load(REPO / "daemonset" / "kustomization.yaml")
    assert not [r for r in base["resources"] if "monitoring" in r], "the base must not need the Operator's CRDs"
    monitor = load(MONITORING / "podmonitor.yaml")
    daemonset = load(REPO / "daemonset" / "daemonset.yaml")
    pod = daemonset["spec"]["template"]
    assert monitor["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], ports[endpoint["port"]], endpoint["path"]) == ("metrics", 9400, "/metrics")
