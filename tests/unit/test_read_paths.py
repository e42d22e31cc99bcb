"""Every file the agent reads goes through one bounded, non-blocking reader: `read_file_bytes` and
`read_text_file` of agent/yamlfile.py, which refuse a FIFO, a device, a socket and a directory in one line without
waiting, and read at most a bound each call site names. Both halves are found from the source with ast, not
listed by hand:

- no raw read is left in agent/ (`Path.read_text`, `Path.read_bytes`, `open` or `Path.open` for reading, `os.open`
  of what may be a file, `os.read`, `json.load` of a file object, OpenSSL reading a CA or certificate file itself,
  ...), but for the few EXEMPT lists, each with its reason;
- every function that calls the reader is run, through the agent's own entry point, against a FIFO, a symbolic
  link to /dev/zero, a directory, a symbolic link to nothing and a regular file over that call's bound (CASES: a
  read added without a case fails here), and each answers within TIME_BOUND_S, with at most MEMORY_BOUND_BYTES
  of Python memory, in one line that names the file (or goes on without the file, as it documents).

The checkers run on a small fixture module first, so a checker that finds nothing cannot pass for the real tree.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import functools
import importlib
import logging
import os
import ssl
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.checks import machine_type
from agent.config import ConfigError, load_config
from agent.cordon import load_cordoned
from agent.deviceplugin.nodefiles import read_node_files
from agent.deviceplugin.response import NodeFiles
from agent.dra.claims import ClaimStore, Paths
from agent.kube import credentials
from agent.kube.credentials import Credentials, CredentialsError, from_kubeconfig
from agent.kube.usage import process_started
from agent.mig.applier import Journal
from agent.mig.layout import LayoutError, load_layouts
from agent.nvml import MockStateError
from agent.nvml.fake import FakeNvml
from agent.nvml.identity import load_identities, save_identities
from agent.nvml.nodefile import NodeFileError, load_node
from agent.nvml.records import DriverInfo, GpuInfo, NodeInventory
from agent.nvml.sysfs import sysfs_numa_node, sysfs_pci_class
from agent.yamlfile import InputFileError, read_text_file

REPO = Path(__file__).resolve().parents[2]
READERS = frozenset({"read_text_file", "read_file_bytes"})
"""The bounded reader's two faces (agent/yamlfile.py)."""
READER_MODULE = "agent.yamlfile"
TIME_BOUND_S = 5.0
"""Opening a FIFO with O_NONBLOCK returns at once and the rest is a few system calls: seconds mean it waits."""
MEMORY_BOUND_BYTES = 4 * 1024 * 1024
"""Python memory one refused read may take at its peak (tracemalloc): a few MB, whatever the file's bound."""


# --- where the agent reads files ------------------------------------------------------------------------------


def agent_modules() -> list[tuple[str, Path]]:
    """Every module of agent/ by name, but the generated protobuf and gRPC stubs (*_pb2*.py)."""
    found = []
    for path in sorted((REPO / "agent").rglob("*.py")):
        if "_pb2" in path.name:
            continue
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append((".".join(parts), path))
    return found


def scoped_calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """Every call of a module with the qualified name of the function it runs in, as Python names it
    (`code.co_qualname`: "Class.method", "outer.<locals>.inner", "<module>")."""
    calls: list[tuple[ast.Call, str]] = []

    def visit(node: ast.AST, prefix: str, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                name = prefix + ("<lambda>" if isinstance(child, ast.Lambda) else child.name)
                visit(child, name + ".<locals>.", name)
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".", prefix + child.name)
            else:
                if isinstance(child, ast.Call):
                    calls.append((child, scope))
                visit(child, prefix, scope)

    visit(tree, "", "<module>")
    return calls


def root(expr: ast.expr) -> str:
    """What an expression is made from, as the source writes it: `resources.files` for
    `resources.files("agent.mig").joinpath(name)`, `self.servicer` for `self.servicer`."""
    while True:
        if isinstance(expr, ast.Call):
            expr = expr.func
        elif isinstance(expr, ast.Subscript) or (isinstance(expr, ast.Attribute)
                                                 and isinstance(expr.value, ast.Call | ast.Subscript)):
            expr = expr.value
        else:
            return ast.unparse(expr)


