"""sync.policy.RateLimit: slots handed out in order, a burst, then per_s a second."""

from __future__ import annotations

import pytest

from asteria_server.sync.policy import RateLimit


def test_a_burst_then_evenly_spaced_slots_in_order() -> None:
    limit = RateLimit(2.0, burst=3)
    waits = [limit.reserve(10.0) for _ in range(6)]
    assert waits == [0.0, 0.0, 0.0, 0.5, 1.0, 1.5]
    # after a quiet spell the burst is back, never more than it
    assert [limit.reserve(100.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="per_s > 0"):
        RateLimit(0.0)
