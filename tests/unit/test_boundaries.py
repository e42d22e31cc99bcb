"""The import rules of the package and of its tests, read from the source with ast (nothing is imported to check them):

- only agent/nvml/ imports pynvml or ctypes (native code and NVML's own errors stay behind the NVML boundary);
  ctypes elsewhere only where NATIVE_ELSEWHERE names the module and why;
- outside agent/nvml/, the fake NVML is reached only through agent/nvml/fake.py (``FakeNvml``), never through
  the modules it is built from (fake_state.py, fake_mig.py, ...);
- a pure module (PURE) imports nothing that reaches the outside world (IO_MODULES), except the few names
  PURE_ALLOWANCES lists for one module with its reason, and nothing it imports from the package, however
  indirectly, imports pynvml or ctypes;
- no module reads another module's private names: no `from agent.x import _name`, and no `obj._name` (obj not
  `self` or `cls`) for a `_name` that another module of the package defines and this one does not;
- no file under tests/ or bench/ imports a test module (`test_*`): what tests share lives in helper modules
  (tests/builders.py, tests/plugin_harness.py, the rigs).

The checker runs on a small fixture package first, so a checker that finds nothing cannot pass for the real tree.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

NATIVE = frozenset({"pynvml", "ctypes"})
"""Only modules under agent/nvml/ may import these."""

NATIVE_ELSEWHERE: dict[str, tuple[str, str]] = {
    "agent/deviceplugin/dirwatch.py": ("ctypes", "inotify_init1/inotify_add_watch through libc; no NVML"),
}
"""Modules outside agent/nvml/ that may import one native module, with the reason."""

IO_MODULES = frozenset({
    # files and the operating system
    "os", "io", "pathlib", "shutil", "tempfile", "glob", "fcntl", "mmap", "sqlite3", "importlib",
    # processes and signals
    "subprocess", "multiprocessing", "signal", "pty",
    # network and the servers the agent runs
    "socket", "ssl", "select", "selectors", "http", "urllib", "aiohttp", "grpc", "kubernetes", "requests",
    "httpx", "prometheus_client",
    # event loops and threads
    "asyncio", "threading", "concurrent", "queue",
    # native code, the clock, log output
    "ctypes", "cffi", "pynvml", "time", "logging",
})
"""Top-level modules a pure module does not import: each reads or changes something outside its arguments."""

PURE = (
    "agent/state.py",
    "agent/inventory.py",
    "agent/labels.py",
    "agent/topology/*.py",
    "agent/health/policy.py",
    "agent/mig/planner.py",
    "agent/nvml/records.py",
    "agent/nvml/catalog.py",
    "agent/mps_client.py",
    "agent/deviceplugin/response.py",
    "agent/telemetry/chargeback.py",
)
"""Modules whose functions depend only on their arguments (globs, each matching at least one file)."""

PURE_IF_PRESENT = ("agent/dra/slices.py", "agent/dra/slices/*.py")
"""Pure modules of a part that may not be in the tree yet."""

PURE_ALLOWANCES: dict[str, dict[str, frozenset[str]]] = {
    # StateBus, the one publication point, lives beside NodeState: it waits on an asyncio and a threading
    # Condition and stamps incidents with the wall clock. Nothing else of these modules may be used there.
    "agent/state.py": {
        "asyncio": frozenset({"Condition"}),
        "threading": frozenset({"Condition"}),
        "time": frozenset({"time"}),
    },
    # Paths of the MPS daemons' directories, joined without touching the filesystem.
    "agent/mps_client.py": {"pathlib": frozenset({"PurePath", "PurePosixPath"})},
}
"""For one pure module: the I/O modules it may import and the only attributes of each it may use."""


@dataclass(frozen=True)
class Import:
    module: str
    """The absolute module name, e.g. "agent.nvml.backend"."""
    names: tuple[str, ...]
    """What `from module import ...` takes; () for `import module`."""
    line: int

    @property
    def top(self) -> str:
        return self.module.split(".")[0]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every import statement of a file, at any depth (a function's local import counts too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(root, path).split(".")
    if path.name != "__init__.py":
        package.pop()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append(Import(module, tuple(alias.name for alias in node.names), node.lineno))
    return found


def source_of(root: Path, module: str) -> Path | None:
    """The file of a module of the tree, or None when it is not one (a third-party or standard module)."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def loaded_with(root: Path, imp: Import) -> list[str]:
    """The tree's modules an import statement runs: the module, the packages above it, and the submodules a
    `from package import name` names."""
    parts = imp.module.split(".")
    modules = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    modules += [f"{imp.module}.{name}" for name in imp.names]
    return [m for m in modules if source_of(root, m) is not None]


