"""protocol.convert: tasks, results and status through real protobuf messages and byte chunks.

Every stream here goes through ``SerializeToString`` / ``FromString``, so what is checked is what
crosses the wire, and one test runs the streams over a real gRPC channel on loopback.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from collections.abc import Iterable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message

from asteria_server.engine import BlockState, BlockStatus, CoherenceRegistry, EngineStats, solve
from asteria_server.errors import InvalidInputError
from asteria_server.protocol import convert, framing
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from asteria_server.protocol.shm import RESULT_FIELDS, SegmentRef
from asteria_server.types import (
    BlockSummary,
    BlockTable,
    Credit,
    SolveKind,
    SolveResult,
    SolveTask,
    SubmitOutcome,
)
from tests.protocol_readers import read_results, read_snapshot

MiB = 1 << 20
M = TypeVar("M", bound=Message)


def _wire(messages: Iterable[M]) -> list[M]:
    """The messages as a receiver sees them: serialized to bytes and parsed back."""
    return [type(m).FromString(m.SerializeToString()) for m in messages]


def _matrix(n: int, dtype: Any, seed: int = 0) -> np.ndarray:
    """A random n x n matrix: every byte matters to an exact comparison."""
    return np.random.default_rng(seed).standard_normal((n, n)).astype(dtype)


def _task(n: int, dtype: Any, *, basis_dtype: Any = None, **overrides: Any) -> SolveTask:
    kwargs: dict[str, Any] = {
        "block": "layers.3.mlp.weight/t0/L",
        "version": 40,
        "kind": SolveKind.INVERSE_ROOT,
        "matrix": _matrix(n, dtype),
        "exponent": 0.125,
        "epsilon": 1e-10,
        "deadline": 60.0,
        "tenant": "alice",
    }
    if basis_dtype is not None:
        kwargs.update(kind=SolveKind.EIGENBASIS, basis=_matrix(n, basis_dtype, 1), base_version=30)
    kwargs.update(overrides)
    return SolveTask(**kwargs)


def _result(n: int, dtype: Any, *, refresh: bool = True, **overrides: Any) -> SolveResult:
    rng = np.random.default_rng(2)
    kwargs: dict[str, Any] = {
        "block": "layers.3.mlp.weight/t0/R",
        "version": 41,
        "kind": SolveKind.EIGENBASIS,
        "matrix": _matrix(n, dtype, 3),
        "eigenvalues": rng.standard_normal(n).astype(dtype),
        "permutation": rng.permutation(n).astype(np.int64) if refresh else None,
        "rotation": _matrix(n, dtype, 4) if refresh else None,
        "base_version": 31 if refresh else -1,
        "epsilon_used": 1e-9,
        "solve_time_s": 0.0125,
        "attempts": 2,
        "tenant": "alice",
    }
    kwargs.update(overrides)
    return SolveResult(**kwargs)


def _assert_same_array(got: np.ndarray | None, want: np.ndarray | None) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got, want, strict=True)


def _assert_same_task(got: SolveTask, want: SolveTask, tenant: str) -> None:
    for field in ("block", "version", "kind", "exponent", "epsilon", "base_version", "deadline"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.tenant == tenant
    _assert_same_array(got.matrix, want.matrix)
    _assert_same_array(got.basis, want.basis)


def _assert_same_result(got: SolveResult, want: SolveResult) -> None:
    for field in (
        "tenant",
        "block",
        "version",
        "kind",
        "base_version",
        "epsilon_used",
        "solve_time_s",
        "attempts",
    ):
        assert getattr(got, field) == getattr(want, field), field
    for field in ("matrix", "eigenvalues", "permutation", "rotation"):
        _assert_same_array(getattr(got, field), getattr(want, field))


def _chunks(messages: list[Any]) -> list[bytes]:
    return [m.chunk for m in messages if m.WhichOneof("part") == "chunk"]


# ----------------------------------------------------------------------------------- tasks


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 1024])
def test_inverse_root_task_round_trips(n: int, dtype: Any) -> None:
    task = _task(n, dtype)
    messages = _wire(framing.snapshot_messages(task, session_id="s-1", chunk_bytes=64 * 1024))
    assert messages[0].WhichOneof("part") == "header"
    assert messages[0].header.session_id == "s-1"
    nbytes = n * n * np.dtype(dtype).itemsize
    chunks = _chunks(messages)
    assert len(chunks) == len(messages) - 1 == math.ceil(nbytes / (64 * 1024))
    assert all(0 < len(c) <= 64 * 1024 for c in chunks)
    got = read_snapshot(messages, tenant="alice")
    _assert_same_task(got, task, "alice")


@pytest.mark.parametrize("dtypes", [(np.float32, np.float64), (np.float64, np.float32)])
@pytest.mark.parametrize("n", [1, 7, 1024])
def test_refresh_task_round_trips_matrix_then_basis(n: int, dtypes: tuple[Any, Any]) -> None:
    matrix_dtype, basis_dtype = dtypes
    task = _task(n, matrix_dtype, basis_dtype=basis_dtype)
    messages = _wire(framing.snapshot_messages(task, chunk_bytes=MiB))
    header = messages[0].header
    assert header.has_basis and header.n == n
    assert header.dtype == convert._DTYPES[np.dtype(matrix_dtype)]
    assert header.basis_dtype == convert._DTYPES[np.dtype(basis_dtype)]
    _assert_same_task(read_snapshot(messages, tenant="alice"), task, "alice")


def test_16_mib_matrix_streams_in_1_mib_chunks() -> None:
    task = _task(2048, np.float32)  # 2048 * 2048 * 4 bytes = 16 MiB
    assert task.matrix.nbytes == 16 * MiB
    messages = _wire(framing.snapshot_messages(task, chunk_bytes=MiB))
    chunks = _chunks(messages)
    assert len(messages) == 17 and len(chunks) == 16
    assert all(len(c) == MiB for c in chunks)
    assert b"".join(chunks) == task.matrix.astype("<f4").tobytes()
    got = read_snapshot(messages, tenant="alice", max_chunk_bytes=MiB)
    _assert_same_task(got, task, "alice")


def test_chunks_may_split_elements() -> None:
    task = _task(30, np.float64, basis_dtype=np.float32)  # 7200 + 3600 bytes
    messages = _wire(framing.snapshot_messages(task, chunk_bytes=1000))
    assert [len(c) for c in _chunks(messages)] == [1000] * 7 + [200] + [1000] * 3 + [600]
    _assert_same_task(read_snapshot(messages, tenant="alice"), task, "alice")


def test_header_carries_defaults_and_the_session_decides_the_tenant() -> None:
    task = SolveTask(block="b", version=0, kind=SolveKind.EIGENBASIS, matrix=np.eye(3))
    header = convert.snapshot_header(task)
    assert header.deadline == math.inf and header.base_version == -1 and not header.has_basis
    assert header.basis_dtype == pb.DTYPE_UNSPECIFIED
    got = read_snapshot(_wire(framing.snapshot_messages(task)), tenant="bob")
    assert got.tenant == "bob" and got.deadline == math.inf and got.basis is None


def test_receiver_exposes_the_session_before_the_bytes_arrive() -> None:
    messages = _wire(framing.snapshot_messages(_task(4, np.float32), session_id="s-9"))
    receiver = framing.SnapshotReceiver(messages[0])
    assert receiver.session_id == "s-9" and receiver.header.block == "layers.3.mlp.weight/t0/L"
    for message in messages[1:]:
        receiver.feed(message)
    assert receiver.finish(tenant="carol").tenant == "carol"


def test_array_chunks_are_c_order_little_endian() -> None:
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    want = a.astype("<f8").tobytes()
    assert b"".join(framing.array_chunks(a.astype(">f8"), 5)) == want
    assert b"".join(framing.array_chunks(np.asfortranarray(a), 7)) == want
    assert b"".join(framing.array_chunks(a.T.copy().T, 64)) == want


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_chunk_size_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 1"):
        list(framing.snapshot_messages(_task(2, np.float32), chunk_bytes=bad))
    with pytest.raises(ValueError, match="max_chunk_bytes must be an int >= 1"):
        framing.ResultReceiver(max_chunk_bytes=bad)


# --------------------------------------------------------------------- broken snapshot streams

BLOCK = "'layers.3.mlp.weight/t0/L'"


def _snapshot_stream(n: int = 16, dtype: Any = np.float64, **kw: Any) -> list[Any]:
    return _wire(framing.snapshot_messages(_task(n, dtype, **kw), chunk_bytes=256))


def _read(messages: list[Any], **kw: Any) -> SolveTask:
    return read_snapshot(messages, tenant="alice", **kw)


def test_truncated_snapshot_is_rejected_naming_the_block() -> None:
    messages = _snapshot_stream()
    with pytest.raises(InvalidInputError, match="stream ended early: 1792 of 2048 bytes") as e:
        _read(messages[:-1])
    assert BLOCK in str(e.value) and "version 40" in str(e.value)


def test_missing_basis_is_rejected() -> None:
    messages = _snapshot_stream(8, np.float32, basis_dtype=np.float32)  # 256 + 256 bytes
    with pytest.raises(InvalidInputError, match=r"ended early.*\(basis: 0 of 256\)"):
        _read(messages[:-1])


def test_extra_chunk_is_rejected() -> None:
    messages = _snapshot_stream()
    extra = pb.SubmitSnapshotRequest(chunk=b"\0" * 8)
    with pytest.raises(InvalidInputError, match=f"{BLOCK}.*longer than announced"):
        _read([*messages, extra])


def test_chunk_running_past_the_matrix_is_rejected() -> None:
    messages = _snapshot_stream()
    last = messages[-1].chunk + b"\0" * 8
    with pytest.raises(InvalidInputError, match=f"{BLOCK}.*overruns matrix"):
        _read([*messages[:-1], pb.SubmitSnapshotRequest(chunk=last)])


def test_chunk_over_the_limit_is_rejected() -> None:
    messages = _snapshot_stream()
    with pytest.raises(InvalidInputError, match="chunk of 256 bytes exceeds the limit of 128"):
        _read(messages, max_chunk_bytes=128)


def test_empty_chunk_is_rejected() -> None:
    messages = _snapshot_stream()
    with pytest.raises(InvalidInputError, match="empty chunk"):
        _read([messages[0], pb.SubmitSnapshotRequest(chunk=b""), *messages[1:]])


def test_bytes_of_another_dtype_are_rejected() -> None:
    # The header says float64 but the client sent float32 bytes: half the announced length.
    f32 = _snapshot_stream(16, np.float32)
    header = pb.SubmitSnapshotRequest()
    header.CopyFrom(f32[0])
    header.header.dtype = pb.DTYPE_FLOAT64
    with pytest.raises(InvalidInputError, match="ended early: 1024 of 2048 bytes"):
        _read([header, *f32[1:]])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", pb.DTYPE_INT64, "dtype must be float32 or float64, got DTYPE_INT64"),
        ("dtype", pb.DTYPE_UNSPECIFIED, "dtype must be float32 or float64, got DTYPE_UNSPECIFIED"),
        ("dtype", 99, "dtype must be float32 or float64, got unknown value 99"),
        ("kind", pb.SOLVE_KIND_UNSPECIFIED, "kind must be INVERSE_ROOT or EIGENBASIS"),
        ("n", 0, "n must be between 1 and 16384"),
        ("n", 1 << 20, r"n must be between 1 and 16384 \(max_matrix_n\), got 1048576"),
        ("has_basis", True, "has_basis is only meaningful for EIGENBASIS"),
        ("basis_dtype", pb.DTYPE_FLOAT32, "basis_dtype is set but has_basis is false"),
        ("version", -3, "version must be an int >= 0"),
        ("exponent", 0.0, "exponent must be a finite number > 0"),
        ("deadline", math.nan, "deadline must be a number"),
    ],
)
def test_bad_header_fields_are_rejected_before_the_bytes(
    field: str, value: Any, message: str
) -> None:
    messages = _snapshot_stream()
    setattr(messages[0].header, field, value)
    with pytest.raises(InvalidInputError, match=message) as e:
        framing.SnapshotReceiver(messages[0])
    assert "layers.3.mlp.weight/t0/L" in str(e.value)


def test_stream_order_is_enforced() -> None:
    messages = _snapshot_stream()
    with pytest.raises(InvalidInputError, match="the first message must be a header"):
        _read(messages[1:])
    with pytest.raises(InvalidInputError, match=f"{BLOCK}.*expected a chunk, got header"):
        _read([messages[0], messages[0], *messages[1:]])
    with pytest.raises(InvalidInputError, match="expected a chunk, got an empty message"):
        _read([messages[0], pb.SubmitSnapshotRequest(), *messages[1:]])
    with pytest.raises(InvalidInputError, match="no messages"):
        _read([])


# --------------------------------------------------------------------------------- results


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 1024])
@pytest.mark.parametrize("shape", ["inverse_root", "eigh", "refresh"])
def test_result_round_trips(n: int, dtype: Any, shape: str) -> None:
    if shape == "inverse_root":
        result = _result(
            n, dtype, refresh=False, kind=SolveKind.INVERSE_ROOT, eigenvalues=None, tenant="t"
        )
    else:
        result = _result(n, dtype, refresh=shape == "refresh")
    messages = _wire(framing.result_messages(result, chunk_bytes=256 * 1024))
    header = messages[0].header
    assert header.n == n and header.matrix.num_bytes == result.matrix.nbytes
    assert header.HasField("rotation") == (shape == "refresh")
    (got,) = read_results(messages, max_chunk_bytes=256 * 1024)
    _assert_same_result(got, result)


def test_16_mib_result_streams_in_1_mib_chunks() -> None:
    result = _result(2048, np.float32)  # matrix and rotation 16 MiB each
    messages = _wire(framing.result_messages(result, chunk_bytes=MiB))
    sizes = [len(c) for c in _chunks(messages)]
    assert sizes == [MiB] * 16 + [2048 * 4, 2048 * 8] + [MiB] * 16
    (got,) = read_results(messages)
    _assert_same_result(got, result)


def test_several_results_share_one_stream() -> None:
    results = [
        _result(5, np.float32, version=7),
        _result(3, np.float64, refresh=False, block="other"),
        _result(5, np.float32, version=9, kind=SolveKind.INVERSE_ROOT, eigenvalues=None,
                permutation=None, rotation=None),
    ]  # fmt: skip
    stream = _wire(m for r in results for m in framing.result_messages(r, chunk_bytes=48))
    receiver = framing.ResultReceiver()
    got = [r for r in (receiver.feed(m) for m in stream) if r is not None]
    receiver.close()
    assert not receiver.in_progress
    assert len(got) == 3
    for g, want in zip(got, results, strict=True):
        _assert_same_result(g, want)


def test_a_batch_gives_each_result_it_can_read() -> None:
    """``batch_results``: several complete results in one message, each announced in its
    segment or carrying its arrays whole. A result whose segment was overwritten gives nothing
    (as ``feed`` gives None); a batch never comes inside a result, nor is followed by a chunk;
    an entry's arrays must be the ones its header announces."""
    results = [_result(4, np.float32, block=f"b{i}", version=10 + i) for i in range(4)]
    segments = {f"seg{i}": r for i, r in enumerate(results)}
    overwritten = {"seg1"}

    events: list[tuple[str, str]] = []

    def reader(ref: SegmentRef, specs: list[Any]) -> list[np.ndarray] | None:
        events.append(("read", ref.segment_id))
        if ref.segment_id in overwritten:
            return None
        held = segments[ref.segment_id]
        arrays = [getattr(held, name) for name in RESULT_FIELDS]
        return [a.copy() for a in arrays if a is not None]

    entries = [
        framing.batched_result(r, shm=SegmentRef(f"seg{i}", 2)) for i, r in enumerate(results[:3])
    ]
    entries.insert(1, framing.batched_result(results[3], chunk_bytes=64))  # arrays inline
    assert not entries[0].arrays and len(entries[1].arrays) == 4
    (batch,) = _wire([pb.StreamResultsResponse(batch=pb.ResultBatch(results=entries))])
    receiver = framing.ResultReceiver(reader=reader)
    got = []
    for result in receiver.feed_all(batch):
        events.append(("got", result.block))
        got.append(result)
    # each result reaches its taker before the next is read (DaemonSource stages as it reads)
    assert events == [
        ("read", "seg0"), ("got", "b0"), ("got", "b3"), ("read", "seg1"), ("read", "seg2"),
        ("got", "b2"),
    ]  # fmt: skip
    assert [r.block for r in got] == ["b0", "b3", "b2"]
    for g, want in zip(got, [results[0], results[3], results[2]], strict=True):
        _assert_same_result(g, want)
    with pytest.raises(InvalidInputError, match="longer than announced"):
        list(receiver.feed_all(pb.StreamResultsResponse(chunk=b"\0" * 8)))
    with pytest.raises(InvalidInputError, match="read it with feed_all"):
        framing.ResultReceiver(reader=reader).feed(batch)
    chunked = _result_stream()
    inside = framing.ResultReceiver(reader=reader)
    assert list(inside.feed_all(chunked[0])) == []
    with pytest.raises(InvalidInputError, match="a batch of results arrived inside"):
        list(inside.feed_all(batch))
    short = pb.BatchedResult()
    short.CopyFrom(entries[1])
    del short.arrays[-1]
    both = pb.BatchedResult()
    both.CopyFrom(entries[0])
    both.arrays.append(b"\0" * 64)
    for entry, problem in [
        (short, "b3.*carries 3 arrays, its header announces 4"),
        (both, "b0.*announced in a segment also carries arrays"),
    ]:
        message = pb.StreamResultsResponse(batch=pb.ResultBatch(results=[entry]))
        with pytest.raises(InvalidInputError, match=problem):
            list(framing.ResultReceiver(reader=reader).feed_all(message))
    with pytest.raises(ValueError, match="more than a chunk"):
        framing.batched_result(results[3], chunk_bytes=32)
    # any other part reads as feed reads it
    plain = framing.ResultReceiver()
    (whole,) = [r for m in chunked for r in plain.feed_all(m)]
    _assert_same_result(whole, _result(8, np.float32))


