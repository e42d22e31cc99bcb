"""`make bench`'s input cost: what reading each input file of the agent costs, over a corpus of hostile files,
held to one budget: at most 20 MB of RSS and 1 s of CPU above a normal read, for any file up to its kind's size
limit (agent.yamlfile.MAX_INPUT_BYTES, 64 KiB, for YAML files; agent.nvml.fake_state.MAX_STATE_BYTES, 256 KiB, for
the mock state), and a refusal of one printable line of at most 300 characters per problem (at most
agent.yamlfile.MAX_PROBLEMS problems listed, and a line counting the rest).

Usage: python bench/input_cost.py [--out bench/input_cost.json] [--check] [--only TEXT[,TEXT...]]
                                  [--jobs N] [--timeout S]
       python bench/input_cost.py --one READER FILE     (one in-process measurement; prints JSON)
       python bench/input_cost.py --make DIR NAME...    (writes those corpus files into DIR)

The corpus is bench/hostile/ (small files) and GENERATORS (the big ones, written at run time into a temporary
directory). Every case runs in a fresh process, so that one case's memory never counts for another:
- an in-process reader (config, layouts, node, mock-state, kubeconfig) runs `--one READER FILE`, which imports
  the agent, reads the reader's valid file once (so that what is lazily built on a first read is not counted),
  then measures the one call that reads FILE: the peak RSS (ru_maxrss) above the peak just before it, its CPU
  time (time.process_time) and its wall time;
- a CLI reader runs `gpu-agent ...` with FILE (`run` until it refuses or logs that it started, then SIGTERM)
  and measures the whole process (os.wait4): its peak RSS, CPU and wall time less the median of three runs of
  the same command on the reader's valid file, so that "extra" is over a normal start.
A case has a hard timeout (a case that runs past it is a failed budget, never a hang), and is ended when its
RSS passes a cap, so that no input can exhaust the machine. --check exits 1 when any case misses its budget or
its refusal is not one short line per problem. MB is 10**6 bytes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.nvml.fake_state import MAX_STATE_BYTES  # noqa: E402
from agent.yamlfile import MAX_INPUT_BYTES, MAX_PROBLEMS  # noqa: E402

HOSTILE = ROOT / "bench" / "hostile"
DEFAULT_OUT = ROOT / "bench" / "input_cost.json"
"""Written there, the results also render docs/benchmarks.md anew (bench/report.py)."""

EXTRA_RSS_MB = 20.0
CPU_S = 1.0
MAX_LINE_CHARS = 300
"""The longest refusal that counts as one short line."""
OUTCOME_CHARS = 200
"""The most characters of a case's outcome kept in the results."""
SMALL_FILE_BYTES = 4096
"""The largest file committed to bench/hostile/: bigger inputs are generated."""
TIMEOUT_S = 30.0
MEMORY_CAP_MB = 2000.0
"""A case whose RSS passes this is ended: it has missed its budget a hundred times over."""
BASELINE_RUNS = 3
MB = 1_000_000
PRIVATE_PARENT = "/tmp"
"""Where each CLI case gets a directory of its own: a short path, as the agent's sockets go there."""
STARTED = b"agent started:"
"""What `gpu-agent run` logs once it has started."""

# --- the readers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cli:
    """A `gpu-agent` command that reads the file: {file} and {dir} (a private directory) are filled in."""

    args: tuple[str, ...]
    until_started: bool = False
    """`run`: SIGTERM once it has started (it would serve until then)."""


KINDS: dict[str, tuple[str, Cli | None]] = {
    "config": ("cli-run", Cli(("run", "--no-kube", "--nvml", "{nvml}", "--kubelet-dir", "{dir}", "--metrics-port",
                               "0", "--config", "{file}"), until_started=True)),
    "layouts": ("cli-mig-plan", Cli(("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", "{file}",
                                     "--layout", "{layout}"))),
    "node": ("cli-inspect-node", Cli(("inspect", "--nvml", "mock:{file}"))),
    "mock-state": ("cli-inspect-mock-state", Cli(("inspect", "--nvml", "mock:single-h200", "--mock-state",
                                                  "{file}"))),
    "kubeconfig": ("", None),
}
"""Each kind of input file: the in-process reader has the kind's name; then the CLI reader that reads it, if any."""

CLI_READERS = {name: cli for name, cli in KINDS.values() if cli is not None}
KIND_OF = {name: kind for kind, (name, cli) in KINDS.items() if cli is not None}
READERS = (*KINDS, *CLI_READERS)


