"""The operator documentation against the product: docs/operations.md, docs/grafana-dashboard.json and the Dockerfile.

Metric names are checked against the /metrics output of a running agent (on the simulated DGX H100), command lines
against the CLI's own parser, label, annotation and taint keys against the agent's ownership rules, Event reasons
against the reconciler, links against the files and headings they point at, and the Dockerfile against what the
docs and SECURITY.md say about the image.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.cli import parser
from agent.config import DEFAULT_CONFIG
from agent.cordon import CORDON_ANNOTATION
from agent.inventory import GPU_RESOURCE, mig_resource
from agent.kube.reconciler import (
    CONDITION_TYPE,
    CONFIG_LABEL,
    EVENT_REASONS,
    MIG_CONFIG_LABEL,
    MIG_REASON_ANNOTATION,
    MIG_STATE_LABEL,
    owned_annotation,
)
from agent.labels import OWNED_NVIDIA_KEYS, owned
from tests.builders import FENCE, code_blocks, github_anchor, scrape_metrics

REPO = Path(__file__).resolve().parents[2]
OPERATIONS = REPO / "docs" / "operations.md"
DASHBOARD = REPO / "docs" / "grafana-dashboard.json"
DOCKERFILE = REPO / "Dockerfile"
DAEMONSET = REPO / "daemonset" / "daemonset.yaml"

METRIC = re.compile(r"\bgpu_agent_[a-z0-9_]+\b")
DCGM_METRIC = re.compile(r"\bDCGM_FI_[A-Z0-9_]+\b")

# What the dashboard must show: the brief of each panel, by the metric series it reads.
DASHBOARD_MUST_READ = {
    "gpu_agent_gpu_healthy",
    "gpu_agent_gpu_xid_errors_total",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "gpu_agent_resource_devices",
    "gpu_agent_resource_allocatable",
    "gpu_agent_allocations_total",
    "gpu_agent_mig_reconfigurations_total",
    "gpu_agent_mig_reconfiguration_seconds_bucket",
    "gpu_agent_kubelet_registrations_total",
    "gpu_agent_api_errors_total",
    "gpu_agent_task_restarts_total",
}


# --- helpers --------------------------------------------------------------------------------------------------


def operations() -> str:
    return OPERATIONS.read_text()


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_expressions(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and query variables."""
    exprs = [t["expr"] for p in all_panels(board["panels"]) for t in p.get("targets", []) if t.get("expr")]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def series_names(exposition: str) -> set[str]:
    """Every series name a query may use: counters as <name>_total (and _created), histograms as _bucket, _sum,
    _count, gauges as they are. A labelled counter with no child yet has a family but no samples, so names come
    from the family types as well as from the samples."""
    names: set[str] = set()
    # dcgm-exporter's family keeps its names as written (its counters have no _total suffix).
    names.update(re.findall(r"^# TYPE (DCGM_FI_\w+) ", exposition, re.M))
    exposition = "".join(line + "\n" for line in exposition.splitlines()
                         if not re.match(r"(# (HELP|TYPE) )?DCGM_", line))
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.update({family.name + "_total", family.name + "_created"})
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count", "_created"))
        else:
            names.add(family.name)
    return names


@pytest.fixture(scope="module")
def exported() -> set[str]:
    names = series_names(scrape_metrics())
    assert "gpu_agent_gpu_healthy" in names and "gpu_agent_resource_devices" in names, names
    return names


# --- (a) the dashboard, and every metric the docs name ----------------------------------------------------------


