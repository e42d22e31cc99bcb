"""Generated kubelet plugin registration API v1 stubs; regenerate with make protos, never edit."""