@pytest.mark.parametrize("refresh", [False, True])
def test_real_solver_results_round_trip(refresh: bool) -> None:
    a = _matrix(6, np.float64)
    spd = a @ a.T + np.eye(6)
    basis = np.linalg.qr(_matrix(6, np.float64, 5))[0] if refresh else None
    task = SolveTask(block="real", version=3, kind=SolveKind.EIGENBASIS, matrix=spd, basis=basis)
    result = solve(task)
    (got,) = read_results(_wire(framing.result_messages(result)))
    _assert_same_result(got, result)


RESULT = "result of block 'layers.3.mlp.weight/t0/R' version 41"


def _result_stream(**kw: Any) -> list[Any]:
    return _wire(framing.result_messages(_result(8, np.float32, **kw), chunk_bytes=100))


def test_truncated_result_is_rejected_at_close() -> None:
    messages = _result_stream()
    receiver = framing.ResultReceiver()
    assert all(receiver.feed(m) is None for m in messages[:-1])
    assert receiver.in_progress
    with pytest.raises(InvalidInputError, match=f"{RESULT}: stream ended early.*rotation"):
        receiver.close()
    with pytest.raises(InvalidInputError, match="ended early"):
        list(read_results(messages[:-1]))


def test_result_stream_order_is_enforced() -> None:
    messages = _result_stream()
    with pytest.raises(InvalidInputError, match="a chunk arrived before any result header"):
        list(read_results(messages[1:]))
    with pytest.raises(InvalidInputError, match=f"{RESULT}: a new header arrived before"):
        list(read_results([*messages[:2], *messages]))
    with pytest.raises(InvalidInputError, match=f"{RESULT}: stream is longer than announced"):
        list(read_results([*messages, messages[-1]]))
    with pytest.raises(InvalidInputError, match="an empty message"):
        list(read_results([pb.StreamResultsResponse()]))


