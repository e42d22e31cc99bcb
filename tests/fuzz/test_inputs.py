"""Bad input at every edge the agent reads: the config file, the MIG layout file, the simulated node file and the
MIG label on the Node. Whatever the input, the answer is a valid object or the module's own error with a message
that names where the problem is; never another exception, never a traceback, never a half-applied change."""

from __future__ import annotations

import asyncio
import copy
import functools
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.config import AgentConfig, ConfigError, parse_config
from agent.daemon import nvml_sync
from agent.mig.layout import LayoutError, default_layouts_text, load_layouts, parse_layouts
from agent.nvml.backend import NvmlBackend
from agent.nvml.fake import FakeNvml
from agent.nvml.nodefile import NodeFileError, parse_node
from agent.simulate import InMemoryNode
from tests.plugin_harness import running_agent, wait_until

ORIGIN = "input.yaml"
FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Format:
    """One file format the agent reads: how to parse it and the one error type it may raise."""

    name: str
    parse: Callable[[str], object]
    error: type[ValueError]
    valid: dict[str, Any]

    def problems(self, err: ValueError) -> list[tuple[str, str]]:
        """(key path, reason) for each problem the error reports."""
        if isinstance(err, LayoutError | NodeFileError):
            return [(path, reason) for path, reason in err.problems]
        problems = []
        for line in str(err).splitlines():
            if re.fullmatch(r"\.\.\. and \d+ more problems?", line):
                continue
            assert line.startswith(f"{ORIGIN}: "), line
            path, _, reason = line.removeprefix(f"{ORIGIN}: ").partition(": ")
            problems.append((path, reason))
        return problems


VALID_CONFIG: dict[str, Any] = {
    "version": "v1",
    "flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": ["envvar", "cdi"], "deviceIDStrategy": "uuid"}},
    "sharing": {
        "timeSlicing": {
            "renameByDefault": False,
            "failRequestsGreaterThanOne": True,
            "resources": [
                {"name": "nvidia.com/gpu", "replicas": 2, "devices": [0, 1]},
                {"name": "nvidia.com/gpu", "replicas": 4, "rename": "nvidia.com/gpu.shared",
                 "devices": ["GPU-5f2c0b7e-1a3d-4c5e-8f90-1b2c3d4e5f60", "NVIDIA-H100-80GB-HBM3"]},
            ],
        },
        "allocationPolicy": "packed",
    },
    "health": {
        "xidDefault": "warn",
        "xid": {109: "unhealthy", 94: "ignore"},
        "checks": {"gpuLost": "node-fatal", "eccUncorrected": "unhealthy", "remappedRowsFailure": "unhealthy",
                   "remappedRowsPending": "warn", "retiredPagesPending": "warn", "thermalThrottle": "ignore",
                   "powerBrake": "warn"},
        "sampleIntervalSeconds": 1,
        "recoveryChecks": 5,
        "nodeFatalUnhealthyGpus": 2,
        "taint": {"key": "gpu-node-agent.io/gpu-fault", "effect": "NoExecute"},
    },
    "mig": {"layoutsFile": "/etc/layouts.yaml", "stateDir": "/var/lib/gpu-node-agent",
            "podResourcesSocket": "/var/lib/kubelet/pod-resources/kubelet.sock", "busyPolicy": "wait",
            "busyWaitSeconds": 60},
}
VALID_NODE: dict[str, Any] = {
    "version": "v1",
    "name": "lab-node",
    "driver": {"version": "570.133.20", "cuda": "12.8"},
    "gpus": [
        {"model": "A100-SXM4-80GB", "numa_node": 0},
        {"model": "A100-SXM4-80GB", "numa_node": 0, "uuid": "GPU-5f2c0b7e-1a3d-4c5e-8f90-1b2c3d4e5f60"},
        {"model": "A100-SXM4-80GB", "numa_node": 1, "pci_bus_id": "00000000:C1:00.0"},
        {"model": "A100-SXM4-80GB", "numa_node": 1},
    ],
    "links": [{"gpus": [0, 1], "nvlink": 12}, {"gpus": [2, 3], "nvlink": 12}, {"gpus": [0, 1], "pcie": "single"}],
    "nvswitch": False,
}