def package_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "agent").rglob("*.py") if "__pycache__" not in p.parts)


def native_violations(root: Path) -> list[str]:
    """Modules outside agent/nvml/ that import pynvml or ctypes without an entry in NATIVE_ELSEWHERE."""
    problems = []
    for path in package_files(root):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("agent/nvml/"):
            continue
        allowed = NATIVE_ELSEWHERE.get(rel, ("", ""))[0]
        for imp in imports_of(root, path):
            if imp.top in NATIVE and imp.top != allowed:
                problems.append(f"{rel}:{imp.line} imports {imp.module} (only agent/nvml/ may)")
    return problems


def fake_part_violations(root: Path) -> list[str]:
    """Modules outside agent/nvml/ that import a part of the fake NVML instead of agent.nvml.fake."""
    problems = []
    for path in package_files(root):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("agent/nvml/"):
            continue
        for imp in imports_of(root, path):
            named = [imp.module] if imp.module.startswith("agent.nvml.") else [
                f"{imp.module}.{name}" for name in imp.names]
            parts = [m for m in named if m.startswith("agent.nvml.fake_")]
            problems += [f"{rel}:{imp.line} imports {part} (use agent.nvml.fake)" for part in parts]
    return problems


def pure_modules(root: Path) -> list[Path]:
    found: list[Path] = []
    for pattern in PURE:
        matched = sorted(root.glob(pattern))
        if not matched:
            raise AssertionError(f"no file matches the pure module {pattern}: rename it in PURE")
        found += matched
    for pattern in PURE_IF_PRESENT:
        found += sorted(root.glob(pattern))
    return [p for p in found if p.name != "__init__.py" or p.read_text().strip()]


def _attribute_uses(tree: ast.AST, bound: str) -> set[str]:
    """The attributes taken of a name (`bound.x`), with "" for any other use of the bare name."""
    used = set()
    attributes = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == bound:
            used.add(node.attr)
        elif isinstance(node, ast.Name) and node.id == bound and id(node) not in attributes:
            used.add("")
    return used


def io_violations(root: Path, path: Path) -> list[str]:
    """The I/O a pure module imports directly, beyond its PURE_ALLOWANCES."""
    rel = path.relative_to(root).as_posix()
    allowances = PURE_ALLOWANCES.get(rel, {})
    tree = ast.parse(path.read_text())
    problems = []
    for imp in imports_of(root, path):
        if imp.top not in IO_MODULES:
            continue
        allowed = allowances.get(imp.top)
        if allowed is None or imp.module != imp.top:
            problems.append(f"{rel}:{imp.line} imports {imp.module} (I/O in a pure module)")
        elif imp.names:
            problems += [f"{rel}:{imp.line} imports {imp.module}.{name} (I/O in a pure module)"
                         for name in imp.names if name not in allowed]
        else:
            problems += [f"{rel}:{imp.line} uses {imp.top}.{attr} (only {', '.join(sorted(allowed))} allowed)"
                         if attr else f"{rel}:{imp.line} passes {imp.top} itself around"
                         for attr in sorted(_attribute_uses(tree, imp.top) - allowed)]
    return problems


def native_reached(root: Path, path: Path) -> list[str]:
    """pynvml or ctypes loaded by importing a module, each with the shortest chain of the tree's modules that
    loads it."""
    start = module_name(root, path)
    chains = {start: [start]}
    queue = [start, *loaded_with(root, Import(start, (), 0))[:-1]]
    for package in queue[1:]:
        chains[package] = [package]
    problems = []
    reported: set[str] = set()
    while queue:
        current = queue.pop(0)
        source = source_of(root, current)
        assert source is not None
        for imp in imports_of(root, source):
            if imp.top in NATIVE and imp.top not in reported:
                reported.add(imp.top)
                problems.append(f"{path.relative_to(root).as_posix()} loads {imp.module} through "
                                f"{' -> '.join(chains[current])}")
            for module in loaded_with(root, imp):
                if module not in chains:
                    chains[module] = [*chains[current], module]
                    queue.append(module)
    return problems


