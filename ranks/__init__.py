"""tandem: one process per device (weights, state, layer program)."""
