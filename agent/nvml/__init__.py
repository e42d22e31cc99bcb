"""The NVML boundary: the only code that imports pynvml."""