def purity_violations(root: Path) -> list[str]:
    problems = []
    for path in pure_modules(root):
        problems += io_violations(root, path) + native_reached(root, path)
    return problems


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, variables and attributes it assigns."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
    return {name for name in found if _private(name)}


def private_reaches(root: Path) -> list[str]:
    """Each place a module of the package takes another module's private name: an import of one from a module
    of the package, or an attribute of something other than `self` or `cls` that another module defines and
    this one does not (a private attribute of a third-party object, such as ctypes' `_obj`, is not counted)."""
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in package_files(root)}
    defined = {path: private_names(tree) for path, tree in trees.items()}
    everywhere = set().union(*defined.values())
    problems = []
    for path, tree in trees.items():
        rel = path.relative_to(root).as_posix()
        imported = {(imp.line, name) for imp in imports_of(root, path) if imp.top == "agent"
                    for name in imp.names if _private(name)}
        problems += [f"{rel}:{line} imports {name}" for line, name in sorted(imported)]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in everywhere and node.attr not in defined[path]:
                problems.append(f"{rel}:{node.lineno} reads {ast.unparse(node)}")
    return sorted(set(problems), key=lambda line: (line.split(":")[0], int(line.split(":")[1].split()[0]), line))


# --- the checker on a fixture package --------------------------------------------------------------------

FIXTURE = {
    "agent/__init__.py": "",
    "agent/nvml/__init__.py": "",
    "agent/nvml/records.py": "from dataclasses import dataclass\n",
    "agent/nvml/backend.py": "import ctypes\nimport pynvml\nfrom agent.nvml.records import *\n",
    "agent/config.py": "import os\nfrom agent.nvml import backend\n",
    "agent/mig/__init__.py": "",
    "agent/mig/applier.py": "import pynvml\n\ndef apply():\n    from ctypes import c_uint\n",
    "agent/mig/planner.py": "from agent.nvml.catalog import MODELS\n",
    "agent/nvml/catalog.py": "import math\n",
    "agent/deviceplugin/__init__.py": "",
    "agent/deviceplugin/dirwatch.py": "import ctypes.util\nimport pynvml\n",
    "agent/simulate.py": "from agent.nvml.fake import FakeNvml\nfrom agent.nvml.fake_mig import FakeMig\n"
                         "from agent.nvml import fake_state\n",
    "agent/state.py": (
        "import asyncio\nimport threading\nimport time\nfrom os import path\nfrom .config import X\n\n"
        "a = asyncio.Condition()\nb = threading.Condition()\nc = threading.Thread\n"
        "d = asyncio.get_event_loop().run_until_complete\ne = time.time()\nf = (time,)\n"
    ),
    "agent/inventory.py": "from agent.nvml.records import GpuInfo\nfrom .state import NodeState\n",
    "agent/labels.py": "import socket\n",
    "agent/topology/__init__.py": "",
    "agent/topology/model.py": "from ..nvml import records\n",
    "agent/health/__init__.py": "",
    "agent/health/policy.py": "import logging\nfrom subprocess import run\n",
    "agent/mps_client.py": "from pathlib import PurePath\n",
    "agent/deviceplugin/response.py": "import operator\n",
    "agent/telemetry/__init__.py": "",
    "agent/telemetry/chargeback.py": "from fractions import Fraction\n",
}