def baseline_file(kind: str, accepted: bool = True) -> str:
    """The corpus file of a tiny input of this kind that is accepted (or refused): a CLI case's figures are
    over the same command's on it, for the same outcome. The accepted one is also read first by --one."""
    return f"{kind}-{'valid' if accepted else 'invalid'}.{'json' if kind == 'mock-state' else 'yaml'}"


# --- the corpus ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    name: str
    """The file's name: in bench/hostile/, or made by GENERATORS[name]."""
    kind: str
    what: str
    cli: bool = True
    """Whether the kind's CLI reader reads it too."""
    node: str | None = None
    """A node file of the corpus for `run`'s --nvml mock:FILE; None runs on the single-h200 preset."""
    layout: str = "l0"
    """`mig plan`'s --layout."""

    @property
    def case(self) -> str:
        return self.name.rsplit(".", 1)[0]


def _padded(head: str, size: int, comment: bool = True) -> bytes:
    """`head` followed by a YAML comment (or JSON whitespace) to exactly `size` bytes, ending in a newline."""
    fill = size - len(head.encode()) - 1
    return (head + ("#" + "x" * (fill - 1) if comment else " " * fill) + "\n").encode()


LIMITS = {"config": MAX_INPUT_BYTES, "layouts": MAX_INPUT_BYTES, "node": MAX_INPUT_BYTES,
          "kubeconfig": MAX_INPUT_BYTES, "mock-state": MAX_STATE_BYTES}
"""The size limit of each kind of file: every generated case is as large as its kind's limit allows."""
NESTED = "[" * 10_000


def _fill(head: str, item: Callable[[int], str], tail: str, limit: int, sep: str = "") -> bytes:
    """`head`, then item(0), item(1), ... (joined by `sep`) as many as keep the file within `limit`, then
    `tail`."""
    parts, size = [], len(head.encode()) + len(tail.encode())
    i = 0
    while True:
        piece = (sep if parts else "") + item(i)
        if size + len(piece.encode()) > limit:
            break
        parts.append(piece)
        size += len(piece.encode())
        i += 1
    return (head + "".join(parts) + tail).encode()


def _filler(text: str, placeholder: str, char: str, limit: int, lead: str = "") -> bytes:
    """`text` with `placeholder` replaced by `lead` and as many `char` as fill it to `limit` bytes."""
    room = limit - len(text.replace(placeholder, "").encode()) - len(lead)
    return text.replace(placeholder, lead + char * room).encode()


CONFIG = (HOSTILE / "config-valid.yaml").read_text()
LAYOUTS = (HOSTILE / "layouts-valid.yaml").read_text()
NODE = (HOSTILE / "node-valid.yaml").read_text()
KUBECONFIG = (HOSTILE / "kubeconfig-valid.yaml").read_text()
MOCK_STATE = (HOSTILE / "mock-state-valid.json").read_text().strip()


@dataclass(frozen=True)
class YamlShapes:
    """Where each generated case of a YAML kind puts its payload: the text before it (around it, for `huge` and
    `big_int`, which hold HUGE and BIG as placeholders), and the line repeated for many keys and duplicates."""

    valid: str
    nested: str
    big_int: str
    huge: str
    keys_head: str
    key_line: str
    """A line with {i}, repeated after keys_head as many times as fit."""
    duplicate_head: str
    duplicate_line: str


def _yaml_generators(kind: str, shapes: YamlShapes) -> dict[str, Callable[[], bytes]]:
    limit = LIMITS[kind]
    return {
        f"{kind}-deep-nesting.yaml": lambda: (shapes.nested + NESTED + "\n").encode(),
        f"{kind}-huge-int.yaml": lambda: _filler(shapes.big_int, "BIG", "0", limit, lead="1"),
        f"{kind}-huge-string.yaml": lambda: _filler(shapes.huge, "HUGE", "a", limit),
        f"{kind}-many-keys.yaml": lambda: _fill(shapes.keys_head, lambda i: shapes.key_line.format(i=i), "", limit),
        f"{kind}-duplicate-keys.yaml": lambda: _fill(shapes.duplicate_head, lambda i: shapes.duplicate_line, "",
                                                     limit),
        f"{kind}-many-documents.yaml": lambda: _fill(shapes.valid, lambda i: "--- {}\n", "", limit),
        f"{kind}-exact-limit.yaml": lambda: _padded(shapes.valid, limit),
        f"{kind}-over-limit.yaml": lambda: _padded(shapes.valid, limit + 1),
    }