def test_dashboard_is_valid_json_with_the_expected_shape() -> None:
    board = dashboard()
    assert board["title"] == "gpu-node-agent"
    assert isinstance(board["schemaVersion"], int) and 36 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    node = variables["node"]
    assert node["type"] == "query"
    assert node["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    query = node["query"]["query"] if isinstance(node["query"], dict) else node["query"]
    assert query == "label_values(gpu_agent_gpu_healthy, instance)"
    assert node["definition"] == query
    assert node["multi"] and node["includeAll"]


def test_dashboard_panels_use_the_datasource_variable_and_the_node_filter() -> None:
    panels = list(all_panels(dashboard()["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    queried = [p for p in panels if p["type"] != "row"]
    assert len(queried) >= 10
    for panel in queried:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            for selector in re.findall(r"(?:gpu_agent|DCGM_FI)_\w+\{([^}]*)\}", target["expr"]):
                assert 'instance=~"$node"' in selector, (panel["title"], target["expr"])
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_panels_tile_the_grid_without_overlapping() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] >= 1 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r} at {(x, y)}"
                cells[(x, y)] = panel["title"]


def test_every_metric_in_the_dashboard_is_one_the_agent_exports(exported: set[str]) -> None:
    exprs = dashboard_expressions(dashboard())
    used = {name for expr in exprs for name in METRIC.findall(expr) + DCGM_METRIC.findall(expr)}
    assert used - exported == set(), f"not in the agent's /metrics: {sorted(used - exported)}"
    assert DASHBOARD_MUST_READ - used == set(), f"no panel shows {sorted(DASHBOARD_MUST_READ - used)}"


def test_every_metric_named_in_the_operations_guide_is_one_the_agent_exports(exported: set[str]) -> None:
    text = operations()
    # A name followed by "(" is the stem of a grep alternation such as gpu_agent_resource_(devices|allocatable).
    stems = set(re.findall(r"\b(gpu_agent_[a-z0-9_]*)\(", text))
    used = set(METRIC.findall(text)) - stems
    assert used, "the guide names no metric"
    assert used - exported == set(), f"not in the agent's /metrics: {sorted(used - exported)}"
    for stem in stems:
        assert any(name.startswith(stem) for name in exported), stem


def test_the_alert_rules_in_the_guide_are_well_formed(exported: set[str]) -> None:
    rule_files = [yaml.safe_load(body) for lang, body in code_blocks(operations()) if lang == "yaml" and
                  body.startswith("groups:")]
    assert len(rule_files) == 1
    rules = [rule for group in rule_files[0]["groups"] for rule in group["rules"]]
    assert {r["alert"] for r in rules} >= {"GPUUnhealthy", "GPUXidErrors", "GPUMigConfigFailed",
                                           "GPUKubeletRegistrationsFlapping"}
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
        assert set(METRIC.findall(rule["expr"])) <= exported, rule["alert"]
    unhealthy = next(r for r in rules if r["alert"] == "GPUUnhealthy")
    assert (unhealthy["expr"], unhealthy["for"]) == ("gpu_agent_gpu_healthy == 0", "5m")


# --- (b) every gpu-agent command line in the guide parses --------------------------------------------------------


def command_lines(text: str) -> list[str]:
    """Logical command lines of the guide's shell blocks: every line of `sh` blocks, and the `$ ` lines of
    `console` blocks (whose other lines are output); continuation lines joined."""
    lines: list[str] = []
    for lang, body in code_blocks(text):
        if lang not in ("sh", "console"):
            continue
        pending = ""
        for raw in body.splitlines():
            line = raw.rstrip()
            if not pending:
                if lang == "console":
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                if line.lstrip().startswith("#"):
                    continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            lines.append(pending + line)
            pending = ""
    return lines


def agent_invocations(text: str) -> list[list[str]]:
    """The arguments after `gpu-agent` of every command line that runs it (directly or after `exec ... --`)."""
    found = []
    for line in command_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as err:
            raise AssertionError(f"unparseable shell line {line!r}: {err}") from err
        for i, word in enumerate(words):
            if word == "gpu-agent" or word.endswith("/gpu-agent"):
                args = words[i + 1:]
                for j, arg in enumerate(args):  # stop at a pipe or the next command
                    if arg in ("|", "&&", "||", ";", "&"):
                        args = args[:j]
                        break
                found.append(args)
                break
    return found


def test_every_gpu_agent_command_in_the_guide_parses() -> None:
    invocations = agent_invocations(operations())
    assert len(invocations) >= 5, invocations
    commands = set()
    for args in invocations:
        try:
            namespace = parser().parse_args(args)
        except SystemExit as exit_:
            raise AssertionError(f"gpu-agent {shlex.join(args)}: rejected by the CLI parser") from exit_
        commands.add(namespace.command if namespace.command != "mig" else f"mig {namespace.action}")
    assert {"run", "simulate", "mig plan", "mig apply"} <= commands, commands


def test_command_extraction_sees_console_and_sh_blocks_only() -> None:
    text = (
        "```console\n$ gpu-agent simulate --node dgx-h100\ngpu-agent output line --not-a-flag\n```\n"
        "```sh\nkubectl -n ns exec pod -- gpu-agent mig plan \\\n  --layout all-balanced\n```\n"
        "```yaml\ncommand: gpu-agent run --bogus\n```\n"
        "  ```console\n  $ gpu-agent inspect --json | head\n  ```\n"
    )
    assert agent_invocations(text) == [
        ["simulate", "--node", "dgx-h100"],
        ["mig", "plan", "--layout", "all-balanced"],
        ["inspect", "--json"],
    ]


# --- (c) every key of the agent's the guide names is one it owns or reads ---------------------------------------

KEY = re.compile(r"(?:nvidia\.com|gpu-node-agent\.io)/[A-Za-z0-9_.<>+*-]*[A-Za-z0-9>*]")
# Keys the agent reads and never writes.
READ_KEYS = {MIG_CONFIG_LABEL, CONFIG_LABEL, "nvidia.com/gpu.present", CORDON_ANNOTATION}
# Resource names the agent advertises (not labels): whole GPUs, renamed replicas and MIG profiles.
RESOURCES = {GPU_RESOURCE, f"{GPU_RESOURCE}.shared"}


def guide_keys(text: str) -> set[str]:
    """The keys the text names. A stem of a regular expression's alternation (as in the clean-up script's grep)
    is kept with its trailing "." or "-", as a prefix."""
    unescaped = text.replace("\\.", ".")
    keys = set()
    for match in KEY.finditer(unescaped):
        key, after = match.group(0), unescaped[match.end():match.end() + 2]
        # "nvidia.com/cuda.(driver|runtime)" or "(nvidia.com/mig-|...)" is a stem; "key-" alone is kubectl's removal
        stem = after in (".(", "-|", "-)")
        keys.add(key + after[0] if stem else key)
    return keys


def agent_knows(key: str) -> bool:
    if key.endswith(".") or key.endswith("-"):  # a prefix: the agent owns keys under it
        return any(k.startswith(key) for k in OWNED_NVIDIA_KEYS) or owned(key + "x")
    concrete = re.sub(r"<[^>]+>", "1g.10gb", key).replace("*", "count")
    return (
        owned(concrete)
        or owned_annotation(concrete)
        or concrete == DEFAULT_CONFIG.health.taint.key
        or concrete in READ_KEYS
        or concrete in RESOURCES
        or concrete == mig_resource(concrete.removeprefix("nvidia.com/mig-"))
    )


def test_the_daemonset_selects_the_gpu_present_label_the_guide_documents() -> None:
    daemonset = yaml.safe_load(DAEMONSET.read_text())
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_every_agent_key_in_the_guide_is_owned_or_read_by_the_agent() -> None:
    # "Beside the GPU Operator" names the Operator's own switches (nvidia.com/gpu.deploy.*), which the agent
    # never writes; tests/integration/test_gpu_operator.py checks them against the Operator's list.
    text = operations()
    start = text.index("## Beside the GPU Operator")
    keys = guide_keys(text[:start] + text[text.index("\n## ", start + 1):])
    unknown = sorted(k for k in keys if not agent_knows(k))
    assert unknown == [], f"keys the agent neither owns nor reads: {unknown}"
    # The guide covers the protocol's keys, and nothing it names as the user's is one the agent writes.
    assert {MIG_CONFIG_LABEL, MIG_STATE_LABEL, MIG_REASON_ANNOTATION, CONFIG_LABEL, "nvidia.com/gpu.present",
            DEFAULT_CONFIG.health.taint.key} <= keys
    assert not any(owned(k) for k in READ_KEYS)


def test_key_check_rejects_keys_the_agent_does_not_have() -> None:
    for stray in ("nvidia.com/gpu.deploy.device-plugin", "nvidia.com/mig.config.reason", "nvidia.com/gpu.uuid",
                  "gpu-node-agent.io"):
        assert not agent_knows(stray) or stray == "gpu-node-agent.io", stray
    assert guide_keys("`nvidia\\.com/mig\\.config\\.state\\.reason` and nvidia.com/mig-<profile>.count.") == {
        "nvidia.com/mig.config.state.reason", "nvidia.com/mig-<profile>.count"}
    assert guide_keys("grep -E '^(nvidia\\.com/cuda\\.(driver|runtime)|nvidia\\.com/mig-|nvidia\\.com/mig\\.(x))'") == {
        "nvidia.com/cuda.", "nvidia.com/mig-", "nvidia.com/mig."}
    assert agent_knows("nvidia.com/cuda.") and agent_knows("nvidia.com/mig-")
    assert not agent_knows("nvidia.com/gpu.deploy.")


def test_event_and_condition_names_in_the_guide_are_the_agents() -> None:
    text = operations()
    alerts = set(re.findall(r"- alert: (\w+)", text))
    named = set(re.findall(r"\b(?:GPU|Mig|Config|Mode)[A-Z][A-Za-z]+\b", text)) - alerts - {"ConfigMap", "ConfigMaps"}
    known = set(EVENT_REASONS.values()) | {CONDITION_TYPE, "GPUsHealthy", "GPUUnhealthy", "NodeGPUFault"}
    assert named - known == set(), sorted(named - known)
    assert {"GPUFault", "GPUWarning", "GPURecovered", "ConfigRejected", "ConfigApplied", "ModeSwitched",
            "MigConfigApplied", "MigConfigFailed", "MigConfigRebooting", CONDITION_TYPE} <= named
    reconciler = (REPO / "agent" / "kube" / "reconciler.py").read_text()
    for reason in ("GPUsHealthy", "GPUUnhealthy", "NodeGPUFault"):
        assert f'"{reason}"' in reconciler, reason


# --- links ------------------------------------------------------------------------------------------------------


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_in_the_guide_resolves() -> None:
    text = FENCE.sub("", operations())
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, fragment = link.partition("#")
        path = (OPERATIONS.parent / target).resolve() if target else OPERATIONS
        assert path.is_file(), f"{link}: no file {path}"
        if fragment:
            assert fragment in anchors(path), f"{link}: no heading #{fragment} in {path.name}"


def test_github_anchor_matches_githubs_rule() -> None:
    assert github_anchor("Config file (`--config`, `version: v1`)") == "config-file---config-version-v1"
    assert github_anchor("Pods on the GPUs, and applying again") == "pods-on-the-gpus-and-applying-again"
    assert github_anchor("4. Check") == "4-check"


# --- (d) the Dockerfile -----------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments and parser directives dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment line inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


def stages() -> tuple[dict[str, str], list[tuple[str, list[tuple[str, str]]]]]:
    """The global ARG defaults, and each stage as (FROM arguments, its instructions)."""
    global_args: dict[str, str] = {}
    result: list[tuple[str, list[tuple[str, str]]]] = []
    for keyword, args in dockerfile_instructions():
        if keyword == "FROM":
            result.append((args, []))
        elif not result:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            result[-1][1].append((keyword, args))
    return global_args, result


def resolve(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], text)


def pip_installs(instructions: list[tuple[str, str]]) -> list[str]:
    """Each `pip install ...` command in the stage's RUN instructions (split at &&)."""
    commands = [part.strip() for keyword, args in instructions if keyword == "RUN" for part in args.split("&&")]
    return [c for c in commands if re.search(r"\bpip install\b", c)]


def test_dockerfile_is_multi_stage_on_python_slim() -> None:
    global_args, parts = stages()
    assert global_args == {"PYTHON_IMAGE": "python:3.11-slim"}
    assert [frm for frm, _ in parts] == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]
    assert resolve(parts[-1][0], global_args) == "python:3.11-slim"


