"""The apiserver rig is a real Kubernetes API: versions, patch semantics, conflicts, RBAC, admission."""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from apiserver import (
    NODE,
    OTHER_NODE,
    TESTBIN_SCRIPT,
    ApiServer,
    group_alive,
    pinned_versions,
    running,
    wait_until,
)
from kubernetes import client as k8s

from tests.releases import kube_release

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"

_serial = itertools.count()


@pytest.fixture
def core(apiserver: ApiServer) -> k8s.CoreV1Api:
    return k8s.CoreV1Api(apiserver.admin_client())


@pytest.fixture
def scratch_node(core: k8s.CoreV1Api) -> Iterator[str]:
    """A Node of this test's own, so exact label and taint assertions do not depend on other tests."""
    name = f"rig-scratch-{next(_serial)}"
    core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    yield name
    core.delete_node(name)


def test_server_reports_the_pinned_version(apiserver: ApiServer) -> None:
    pinned = pinned_versions()["kube-apiserver"]
    release = kube_release()  # KUBE, or the default release (hack/testbin/kube/default)
    # A GA patch release (v1.37.2) or, for a release pinned before its .0, a pre-release (v1.38.0-beta.0).
    assert re.fullmatch(rf"v{re.escape(release)}\.\d+(-(alpha|beta|rc)\.\d+)?", pinned), pinned
    info = k8s.VersionApi(apiserver.admin_client()).get_code()
    assert info.git_version == pinned
    assert f"{info.major}.{info.minor}" == release
    assert apiserver.release() == tuple(int(x) for x in release.split("."))
    assert apiserver.behaves_as() == apiserver.release()  # the rig's own server emulates nothing


def test_without_kube_the_rig_is_the_default_release_and_each_release_has_its_own_binaries() -> None:
    out = subprocess.run(["bash", str(TESTBIN_SCRIPT), "--print-versions"], capture_output=True, text=True,
                         check=True, env={k: v for k, v in os.environ.items() if k != "KUBE"}).stdout
    assert out.splitlines()[0] == "kube-apiserver v1.37.2"  # the newest GA release, not 1.38's beta
    beta = subprocess.run(["bash", str(TESTBIN_SCRIPT), "--print-versions"], capture_output=True, text=True,
                          check=True, env={**os.environ, "KUBE": "1.38"}).stdout
    assert beta.splitlines()[:3] == ["kube-apiserver v1.38.0-beta.0", "kubectl v1.38.0-beta.0", "etcd v3.7.4"]
    dirs = {r: subprocess.run(["bash", str(TESTBIN_SCRIPT), "--print-dir"], capture_output=True, text=True,
                              check=True, env={**os.environ, "KUBE": r}).stdout.strip() for r in ("1.35", "1.37")}
    assert {r: Path(d).name for r, d in dirs.items()} == {"1.35": "kube-1.35", "1.37": "kube-1.37"}
    refused = subprocess.run(["bash", str(TESTBIN_SCRIPT), "--print-versions"], capture_output=True, text=True,
                             check=False, env={**os.environ, "KUBE": "1.34"})
    assert (refused.returncode, refused.stderr) == (
        2, "KUBE=1.34: no such release here (known: 1.35 1.36 1.37 1.38)\n")


def test_fixture_nodes_exist(core: k8s.CoreV1Api) -> None:
    names = {n.metadata.name for n in core.list_node().items}
    assert {NODE, OTHER_NODE} <= names
    assert core.read_node(NODE).metadata.labels["kubernetes.io/hostname"] == NODE


def test_strategic_merge_patch_adds_changes_and_deletes_labels(core: k8s.CoreV1Api, scratch_node: str) -> None:
    core.patch_node(
        scratch_node,
        {"metadata": {"labels": {"a.example/x": "1", "a.example/y": "2"}}},
        _content_type=STRATEGIC,
    )
    node = core.patch_node(
        scratch_node,
        {"metadata": {"labels": {"a.example/x": None, "a.example/y": "3"}}},
        _content_type=STRATEGIC,
    )
    assert node.metadata.labels == {"kubernetes.io/hostname": scratch_node, "a.example/y": "3"}


def test_json_merge_patch_adds_changes_and_deletes_labels(core: k8s.CoreV1Api, scratch_node: str) -> None:
    core.patch_node(
        scratch_node, {"metadata": {"labels": {"b.example/x": "1", "b.example/y": "2"}}}, _content_type=MERGE
    )
    node = core.patch_node(
        scratch_node, {"metadata": {"labels": {"b.example/x": None, "b.example/z": "4"}}}, _content_type=MERGE
    )
    assert node.metadata.labels == {
        "kubernetes.io/hostname": scratch_node,
        "b.example/y": "2",
        "b.example/z": "4",
    }


def test_merge_patch_replaces_the_taint_list_whole(core: k8s.CoreV1Api, scratch_node: str) -> None:
    two = [
        {"key": "a.example/one", "value": "1", "effect": "NoSchedule"},
        {"key": "a.example/two", "effect": "NoExecute"},
    ]
    node = core.patch_node(scratch_node, {"spec": {"taints": two}}, _content_type=MERGE)
    assert [(t.key, t.value, t.effect) for t in node.spec.taints] == [
        ("a.example/one", "1", "NoSchedule"),
        ("a.example/two", None, "NoExecute"),
    ]
    one = [{"key": "a.example/three", "value": "3", "effect": "PreferNoSchedule"}]
    node = core.patch_node(scratch_node, {"spec": {"taints": one}}, _content_type=MERGE)
    assert [(t.key, t.value, t.effect) for t in node.spec.taints] == [("a.example/three", "3", "PreferNoSchedule")]
    node = core.patch_node(scratch_node, {"spec": {"taints": None}}, _content_type=MERGE)
    assert node.spec.taints is None


