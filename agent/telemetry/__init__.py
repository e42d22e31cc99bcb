"""GPU telemetry under dcgm-exporter's names: the field catalogue, the collection task and its exposition."""