def _mode(call: ast.Call, position: int) -> str | None:
    """The mode an open-like call is given (a constant), "r" when it gives none, None when it is not a constant."""
    mode: ast.expr | None = call.args[position] if len(call.args) > position else None
    mode = next((k.value for k in call.keywords if k.arg == "mode"), mode)
    if mode is None:
        return "r"
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else None


def _writes_only(mode: str | None) -> bool:
    return mode is not None and any(c in mode for c in "wax") and "+" not in mode


def _flag_names(expr: ast.expr) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(expr)
            if isinstance(n, ast.Attribute | ast.Name)}


LOADS_A_FILE_OBJECT = frozenset({"json.load", "pickle.load", "marshal.load", "tomllib.load", "plistlib.load"})
COPIES_A_FILE = frozenset({"shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copyfileobj"})


def raw_read(call: ast.Call) -> tuple[str, str] | None:
    """(what, of what) where `call` reads a file past the bounded reader; None where it does not. `what` is the
    kind of read ("Path.read_text", "open", "os.open", ...) and `of what` the source of the file's path (or the
    object read from), as the exemptions name it."""
    func = call.func
    name = ast.unparse(func)
    first = ast.unparse(call.args[0]) if call.args else ""
    if isinstance(func, ast.Attribute) and func.attr in ("read_text", "read_bytes"):
        return f"Path.{func.attr}", root(func.value)
    if name in ("open", "io.open", "codecs.open", "os.fdopen", "io.FileIO"):
        return None if _writes_only(_mode(call, 1)) else (name, first)
    if name == "os.open":  # flags: a directory (flock, fsync) or write-only is no read of a file's content
        flags = _flag_names(call.args[1]) if len(call.args) > 1 else set()
        return None if flags & {"O_DIRECTORY", "O_WRONLY"} else (name, first)
    if name in ("os.read", "os.pread", "os.readv"):
        return name, first
    if name in LOADS_A_FILE_OBJECT or name in COPIES_A_FILE:
        return name, first
    if isinstance(func, ast.Attribute) and func.attr == "open":  # Path.open, or a method of the same name
        return None if _writes_only(_mode(call, 0)) else ("Path.open", root(func.value))
    if isinstance(func, ast.Attribute) and func.attr in ("load_cert_chain", "load_verify_locations",
                                                         "load_dh_params"):
        return f"SSLContext.{func.attr}", first or ast.unparse(call.keywords[0].value)
    for keyword in call.keywords:  # ssl.create_default_context(cafile=..., capath=...): OpenSSL reads the file
        if keyword.arg in ("cafile", "capath") and not (isinstance(keyword.value, ast.Constant)
                                                        and keyword.value.value is None):
            return f"{name}({keyword.arg}=)", root(keyword.value)
    return None


