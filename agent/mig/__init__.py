"""MIG: layout files, placement planning and applying layouts through the NVML boundary."""