def test_build_stage_installs_only_hash_checked_wheels_from_the_locks() -> None:
    _, parts = stages()
    build = parts[0][1]
    copies = [args for keyword, args in build if keyword == "COPY"]
    assert copies[:2] == ["requirements-build.lock ./", "requirements.lock ./"]
    installs = pip_installs(build)
    assert installs == [
        "/opt/build/bin/pip install --require-hashes --no-deps --only-binary=:all: -r requirements-build.lock",
        "/opt/gpu-node-agent/bin/pip install --require-hashes --no-deps --only-binary=:all: -r requirements.lock",
        "/opt/gpu-node-agent/bin/pip install --no-deps /tmp/wheels/gpu_node_agent-*.whl",
    ]
    # The agent's own wheel is built from this tree without fetching anything, and checked against the lock.
    runs = " ".join(args for keyword, args in build if keyword == "RUN")
    assert "/opt/build/bin/pip wheel --no-build-isolation --no-deps" in runs
    # Nothing is pip-installed into the base image's own Python: Debian's and Ubuntu's refuse it (PEP 668).
    assert runs.startswith("python -m venv /opt/build ")
    assert not re.search(r"(^|&& )python -m pip\b", runs), runs
    assert "/opt/gpu-node-agent/bin/pip check" in runs
    assert "/opt/gpu-node-agent/bin/pip uninstall --yes pip setuptools" in runs
    for lock in ("requirements.lock", "requirements-build.lock"):
        assert (REPO / lock).is_file()
        assert f"!{lock}" in (REPO / ".dockerignore").read_text().splitlines()


