"""Generated kubelet DRA resource health API v1 stubs; regenerate with make protos, never edit."""
