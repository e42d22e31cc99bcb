"""Generated kubelet DRA plugin API v1 stubs; regenerate with make protos, never edit."""
