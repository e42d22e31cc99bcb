"""Kubeconfigs as kubectl reads them, against the rig's real kube-apiserver: the agent presents the same identity
kubectl does with the same file (a client certificate with insecure-skip-tls-verify, a tokenFile relative to the
kubeconfig)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from apiserver import KUBE_BIN, NODE, ApiServer

from agent.kube.node import ApiError, NodeApi

KUBECTL = KUBE_BIN / "kubectl"


def write_kubeconfig(path: Path, cluster: dict[str, object], user: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rig",
        "clusters": [{"name": "rig", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "rig", "context": {"cluster": "rig", "user": "u"}}],
    }))  # fmt: skip
    path.chmod(0o600)
    return path


def kubectl_whoami(kubeconfig: Path, cwd: Path) -> str:
    """The user name the API server sees for `kubeconfig`, asked by kubectl itself."""
    result = subprocess.run([str(KUBECTL), "--kubeconfig", str(kubeconfig), "auth", "whoami", "-o", "json"],
                            capture_output=True, text=True, cwd=cwd, timeout=30)
    assert result.returncode == 0, result.stderr
    return str(json.loads(result.stdout)["status"]["userInfo"]["username"])


async def test_a_client_certificate_is_presented_with_insecure_skip_tls_verify(apiserver: ApiServer,
                                                                               tmp_path: Path) -> None:
    """The agent once dropped its certificate when told not to verify the server: anonymous, 403 forever."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", {"server": apiserver.url, "insecure-skip-tls-verify": True},
                                  {"client-certificate": str(apiserver.admin.cert),
                                   "client-key": str(apiserver.admin.key)})
    assert kubectl_whoami(kubeconfig, tmp_path) == "rig-admin"
    api = await NodeApi.connect(kubeconfig, NODE)
    try:
        assert (await api.get()).name == NODE
    finally:
        await api.close()


async def test_a_relative_token_file_is_read_next_to_the_kubeconfig(apiserver: ApiServer, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "creds"
    directory.mkdir()
    (directory / "token").write_text(apiserver.service_account_token("token-file-reader") + "\n")
    kubeconfig = write_kubeconfig(directory / "kubeconfig",
                                  {"server": apiserver.url, "certificate-authority": str(apiserver.ca_path)},
                                  {"tokenFile": "token"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert kubectl_whoami(kubeconfig, elsewhere) == "system:serviceaccount:default:token-file-reader"
    monkeypatch.chdir(elsewhere)
    assert not Path("token").exists() and os.getcwd() == str(elsewhere)
    api = await NodeApi.connect(kubeconfig, NODE)
    try:
        # The account may not read Nodes: the API server's refusal names it, so the token was sent.
        with pytest.raises(ApiError) as refused:
            await api.get()
        assert refused.value.status == 403
        assert ('User "system:serviceaccount:default:token-file-reader" cannot get resource "nodes"'
                in str(refused.value))
    finally:
        await api.close()
