"""Whole-stream readers over ``protocol.framing``'s receivers: for tests that hold a stream as a
plain iterable of messages (the servicer and the client drive the receivers one message at a
time themselves)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from asteria_server.errors import InvalidInputError
from asteria_server.protocol.framing import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MATRIX_N,
    ResultReceiver,
    SnapshotReceiver,
)
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.types import SolveResult, SolveTask


def read_snapshot(
    messages: Iterable[pb.SubmitSnapshotRequest],
    *,
    tenant: str,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_matrix_n: int = DEFAULT_MAX_MATRIX_N,
) -> SolveTask:
    """The task a whole SubmitSnapshot stream carries in chunks."""
    it = iter(messages)
    first = next(it, None)
    if first is None:
        raise InvalidInputError(
            "SubmitSnapshot stream: no messages (expected a header, then chunks)"
        )
    receiver = SnapshotReceiver(first, max_chunk_bytes=max_chunk_bytes, max_matrix_n=max_matrix_n)
    for message in it:
        receiver.feed(message)
    return receiver.finish(tenant=tenant)


def read_results(
    messages: Iterable[pb.StreamResultsResponse],
    *,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_matrix_n: int = DEFAULT_MAX_MATRIX_N,
) -> Iterator[SolveResult]:
    """The results a StreamResults stream carries, as each completes."""
    receiver = ResultReceiver(max_chunk_bytes=max_chunk_bytes, max_matrix_n=max_matrix_n)
    for message in messages:
        result = receiver.feed(message)
        if result is not None:
            yield result
    receiver.close()
