"""Where the kubelet conformance harness lives, and how it gets built (hack/kubelet-harness.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTBIN = Path(os.environ.get("TESTBIN_DIR", REPO / ".cache" / "testbin"))
BUILD_SCRIPT = REPO / "hack" / "kubelet-harness.sh"


@dataclass(frozen=True)
class HarnessBinaries:
    harness: Path
    stub_plugin: Path


def build_harness() -> HarnessBinaries:
    """Builds the harness and the stand-in plugin if their sources changed; a few milliseconds otherwise."""
    env = {**os.environ, "TESTBIN_DIR": str(TESTBIN)}
    # Output goes to the terminal: a build with a cold Go cache takes minutes.
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, stdout=sys.stderr, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed with exit code {result.returncode}")
    return HarnessBinaries(TESTBIN / "kubelet-harness", TESTBIN / "kubelet-stubplugin")
