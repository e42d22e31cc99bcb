"""The kustomize base in daemonset/ through the pinned kubectl, as a user applies it, against the real API server:
it renders what the kustomization lists, the server accepts every object (the DaemonSet validated for real), and
the agent's pod-bound token can do exactly what RBAC and the admission policy allow it, seen through kubectl."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml
from apiserver import NODE, OTHER_NODE, ApiServer
from base_manifests import (
    ACCOUNT,
    APPLIED,
    BASE,
    NAMESPACE,
    POLICY_DENIAL,
    RENDERED,
    User,
    agent_token_checks,
    apply_base,
    bound_token_kubeconfig,
    identity,
    kubectl,
    ok,
)


@pytest.fixture(scope="module")
def admin(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> User:
    return User(apiserver.kubeconfig_path, tmp_path_factory.mktemp("kubectl-admin"))


@pytest.fixture(scope="module")
def agent(apiserver: ApiServer, admin: User, tmp_path_factory: pytest.TempPathFactory) -> User:
    """kubectl as the agent's pod-bound identity, once the base is applied and its admission policy is in force."""
    apply_base(admin)
    directory = tmp_path_factory.mktemp("kubectl-agent")
    user = User(bound_token_kubeconfig(apiserver, admin, directory / "kubeconfig"), directory / "cache")
    # A new policy takes effect a moment after it is created. Probe with a server-side dry run, which passes
    # through admission but changes nothing if the policy is not enforced yet.
    deadline = time.monotonic() + 30
    while True:
        probe = user("label", "node", OTHER_NODE, "gpu-node-agent.io/probe=1", "--dry-run=server")
        if probe.returncode != 0 and POLICY_DENIAL in probe.stderr:
            return user
        assert time.monotonic() < deadline, f"the admission policy never took effect: {probe.stderr}"
        time.sleep(0.2)


@pytest.fixture
def node_restored(admin: User) -> Iterator[None]:
    """Puts NODE's taints back as found and drops the labels these tests add, whatever happened."""
    before = json.loads(ok(admin("get", "node", NODE, "-o", "json")))
    try:
        yield
    finally:
        labels = {k: None for k in ("gpu-node-agent.io/probe", "gpu-node-agent.io/m")}
        labels["team"] = before["metadata"].get("labels", {}).get("team")  # None deletes it
        patch = {"metadata": {"labels": labels}, "spec": {"taints": before["spec"].get("taints")}}
        ok(admin("patch", "node", NODE, "--type=merge", "-p", json.dumps(patch)))