def _many_events(limit: int) -> bytes:
    from agent.nvml.nodefile import default_uuid

    gpu = default_uuid("single-h200", 0)  # the preset's one GPU
    return _fill('{"format": 1, "node": "single-h200", "gpus": {}, "next_seq": 999999999, "events": [',
                 lambda i: f'{{"seq": {i + 1}, "gpu_uuid": "{gpu}", "event_type": 8, "data": 79}}', "]}", limit,
                 sep=", ")


def _many_links(limit: int) -> bytes:
    pairs = [(a, b) for a in range(8) for b in range(a + 1, 8)]
    head = '{"version": "v1", "gpus": [' + ", ".join(['{"model": "H200-141GB", "numa_node": 0}'] * 8) + \
        '], "links": ['
    return _fill(head, lambda i: f'{{"gpus": [{pairs[i % len(pairs)][0]}, {pairs[i % len(pairs)][1]}], '
                 '"nvlink": 1}', "]}", limit, sep=", ")


GENERATORS: dict[str, Callable[[], bytes]] = {
    **_yaml_generators("config", YamlShapes(
        valid=CONFIG, nested="version: v1\nflags:\n  migStrategy: ",
        big_int="version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
                "      replicas: BIG\n",
        huge="version: v1\nflags:\n  migStrategy: HUGE\n",
        keys_head="version: v1\nflags:\n", key_line="  k{i}: none\n",
        duplicate_head="version: v1\nflags:\n", duplicate_line="  migStrategy: none\n")),
    **_yaml_generators("layouts", YamlShapes(
        valid=LAYOUTS, nested="version: v1\nmig-configs:\n  l0: ",
        big_int="version: v1\nmig-configs:\n  l0:\n  - devices: [BIG]\n    mig-enabled: false\n",
        huge="version: v1\nmig-configs:\n  l0:\n  - devices: all\n    mig-enabled: HUGE\n",
        keys_head="version: v1\nmig-configs:\n", key_line="  l{i}: []\n",
        duplicate_head="version: v1\nmig-configs:\n", duplicate_line="  l0: []\n")),
    **_yaml_generators("node", YamlShapes(
        valid=NODE, nested="version: v1\ngpus: ",
        big_int="version: v1\ngpus:\n- {model: H200-141GB, numa_node: BIG}\n",
        huge="version: v1\nname: HUGE\ngpus:\n- {model: H200-141GB, numa_node: 0}\n",
        keys_head=NODE, key_line="k{i}: 1\n", duplicate_head=NODE, duplicate_line="name: node\n")),
    **_yaml_generators("kubeconfig", YamlShapes(
        valid=KUBECONFIG, nested="apiVersion: v1\ncurrent-context: ",
        big_int="apiVersion: v1\ncurrent-context: BIG\n",
        huge=KUBECONFIG.replace("token: abc", "token: HUGE"),
        keys_head=KUBECONFIG, key_line="k{i}: 1\n", duplicate_head=KUBECONFIG,
        duplicate_line="current-context: ctx\n")),
    "node-many-gpus.json": lambda: _fill('{"version": "v1", "gpus": [',
                                         lambda i: '{"model": "H200-141GB", "numa_node": 0}', "]}",
                                         LIMITS["node"], sep=", "),
    "node-many-links.json": lambda: _many_links(LIMITS["node"]),
    "mock-state-deep-nesting.json": lambda: (NESTED + "\n").encode(),
    "mock-state-huge-int.json": lambda: _filler('{"format": 1, "gpus": {}, "next_seq": BIG}\n', "BIG", "0",
                                                LIMITS["mock-state"], lead="1"),
    "mock-state-huge-string.json": lambda: _filler('{"format": 1, "gpus": {}, "node": "HUGE"}\n', "HUGE", "a",
                                                   LIMITS["mock-state"]),
    "mock-state-many-keys.json": lambda: _fill('{"format": 1, "gpus": {', lambda i: f'"GPU-{i}": {{}}', "}}",
                                               LIMITS["mock-state"], sep=", "),
    "mock-state-duplicate-keys.json": lambda: _fill('{"format": 1, "gpus": {}, ', lambda i: '"node": "single-h200", ',
                                                    '"next_seq": 1}\n', LIMITS["mock-state"]),
    "mock-state-many-documents.json": lambda: _fill("", lambda i: MOCK_STATE + "\n", "", LIMITS["mock-state"]),
    "mock-state-many-events.json": lambda: _many_events(LIMITS["mock-state"]),
    "mock-state-exact-limit.json": lambda: _padded(MOCK_STATE, LIMITS["mock-state"], comment=False),
    "mock-state-over-limit.json": lambda: _padded(MOCK_STATE, LIMITS["mock-state"] + 1, comment=False),
}

