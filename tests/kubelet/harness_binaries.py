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


def build_harness(into: Path | None = None) -> HarnessBinaries:
    """Builds the harness and the stand-in plugin if their sources changed; a few milliseconds otherwise.

    With `into`, the binaries returned are links in that directory, made under the build lock: another
    checkout sharing the test-binary directory may rebuild it from its own sources while tests run.
    """
    env = {**os.environ, "TESTBIN_DIR": str(TESTBIN)}
    link = ["--link-into", str(into)] if into else []
    # Output goes to the terminal: a build with a cold Go cache takes minutes.
    result = subprocess.run(["bash", str(BUILD_SCRIPT), *link], env=env, stdout=sys.stderr, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed with exit code {result.returncode}")
    where = into or TESTBIN
    return HarnessBinaries(where / "kubelet-harness", where / "kubelet-stubplugin")
