"""A fleet of real `gpu-agent run` processes against one real kube-apiserver that restarts (etcd kept): what the
agents cost it, counted on the server's side (its audit log of the agents' ServiceAccounts), and how soon each
puts back an owned label removed by hand. The rig and the fleet are bench/fleet.py's, which measures the same
for 50 agents and more disturbances."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fleet import AuditLog, Nodes, agent_kubeconfigs, apiserver_restart, audited, fleet, node_names, start

AGENTS = 3


@pytest.mark.testbin
@pytest.mark.timeout(240)
def test_a_restarted_api_server_gets_a_few_requests_per_agent_and_every_label_back(tmp_path: Path) -> None:
    names = node_names(AGENTS)
    with audited(tmp_path, names) as server:
        audit = AuditLog(server.audit_log, AGENTS)
        nodes = Nodes(server, AGENTS)
        with fleet(agent_kubeconfigs(server, AGENTS), dra=False) as agents:
            started = start(agents, audit, nodes, wave=AGENTS)
            assert started.never_labelled == []
            # SIGTERM to kube-apiserver, a new one on the same port and etcd, then nvidia.com/gpu.count removed
            # from every Node; the requests are counted from the SIGTERM until 60 s after the new one was ready.
            restart = apiserver_restart(server, audit, nodes, AGENTS)
    summary = restart.summary(AGENTS)
    seen = {name: count for name, count in zip(names, summary["per_agent"], strict=True)}
    assert {name: count for name, count in seen.items() if count > 5} == {}, (
        f"requests per agent from the restart until 60 s after ready: {seen}; "
        f"by verb, resource and code: {summary['by_verb_resource_code']}")
    assert sorted(restart.repaired_s) == list(names), f"labels put back: {restart.repaired_s}"
    assert {name: s for name, s in restart.repaired_s.items() if s > 15.0} == {}, (
        f"seconds after the API server was ready until each Node had nvidia.com/gpu.count again: {restart.repaired_s}")