_GENERATED_WHAT = {
    "deep-nesting": "10,000 levels of [",
    "huge-int": "one number as long as the size limit allows",
    "huge-string": "one value as long as the size limit allows",
    "many-keys": "as many keys as the size limit allows",
    "duplicate-keys": "one key repeated as often as the size limit allows",
    "many-documents": "as many small documents after the first as the size limit allows",
    "exact-limit": "a valid file padded to exactly the size limit",
    "over-limit": "a valid file padded to one byte over the size limit",
}

STARS_NODE = "node-64-a100.yaml"

CORPUS: tuple[Input, ...] = (
    Input("config-valid.yaml", "config", "the smallest valid config"),
    Input("config-invalid.yaml", "config", "the smallest refused config"),
    Input("config-alias-bomb.yaml", "config", "billion laughs under sharing.timeSlicing.resources[].devices"),
    Input("config-pattern-stars.yaml", "config", "resources.gpus[].pattern and resources.mig[].pattern of 50 "
          "stars and a character no name has, on 64 GPUs with the catalog's longest name",
          node=STARS_NODE),
    Input("config-unicode-escapes.yaml", "config", "a key of escapes: a lone surrogate, a bidi override, NUL"),
    Input("config-unicode-raw.yaml", "config", "a BOM; a value with a combining accent, a zero-width space and a "
          "line separator"),
    Input("config-unicode-key.yaml", "config", "an unknown key starting with a raw bidi override"),
    Input("config-nul.yaml", "config", "a NUL byte in a value"),
    Input("config-not-utf8.yaml", "config", "a byte that is not UTF-8"),
    *(Input(f"config-{case}.yaml", "config", what) for case, what in _GENERATED_WHAT.items()),
    Input("layouts-valid.yaml", "layouts", "the smallest valid layout file"),
    Input("layouts-invalid.yaml", "layouts", "the smallest refused layout file"),
    Input("layouts-alias-bomb.yaml", "layouts", "billion laughs under mig-configs.l0[].devices"),
    Input("layouts-unicode.yaml", "layouts", "a layout name with a bidi override and a lone surrogate"),
    *(Input(f"layouts-{case}.yaml", "layouts", what) for case, what in _GENERATED_WHAT.items()),
    Input("node-valid.yaml", "node", "the smallest valid node file"),
    Input("node-invalid.yaml", "node", "the smallest refused node file"),
    Input("node-alias-bomb.yaml", "node", "billion laughs in the node's name"),
    Input("node-unicode.yaml", "node", "a name with a bidi override and a lone surrogate"),
    Input(STARS_NODE, "node", "64 GPUs (the most a node file may have), each with the longest NVML name"),
    Input("node-many-gpus.json", "node", "a JSON node file of as many GPUs as the size limit allows"),
    Input("node-many-links.json", "node", "a JSON node file of 8 GPUs and as many NVLink entries as the size "
          "limit allows"),
    *(Input(f"node-{case}.yaml", "node", what) for case, what in _GENERATED_WHAT.items()),
    Input("mock-state-valid.json", "mock-state", "the smallest valid mock state file"),
    Input("mock-state-invalid.json", "mock-state", "the smallest refused mock state file"),
    Input("mock-state-unicode.json", "mock-state", "NUL, a lone surrogate and a bidi override in the node and a "
          "GPU"),
    Input("mock-state-many-events.json", "mock-state", "as many recorded events as the size limit allows"),
    *(Input(f"mock-state-{case}.json", "mock-state", what) for case, what in _GENERATED_WHAT.items()),
    Input("kubeconfig-valid.yaml", "kubeconfig", "a valid kubeconfig with a token"),
    Input("kubeconfig-invalid.yaml", "kubeconfig", "a kubeconfig without a current context"),
    Input("kubeconfig-alias-bomb.yaml", "kubeconfig", "billion laughs as the current context"),
    Input("kubeconfig-bad-base64.yaml", "kubeconfig", "certificate-authority-data that is not base64"),
    Input("kubeconfig-unicode.yaml", "kubeconfig", "a lone surrogate and a bidi override in the current context, "
          "NUL in the token"),
    *(Input(f"kubeconfig-{case}.yaml", "kubeconfig", what) for case, what in _GENERATED_WHAT.items()),
)


