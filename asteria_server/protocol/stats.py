"""The daemon's data-path numbers that Status reports: now in :mod:`asteria_server.types`."""

from asteria_server.types import TransportStats

__all__ = ["TransportStats"]
