"""The client runtime: where preconditioner results come from, their versions and staleness."""