def materialize(names: list[str], directory: Path) -> None:
    """The corpus files `names` in `directory`: copies of the committed ones, and the generated ones."""
    for name in names:
        if name in GENERATORS:
            (directory / name).write_bytes(GENERATORS[name]())
        else:
            shutil.copyfile(HOSTILE / name, directory / name)


# --- one measurement in this process (--one) -----------------------------------------------------------


def _summary(text: str) -> dict[str, Any]:
    """What a user sees of an outcome: its first characters, how many lines, how long the longest is, and whether
    they are all printable (no control or format characters such as a bidi override, no line separator)."""
    lines = text.rstrip("\n").split("\n") if text else []
    return {"outcome": text[:OUTCOME_CHARS], "lines": len(lines), "longest_line": max(map(len, lines), default=0),
            "printable": all(line.isprintable() for line in lines)}


def _peak_rss_kb(reset: bool = False) -> int:
    """This process's peak RSS in KiB. `reset` first lowers the kernel's high-water mark to the RSS of now
    (clear_refs), so that the peak that follows is the read's own, not the imports'; where that is not allowed,
    ru_maxrss (the peak since the start)."""
    if reset:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def read_once(reader: str, path: Path) -> dict[str, Any]:
    """Read `path` with an in-process reader, measured; the reader's valid file is read once first."""
    from agent.config import ConfigError, load_config
    from agent.kube.credentials import CredentialsError, from_kubeconfig
    from agent.mig.layout import LayoutError, load_layouts
    from agent.nvml import MockStateError
    from agent.nvml.fake import FakeNvml
    from agent.nvml.nodefile import NodeFileError, load_node

    spec = load_node("single-h200")
    calls: dict[str, tuple[Callable[[Path], object], type[Exception]]] = {
        "config": (load_config, ConfigError),
        "layouts": (load_layouts, LayoutError),
        "node": (lambda p: load_node(str(p)), NodeFileError),
        "mock-state": (lambda p: FakeNvml(spec, p), MockStateError),
        "kubeconfig": (from_kubeconfig, CredentialsError),
    }
    call, refusal = calls[reader]
    call(HOSTILE / baseline_file(reader))
    gc.collect()
    rss_kb = _peak_rss_kb(reset=True)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        call(path)
        outcome, text = "accepted", ""
    except refusal as err:
        outcome, text = "refused", str(err)
    except Exception as err:  # what a reader must never raise: reported as such
        outcome, text = "unexpected", f"{type(err).__name__}: {err}"
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    extra_kb = _peak_rss_kb() - rss_kb
    return {"result": outcome, "extra_rss_mb": extra_kb * 1024 / MB, "cpu_s": cpu, "wall_s": wall,
            **_summary(text)}


# --- one process, watched ------------------------------------------------------------------------------


@dataclass
class _Output:
    """A child's stream, read as it comes: counted, with its first lines kept (a case may print millions)."""

    lines: list[bytes] = field(default_factory=list)
    count: int = 0
    traceback: bool = False
    started: threading.Event = field(default_factory=threading.Event)

    def read(self, stream: IO[bytes]) -> None:
        whole = True
        """Whether the last piece read ended a line: a line longer than a piece is one line, read piecewise."""
        while piece := stream.readline(1 << 16):
            starts, whole = whole, piece.endswith(b"\n")
            if not starts:
                continue
            if STARTED in piece:
                self.started.set()
            if b" INFO agent." in piece:  # the agent's own log as it starts: not part of what it says
                continue
            if piece.startswith(b"Traceback"):
                self.traceback = True
            self.count += 1
            if len(self.lines) < 5:
                self.lines.append(piece[:4 * OUTCOME_CHARS])
            else:
                self.lines[-1] = piece[:4 * OUTCOME_CHARS]  # the last line, for a traceback's exception


