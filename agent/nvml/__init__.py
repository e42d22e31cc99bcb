"""The NVML boundary: the only code that imports pynvml (tests/unit/test_boundaries.py holds the rest of the
package to that). What crosses it: the records of records.py and the tables of catalog.py, which import no
pynvml, so that importing this package or them loads none; NvmlUnavailable from backend.py, MigCallError from
mig_ops.py; MockStateError below."""


class MockStateError(ValueError):
    """The fake NVML's state file (--mock-state) cannot be used; the message is one line naming it and why."""