def test_credit_messages_go_to_their_listener_between_results_only() -> None:
    """Credit messages may come between results (handed to ``on_credit``, ignored without
    one), never inside one; negative counts are refused."""
    credit = Credit(workers_idle=2, queued=1, snapshots_answered=7)
    message = convert.credit_to_proto(credit)
    stream = _result_stream()
    seen: list[Credit] = []
    receiver = framing.ResultReceiver(on_credit=seen.append)
    results = [receiver.feed(m) for m in [message, *stream, message]]
    assert seen == [credit, credit]
    assert [r is not None for r in results] == [False] * len(stream) + [True, False]
    assert framing.ResultReceiver().feed(message) is None  # not asked for: ignored
    inside = framing.ResultReceiver(on_credit=seen.append)
    inside.feed(stream[0])
    with pytest.raises(InvalidInputError, match="a credit message arrived inside this result"):
        inside.feed(message)
    message.credit.queued = -1
    with pytest.raises(InvalidInputError, match="counts must not be negative"):
        framing.ResultReceiver(on_credit=seen.append).feed(message)


@pytest.mark.parametrize(
    ("idle", "queued", "unanswered", "expected"),
    [(1, 0, 0, 2), (2, 0, 1, 2), (1, 1, 0, 1), (1, 0, 5, 0), (0, 0, 0, 0), (0, 3, 0, 0)],
)
def test_credit_is_free_workers_plus_one_less_what_waits(
    idle: int, queued: int, unanswered: int, expected: int
) -> None:
    credit = Credit(workers_idle=idle, queued=queued, snapshots_answered=0)
    assert credit.for_client(unanswered) == expected


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h.ClearField("matrix"), "the matrix header is missing"),
        (lambda h: setattr(h.permutation, "dtype", pb.DTYPE_FLOAT32), "permutation must be int64"),
        (lambda h: setattr(h.matrix, "dtype", pb.DTYPE_INT64), "matrix must be float32 or floa"),
        (lambda h: setattr(h.eigenvalues, "dtype", 0), "eigenvalues dtype must be float32 or"),
        (lambda h: h.rotation.shape.append(1), r"rotation must have shape \(8, 8\)"),
        (lambda h: setattr(h.matrix, "num_bytes", 255), "matrix announces 255 bytes but float32"),
        (lambda h: setattr(h, "kind", pb.SOLVE_KIND_INVERSE_ROOT), "eigenvalues is only meaning"),
        (lambda h: setattr(h, "kind", 7), "kind must be INVERSE_ROOT or EIGENBASIS, got unknown"),
        (lambda h: setattr(h, "n", 9), r"matrix must have shape \(9, 9\), got \(8, 8\)"),
        (lambda h: setattr(h, "tenant", ""), "block and tenant must be non-empty"),
        (lambda h: setattr(h, "version", -1), "version >= 0"),
    ],
)
def test_bad_result_headers_are_rejected(edit: Any, message: str) -> None:
    messages = _result_stream()
    edit(messages[0].header)
    with pytest.raises(InvalidInputError, match=message) as e:
        list(read_results(messages))
    assert "'layers.3.mlp.weight/t0/R'" in str(e.value)