@dataclass
class Ran:
    rc: int | None
    rss_mb: float
    cpu_s: float
    wall_s: float
    stdout: _Output
    stderr: _Output
    ended: str | None
    """Why it was ended: "timeout" or "memory cap"; None when it ended by itself (or by the SIGTERM asked for)."""
    started: bool


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MB
    except (OSError, ValueError):
        pass
    return 0.0


def run_watched(command: list[str], timeout: float, until_started: bool = False) -> Ran:
    """Run `command` in a session of its own, ended at `timeout` or past MEMORY_CAP_MB; its peak RSS and CPU time
    from os.wait4. `until_started`: SIGTERM once it logs STARTED."""
    began = time.perf_counter()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Output(), _Output()
    readers = [threading.Thread(target=o.read, args=(s,), daemon=True) for o, s in ((out, proc.stdout),
                                                                                     (err, proc.stderr))]
    for t in readers:
        t.start()
    ended: str | None = None
    signalled = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if ended is None:
            if time.perf_counter() - began > timeout:
                ended = "timeout"
            elif _rss_mb(proc.pid) > MEMORY_CAP_MB:
                ended = "memory cap"
            if ended is not None:
                os.killpg(proc.pid, signal.SIGKILL)
        if until_started and not signalled and err.started.is_set():
            os.kill(proc.pid, signal.SIGTERM)
            signalled = True
        time.sleep(0.01)
    wall = time.perf_counter() - began
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait for it
    for t in readers:
        t.join(timeout=5)
    proc.stdout.close()
    proc.stderr.close()
    return Ran(proc.returncode, usage.ru_maxrss * 1024 / MB, usage.ru_utime + usage.ru_stime, wall, out, err,
               ended, err.started.is_set())


# --- the cases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    entry: Input
    reader: str

    @property
    def label(self) -> str:
        return f"{self.entry.case} / {self.reader}"


def cases(only: list[str] | None = None) -> list[Case]:
    found = []
    for entry in CORPUS:
        cli_reader, cli = KINDS[entry.kind]
        readers = [entry.kind] + ([cli_reader] if cli is not None and entry.cli else [])
        found += [Case(entry, r) for r in readers]
    if only:
        found = [c for c in found if any(text in c.label for text in only)]
    return found



def _budget(result: str, extra_rss_mb: float, cpu_s: float) -> str:
    if result in ("timeout", "memory cap"):
        return result
    return "pass" if result != "crashed" and extra_rss_mb <= EXTRA_RSS_MB and cpu_s <= CPU_S else "fail"


def _one_line(row: dict[str, Any]) -> str:
    """Whether a refusal is one line per problem, each of at most MAX_LINE_CHARS printable characters, at most
    MAX_PROBLEMS of them and a line counting the rest, from a reader's own error; "-" when nothing was refused."""
    if row["result"] in ("refused", "unexpected", "crashed"):
        short = 1 <= row["lines"] <= MAX_PROBLEMS + 1 and row["longest_line"] <= MAX_LINE_CHARS and row["printable"]
        return "ok" if row["result"] == "refused" and short else "fail"
    return "-"


def _cli_command(case: Case, path: Path, files: Path, directory: Path) -> tuple[list[str], Cli]:
    cli = CLI_READERS[case.reader]
    nvml = f"mock:{files / case.entry.node}" if case.entry.node else "mock:single-h200"
    args = [a.format(file=path, dir=directory, nvml=nvml, layout=case.entry.layout) for a in cli.args]
    return [sys.executable, "-m", "agent.cli", *args], cli


def _cli_outcome(ran: Ran) -> dict[str, Any]:
    if ran.ended is not None:
        return {"result": ran.ended, **_summary("")}
    if ran.started or ran.rc == 0:
        return {"result": "accepted", **_summary("")}
    said = ran.stderr if ran.stderr.count else ran.stdout
    if ran.stderr.traceback:
        return {"result": "unexpected", **_summary("traceback: " + ran.stderr.lines[-1].decode(errors="replace")),
                "lines": said.count}
    text = b"".join(said.lines).decode(errors="replace")
    summary = _summary(text)
    return {"result": "refused", **summary, "lines": said.count}


def run_cli(case: Case, path: Path, files: Path, timeout: float) -> tuple[Ran, dict[str, Any]]:
    directory = Path(tempfile.mkdtemp(prefix="ic-", dir=PRIVATE_PARENT))
    try:
        if case.reader == "cli-inspect-mock-state":  # the fake NVML may write its state back
            path = Path(shutil.copy(path, directory / path.name))
        command, cli = _cli_command(case, path, files, directory)
        ran = run_watched(command, timeout, cli.until_started)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return ran, _cli_outcome(ran)


