"""Generated kubelet DRA plugin API v1beta1 stubs; regenerate with make protos, never edit."""