def test_result_with_a_malformed_array_is_not_sent() -> None:
    bad = _result(4, np.float32, permutation=np.arange(4, dtype=np.int32))
    with pytest.raises(InvalidInputError, match=f"{RESULT}: permutation must be int64"):
        convert.result_header(bad)
    bad = _result(4, np.float32, eigenvalues=np.zeros(5, np.float32))
    with pytest.raises(InvalidInputError, match=r"eigenvalues must have shape \(4,\)"):
        list(framing.result_messages(bad))
    bad = _result(4, np.float32, matrix=np.zeros((4, 3), np.float32))
    with pytest.raises(InvalidInputError, match=r"matrix must have shape \(4, 4\)"):
        convert.result_header(bad)


# ---------------------------------------------------------------------------- status, enums


def _block_status(**overrides: Any) -> BlockStatus:
    kwargs: dict[str, Any] = {
        "tenant": "alice",
        "block": "b0",
        "version": 12,
        "submitted_version": 14,
        "in_flight_version": 14,
        "queued_version": 14,
        "running_version": -1,
        "delivered_version": 12,
        "staleness_steps": 2,
        "age_s": 1.5,
        "submitted_age_s": 0.25,
        "delivered_age_s": 0.0,
        "last_solve_s": 0.125,
        "failures": 3,
        "consecutive_failures": 1,
        "duplicates": 4,
        "stale_ignored": 5,
        "superseded": 6,
        "state": BlockState.QUEUED,
        "last_error": "block 'b0' version 13: eigendecomposition residual too large",
        "queue_position": 0,
    }
    kwargs.update(overrides)
    return BlockStatus(**kwargs)


