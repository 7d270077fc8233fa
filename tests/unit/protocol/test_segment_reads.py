"""Reads under a segment's seqlock (``Segment.read_with``): what a solver worker's one read of a
client's snapshot relies on. A reader's value counts only at the announced sequence, and an
error it raises counts only if no write overlapped it (one that did is a newer snapshot's doing,
which supersedes the task: the answer is *overwritten*, never a bad-input error)."""

from __future__ import annotations

import numpy as np
import pytest

from asteria_server.protocol.shm import ArraySpec, Segment, create_segment, segment_bytes

SPECS = [ArraySpec(np.dtype("<f4"), (4, 4))]


def segment_with(values: np.ndarray) -> tuple[Segment, int]:
    _, segment = create_segment(segment_bytes(SPECS), own_fd=True)
    return segment, segment.write(SPECS, [values])


def test_the_readers_value_at_the_announced_sequence() -> None:
    segment, sequence = segment_with(np.eye(4, dtype=np.float32))
    assert segment.read_with(SPECS, sequence, lambda views: float(views[0].sum())) == 4.0
    # Not at another sequence, nor at an odd one (a write in progress).
    assert segment.read_with(SPECS, sequence + 2, lambda views: 1) is None
    assert segment.read_with(SPECS, sequence + 1, lambda views: 1) is None


def test_a_write_during_the_read_makes_it_none() -> None:
    segment, sequence = segment_with(np.eye(4, dtype=np.float32))

    def torn(views: list[np.ndarray]) -> float:
        value = float(views[0].sum())
        segment.write(SPECS, [np.zeros((4, 4), np.float32)])  # the client's next snapshot
        return value

    assert segment.read_with(SPECS, sequence, torn) is None


def test_an_error_on_a_torn_read_is_none_and_on_an_intact_one_stands() -> None:
    segment, sequence = segment_with(np.eye(4, dtype=np.float32))

    def fails_while_written(views: list[np.ndarray]) -> None:
        segment.begin_write()  # a writer got in while the reader looked
        raise ValueError("looked asymmetric")

    assert segment.read_with(SPECS, sequence, fails_while_written) is None
    segment.end_write()
    segment, sequence = segment_with(np.eye(4, dtype=np.float32))

    def fails(views: list[np.ndarray]) -> None:
        raise ValueError("really asymmetric")

    with pytest.raises(ValueError, match="really asymmetric"):
        segment.read_with(SPECS, sequence, fails)