SHIPPED_LAYOUTS = yaml.safe_load(default_layouts_text())["mig-configs"]
VALID_LAYOUTS: dict[str, Any] = {
    "version": "v1",
    "mig-configs": {name: SHIPPED_LAYOUTS[name] for name in ("all-disabled", "all-enabled", "all-1g.10gb",
                                                             "all-balanced")},
}

FORMATS = {
    "config": Format("config", lambda text: parse_config(text, ORIGIN), ConfigError, VALID_CONFIG),
    "layouts": Format("layouts", lambda text: parse_layouts(text, ORIGIN), LayoutError, VALID_LAYOUTS),
    "node": Format("node", lambda text: parse_node(text, ORIGIN), NodeFileError, VALID_NODE),
}


def outcome(fmt: Format, text: str) -> ValueError | None:
    """None when the text parses; the module's own error otherwise. Any other exception fails the test."""
    try:
        fmt.parse(text)
    except fmt.error as err:
        return err
    return None


def assert_well_reported(fmt: Format, err: ValueError) -> None:
    """Every problem is a line that starts with the file's name and says something after it; past ten problems,
    a last line counts the rest."""
    lines = str(err).splitlines()
    assert lines, f"{fmt.name}: an empty message"
    if len(lines) > 10:
        assert len(lines) == 11 and re.fullmatch(r"\.\.\. and \d+ more problems?", lines[-1]), lines
        lines = lines[:-1]
    assert all(line.startswith(f"{ORIGIN}: ") and line.removeprefix(f"{ORIGIN}: ").strip() for line in lines), lines
    if isinstance(err, LayoutError | NodeFileError):
        assert all(reason.strip() for _, reason in err.problems), err.problems


def test_the_valid_documents_parse() -> None:
    for fmt in FORMATS.values():
        assert outcome(fmt, yaml.safe_dump(fmt.valid)) is None, fmt.name


# --- arbitrary and YAML-ish text ------------------------------------------------------------------------

TOKENS = [
    "version", "v1", "mig-configs", "gpus", "health", "xid", "flags", "devices", "all", "mig-enabled",
    "mig-devices", "model", "numa_node", "links", "nvlink", "pcie", "1g.10gb", "A100-SXM4-80GB", "0x233010DE",
    ":", ": ", "- ", "? ", "[", "]", "{", "}", ", ", "\n", "\n  ", "\n    ", "&a ", "*a", "<<: ", "'", '"', "#",
    "|\n  ", ">\n  ", "~", "null", "true", "no", "0o17", "0x1F", "1e400", "-.inf", ".nan", "123", "-7",
    "99999999999999999999", "2001-12-14", "!!str ", "!!int ", "!!float ", "!!bool ", "!!timestamp ", "!!binary ",
    "!!set ", "!!omap ", "!!map ", "!!seq ", "!!python/object:os.system ", "---\n", "...\n", "%YAML 1.1\n", " ",
    "\t", "\x00", "é", "\u2028", "\ufeff",
]
YAMLISH = st.lists(st.sampled_from(TOKENS), max_size=40).map("".join)


@pytest.mark.parametrize("name", sorted(FORMATS))
@FUZZ
@given(text=st.one_of(st.text(max_size=300), YAMLISH))
def test_any_text_is_parsed_or_refused_by_the_module_itself(name: str, text: str) -> None:
    fmt = FORMATS[name]
    err = outcome(fmt, text)
    if err is not None:
        assert_well_reported(fmt, err)


# Inputs that break PyYAML's own constructors or recursion, or the node file's duplicate-key check. Each is a
# file a user can write; each must end in the module's error, which the CLI prints as one line.
HOSTILE = {
    "tagged-int-not-a-number": "version: !!int v1\n",
    "tagged-int-empty": "version: !!int\n",
    "tagged-float-not-a-number": "version: !!float v1\n",
    "tagged-bool-not-a-bool": "version: !!bool v1\n",
    "tagged-timestamp-not-a-time": "version: !!timestamp v1\n",
    "integer-of-5000-digits": "version: 1" + "0" * 5000 + "\n",
    "hex-integer-of-5000-digits": "version: 0x" + "f" * 5000 + "\n",
    "nested-5000-deep": "version: " + "[" * 5000 + "]" * 5000 + "\n",
    "list-as-a-key": "version: v1\n? [a, b]\n: 1\n",
    "set-as-a-key": "version: v1\n? !!set {a}\n: 1\n",
    "control-character": "version: v1\x08\n",
}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_yaml_is_refused_by_the_module_itself(name: str, case: str) -> None:
    fmt = FORMATS[name]
    err = outcome(fmt, HOSTILE[case])
    assert err is not None
    assert_well_reported(fmt, err)


