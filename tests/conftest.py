"""What a parallel run (pytest-xdist, `-n N --dist loadfile`, as `make test` runs the suite) needs: each worker gets
the run's one hypothesis seed (`fuzz/seed.py`); what a worker found after its session fixtures were torn down (a
rig's process group still running, `integration/conftest.py`) fails the run and is printed by the process that
started the workers, where a worker's own terminal output does not reach; and the files are handed out longest
first, by the seconds each took in the last run (kept in pytest's cache), so that a file that waits a minute or
more starts at once rather than last. The order of the tests within a file never changes."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from tests.fuzz.seed import WORKER_INPUT, decide, line

_SEED = pytest.StashKey[tuple[int, str]]()
_FUZZ_SEEDED = pytest.StashKey[bool]()
_LEAKED = pytest.StashKey[list[str]]()
FILE_SECONDS = "gpu-node-agent/file-seconds"
"""Where pytest's cache keeps how long each test file took, setup and teardown included, in the last run."""


_seconds: defaultdict[str, float] = defaultdict(float)
"""This run's seconds per test file, counted where the reports arrive (in one process, or where the workers'
reports arrive)."""


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _cache(config: pytest.Config) -> Any:
    return getattr(config, "cache", None)  # None under -p no:cacheprovider


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cache = _cache(config)
    if not hasattr(config, "workerinput") or cache is None:
        return  # one process: the order as collected
    # Every worker reads the same record, so every worker collects the same order, as pytest-xdist requires.
    seconds: dict[str, float] = cache.get(FILE_SECONDS, {})
    # A file not in the record (new, or renamed) is taken to be long: it runs early, and is timed this run.
    items.sort(key=lambda item: -seconds.get(_file(item.nodeid), float("inf")))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[_file(report.nodeid)] += report.duration


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    config: pytest.Config = node.config
    if _SEED not in config.stash:
        config.stash[_SEED] = decide(config)
    node.workerinput[WORKER_INPUT] = list(config.stash[_SEED])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    output: dict[str, Any] = getattr(node, "workeroutput", {})
    config: pytest.Config = node.config
    if output.get("fuzz_seeded"):
        config.stash[_FUZZ_SEEDED] = True
    if output.get("leaked"):
        config.stash.setdefault(_LEAKED, []).append(f"{node.gateway.id}: {output['leaked']}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if config.stash.get(_LEAKED, []):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    cache = _cache(config)
    # A run of part of a file (-m, -k, a test named), or one cut short, would record part of a file's time.
    partial = (config.option.markexpr or config.option.keyword or any("::" in arg for arg in config.args)
               or exitstatus == pytest.ExitCode.INTERRUPTED)
    if hasattr(config, "workerinput") or cache is None or partial:
        return
    record: dict[str, float] = cache.get(FILE_SECONDS, {})
    cache.set(FILE_SECONDS, {**record, **{name: round(s, 2) for name, s in _seconds.items()}})


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if config.stash.get(_FUZZ_SEEDED, False):
        terminalreporter.write_line(line(*config.stash[_SEED]))
    for leak in config.stash.get(_LEAKED, []):
        terminalreporter.write_line(leak, red=True)
