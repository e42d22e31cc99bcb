"""The agent as a Kubernetes DRA driver: ResourceSlices for the node's GPUs."""