@pytest.mark.parametrize(
    ("args", "file", "code"),
    [
        (["run", "--no-kube", "--nvml", "mock:single-h200", "--kubelet-dir", "/tmp", "--config"], "config.yaml", 2),
        (["simulate", "--node"], "node.yaml", 1),
        (["mig", "plan", "--nvml", "mock:single-h200", "--layout", "x", "--mig-config"], "layouts.yaml", 1),
    ],
)
def test_the_cli_reports_hostile_yaml_in_one_line(tmp_path: Path, args: list[str], file: str, code: int) -> None:
    path = tmp_path / file
    path.write_text(HOSTILE["tagged-int-not-a-number"])
    done = subprocess.run([sys.executable, "-m", "agent.cli", *args, str(path)],
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == code, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert str(path) in done.stderr


# --- structured mutations of valid documents ------------------------------------------------------------

KEYS = st.one_of(
    st.sampled_from(["version", "name", "devices", "all", "x", "mig-enabled", "gpus", "1g.10gb", "nvlink"]),
    st.text("abcXYZ019-_.", min_size=1, max_size=8),
    st.integers(-2, 2000),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-3, 70), st.floats(), st.text(max_size=20),
    st.sampled_from(["all", "v1", "none", "mixed", "warn", "node-fatal", "0x233010DE", "1g.10gb", "7g.80gb",
                     "A100-SXM4-80GB", "H100-SXM5-80GB", "GPU-5f2c0b7e-1a3d-4c5e-8f90-1b2c3d4e5f60",
                     "00000000:18:00.0", "nvidia.com/gpu", "", "-1", "1e9"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(KEYS, inner, max_size=3)), max_leaves=8)


def key_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        yield from key_paths(value, (*prefix, key))


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """The document with one to three edits: a value replaced, a key or item removed, or one added."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in key_paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        edit = draw(st.sampled_from(["replace", "remove", "add"]))
        target = parent[path[-1]]
        if edit == "remove":
            del parent[path[-1]]
        elif edit == "add" and isinstance(target, dict):
            target[draw(KEYS)] = draw(VALUES)
        elif edit == "add" and isinstance(target, list):
            target.append(draw(VALUES))
        else:
            parent[path[-1]] = draw(VALUES)
    return doc


def locate(doc: Any, path: str) -> str:
    """Follow a reported key path (`a.b[2].c`, keys may hold dots) into the document: "found", "missing" when
    only its last key is absent (a required key), or "nowhere"."""
    node, rest = doc, path
    while rest:
        if rest.startswith("["):
            index, _, rest = rest[1:].partition("]")
            rest = rest.removeprefix(".")
            if isinstance(node, list) and index.isdigit() and int(index) < len(node):
                node = node[int(index)]
            elif isinstance(node, dict) and any(str(k) == index for k in node):
                node = next(v for k, v in node.items() if str(k) == index)
            elif not isinstance(node, list | dict) and index == "0" and not rest:
                return "found"  # a single value the format takes as a one-item list
            else:
                return "nowhere"
            continue
        if not isinstance(node, dict):
            return "nowhere"
        for key in sorted((str(k) for k in node), key=len, reverse=True):
            if rest == key or rest.startswith((f"{key}.", f"{key}[")):
                node = next(v for k, v in node.items() if str(k) == key)
                rest = rest[len(key):].removeprefix(".")
                break
        else:
            return "missing" if not any(c in rest for c in ".[") else "nowhere"
    return "found"


@pytest.mark.parametrize("name", sorted(FORMATS))
@FUZZ
@given(data=st.data())
def test_a_mutated_document_is_refused_naming_key_paths_that_exist(name: str, data: st.DataObject) -> None:
    fmt = FORMATS[name]
    doc = data.draw(mutated(fmt.valid), label="document")
    err = outcome(fmt, yaml.safe_dump(doc))
    if err is None:
        return
    assert_well_reported(fmt, err)
    for path, reason in fmt.problems(err):
        assert reason.strip(), f"{path!r} is named without a reason"
        where = locate(doc, path)
        assert where == "found" or (where == "missing" and ("missing" in reason or "required" in reason)), (
            f"{path!r} ({reason}) names no key of the document")


# --- the MIG label on the Node ---------------------------------------------------------------------------

LAYOUT_NAMES = load_layouts().names()
LABEL_VALUES = st.one_of(
    st.text(min_size=1, max_size=80),
    st.sampled_from([
        "all-disabled ", " all-balanced", "ALL-BALANCED", "all-1g.10gb\n", "all-1g.10gb+me", "all-balanced;rm -rf /",
        "../../etc/passwd", "\x00", "x" * 5000, "all-7g.80gb,all-disabled", "all-2g.99gb", "{}", "null",
    ]),
).filter(lambda value: value not in LAYOUT_NAMES)


def mig_layout_of(fake: FakeNvml) -> tuple[object, ...]:
    """The GPUs' MIG modes and instances as NVML reports them, read independently of the agent."""
    inventory = nvml_sync(NvmlBackend(lib=fake), lambda b: b.inventory())
    return tuple((g.mig_enabled, g.mig_pending) for g in inventory.gpus), inventory.mig_devices


def no_such_layout(value: str) -> str:
    """The reason a layout name no layout has gets: the name quoted whole up to 60 characters, else its start and
    its length, so that a huge value makes a short reason."""
    name = repr(value) if len(value) <= 60 else f"{value[:60]!r}... ({len(value)} characters)"
    known = ", ".join(LAYOUT_NAMES[:40]) + (f" and {len(LAYOUT_NAMES) - 40} more" if len(LAYOUT_NAMES) > 40 else "")
    return f"built-in default-layouts.yaml: no layout named {name} (known: {known})"


def at_most_1024(message: str) -> str:
    """An Event message as the agent records it: cut to 1024 characters, saying so."""
    return message if len(message) <= 1024 else message[:1009] + " ... (shortened)"


async def label_protocol(config: AgentConfig, values: list[str]) -> None:
    node = InMemoryNode("gpu-node-1")
    async with running_agent("dgx-a100", config, kube=node) as rig:
        kubelet, fake, bus = rig.kubelet, rig.fake, rig.agent.bus
        devices = [(d.ID, d.health) for d in kubelet.plugins["nvidia.com/gpu"].devices]
        layout = mig_layout_of(fake)

        def ended_in_failed(value: str) -> bool:
            status = bus.current.mig_status
            return status is not None and (status.layout, status.state) == (value, "failed")

        failures: list[str] = []
        for value in values:
            reason = no_such_layout(value)
            await node.patch_metadata({"nvidia.com/mig.config": value}, {})
            await wait_until(functools.partial(ended_in_failed, value), 10, f"label value {value!r} to end in failed")
            await rig.converged(10)
            assert node.view.labels.get("nvidia.com/mig.config.state") == "failed"
            assert node.view.annotations.get("nvidia.com/mig.config.state.reason") == reason[:4096]
            assert bus.current.mig_status is not None
            assert bus.current.mig_status.reason == reason
            if not failures or failures[-1] != value:
                failures.append(value)
            assert mig_layout_of(fake) == layout  # nothing applied, not even in part
            assert [(d.ID, d.health) for d in kubelet.plugins["nvidia.com/gpu"].devices] == devices
            assert bus.current.draining == frozenset()
        assert [e for e in node.events if e[1] == "MigConfigFailed"] == [
            ("Warning", "MigConfigFailed", at_most_1024(f"MIG layout {v}: failed: {no_such_layout(v)}"))
            for v in failures
        ]
        assert rig.restarts() == {}


@settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(LABEL_VALUES, min_size=1, max_size=6))
@example(values=["all-2g.99gb", "all-2g.99gb", "x" * 5000, "\x00"])
def test_any_mig_label_value_ends_in_failed_with_a_reason_and_changes_nothing(
    tmp_path_factory: pytest.TempPathFactory, values: list[str]
) -> None:
    state = tmp_path_factory.mktemp("mig")
    config = parse_config(yaml.safe_dump({"version": "v1", "mig": {
        "stateDir": str(state / "journal"), "podResourcesSocket": str(state / "no-kubelet.sock")}}))
    asyncio.run(label_protocol(config, values))