EXEMPT: dict[tuple[str, str, str], str] = {
    ("agent.yamlfile", "os.open", "path"):
        "the bounded reader itself: O_NONBLOCK, fstat refuses what is not a regular file before any read",
    ("agent.yamlfile", "os.read", "fd"): "the bounded reader itself: reads at most its bound plus one byte",
    ("agent.mig.layout", "Path.read_text", "resources.files"):
        "the default layouts shipped inside the package (importlib.resources): a fixed name, no input's",
    ("agent.telemetry.exposition", "Path.read_text", "resources.files"):
        "the XID messages shipped inside the package (importlib.resources): a fixed name, no input's",
    ("agent.nvml.nodefile", "Path.read_text", "_preset_dir"):
        "a node preset shipped inside the package (importlib.resources); its name is checked against the package's "
        "own listing first",
    ("agent.nvml.fake_state", "os.open", "lock_path"):
        "the lock file beside the mock state, opened O_RDWR|O_CREAT only to flock it, never read (O_RDWR does "
        "not wait on a FIFO)",
    ("agent.deviceplugin.dirwatch", "os.read", "self._fd"):
        "drains the watch's own inotify descriptor (inotify_init1, IN_NONBLOCK), not a file",
    ("agent.kube.credentials", "ssl.create_default_context(cafile=)", "_private_copy"):
        "OpenSSL loads the private copy of the CA that _private_copy made through read_file_bytes",
    ("agent.kube.credentials", "SSLContext.load_cert_chain", "cert_file"):
        "OpenSSL loads the private copies of the certificate and key (_private_copy, or the inline data) in a "
        "temporary directory only this call knows; the ssl module takes files only",
    ("agent.deviceplugin.server", "Path.open", "self.servicer"):
        "the servicer's own open() (it starts taking ListAndWatch streams), no file",
    ("agent.agent", "Path.open", "monitor"): "the XID monitor's own open() (NVML event sets), no file",
    ("agent.health.monitor", "Path.open", "self"): "the XID monitor's own open() (NVML event sets), no file",
}
"""Reads the bounded reader does not make, by (module, what, of what), each with why it is safe."""


@dataclass(frozen=True)
class Read:
    module: str
    scope: str
    line: int
    what: str
    source: str

    def __str__(self) -> str:
        return f"{self.module}:{self.scope} (line {self.line}): {self.what} of {self.source}"


def raw_reads(module: str, source: str) -> list[Read]:
    """The reads of `module` that bypass the bounded reader and are not exempt."""
    found = []
    for call, scope in scoped_calls(ast.parse(source)):
        read = raw_read(call)
        if read is not None and (module, *read) not in EXEMPT:
            found.append(Read(module, scope, call.lineno, *read))
    return found


def reader_calls(module: str, source: str) -> dict[str, list[str]]:
    """Where `module` calls the bounded reader: "module:function" (the function it is called in) to the bound
    each call passes, as the source writes it ("MAX_INPUT_BYTES" for read_text_file's default)."""
    found: dict[str, list[str]] = {}
    for call, scope in scoped_calls(ast.parse(source)):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else ast.unparse(call.func)
        if name in READERS:
            bound = call.args[1] if len(call.args) > 1 else next(
                (k.value for k in call.keywords if k.arg == "max_bytes"), None)
            found.setdefault(f"{module}:{scope}", []).append(
                "MAX_INPUT_BYTES" if bound is None else ast.unparse(bound))
    return found


@functools.cache
def tree_reader_calls() -> dict[str, list[str]]:
    calls: dict[str, list[str]] = {}
    for module, path in agent_modules():
        if module != READER_MODULE:
            calls.update(reader_calls(module, path.read_text()))
    return calls


def bound_of(key: str) -> int:
    """The largest bound the reads of the function `key` pass, evaluated as the module does."""
    module = importlib.import_module(key.split(":")[0])
    namespace = {**vars(importlib.import_module(READER_MODULE)), **vars(module)}
    return max(int(eval(text, namespace)) for text in tree_reader_calls()[key])  # the agent's own source, its constants


# --- the checkers on a fixture ---------------------------------------------------------------------------------


FIXTURE = textwrap.dedent('''
    import json, os, ssl
    from importlib import resources
    from agent.yamlfile import read_text_file

    def reads(path, fd):
        path.read_text()
        (path / "x").read_bytes()
        open(path)
        open(path, "rb")
        open(path, mode="r+")
        with path.open() as f:
            json.load(f)
        os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.read(fd, 10)
        ssl.create_default_context(cafile=str(path))
        ssl.create_default_context().load_cert_chain(path)

    def writes(path):
        open(path, "w")
        path.open("ab")
        os.open(path, os.O_WRONLY | os.O_CREAT)
        os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        ssl.create_default_context(cafile=None)
        resources.files("agent").joinpath("x").read_text()

    class Holder:
        def load(self):
            return read_text_file(self.path)

        def nested(self):
            def inner(p):
                return read_text_file(p, 100)
            return inner
''')