def _engine_stats(**overrides: Any) -> EngineStats:
    kwargs: dict[str, Any] = {
        "incarnation_id": "4f2c",
        "uptime_s": 12.5,
        "num_workers": 3,
        "workers_busy": 2,
        "workers_idle": 1,
        "worker_restarts": 1,
        "queue_depth": 7,
        "blocks": 40,
        "solves_done": 1000,
        "solves_failed": 2,
        "results_discarded": 1,
        "seconds_per_n3": 1.25e-10,
        "closed": False,
        "broken_reason": None,
    }
    kwargs.update(overrides)
    return EngineStats(**kwargs)


def _status_wire(message: pb.StatusResponse) -> pb.StatusResponse:
    return pb.StatusResponse.FromString(message.SerializeToString())


@pytest.mark.parametrize("state", list(BlockState))
def test_block_status_round_trips_in_every_state(state: BlockState) -> None:
    full = _block_status(state=state)
    empty = _block_status(
        state=state,
        age_s=None,
        submitted_age_s=None,
        delivered_age_s=None,
        last_solve_s=None,
        last_error=None,
        queue_position=None,
    )
    stats = _engine_stats()
    got_stats, got_blocks = convert.status_from_proto(
        _status_wire(convert.status_to_proto(stats, [full, empty]))
    )
    assert got_blocks == [full, empty] and got_stats == stats