def write_fixture(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


def test_the_checker_finds_native_imports_outside_the_nvml_package(tmp_path: Path) -> None:
    write_fixture(tmp_path, FIXTURE)
    assert native_violations(tmp_path) == [
        "agent/deviceplugin/dirwatch.py:2 imports pynvml (only agent/nvml/ may)",
        "agent/mig/applier.py:1 imports pynvml (only agent/nvml/ may)",
        "agent/mig/applier.py:4 imports ctypes (only agent/nvml/ may)",
    ]


def test_the_checker_finds_parts_of_the_fake_imported_outside_the_nvml_package(tmp_path: Path) -> None:
    write_fixture(tmp_path, FIXTURE)
    assert fake_part_violations(tmp_path) == [
        "agent/simulate.py:2 imports agent.nvml.fake_mig (use agent.nvml.fake)",
        "agent/simulate.py:3 imports agent.nvml.fake_state (use agent.nvml.fake)",
    ]


def test_the_checker_finds_io_and_nvml_reached_from_pure_modules(tmp_path: Path) -> None:
    write_fixture(tmp_path, FIXTURE)
    assert purity_violations(tmp_path) == [
        "agent/state.py:1 uses asyncio.get_event_loop (only Condition allowed)",
        "agent/state.py:2 uses threading.Thread (only Condition allowed)",
        "agent/state.py:3 passes time itself around",
        "agent/state.py:4 imports os (I/O in a pure module)",
        "agent/state.py loads ctypes through agent.state -> agent.config -> agent.nvml.backend",
        "agent/state.py loads pynvml through agent.state -> agent.config -> agent.nvml.backend",
        "agent/inventory.py loads ctypes through agent.inventory -> agent.state -> agent.config -> agent.nvml.backend",
        "agent/inventory.py loads pynvml through agent.inventory -> agent.state -> agent.config -> agent.nvml.backend",
        "agent/labels.py:1 imports socket (I/O in a pure module)",
        "agent/health/policy.py:1 imports logging (I/O in a pure module)",
        "agent/health/policy.py:2 imports subprocess (I/O in a pure module)",
    ]


PRIVATE_FIXTURE = {
    "agent/__init__.py": "",
    "agent/store.py": (
        "import ctypes\n\nclass Store:\n    def __init__(self):\n        self._items = []\n\n"
        "    def _load(self):\n        return self._items\n\n    def same(self, other):\n"
        "        return other._items\n\n_CACHE = {}\n\ndef raw(ref):\n    return ref._obj\n"
    ),
    "agent/user.py": (
        "from agent.store import Store, _CACHE\nfrom agent import store\n\ndef use(s: Store):\n"
        "    s._load()\n    return store._CACHE, s._items, s.__class__\n"
    ),
    "agent/server.py": "import grpc\n\nclass Server:\n    def run(self):\n        return grpc._cython\n",
}


def test_the_checker_finds_private_names_read_across_modules(tmp_path: Path) -> None:
    write_fixture(tmp_path, PRIVATE_FIXTURE)
    # Not counted: self._x, another instance's attribute in the module that defines it (Store.same), a
    # third-party object's private attribute (ctypes' _obj, grpc's _cython), dunders.
    assert private_reaches(tmp_path) == [
        "agent/user.py:1 imports _CACHE",
        "agent/user.py:5 reads s._load",
        "agent/user.py:6 reads s._items",
        "agent/user.py:6 reads store._CACHE",
    ]


def test_no_module_reads_another_modules_private_names() -> None:
    assert private_reaches(REPO) == []


def test_a_missing_pure_module_is_an_error_not_a_pass(tmp_path: Path) -> None:
    write_fixture(tmp_path, {k: v for k, v in FIXTURE.items() if k != "agent/labels.py"})
    with pytest.raises(AssertionError, match=r"no file matches the pure module agent/labels\.py"):
        purity_violations(tmp_path)


# --- the rules on the package ----------------------------------------------------------------------------


def test_only_the_nvml_package_imports_pynvml_or_ctypes() -> None:
    assert native_violations(REPO) == []


def test_the_fake_nvml_is_reached_only_through_its_entry_point() -> None:
    assert fake_part_violations(REPO) == []


def test_each_native_exception_is_still_needed() -> None:
    for rel, (module, _reason) in NATIVE_ELSEWHERE.items():
        tops = {imp.top for imp in imports_of(REPO, REPO / rel)}
        assert module in tops, f"{rel} no longer imports {module}: remove it from NATIVE_ELSEWHERE"


def test_pure_modules_import_no_io_and_load_no_nvml() -> None:
    assert purity_violations(REPO) == []


def test_importing_the_pure_core_loads_neither_pynvml_nor_ctypes() -> None:
    modules = sorted(module_name(REPO, p) for p in pure_modules(REPO))
    script = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
              f"print(sorted(set({sorted(NATIVE)!r}) & set(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
    assert "agent.state" in modules and "agent.nvml.records" in modules


def test_simulate_and_the_agent_without_an_api_server_load_no_http_client() -> None:
    """docs/architecture.md: --no-kube and `simulate` never load an HTTP client, nor DRA mode's parts."""
    http = ("agent.kube.client", "agent.kube.node", "agent.dra.publisher", "agent.dra.plugin")
    script = ("import sys\nimport agent.simulate, agent.daemon, agent.cli\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'kubernetes')\n"
              f"             or m in {http!r}))")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["agent.simulate", "agent.daemon", "agent.agent", "agent.cli"])
