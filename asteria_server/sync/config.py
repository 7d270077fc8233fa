"""The timings of the peer groups, one frozen dataclass read once from the environment.

Apart from :mod:`.manager` so that the membership and the decisions (:mod:`.membership`,
:mod:`.decide`) read the same config without importing the manager that runs them."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Environment variables that override :class:`SyncConfig`'s defaults (seconds).
ENV_PREFIX = "ASTERIA_SYNC_"


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Timings of the peer groups (seconds); see the module docstring."""

    heartbeat_s: float = 0.25
    suspect_s: float = 2.0
    dead_s: float = 5.0
    patience_s: float = 2.0
    settle_s: float = 0.3
    call_timeout_s: float = 1.0
    push_timeout_s: float = 10.0
    #: How long a member declared dead is still trusted with the snapshots it had accepted
    #: (queued or on a worker): only after this is a version it held solved elsewhere.
    takeover_grace_s: float = 10.0
    #: A job's peer group ends once no session of the job has been open here for this long
    #: (long enough for its ranks to reconnect after a restart).
    group_idle_s: float = 120.0
    #: Heartbeats to peers not yet proven, all peer groups of the daemon together, per second.
    unproven_heartbeats_per_s: float = 16.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"SyncConfig.{f.name} must be a number > 0, got {value!r}")
        if not self.heartbeat_s < self.suspect_s < self.dead_s:
            raise ValueError(
                "SyncConfig needs heartbeat_s < suspect_s < dead_s, got "
                f"{self.heartbeat_s}, {self.suspect_s}, {self.dead_s}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SyncConfig:
        """Defaults overridden by ``ASTERIA_SYNC_HEARTBEAT_S`` etc. (ValueError if malformed)."""
        env = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for f in dataclasses.fields(cls):
            text = env.get(ENV_PREFIX + f.name.upper(), "").strip()
            if text:
                try:
                    values[f.name] = float(text)
                except ValueError:
                    raise ValueError(
                        f"{ENV_PREFIX}{f.name.upper()} must be a number of seconds, got {text!r}"
                    ) from None
        return cls(**values)