def test_zero_and_unset_optionals_stay_distinct() -> None:
    status = _block_status(age_s=0.0, queue_position=0, last_error="", delivered_age_s=None)
    message = convert.block_status_to_proto(status)
    assert message.HasField("queue_position") and not message.HasField("delivered_age_s")
    assert convert.block_status_from_proto(message) == status


def test_registry_status_round_trips() -> None:
    now = [100.0]
    registry = CoherenceRegistry(max_consecutive_failures=1, clock=lambda: now[0])
    registry.on_submit("alice", "a", 3)
    registry.on_submit("alice", "b", 5)
    registry.on_dispatch("alice", "b", 5)
    registry.on_failure("alice", "b", 5, "block 'b' version 5: result holds NaN or Inf")
    now[0] = 101.5
    statuses = registry.status(queue_positions={("alice", "a"): 0})
    assert {s.state for s in statuses} == {BlockState.QUEUED, BlockState.FAILED}
    got = [convert.block_status_from_proto(convert.block_status_to_proto(s)) for s in statuses]
    assert got == statuses


@pytest.mark.parametrize("broken", [None, "3 solver workers died before becoming ready"])
def test_engine_stats_round_trip(broken: str | None) -> None:
    stats = _engine_stats(broken_reason=broken, closed=broken is not None)
    wire = pb.EngineStats.FromString(convert.engine_stats_to_proto(stats).SerializeToString())
    assert convert.engine_stats_from_proto(wire) == stats
    assert dataclasses.asdict(convert.engine_stats_from_proto(wire)) == stats.to_dict()


