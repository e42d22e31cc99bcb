"""One hypothesis seed for every fuzz test of a run: fresh each run, fixed in CI, printed so that a failure can
be replayed (the rules are in `seed.py`). Replay a run with `GPU_AGENT_FUZZ_SEED=N .venv/bin/pytest -q tests/fuzz`
(or `--hypothesis-seed=N`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest

from tests.fuzz.seed import decide, line
from tests.plugin_harness import short_dir

HERE = Path(__file__).parent
_SEED = pytest.StashKey[tuple[int, str]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    fuzz = [item for item in items if isinstance(item, pytest.Function) and HERE in Path(item.path).parents
            and getattr(item.obj, "is_hypothesis_test", False)]
    if not fuzz:
        return
    config.stash[_SEED] = decide(config)
    seed, _ = config.stash[_SEED]
    for item in fuzz:
        # Set on the test hypothesis wraps, which it reads before --hypothesis-seed or derandomize.
        hypothesis.seed(seed)(item.obj)
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        # A pytest-xdist worker: the process that started it prints the line (tests/conftest.py).
        workeroutput["fuzz_seeded"] = True
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line(*config.stash[_SEED]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if _SEED in config.stash:
        terminalreporter.write_line(line(*config.stash[_SEED]))


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    """A kubelet directory of the test's own, short enough for the sockets in it."""
    directory = short_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)
