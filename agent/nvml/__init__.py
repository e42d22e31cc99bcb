"""The NVML boundary: the only code that imports pynvml."""


class MockStateError(ValueError):
    """The fake NVML's state file (--mock-state) cannot be used; the message is one line naming it and why."""