def test_no_stage_installs_a_compiler_and_the_final_stage_runs_nothing() -> None:
    _, parts = stages()
    compilers = re.compile(r"\b(apt-get|apt|apk|yum|dnf|build-essential|gcc|g\+\+|clang|make|cmake)\b")
    for _, instructions in parts:
        for keyword, args in instructions:
            if keyword == "RUN":
                assert not compilers.search(args), args
    final = parts[-1][1]
    assert [k for k, _ in final] == ["LABEL", "COPY", "ENV", "USER", "EXPOSE", "ENTRYPOINT", "CMD"]
    assert dict(final)["COPY"] == "--from=build /opt/gpu-node-agent /opt/gpu-node-agent"
    env = dict(final)["ENV"]
    assert "PATH=/opt/gpu-node-agent/bin:$PATH" in env
    assert "NVIDIA_VISIBLE_DEVICES=all" in env and "NVIDIA_DRIVER_CAPABILITIES=utility" in env
    assert dict(final)["USER"] == "0:0"
    assert dict(final)["EXPOSE"] == "9400"


def test_image_runs_gpu_agent_run_and_the_daemonset_keeps_it() -> None:
    _, parts = stages()
    final = dict(parts[-1][1])
    entrypoint, cmd = json.loads(final["ENTRYPOINT"]), json.loads(final["CMD"])
    assert (entrypoint, cmd) == (["gpu-agent"], ["run"])
    assert parser().parse_args(cmd).command == "run"
    container = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == entrypoint
    args = [a.replace("$(NODE_NAME)", "gpu-node-1") for a in container["args"]]
    assert args[0] == "run"
    assert parser().parse_args(args).command == "run"
