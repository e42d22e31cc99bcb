"""GPU interconnect topology: link matrix, pair scores and the optimal allocator."""