Baselines = dict[tuple[str, str, bool], dict[str, float]]
"""By CLI reader, node file ("" for the preset) and whether the input was accepted."""


def baselines(chosen: list[Case], files: Path, timeout: float, jobs: int) -> Baselines:
    """The median cost of each CLI command (with the case's --nvml) on its kind's tiny valid file, and on its tiny
    refused file: a refused command skips what follows the read, so its figures are over a refusal's."""
    kinds = {(c.reader, c.entry.node or ""): c.entry.kind for c in chosen if c.reader in CLI_READERS}
    wanted = {(reader, node, accepted): kind for (reader, node), kind in kinds.items() for accepted in (True, False)}

    def one(key: tuple[str, str, bool]) -> Ran:
        reader, node, accepted = key
        entry = Input(baseline_file(wanted[key], accepted), wanted[key], "baseline", node=node or None)
        ran, outcome = run_cli(Case(entry, reader), files / entry.name, files, timeout)
        if outcome["result"] != ("accepted" if accepted else "refused"):
            raise SystemExit(f"input_cost: the baseline {entry.name} / {reader} was {outcome['result']}: "
                             f"{outcome['outcome']}")
        return ran

    keys = [key for key in wanted for _ in range(BASELINE_RUNS)]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        runs = list(pool.map(one, keys))
    found: Baselines = {}
    for key in wanted:
        mine = [r for k, r in zip(keys, runs, strict=True) if k == key]
        found[key] = {"rss_mb": statistics.median(r.rss_mb for r in mine),
                      "cpu_s": statistics.median(r.cpu_s for r in mine),
                      "wall_s": statistics.median(r.wall_s for r in mine)}
    return found


def measure(case: Case, files: Path, base: Baselines, timeout: float) -> dict[str, Any]:
    path = files / case.entry.name
    row: dict[str, Any] = {"case": case.entry.case, "file": case.entry.name, "kind": case.entry.kind,
                           "reader": case.reader, "what": case.entry.what, "size_bytes": path.stat().st_size}
    if case.reader in CLI_READERS:
        ran, outcome = run_cli(case, path, files, timeout)
        normal = base[(case.reader, case.entry.node or "", outcome["result"] == "accepted")]
        row.update(outcome, extra_rss_mb=ran.rss_mb - normal["rss_mb"], cpu_s=ran.cpu_s - normal["cpu_s"],
                   wall_s=ran.wall_s - normal["wall_s"], rc=ran.rc,
                   process={"rss_mb": round(ran.rss_mb, 1), "cpu_s": round(ran.cpu_s, 3),
                            "wall_s": round(ran.wall_s, 3)})
    else:
        ran = run_watched([sys.executable, str(Path(__file__).resolve()), "--one", case.reader, str(path)], timeout)
        reported = ran.stdout.lines[-1] if ran.stdout.lines else b""
        if ran.ended is not None:
            row.update(result=ran.ended, extra_rss_mb=ran.rss_mb, cpu_s=ran.cpu_s, wall_s=ran.wall_s,
                       **_summary(""))
        elif ran.rc == 0 and reported.startswith(b"{"):
            row.update(json.loads(reported))
        else:  # the measuring process itself died (a crash of the interpreter, an exception escaping)
            last = ran.stderr.lines[-1].decode(errors="replace") if ran.stderr.lines else f"exit status {ran.rc}"
            row.update(result="crashed", extra_rss_mb=ran.rss_mb, cpu_s=ran.cpu_s, wall_s=ran.wall_s,
                       **_summary(last.strip()))
    for key in ("extra_rss_mb", "wall_s"):
        row[key] = round(row[key], 1 if key == "extra_rss_mb" else 3)
    row["cpu_s"] = round(row["cpu_s"], 3)
    row["budget"] = _budget(row["result"], row["extra_rss_mb"], row["cpu_s"])
    row["one_line"] = _one_line(row)
    return row


# --- the report ----------------------------------------------------------------------------------------

COLUMNS = (("case", 30), ("reader", 22), ("size", 9), ("+RSS MB", 8), ("CPU s", 7), ("wall s", 7),
           ("budget", 10), ("one-line", 8), ("outcome", 0))


