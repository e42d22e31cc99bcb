"""The only code that talks to the API server: the agent's own Node, its labels, taints and events."""