def test_status_without_a_state_is_rejected() -> None:
    message = convert.block_status_to_proto(_block_status())
    message.state = pb.BLOCK_STATE_UNSPECIFIED
    with pytest.raises(InvalidInputError, match="status of block 'b0': state must be set"):
        convert.block_status_from_proto(message)


@pytest.mark.parametrize("outcome", list(SubmitOutcome))
def test_every_submit_outcome_round_trips(outcome: SubmitOutcome) -> None:
    wire = pb.SubmitSnapshotResponse.FromString(
        convert.outcome_to_proto(outcome).SerializeToString()
    )
    assert convert.outcome_from_proto(wire) is outcome


def test_unset_outcome_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="outcome must be set"):
        convert.outcome_from_proto(pb.SubmitSnapshotResponse())


def test_every_python_enum_has_exactly_one_wire_value() -> None:
    pairs = [
        (SolveKind, convert._KINDS, pb.SolveKind),
        (SubmitOutcome, convert._OUTCOMES, pb.SubmitOutcome),
        (BlockState, convert._STATES, pb.BlockState),
    ]
    for py_enum, table, wire_enum in pairs:
        assert set(table) == set(py_enum)
        # every wire value but UNSPECIFIED (0) is some Python member
        assert sorted(table.values()) == sorted(v for v in wire_enum.values() if v != 0)
    for kind in SolveKind:
        assert convert.kind_from_proto(convert._KINDS[kind], what="x") is kind


# ------------------------------------------------------------------------- over real gRPC


