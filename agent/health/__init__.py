"""GPU health: the XID event loop, periodic checks, and the policy that turns signals into device health."""