def test_the_checkers_find_raw_reads_and_the_readers_callers_in_a_fixture() -> None:
    assert [(r.scope, r.line, r.what, r.source) for r in raw_reads("fixture", FIXTURE)] == [
        ("reads", 7, "Path.read_text", "path"),
        ("reads", 8, "Path.read_bytes", "path / 'x'"),
        ("reads", 9, "open", "path"),
        ("reads", 10, "open", "path"),
        ("reads", 11, "open", "path"),
        ("reads", 12, "Path.open", "path"),
        ("reads", 13, "json.load", "f"),
        ("reads", 14, "os.open", "path"),
        ("reads", 15, "os.read", "fd"),
        ("reads", 16, "ssl.create_default_context(cafile=)", "str"),
        ("reads", 17, "SSLContext.load_cert_chain", "path"),
        ("writes", 25, "Path.read_text", "resources.files"),  # exempt by module and source only
    ]
    assert reader_calls("fixture", FIXTURE) == {"fixture:Holder.load": ["MAX_INPUT_BYTES"],
                                                "fixture:Holder.nested.<locals>.inner": ["100"]}


# --- no raw read in agent/ --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("module", "path"), agent_modules(), ids=[m for m, _ in agent_modules()])
def test_no_module_reads_a_file_past_the_bounded_reader(module: str, path: Path) -> None:
    found = raw_reads(module, path.read_text())
    assert not found, ("read past agent/yamlfile.py's bounded reader (use read_text_file or read_file_bytes with a "
                       "documented bound, or add an exemption with its reason):\n" + "\n".join(map(str, found)))


def test_every_exemption_is_still_needed() -> None:
    used = set()
    for module, path in agent_modules():
        used |= {(module, *read) for call, _ in scoped_calls(ast.parse(path.read_text()))
                 if (read := raw_read(call)) is not None}
    assert sorted(set(EXEMPT) - used) == []


# --- each read, against hostile files ---------------------------------------------------------------------------


KINDS = ("fifo", "dev-zero", "directory", "dangling-symlink", "over-limit")


@dataclass(frozen=True)
class Case:
    run: Callable[[Path], object]
    """The agent's entry point, given the path where the hostile file is."""
    name: str = "input"
    """Where the hostile file is made, under a fresh directory (the entry point may expect a fixed name)."""
    refused: type[Exception] | None = None
    """What the entry point raises for a file it cannot read (its message one line naming the file); None where
    it goes on without the file, answering `answer`."""
    answer: object = None
    says_so: bool = False
    """Where it goes on without the file, it says why in one log line naming the file."""
    absent: frozenset[str] = frozenset()
    """Kinds of hostile file the entry point takes for no file at all: it answers `answer` and says nothing."""
    fixed: str = ""
    """Why `run` calls the reader itself at the call's bound: the call reads a fixed path the module has no
    parameter or constant for."""


SPEC = load_node("single-h200")
GPU = GpuInfo(index=0, uuid="GPU-0", name="NVIDIA H200", pci_bus_id="00000000:18:00.0", minor=0, memory_mib=143771,
              architecture="hopper", compute_capability=(9, 0), numa_node=None, mig_capable=True, mig_enabled=False,
              mig_pending=False)
SERVER = "https://127.0.0.1:6443"
KUBECONFIG = """apiVersion: v1
current-context: ctx
clusters:
- {name: c, cluster: {server: "https://127.0.0.1:6443", CLUSTER}}
users:
- {name: u, user: {USER}}
contexts:
- {name: ctx, context: {cluster: c, user: u}}
"""


def kubeconfig_with(path: Path, cluster: str, user: str = "token: abc") -> Credentials:
    kubeconfig = path.with_name("kubeconfig")
    kubeconfig.write_text(KUBECONFIG.replace("CLUSTER", cluster).replace("USER", user))
    return from_kubeconfig(kubeconfig)


