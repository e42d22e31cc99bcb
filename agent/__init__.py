"""gpu-node-agent: one node agent for GPU nodes in Kubernetes."""