def test_patch_with_stale_resource_version_is_a_conflict(core: k8s.CoreV1Api, scratch_node: str) -> None:
    stale = core.read_node(scratch_node).metadata.resource_version
    core.patch_node(scratch_node, {"metadata": {"labels": {"c.example/x": "1"}}}, _content_type=MERGE)
    with pytest.raises(k8s.ApiException) as err:
        core.patch_node(
            scratch_node,
            {"metadata": {"resourceVersion": stale, "labels": {"c.example/x": "2"}}},
            _content_type=MERGE,
        )
    assert err.value.status == 409
    assert core.read_node(scratch_node).metadata.labels["c.example/x"] == "1"


def test_service_account_without_rbac_cannot_read_nodes(apiserver: ApiServer) -> None:
    nobody = k8s.CoreV1Api(apiserver.service_account_client("rig-nobody"))
    for call in (nobody.list_node, lambda: nobody.read_node(NODE)):
        with pytest.raises(k8s.ApiException) as err:
            call()
        assert err.value.status == 403


def test_service_account_kubeconfig_authenticates_as_the_account(apiserver: ApiServer) -> None:
    from kubernetes import config

    api = config.new_client_from_config(str(apiserver.service_account_kubeconfig("rig-whoami")))
    review = k8s.AuthenticationV1Api(api).create_self_subject_review(k8s.V1SelfSubjectReview())
    assert review.status.user_info.username == "system:serviceaccount:default:rig-whoami"
    api.close()


def test_node_identity_is_confined_to_its_node(apiserver: ApiServer, scratch_node: str) -> None:
    kubelet = k8s.CoreV1Api(apiserver.node_client(scratch_node))
    node = kubelet.patch_node(scratch_node, {"metadata": {"labels": {"d.example/x": "1"}}}, _content_type=MERGE)
    assert node.metadata.labels["d.example/x"] == "1"
    # The Node authorizer: another node is out of reach.
    with pytest.raises(k8s.ApiException) as err:
        kubelet.patch_node(OTHER_NODE, {"metadata": {"labels": {"d.example/x": "1"}}}, _content_type=MERGE)
    assert err.value.status == 403
    # The NodeRestriction admission plugin: reserved labels are out of reach even on its own node.
    with pytest.raises(k8s.ApiException) as err:
        kubelet.patch_node(
            scratch_node,
            {"metadata": {"labels": {"node-restriction.kubernetes.io/x": "1"}}},
            _content_type=MERGE,
        )
    assert err.value.status == 403
    assert "NodeRestriction" in str(err.value.body) or "node-restriction" in str(err.value.body)


def test_validating_admission_policy_is_enforced(apiserver: ApiServer, core: k8s.CoreV1Api, scratch_node: str) -> None:
    admission = k8s.AdmissionregistrationV1Api(apiserver.admin_client())
    name = "rig-deny-forbidden-label"
    admission.create_validating_admission_policy(
        k8s.V1ValidatingAdmissionPolicy(
            metadata=k8s.V1ObjectMeta(name=name),
            spec=k8s.V1ValidatingAdmissionPolicySpec(
                failure_policy="Fail",
                match_constraints=k8s.V1MatchResources(
                    resource_rules=[
                        k8s.V1NamedRuleWithOperations(
                            api_groups=[""], api_versions=["v1"], operations=["UPDATE"], resources=["nodes"]
                        )
                    ]
                ),
                validations=[
                    k8s.V1Validation(
                        expression="!('e.example/forbidden' in object.metadata.?labels.orValue({}))",
                        message="e.example/forbidden may not be set",
                    )
                ],
            ),
        )
    )
    admission.create_validating_admission_policy_binding(
        k8s.V1ValidatingAdmissionPolicyBinding(
            metadata=k8s.V1ObjectMeta(name=name),
            spec=k8s.V1ValidatingAdmissionPolicyBindingSpec(policy_name=name, validation_actions=["Deny"]),
        )
    )
    try:
        # Policies reach the admission plugin through an informer: wait for the first denial.
        def denied() -> bool:
            try:
                core.patch_node(
                    scratch_node, {"metadata": {"labels": {"e.example/forbidden": "1"}}}, _content_type=MERGE
                )
            except k8s.ApiException as e:
                assert e.status == 422, e
                assert "e.example/forbidden may not be set" in str(e.body)
                return True
            core.patch_node(scratch_node, {"metadata": {"labels": {"e.example/forbidden": None}}}, _content_type=MERGE)
            return False

        wait_until(denied, 30, "the ValidatingAdmissionPolicy to deny", interval=0.5)
    finally:
        admission.delete_validating_admission_policy_binding(name)
        admission.delete_validating_admission_policy(name)


def test_restart_keeps_port_and_objects(apiserver: ApiServer, core: k8s.CoreV1Api) -> None:
    before = core.read_node(NODE).metadata.uid
    port = apiserver.port
    apiserver.restart()
    assert apiserver.port == port
    assert k8s.CoreV1Api(apiserver.admin_client()).read_node(NODE).metadata.uid == before


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.testbin
def test_teardown_leaves_no_process(tmp_path: Path) -> None:
    with running(tmp_path) as rig:
        groups = rig.process_groups
        port = rig.port
        assert len(groups) == 2 and all(group_alive(g) for g in groups)
        assert not _port_free(port)
    assert [g for g in groups if group_alive(g)] == []
    assert _port_free(port)
    assert not (tmp_path / "etcd-data").exists()
