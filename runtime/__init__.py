"""tandem: the coordinator side (no GPU code, no torch on the hot path)."""
