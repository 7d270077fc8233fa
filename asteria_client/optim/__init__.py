"""Asteria's optimizers and the machinery they share (blocking, grafting, numerics)."""
