"""The daemon's data-path numbers that Status reports next to the engine's (``EngineStats``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TransportStats:
    """Shared-memory handovers and snapshot uploads of one daemon, right now.

    Attributes:
        shm_connections: clients connected to the segment-handover socket.
        shm_segments: segments those clients handed over (each one mapping in the daemon).
        shm_mapped_bytes: their total size.
        upload_bytes_in_flight: snapshot bytes being received now (chunks or segment copies).
        upload_budget_bytes: the limit on those (``max_upload_bytes``).
        uploads_waiting: uploads waiting for room in that budget.
    """

    shm_connections: int = 0
    shm_segments: int = 0
    shm_mapped_bytes: int = 0
    upload_bytes_in_flight: int = 0
    upload_budget_bytes: int = 0
    uploads_waiting: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
