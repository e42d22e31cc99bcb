"""Generated kubelet PodResources API v1 stubs; regenerate with make protos, never edit."""