def table_row(row: dict[str, Any], files: Path) -> str:
    """One line of the table; the outcome without the corpus directory's path, with its line breaks shown and
    what cannot be printed escaped."""
    shown = re.sub(re.escape(f"{files}/") + "|" + re.escape(f"{PRIVATE_PARENT}/ic-") + r"\w+/", "", row["outcome"])
    outcome = shown.replace("\n", " | ") or row["result"]
    if row["result"] == "unexpected":
        outcome = f"unexpected: {row['outcome']}"
    cells = (row["case"], row["reader"], row["size_bytes"], row["extra_rss_mb"], row["cpu_s"], row["wall_s"],
             row["budget"], row["one_line"], " ".join(outcome.split())[:70].encode("ascii", "backslashreplace")
             .decode("ascii"))
    return " ".join(f"{cell!s:<{width}}" if width else str(cell) for cell, (_, width) in zip(cells, COLUMNS,
                                                                                            strict=True))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--one", nargs=2, metavar=("READER", "FILE"), help="measure one in-process read, print JSON")
    p.add_argument("--make", nargs="+", metavar=("DIR", "NAME"), help="write corpus files into DIR")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--check", action="store_true", help="exit 1 when a case misses its budget or one-line rule")
    p.add_argument("--only", help="comma-separated parts of 'case / reader' labels: run the matching cases")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="cases run at once")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds one case may run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.one:
        reader, file = args.one
        if reader not in KINDS:
            print(f"input_cost: --one: unknown reader {reader!r} (known: {', '.join(KINDS)})", file=sys.stderr)
            return 2
        print(json.dumps(read_once(reader, Path(file))))
        return 0
    if args.make:
        materialize(args.make[1:], Path(args.make[0]))
        return 0
    chosen = cases(args.only.split(",") if args.only else None)
    if not chosen:
        print(f"input_cost: no case matches --only {args.only}", file=sys.stderr)
        return 2
    started, load = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="input-cost-") as tmp:
        files = Path(tmp)
        needed = sorted({c.entry.name for c in chosen} | {STARS_NODE}
                        | {baseline_file(c.entry.kind, a) for c in chosen for a in (True, False)})
        # Made in a process of its own: what a child's peak RSS counts starts from its parent's RSS when it is
        # spawned, so the parent stays small.
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--make", str(files), *needed], check=True)
        base = baselines(chosen, files, args.timeout, args.jobs)
        print(" ".join(f"{name:<{width}}" if width else name for name, width in COLUMNS), flush=True)
        rows: dict[Case, dict[str, Any]] = {}
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(measure, c, files, base, args.timeout): c for c in chosen}
            try:
                for future in concurrent.futures.as_completed(futures):
                    rows[futures[future]] = row = future.result()
                    print(table_row(row, files), flush=True)
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    ordered = [rows[c] for c in chosen]
    missed = [r for r in ordered if r["budget"] != "pass"]
    long = [r for r in ordered if r["one_line"] == "fail"]
    duration = round(time.monotonic() - started, 1)
    result: dict[str, Any] = {
        "budget": {"extra_rss_mb": EXTRA_RSS_MB, "cpu_s": CPU_S, "refusal": f"one printable line of at most "
                   f"{MAX_LINE_CHARS} characters per problem, at most {MAX_PROBLEMS} problems and a line counting "
                   "the rest", "limits_bytes": LIMITS, "timeout_s": args.timeout,
                   "memory_cap_mb": MEMORY_CAP_MB},
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                    "load_average_at_start": load},
        "bench_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB, 1),
        "cli_baselines": [{"reader": r, "node": n or "single-h200", "file": baseline_file(KIND_OF[r], a),
                           **{k: round(v, 3) for k, v in b.items()}} for (r, n, a), b in base.items()],
        "cases": ordered,
        "summary": {"cases": len(ordered), "over_budget": len(missed), "not_one_line": len(long),
                    "duration_s": duration},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=True) + "\n")
    print(f"input cost: {len(ordered)} cases, {len(missed)} over budget ({EXTRA_RSS_MB:g} MB extra RSS, "
          f"{CPU_S:g} s CPU), {len(long)} refusals not one line of at most {MAX_LINE_CHARS} characters per "
          "problem; "
          f"{duration} s; {args.out}")
    if args.out == DEFAULT_OUT:
        from bench import report

        print(f"rendered {report.write()}")
    return 1 if args.check and (missed or long) else 0


if __name__ == "__main__":
    sys.exit(main())
