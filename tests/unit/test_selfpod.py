"""Toleration matching for the agent's own taint, as Kubernetes matches (k8s.io/api/core/v1 ToleratesTaint), and
what the start-up check says for each answer the API server can give."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agent.config import TaintSettings
from agent.kube.node import ApiError
from agent.kube.selfpod import NotTolerated, check_at_start, check_reloaded, problem, tolerates

KEY = "gpu-node-agent.io/gpu-fault"


@pytest.mark.parametrize(("toleration", "expected"), [
    ({"operator": "Exists"}, True),  # empty key and Exists: every taint
    ({"key": KEY, "operator": "Exists"}, True),
    ({"key": KEY, "operator": "Exists", "effect": "NoExecute"}, True),
    ({"key": KEY, "operator": "Exists", "effect": "NoSchedule"}, False),
    ({"key": "gpu-node-agent.io/other", "operator": "Exists"}, False),
    ({"key": KEY, "operator": "Equal", "value": "true"}, True),
    ({"key": KEY, "value": "true"}, True),  # no operator is Equal
    ({"key": KEY, "operator": "Equal", "value": "false"}, False),
    ({"key": KEY, "operator": "Equal"}, False),  # Equal with no value matches only an empty value
    ({"key": KEY, "operator": "Lt", "value": "true"}, False),  # an operator this API does not know
    ({"effect": "NoExecute", "operator": "Exists"}, True),
])
def test_one_toleration_against_the_taint(toleration: dict[str, Any], expected: bool) -> None:
    assert tolerates(toleration, KEY, "true", "NoExecute") is expected


def test_what_the_tolerations_leave() -> None:
    shipped = [{"key": KEY, "operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists",
                                                    "effect": "NoSchedule"}]
    assert problem(shipped, KEY, "NoExecute") is None
    assert problem(shipped, KEY, "NoSchedule") is None
    assert problem(shipped, "gpu-node-agent.io/other", "NoSchedule") == "is not tolerated"
    assert problem([], KEY, "PreferNoSchedule") == "is not tolerated"
    # NoExecute tolerated for a while evicts the pod then; the shortest of the matching tolerations counts.
    timed = [{"key": KEY, "operator": "Exists", "tolerationSeconds": 600},
             {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
    assert problem(timed, KEY, "NoExecute") == "is tolerated for only 300s (tolerationSeconds)"
    assert problem(timed, KEY, "NoSchedule") is None  # tolerationSeconds means nothing for NoSchedule


class Pods:
    def __init__(self, pod: dict[str, Any] | None = None, error: Exception | None = None) -> None:
        self.pod, self.error, self.asked = pod or {}, error, []

    async def get_pod(self, namespace: str, name: str, timeout: float = 30) -> dict[str, Any]:
        self.asked.append((namespace, name))
        if self.error is not None:
            raise self.error
        return self.pod


IN_POD = {"POD_NAME": "gpu-node-agent-x7k2p", "POD_NAMESPACE": "gpu-node-agent"}
TOLERANT = {"spec": {"tolerations": [{"key": KEY, "operator": "Exists"}]}}


async def test_a_tolerated_taint_starts_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    pods = Pods(TOLERANT)
    with caplog.at_level(logging.DEBUG, "agent.kube.selfpod"):
        await check_at_start(pods, TaintSettings(effect="NoExecute"), IN_POD)
    assert pods.asked == [("gpu-node-agent", "gpu-node-agent-x7k2p")]
    assert caplog.messages == []


async def test_an_untolerated_taint_is_refused_naming_the_toleration() -> None:
    taint = TaintSettings(key="gpu-node-agent.io/gpu-fatal", effect="NoExecute")
    with pytest.raises(NotTolerated) as refused:
        await check_at_start(Pods(TOLERANT), taint, IN_POD)
    assert str(refused.value) == (
        "health.taint gpu-node-agent.io/gpu-fatal=true:NoExecute is not tolerated by pod "
        "gpu-node-agent/gpu-node-agent-x7k2p (on a node fault the agent would evict itself and the node would "
        "never recover); add {key: gpu-node-agent.io/gpu-fatal, operator: Exists} to the DaemonSet's tolerations, "
        "or set health.taint to a taint the pod tolerates")


async def test_outside_a_pod_the_check_is_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    pods = Pods(error=AssertionError("not asked"))
    with caplog.at_level(logging.DEBUG, "agent.kube.selfpod"):
        await check_at_start(pods, TaintSettings(), {})
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [(
        "INFO", "not running in a pod (POD_NAME is not set): not checking that it tolerates health.taint "
                "gpu-node-agent.io/gpu-fault=true:NoSchedule")]


@pytest.mark.parametrize(("error", "line"), [
    (ApiError(404, "NotFound", 'pods "gpu-node-agent-x7k2p" not found'),
     "cannot check that pod gpu-node-agent/gpu-node-agent-x7k2p tolerates health.taint "
     "gpu-node-agent.io/gpu-fault=true:NoSchedule: the API server has no such pod (POD_NAME and POD_NAMESPACE come "
     "from the downward API); not checked"),
    (ApiError(500, "InternalError", "etcd is down"),
     "cannot check that pod gpu-node-agent/gpu-node-agent-x7k2p tolerates health.taint "
     "gpu-node-agent.io/gpu-fault=true:NoSchedule: the API server answered 500 InternalError: etcd is down"),
    (TimeoutError(),
     "cannot check that pod gpu-node-agent/gpu-node-agent-x7k2p tolerates health.taint "
     "gpu-node-agent.io/gpu-fault=true:NoSchedule: TimeoutError; not checked"),
])
async def test_a_check_that_cannot_be_made_is_one_warning(error: Exception, line: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, "agent.kube.selfpod"):
        await check_at_start(Pods(error=error), TaintSettings(), IN_POD)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", line)]


async def test_a_reloaded_taint_that_is_not_tolerated_is_the_reason_to_reject_it(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, "agent.kube.selfpod"):
        assert await check_reloaded(Pods(TOLERANT), TaintSettings(), IN_POD) is None
        assert await check_reloaded(None, TaintSettings(key="gpu-node-agent.io/x"), IN_POD) is None  # --no-kube
        assert await check_reloaded(Pods(TOLERANT), TaintSettings(key="gpu-node-agent.io/x"), IN_POD) == (
            "health.taint gpu-node-agent.io/x=true:NoSchedule is not tolerated by pod "
            "gpu-node-agent/gpu-node-agent-x7k2p (once the agent restarts on a node it tainted, its pod cannot "
            "come back and the node never recovers); add {key: gpu-node-agent.io/x, operator: Exists} to the "
            "DaemonSet's tolerations, or set health.taint to a taint the pod tolerates")
    assert caplog.records == []


def test_the_checked_value_is_the_one_the_agent_taints_with() -> None:
    # An Equal toleration is matched against the value of the taint the reconciler writes.
    from agent.kube.reconciler import TaintPolicy, node_intent
    from agent.state import DeviceHealth
    from tests.builders import node

    state = node("single-h200")
    uuid = state.inventory.gpus[0].uuid
    faulty = state.evolve(health={uuid: DeviceHealth(False, "XID 79", node_fatal=True)})
    intent = node_intent(faulty, {}, TaintPolicy(KEY, "NoExecute"))
    assert intent.taint == {"key": KEY, "value": "true", "effect": "NoExecute"}
    equal = [{"key": KEY, "operator": "Equal", "value": "true", "effect": "NoExecute"}]
    assert problem(equal, KEY, "NoExecute") is None
