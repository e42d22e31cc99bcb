"""GPU interconnect topology: link matrix, pair scores and the preferred-allocation search."""
