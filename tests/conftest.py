"""What a parallel run (pytest-xdist, `-n N`, as `make test` runs the suite) needs from the process that starts the
workers: each worker gets the run's one hypothesis seed (`fuzz/seed.py`), and what a worker found after its
session fixtures were torn down (a rig's process group still running, `integration/conftest.py`) fails the run
and is printed here, where a worker's own terminal output does not reach."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fuzz.seed import WORKER_INPUT, decide, line

_SEED = pytest.StashKey[tuple[int, str]]()
_FUZZ_SEEDED = pytest.StashKey[bool]()
_LEAKED = pytest.StashKey[list[str]]()


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
    if session.config.stash.get(_LEAKED, []):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if config.stash.get(_FUZZ_SEEDED, False):
        terminalreporter.write_line(line(*config.stash[_SEED]))
    for leak in config.stash.get(_LEAKED, []):
        terminalreporter.write_line(leak, red=True)