def test_protocol_does_not_import_torch() -> None:
    # In a fresh interpreter: this one already has torch from conftest.
    code = (
        "import sys\n"
        "import asteria_server.protocol.convert, asteria_server.protocol.errors\n"
        "import asteria_server.protocol.generated.asteria.v1.preconditioner_pb2_grpc\n"
        "assert 'torch' not in sys.modules and 'asteria_client' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _Loopback(pb_grpc.PreconditionerServicer):
    """Just enough of a servicer to carry the streams over a real channel."""

    def __init__(self) -> None:
        self.tasks: list[SolveTask] = []

    def SubmitSnapshot(self, request_iterator: Iterator[Any], context: Any) -> Any:
        self.tasks.append(read_snapshot(request_iterator, tenant="from-session"))
        return convert.outcome_to_proto(SubmitOutcome.QUEUED)

    def StreamResults(self, request: Any, context: Any) -> Iterator[Any]:
        for task in self.tasks:
            yield from framing.result_messages(solve(task))


def test_streams_cross_a_real_grpc_channel() -> None:
    servicer = _Loopback()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PreconditionerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PreconditionerStub(channel)
            a = _matrix(600, np.float64)  # 2.9 MB: three 1 MiB chunks, under gRPC's 4 MB limit
            task = SolveTask(
                block="w", version=1, kind=SolveKind.INVERSE_ROOT, matrix=a @ a.T / 600
            )
            answer = stub.SubmitSnapshot(framing.snapshot_messages(task), timeout=30)
            assert convert.outcome_from_proto(answer) is SubmitOutcome.QUEUED
            (got_task,) = servicer.tasks
            _assert_same_task(got_task, task, "from-session")
            stream = stub.StreamResults(pb.StreamResultsRequest(session_id="s"), timeout=30)
            (result,) = read_results(stream)
            assert result.block == "w" and result.matrix.shape == (600, 600)
            assert result.tenant == "from-session"
    finally:
        server.stop(None)


def test_transport_stats_round_trip_and_are_absent_from_older_daemons() -> None:
    from asteria_server.types import TransportStats

    stats = _engine_stats()
    transport = TransportStats(
        shm_connections=2,
        shm_segments=44,
        shm_mapped_bytes=3 << 20,
        upload_bytes_in_flight=4096,
        upload_budget_bytes=2 << 30,
        uploads_waiting=1,
    )
    message = _status_wire(convert.status_to_proto(stats, [], transport))
    assert convert.transport_stats_from_proto(message) == transport
    assert convert.transport_stats_from_proto(convert.status_to_proto(stats, [])) is None


def test_status_columns_round_trip_every_field_and_equal_the_records() -> None:
    blocks = [
        _block_status(),
        _block_status(
            block="b1",
            version=-1,
            running_version=9,
            queued_version=-1,
            in_flight_version=9,
            staleness_steps=15,
            age_s=None,
            delivered_age_s=None,
            last_solve_s=None,
            state=BlockState.RUNNING,
            last_error=None,
            queue_position=None,
            tier="shm",
        ),
        _block_status(block="b2", state=BlockState.FAILED, tier="spill", queue_position=7),
    ]
    table = BlockTable.of("alice", blocks)
    wire = pb.BlockColumns.FromString(convert.block_table_to_proto(table).SerializeToString())
    assert len(wire.block) == 3 and list(wire.error_index) == [0, 2]  # errors are sparse
    back = convert.block_table_from_proto(wire)
    assert list(back) == blocks and back.to_dicts() == [b.to_dict() for b in blocks]
    assert back[1:] == blocks[1:]


def test_status_columns_of_unequal_length_or_without_state_are_refused() -> None:
    wire = convert.block_table_to_proto(BlockTable.of("alice", [_block_status()]))
    short = pb.BlockColumns()
    short.CopyFrom(wire)
    short.version.append(3)
    with pytest.raises(InvalidInputError, match=r"status columns: \['version'\] must have one"):
        convert.block_table_from_proto(short)
    unset = pb.BlockColumns()
    unset.CopyFrom(wire)
    unset.state[0] = pb.BLOCK_STATE_UNSPECIFIED
    with pytest.raises(InvalidInputError, match="status of block 'b0': state must be set"):
        convert.block_table_from_proto(unset)
    bad_error = pb.BlockColumns()
    bad_error.CopyFrom(wire)
    bad_error.error_index[0] = 5
    with pytest.raises(InvalidInputError, match="error_index must name one block per error"):
        convert.block_table_from_proto(bad_error)


def test_a_status_summary_round_trips() -> None:
    summary = BlockSummary(
        idle=3,
        queued=2,
        running=1,
        failed=1,
        tier_host=4,
        tier_none=3,
        never_computed=2,
        staleness_steps_p50=1,
        staleness_steps_p99=9,
        staleness_steps_max=12,
        oldest_result_age_s=3.5,
        failures=4,
        worst=BlockTable.of("alice", [_block_status(state=BlockState.FAILED)]),
    )
    wire = pb.BlockSummary.FromString(convert.block_summary_to_proto(summary).SerializeToString())
    back = convert.block_summary_from_proto(wire)
    assert back.to_dict() == summary.to_dict() and back.blocks == 7
    none = convert.block_summary_from_proto(convert.block_summary_to_proto(BlockSummary()))
    assert none.oldest_result_age_s is None and none.blocks == 0 and len(none.worst) == 0
