"""The one hypothesis seed of a run: which it is, where it came from, and the line that names it.

The seed is, in order: `--hypothesis-seed=N`; the environment variable GPU_AGENT_FUZZ_SEED; CI_SEED when CI is
set (to anything but "", 0 or false; `make test` passes GPU_AGENT_FUZZ_SEED=0); else a fresh random one. A
parallel run (pytest-xdist) decides it once, in the process that starts the workers, and hands it to each worker
(`tests/conftest.py`), so that every worker's fuzz tests run on the seed the run prints."""

from __future__ import annotations

import os
import random

import pytest

SEED_ENV = "GPU_AGENT_FUZZ_SEED"
CI_SEED = 0
WORKER_INPUT = "fuzz_seed"
"""The key under which a pytest-xdist worker gets the run's seed and its source."""


def decide(config: pytest.Config) -> tuple[int, str]:
    """The seed and where it came from."""
    handed = getattr(config, "workerinput", {}).get(WORKER_INPUT)
    if handed is not None:
        seed, source = handed
        return int(seed), str(source)
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


def line(seed: int, source: str) -> str:
    return f"fuzz: hypothesis seed {seed} ({source}); replay with {SEED_ENV}={seed} or --hypothesis-seed={seed}"