def claim_store(checkpoint: Path) -> dict[str, Any]:
    paths = Paths(checkpoint.parent / "reg.sock", checkpoint.parent / "dra.sock", checkpoint, checkpoint.parent / "cdi",
                  checkpoint.parent)
    return ClaimStore(paths, "gpu.nvidia.com").claims


def fake_nvml(path: Path) -> None:
    FakeNvml(SPEC, state_file=path)


def saved_identities(path: Path) -> None:
    save_identities(path, {0: GPU})  # the file is read to compare, then replaced by the agent's own (or a warning)


CASES: dict[str, Case] = {
    "agent.config:load_config": Case(load_config, "config.yaml", refused=ConfigError),
    "agent.mig.layout:load_layouts": Case(load_layouts, "layouts.yaml", refused=LayoutError),
    "agent.nvml.nodefile:load_node": Case(lambda p: load_node(str(p)), "node.yaml", refused=NodeFileError),
    "agent.nvml.fake_state:FakeState._read_state": Case(fake_nvml, "nvml.json", refused=MockStateError,
                                                        absent=frozenset({"dangling-symlink"})),
    "agent.nvml.identity:load_identities": Case(load_identities, "gpus.json", answer={}, says_so=True),
    "agent.nvml.identity:save_identities": Case(saved_identities, "gpus.json"),
    "agent.cordon:load_cordoned": Case(lambda p: load_cordoned(p, NodeInventory(DriverInfo("570.133.20", "12.8"),
                                                                                (GPU,), ())),
                                       "cordon.json", answer=frozenset(), says_so=True),
    "agent.dra.claims:ClaimStore._read": Case(claim_store, "checkpoint.json", answer={}, says_so=True,
                                              absent=frozenset({"dangling-symlink"})),
    "agent.dra.claims:ClaimStore._fold_legacy_dynamic": Case(
        lambda p: claim_store(p.with_name("checkpoint.json")), "dynamic-mig.json", answer={}, says_so=True,
        absent=frozenset({"dangling-symlink"})),
    "agent.kube.credentials:Credentials.headers": Case(
        lambda p: Credentials(SERVER, ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), token_file=p).headers(), "token",
        refused=CredentialsError),
    "agent.kube.credentials:from_kubeconfig": Case(from_kubeconfig, "kubeconfig", refused=CredentialsError),
    "agent.kube.credentials:_private_copy": Case(lambda p: kubeconfig_with(p, f"certificate-authority: {p}"),
                                                 "ca.pem", refused=CredentialsError),
    "agent.checks:machine_type": Case(machine_type, "product_name", answer="unknown", says_so=True),
    "agent.nvml.sysfs:sysfs_numa_node": Case(lambda p: sysfs_numa_node("00000000:18:00.0", p.parent.parent),
                                             "0000:18:00.0/numa_node"),
    "agent.nvml.sysfs:sysfs_pci_class": Case(lambda p: sysfs_pci_class("00000000:18:00.0", p.parent.parent),
                                             "0000:18:00.0/class"),
    "agent.kube.usage:process_started": Case(lambda p: abs(process_started(p) - time.monotonic()) < 1.0, "stat",
                                             answer=True),
    "agent.deviceplugin.nodefiles:read_node_files": Case(
        lambda p: read_node_files(exists=lambda _: False, mig_minors=p), "mig-minors", answer=NodeFiles()),
    # The MIG journal (agent/mig/applier.py): an interrupted apply's layout, refused in one line naming the file.
    "agent.mig.applier:Journal.pending": Case(lambda p: Journal(p.parent).pending(), "mig-journal.json",
                                              refused=InputFileError),
    # /proc/locks (agent/locks.py, once the lead moves it onto the reader): its path is fixed in _holder_of.
    "agent.locks:_holder_of": Case(lambda p: read_text_file(p, bound_of("agent.locks:_holder_of")), "locks",
                                   refused=InputFileError,
                                   fixed="/proc/locks is written in _holder_of, with no parameter or constant"),
}
"""Every function of agent/ that calls the bounded reader ("module:function"), with its entry point."""