@pytest.mark.testbin
def test_kustomize_renders_exactly_the_listed_objects() -> None:
    rendered = [d for d in yaml.safe_load_all(ok(kubectl("kustomize", str(BASE)))) if d]
    assert [identity(d) for d in rendered] == RENDERED
    # The base has no transformers: what it renders is what its resource files say, object for object.
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    sources = [d for name in kustomization["resources"] for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    assert sorted(map(identity, sources), key=str) == sorted(RENDERED, key=str)
    canonical = [json.dumps(d, sort_keys=True) for d in rendered]
    assert sorted(canonical) == sorted(json.dumps(d, sort_keys=True) for d in sources)


def test_server_accepts_every_object_then_apply_is_idempotent(admin: User) -> None:
    # A server dry run creates nothing, so on a cluster without the namespace every namespaced object fails
    # with NotFound: apply the Namespace for real first (as `kubectl apply -k` itself would, in order).
    ok(admin("apply", "--server-side", "-f", str(BASE / "namespace.yaml")))
    dry = admin("apply", "--server-side", "--dry-run=server", "-k", str(BASE))
    # No warnings either: the server found nothing deprecated or dubious in any object.
    assert (dry.returncode, dry.stderr) == (0, ""), dry.stderr
    assert dry.stdout.splitlines() == [f"{name} serverside-applied (server dry run)" for name in APPLIED]

    apply_base(admin)
    apply_base(admin)  # again: nothing to change, nothing contested
    assert ok(admin("get", "-k", str(BASE), "-o", "name")).splitlines() == APPLIED
    daemonset = json.loads(ok(admin("get", "daemonset", "-n", NAMESPACE, "gpu-node-agent", "-o", "json")))
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == ACCOUNT


def test_a_second_server_side_writer_gets_no_conflict(admin: User) -> None:
    """Another field manager (a GitOps controller, a second operator) applying the same manifests co-owns every field.
    A field the API marks atomic is compared whole against the stored, defaulted value, so a manifest that omits a
    default inside one conflicts with whoever wrote it first."""
    apply_base(admin)
    second = admin("apply", "--server-side", "--dry-run=server", "--field-manager=second-writer", "-k", str(BASE))
    assert (second.returncode, second.stderr) == (0, ""), second.stderr


def test_agent_token_can_do_only_what_rbac_and_the_policy_allow(agent: User, node_restored: None) -> None:
    agent_token_checks(agent)


def test_patch_content_types_with_the_agent_token(agent: User, node_restored: None) -> None:
    merged = agent("patch", "node", NODE, "--type=merge", "-p", '{"metadata":{"labels":{"gpu-node-agent.io/m":"1"}}}')
    assert (merged.returncode, merged.stdout) == (0, f"node/{NODE} patched\n"), merged.stderr
    version = ok(agent("get", "node", NODE, "-o", "jsonpath={.metadata.resourceVersion}"))

    def json_patch(expected_version: str, value: str, *flags: str) -> subprocess.CompletedProcess[str]:
        ops = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": expected_version},
            {"op": "replace", "path": "/metadata/labels/gpu-node-agent.io~1m", "value": value},
        ]
        return agent("patch", "node", NODE, "--type=json", "-p", json.dumps(ops), *flags)

    # A JSON patch whose test op fails is refused as 422 Invalid (not 409): the patch cannot be applied at all.
    stale = json_patch("1", "2", "-v=6")
    assert stale.returncode == 1
    assert 'verb="PATCH"' in stale.stderr and 'status="422 Unprocessable Entity"' in stale.stderr, stale.stderr
    assert stale.stderr.endswith(
        "The request is invalid: the server rejected our request due to an error in our request\n"
    ), stale.stderr

    # A stale resourceVersion inside a merge patch is a precondition: 409 Conflict.
    conflict = agent(
        "patch", "node", NODE, "--type=merge", "-p",
        '{"metadata":{"resourceVersion":"1","labels":{"gpu-node-agent.io/m":"3"}}}',
    )  # fmt: skip
    assert conflict.returncode == 1
    assert conflict.stderr == (
        f'Error from server (Conflict): Operation cannot be fulfilled on nodes "{NODE}": the object has been '
        "modified; please apply your changes to the latest version and try again\n"
    )
    labels = json.loads(ok(agent("get", "node", NODE, "-o", "jsonpath={.metadata.labels}")))
    assert labels["gpu-node-agent.io/m"] == "1"

    # With the current resourceVersion the same JSON patch applies.
    current = json_patch(version, "2")
    assert (current.returncode, current.stdout) == (0, f"node/{NODE} patched\n"), current.stderr
    labels = json.loads(ok(agent("get", "node", NODE, "-o", "jsonpath={.metadata.labels}")))
    assert labels["gpu-node-agent.io/m"] == "2"


def test_the_agents_requests_are_classified_by_their_own_flow_schema(agent: User, admin: User) -> None:
    """API Priority and Fairness names the FlowSchema and priority level of each request in its answer's headers:
    the agent's go to the base's gpu-node-agent level, not to the cluster's default for service accounts."""
    uids = {kind: ok(admin("get", kind, "gpu-node-agent", "-o", "jsonpath={.metadata.uid}"))
            for kind in ("flowschema", "prioritylevelconfiguration")}
    answered = agent("get", "--raw", f"/api/v1/nodes/{NODE}", "-v=8")
    assert answered.returncode == 0, answered.stderr
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.split("] ", 1)[-1].partition(": ") for line in answered.stderr.splitlines())
               if k.strip().lower().startswith("x-kubernetes-pf-")}
    assert headers == {"x-kubernetes-pf-flowschema-uid": uids["flowschema"],
                       "x-kubernetes-pf-prioritylevel-uid": uids["prioritylevelconfiguration"]}
