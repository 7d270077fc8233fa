"""Process-group awareness: which ranks a job has, where they run, what the job is called."""

from asteria_client.distributed.layout import JobLayout, discover_layout

__all__ = ["JobLayout", "discover_layout"]