def test_every_read_of_the_agent_has_a_hostile_case_and_every_case_a_read() -> None:
    calls = set(tree_reader_calls())
    assert sorted(calls - set(CASES)) == [], "a read without a case: add it to CASES"
    assert sorted(set(CASES) - calls) == [], "a case without a read: the function no longer calls the reader"


def make(kind: str, path: Path, bound: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)  # opened for reading without O_NONBLOCK, it waits for a writer for ever
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")  # read to its end, it fills memory
    elif kind == "directory":
        path.mkdir()
    elif kind == "dangling-symlink":
        path.symlink_to(path.parent / "nowhere")
    else:
        with open(path, "wb") as f:  # bound + 1 bytes, the last on disk: the size is the file system's word
            f.seek(bound)
            f.write(b"\n")


@dataclass
class Outcome:
    value: object = None
    error: BaseException | None = None
    seconds: float = 0.0
    peak_bytes: int = 0
    reads: list[tuple[str, str, str]] = field(default_factory=list)
    """(module, function, path) of each call of the reader."""


@contextlib.contextmanager
def watching_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, str]]]:
    """Each call of the bounded reader from agent/, with the module and function that made it."""
    reads: list[tuple[str, str, str]] = []
    reader = importlib.import_module(READER_MODULE)
    for name in sorted(READERS):
        original = getattr(reader, name, None)
        if original is None:
            continue

        def spy(path: Path, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            reads.append((caller.f_globals.get("__name__", ""), caller.f_code.co_qualname, str(path)))
            return _original(path, *args, **kwargs)

        for module in list(sys.modules.values()):
            if (getattr(module, "__name__", "").startswith("agent.") and module is not reader
                    and getattr(module, name, None) is original):
                monkeypatch.setattr(module, name, spy)
    yield reads


def run_bounded(case: Case, path: Path) -> Outcome:
    """Run the case on a thread, waited for at most TIME_BOUND_S, with Python's allocations traced."""
    outcome = Outcome()

    def target() -> None:
        try:
            outcome.value = case.run(path)
        except BaseException as err:  # whatever it raises is looked at
            outcome.error = err

    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(TIME_BOUND_S)
    outcome.seconds = time.monotonic() - start
    outcome.peak_bytes = tracemalloc.get_traced_memory()[1] - base
    if not tracing:
        tracemalloc.stop()
    if thread.is_alive():
        if path.is_fifo() if not path.is_symlink() else False:
            with contextlib.suppress(OSError):  # a writer that comes and goes lets the blocked reader go
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{path}: the entry point did not return within {TIME_BOUND_S} s (it waits on the file)")
    return outcome


def one_line_naming(text: str, path: Path) -> bool:
    return "\n" not in text and str(path) in text


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key", sorted(CASES))
def test_each_read_answers_a_hostile_file_at_once_in_one_line_with_bounded_memory(
        key: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    case = CASES[key]
    module = key.split(":")[0]
    unread = raw_reads(module, (REPO / (module.replace(".", "/") + ".py")).read_text())
    # Not run where a raw read is left: a FIFO would hang this test and /dev/zero fill its memory.
    assert not unread, f"{key}: not run: {module} still reads past the bounded reader ({unread[0]})"
    assert key in tree_reader_calls(), f"{key}: not run: the function does not call the bounded reader"
    path = tmp_path / case.name
    make(kind, path, bound_of(key))
    caplog.set_level(logging.INFO)
    with watching_reads(monkeypatch) as reads:
        outcome = run_bounded(case, path)
    assert outcome.seconds < TIME_BOUND_S
    assert outcome.peak_bytes < MEMORY_BOUND_BYTES, f"{outcome.peak_bytes} bytes at the peak"
    if kind == "fifo" and not case.fixed:  # the case reaches this very read: every entry point hands on a FIFO
        module_name, function = key.split(":")
        assert (module_name, function, str(path)) in reads, f"{key} did not read {path}: {reads}"
    said = [r.getMessage() for r in caplog.records if r.name.startswith("agent") and r.levelno >= logging.INFO]
    assert all(one_line_naming(line, path) for line in said), said
    if case.refused is not None and kind not in case.absent:
        assert isinstance(outcome.error, case.refused), f"{key} gave {outcome.error!r}, {outcome.value!r}"
        assert one_line_naming(str(outcome.error), path), str(outcome.error)
        return
    assert outcome.error is None, f"{key} raised {outcome.error!r}"
    assert outcome.value == case.answer
    if case.says_so and kind not in case.absent:
        assert len(said) == 1, said
    elif kind in case.absent:
        assert said == []


# --- what the table's one case per function leaves out --------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key", ["client-certificate", "client-key"])
def test_a_client_certificate_or_key_that_is_a_hostile_file_is_refused_in_one_line_naming_it(
        key: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The certificate and the key go through `_private_copy` as the CA does; each is named when it is the one."""
    unread = raw_reads("agent.kube.credentials", (REPO / "agent/kube/credentials.py").read_text())
    assert not unread, f"not run: agent.kube.credentials still reads past the bounded reader ({unread[0]})"
    other = tmp_path / "other.pem"
    other.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    path = tmp_path / f"{key}.pem"
    make(kind, path, bound_of("agent.kube.credentials:_private_copy"))
    user = (f"client-certificate: {path}, client-key: {other}" if key == "client-certificate"
            else f"client-certificate: {other}, client-key: {path}")
    outcome = run_bounded(Case(lambda p: kubeconfig_with(p, "insecure-skip-tls-verify: true", user)), path)
    assert isinstance(outcome.error, CredentialsError), repr(outcome.error)
    assert one_line_naming(str(outcome.error), path)
    assert f"user 'u': {key.replace('-', ' ')} {path}: " in str(outcome.error)
    assert outcome.peak_bytes < MEMORY_BOUND_BYTES


@pytest.mark.parametrize("kind", KINDS)
def test_a_service_account_ca_that_is_a_hostile_file_is_refused_in_one_line_naming_it(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pod the CA's path is the module's constant SERVICE_ACCOUNT: the same reader, the same refusal."""
    unread = raw_reads("agent.kube.credentials", (REPO / "agent/kube/credentials.py").read_text())
    assert not unread, f"not run: agent.kube.credentials still reads past the bounded reader ({unread[0]})"
    monkeypatch.setattr(credentials, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    path = tmp_path / "ca.crt"
    make(kind, path, bound_of("agent.kube.credentials:_private_copy"))
    outcome = run_bounded(Case(lambda _: credentials.in_cluster()), path)
    assert isinstance(outcome.error, CredentialsError), repr(outcome.error)
    assert one_line_naming(str(outcome.error), path), str(outcome.error)
    assert outcome.peak_bytes < MEMORY_BOUND_BYTES


def test_a_file_over_its_bound_on_disk_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """Its size is the file system's word: nothing of it is read (a 32 MiB checkpoint bound costs no 32 MiB)."""
    path = tmp_path / "big"
    make("over-limit", path, 32 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(InputFileError) as caught:
            read_text_file(path, 32 * 1024 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(caught.value) == f"{path}: larger than 32 MiB; not read"
    assert peak < 64 * 1024


def test_a_proc_file_that_gives_no_size_is_read_up_to_its_bound() -> None:
    """/proc gives its files' size as 0: the bound holds as the file is read."""
    text = read_text_file(Path("/proc/self/stat"), 4096)
    assert text.startswith(f"{os.getpid()} (")
    with pytest.raises(InputFileError) as caught:
        read_text_file(Path("/proc/self/stat"), 8)
    assert str(caught.value) == "/proc/self/stat: larger than 8 bytes; not read"


def test_a_socket_is_refused_in_one_line(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(InputFileError) as caught:
            read_text_file(path)
    assert caught.value.reason in ("is a socket, not a regular file",
                                   f"cannot open: {os.strerror(errno.ENXIO)}")  # Linux refuses to open a socket
