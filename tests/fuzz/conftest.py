"""One hypothesis seed for every fuzz test of a run: fresh each run, fixed in CI, printed so that a failure can
be replayed.

The seed is, in order: `--hypothesis-seed=N`; the environment variable GPU_AGENT_FUZZ_SEED; CI_SEED when CI is
set (to anything but "", 0 or false; `make test` passes GPU_AGENT_FUZZ_SEED=0); else a fresh random one. Replay a
run with `GPU_AGENT_FUZZ_SEED=N .venv/bin/pytest -q tests/fuzz` (or `--hypothesis-seed=N`)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import hypothesis
import pytest

SEED_ENV = "GPU_AGENT_FUZZ_SEED"
CI_SEED = 0
HERE = Path(__file__).parent
_SEED = pytest.StashKey[tuple[int, str]]()


def _seed(config: pytest.Config) -> tuple[int, str]:
    """The seed and where it came from."""
    given = config.getoption("hypothesis_seed", None)
    if given is not None:
        try:
            return int(given), "--hypothesis-seed"
        except ValueError:
            raise pytest.UsageError(f"--hypothesis-seed: {given!r} is not a whole number") from None
    text = os.environ.get(SEED_ENV, "").strip()
    if text:
        try:
            return int(text), SEED_ENV
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}: {text!r} is not a whole number") from None
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return CI_SEED, "CI is set"
    return random.SystemRandom().randrange(2**32), "fresh"


def _line(config: pytest.Config) -> str:
    seed, source = config.stash[_SEED]
    return f"fuzz: hypothesis seed {seed} ({source}); replay with {SEED_ENV}={seed} or --hypothesis-seed={seed}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    fuzz = [item for item in items if isinstance(item, pytest.Function) and HERE in Path(item.path).parents
            and getattr(item.obj, "is_hypothesis_test", False)]
    if not fuzz:
        return
    config.stash[_SEED] = _seed(config)
    seed, _ = config.stash[_SEED]
    for item in fuzz:
        # Set on the test hypothesis wraps, which it reads before --hypothesis-seed or derandomize.
        hypothesis.seed(seed)(item.obj)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(_line(config))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if _SEED in config.stash:
        terminalreporter.write_line(_line(config))