def test_importing_a_module_of_the_agent_without_an_api_server_loads_no_aiohttp(module: str) -> None:
    """docs/architecture.md: --no-kube and `simulate` never load an HTTP client; each module on its own."""
    run = subprocess.run([sys.executable, "-c", f"import {module}, sys; print('aiohttp' in sys.modules)"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


RUN_WITHOUT_API_SERVER = """
import asyncio, sys, tempfile
from pathlib import Path
from agent.config import parse_config
from agent.daemon import AgentOptions, start_agent
from agent.nvml.backend import open_backend
from agent.simulate import simulate

async def main():
    await simulate(open_backend("mock:dgx-h100"), parse_config("version: v1\\n"), node_name="sim-dgx-h100")
    with tempfile.TemporaryDirectory(prefix="agent-") as tmp:  # --no-kube, in DRA mode
        config = parse_config(f"version: v1\\ndra: {{enabled: true}}\\nmig: {{stateDir: {tmp}/mig}}\\n")
        agent = await start_agent(open_backend("mock:dgx-h100"),
                                  AgentOptions(config=config, kubelet_dir=Path(tmp), metrics_port=None))
        await agent.stop()

asyncio.run(main())
print(sorted(m for m in sys.modules if m.split(".")[0] in ("aiohttp", "kubernetes") or m in HTTP))
"""


def test_running_simulate_or_the_agent_without_an_api_server_loads_no_http_client() -> None:
    """docs/architecture.md: a whole `simulate` run, and an agent started without an API server in DRA mode,
    load no HTTP client, nor the DRA modules that need one."""
    http = ("agent.kube.client", "agent.kube.node", "agent.dra.publisher", "agent.dra.plugin")
    script = f"HTTP = {http!r}\n" + RUN_WITHOUT_API_SERVER
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


CONSUMERS = {
    "device plugin": ("agent/deviceplugin/server.py", "agent/deviceplugin/servicer.py",
                      "agent/deviceplugin/response.py"),
    "node reconciler": ("agent/kube/reconciler.py",),
    "slice publisher": ("agent/dra/publisher.py",),
    "DRA kubelet plugin": ("agent/dra/plugin.py", "agent/dra/prepare.py", "agent/dra/health.py",
                           "agent/dra/claims.py"),
    "MIG controller": ("agent/mig/controller.py",),
    "MPS daemons": ("agent/mps.py",),
}
"""The consumers of the state bus, each with its modules. The metrics registry (agent/metrics.py), which every
part counts into, is not one of them here."""

NVML_CALLS = ("agent.nvml.backend", "agent.nvml.mig_ops", "agent.nvml.fields", "agent.nvml.fake")
"""The modules through which NVML is called."""


def consumer_reaches(root: Path) -> list[str]:
    """A consumer's module importing another consumer's, or the NVML modules (the MIG controller, also a
    producer, excepted for NVML)."""
    owner = {module_name(root, root / f): name for name, files in CONSUMERS.items() for f in files}
    problems = []
    for name, files in CONSUMERS.items():
        for rel in files:
            for imp in imports_of(root, root / rel):
                for module in loaded_with(root, imp):
                    if owner.get(module, name) != name:
                        problems.append(f"{rel}:{imp.line} ({name}) imports {module} ({owner[module]})")
                    if module in NVML_CALLS and name != "MIG controller":
                        problems.append(f"{rel}:{imp.line} ({name}) imports {module} (NVML)")
    return problems


def test_no_consumer_imports_another_or_calls_nvml() -> None:
    """docs/architecture.md: consumers reach each other only through callbacks the composition root hands them
    (SlicePublisher.republish, DraKubeletPlugin.holders), and only DRA's dynamic MIG (agent/dra/dynamic.py,
    handed to the kubelet plugin) calls NVML on a consumer's behalf."""
    for files in CONSUMERS.values():
        assert all((REPO / rel).is_file() for rel in files), files
    assert consumer_reaches(REPO) == []
    dynamic = {imp.module for imp in imports_of(REPO, REPO / "agent/dra/dynamic.py")}
    assert "agent.nvml.mig_ops" in dynamic
    root = (REPO / "agent/daemon.py").read_text()
    assert "slices.republish" in root and "dra.plugin.holders" in (REPO / "agent/agent.py").read_text()


def test_production_answers_allocate_through_the_response_builder() -> None:
    """docs/architecture.md: the servicer answers through ResponseBuilder.fill; container_response is a
    builder of its own for one answer."""
    servicer = ast.parse((REPO / "agent/deviceplugin/servicer.py").read_text())
    called = {node.func.attr for node in ast.walk(servicer)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    names = {node.id for node in ast.walk(servicer) if isinstance(node, ast.Name)}
    assert "fill" in called and "ResponseBuilder" in names and "container_response" not in names


def test_the_catalogs_nvml_numbers_are_pynvmls() -> None:
    import pynvml

    from agent.nvml import catalog

    written = {name: value for name, value in vars(catalog).items() if name.startswith("NVML_")}
    assert len(written) == 24
    assert {name: getattr(pynvml, name) for name in written} == written


def test_an_nvml_error_in_a_mig_call_leaves_the_boundary_as_mig_call_error_with_nvmls_message() -> None:
    import pynvml

    from agent.nvml.backend import fake_backend
    from agent.nvml.fake import FakeNvml
    from agent.nvml.mig_ops import MigCallError, MigOps
    from agent.nvml.nodefile import load_node

    fake = FakeNvml(load_node("dgx-h100"))
    backend = fake_backend(fake)
    backend.init()
    fake.fail_next("nvmlDeviceGetMigMode", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(MigCallError) as caught:
        MigOps(backend).state(0)
    assert str(caught.value) == "Unknown Error"
    assert not isinstance(caught.value, pynvml.NVMLError)
    assert isinstance(caught.value.__cause__, pynvml.NVMLError_Unknown)
    # The next call goes through: the wrapper changed the error's type, not the state.
    assert MigOps(backend).state(0).name == "NVIDIA H100 80GB HBM3"


# --- the tests' own imports ------------------------------------------------------------------------------------


def imports_of_test_modules(root: Path) -> list[str]:
    """Every import, at any depth, of a file under tests/ or bench/ that takes a test module (`test_*`) or a name
    that begins with `test_` (a test module of a package, or a test itself): shared code lives in helper modules
    (tests/builders.py, tests/plugin_harness.py, the rigs), so that no test module depends on another."""
    found = []
    for path in sorted(p for top in ("bench", "tests") for p in (root / top).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root)
        for imp in imports_of(root, path):
            if any(part.startswith("test_") for part in imp.module.split(".")):
                found.append(f"{rel}:{imp.line} imports {imp.module}")
            found += [f"{rel}:{imp.line} imports {imp.module}.{name}" for name in imp.names if name.startswith("test_")]
    return found


def test_the_checker_finds_test_modules_imported_by_tests(tmp_path: Path) -> None:
    other = "tests.unit.test_other"  # a test module, as each fixture file names it
    write_fixture(tmp_path, {
        "tests/__init__.py": "",
        "tests/builders.py": "from tests.plugin_harness import short_dir\n",
        "tests/unit/test_from.py": f"from {other} import helper\n",
        "tests/unit/test_plain.py": f"import pytest\nimport {other}\n",
        "tests/unit/test_package.py": "from tests.unit import test_other, builders\n",
        "tests/unit/test_relative.py": "from .test_other import helper\n",
        "tests/unit/test_local.py": f"def f():\n    from {other} import helper\n",
        "tests/unit/test_other.py": "from tests.builders import node\n",
        "tests/integration/test_top.py": "from apiserver import NODE\nfrom test_manifests import ok\n",
        "tests/integration/rig.py": "from helpers import test_agent_token as checks\n",
        "bench/fleet.py": "from tests.builders import AGENT\nfrom tests.fuzz import test_hostile\n",
    })
    assert imports_of_test_modules(tmp_path) == [
        "bench/fleet.py:2 imports tests.fuzz.test_hostile",
        "tests/integration/rig.py:1 imports helpers.test_agent_token",
        "tests/integration/test_top.py:2 imports test_manifests",
        "tests/unit/test_from.py:1 imports tests.unit.test_other",
        "tests/unit/test_local.py:2 imports tests.unit.test_other",
        "tests/unit/test_package.py:1 imports tests.unit.test_other",
        "tests/unit/test_plain.py:2 imports tests.unit.test_other",
        "tests/unit/test_relative.py:1 imports tests.unit.test_other",
    ]


def test_no_test_module_or_benchmark_imports_a_test_module() -> None:
    assert imports_of_test_modules(REPO) == []


def test_no_two_test_files_share_a_name() -> None:
    # The test directories are not packages: pytest imports each test file by its bare name, and a second file of
    # the same name in another directory fails the whole run's collection ("import file mismatch").
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
