"""Fault tests import the API-server rig the way tests/integration does, as the top-level module `apiserver`, so
that one module (and its one record of the process groups it started) serves both directories in a session."""

from __future__ import annotations

import sys
from pathlib import Path

INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
if INTEGRATION not in sys.path:
    sys.path.insert(0, INTEGRATION)
