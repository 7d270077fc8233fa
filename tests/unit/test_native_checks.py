"""Native mode's solver checks, read once per step: the same results and the same failures as
checking each block when it is solved, with one host read for all of a step's blocks.

``NativeSource`` solves the blocks submitted since the last ``take`` there, together, with the
unchecked functions of ``runtime/linalg.py`` (the checks as device flags, the eighs batched by
shape) and reads the flags at once; a block whose flag failed is solved again by the checked
path. These tests hold both halves
to the checked path: bitwise equal results where every check passes, the checked path's
epsilon retry where the first attempt fails, and its SolverError, recorded with its message,
where every attempt fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asteria_client.runtime import linalg
from asteria_client.runtime.source import NativeSource, PreconditionerRequest, compute_locally
from asteria_client.runtime.sync_audit import HostSyncAudit
from asteria_server.errors import SolverError
from asteria_server.types import SolveKind


def _factor(
    n: int, seed: int, dtype: torch.dtype = torch.float32, rank: int | None = None
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, rank or 2 * n, generator=gen, dtype=torch.float64)
    return (g @ g.T / g.shape[1]).to(dtype)


def _basis(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q.to(torch.float32)


def _requests(n: int, blocks: int, prefix: str = "b") -> list[PreconditionerRequest]:
    """Every kind of solve: roots, first bases, QR refreshes."""
    out = []
    for i in range(blocks):
        matrix = _factor(n, seed=i)
        kind = i % 3
        if kind == 0:
            out.append(
                PreconditionerRequest(
                    block=f"{prefix}{i}", version=1, kind=SolveKind.INVERSE_ROOT, matrix=matrix
                )
            )
        else:
            basis = None if kind == 1 else _basis(n, seed=100 + i)
            out.append(
                PreconditionerRequest(
                    block=f"{prefix}{i}",
                    version=1,
                    kind=SolveKind.EIGENBASIS,
                    matrix=matrix,
                    basis=basis,
                )
            )
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a, b)


def test_results_are_bitwise_those_of_the_checked_path() -> None:
    requests = _requests(8, 9) + _requests(24, 3, prefix="wide")
    source = NativeSource()
    for request in requests:
        source.submit(request)
    for request in requests:
        got = source.take(request.block)
        want = compute_locally(request)
        assert got is not None, request.block
        for field in ("matrix", "eigenvalues", "permutation", "rotation"):
            assert _same(getattr(got, field), getattr(want, field)), (request.block, field)
        assert source.record(request.block).failures == 0


def test_a_step_reads_its_flags_once_whatever_the_number_of_blocks() -> None:
    """The only host reads are torch.linalg.eigh's own info check, once for all the blocks of
    one shape (their eighs are batched), and one read of all the flags; the checked path
    reads several per block."""
    counts = {}
    for blocks in (3, 12):
        requests = _requests(8, blocks)
        source = NativeSource()
        audit = HostSyncAudit("cpu")
        with audit:
            for request in requests:
                source.submit(request)
            for request in requests:
                assert source.take(request.block) is not None
        assert audit.counts.pop("linalg_eigh", 0) == 1  # every block is 8x8: one batch
        counts[blocks] = dict(audit.counts)
    assert counts[3] == counts[12] == {"tolist": 1}, counts
    checked = HostSyncAudit("cpu")
    with checked:
        for request in _requests(8, 3):
            compute_locally(request)
    assert checked.total - checked.counts["linalg_eigh"] > 3  # what the flags replace


def test_a_first_attempt_that_fails_takes_the_checked_paths_retry() -> None:
    """A rank-deficient factor with epsilon 0: the first attempt's ``lam > 0`` fails, the
    checked path's retry with a larger epsilon succeeds; the source returns that result."""
    matrix = _factor(6, seed=3, dtype=torch.float64, rank=3)
    request = PreconditionerRequest(
        block="deficient", version=2, kind=SolveKind.INVERSE_ROOT, matrix=matrix, epsilon=0.0
    )
    _, ok = linalg.inverse_root_unchecked(matrix, request.exponent, request.epsilon)
    assert not bool(ok), "the first attempt must fail, or this test tests nothing"
    source = NativeSource()
    source.submit(request)
    got = source.take("deficient")
    assert got is not None
    assert torch.equal(got.matrix, compute_locally(request).matrix)
    assert source.record("deficient").failures == 0


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.full((4, 4), np.nan), "NaN or Inf"),
        (np.array([[1.0, 2.0], [0.0, 1.0]]), "not symmetric"),
        (np.ones((3, 4)), "square"),
        (-np.eye(4), "positive semi-definite"),
    ],
    ids=["nan", "asymmetric", "not-square", "negative-definite"],
)
@pytest.mark.parametrize("kind", ["root", "basis"])
def test_a_failed_block_is_recorded_with_the_checked_paths_message(
    bad: np.ndarray, match: str, kind: str
) -> None:
    """Between two good blocks, a bad one fails as the checked path fails (same message,
    recorded), its neighbours' results are delivered, and the last good result is kept."""
    solve = SolveKind.INVERSE_ROOT if kind == "root" else SolveKind.EIGENBASIS
    good = _requests(8, 2)
    request = PreconditionerRequest(
        block="layer.weight/tile0/dim1", version=3, kind=solve, matrix=torch.from_numpy(bad)
    )
    with pytest.raises(SolverError, match=match) as info:
        compute_locally(request)
    source = NativeSource()
    source.submit(good[0])
    source.submit(request)
    source.submit(good[1])
    assert source.take(request.block) is None
    record = source.record(request.block)
    assert (record.failures, record.consecutive_failures) == (1, 1)
    assert record.last_error == str(info.value)
    for request in good:
        assert source.take(request.block) is not None


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13, 24, 33, 64])
def test_a_batched_eigh_has_the_bits_of_single_calls(n: int) -> None:
    """Native results must not depend on which blocks share a step (a rank-deficient factor's
    null-space basis is whatever the rounding picks). Even orders make one batch, which on CPU
    rounds as single calls do; odd orders are solved one by one, because MKL rounds the
    matrices of a batch that start off a 16-byte boundary differently (in float64, every
    other one of odd order)."""
    matrices = [_factor(n, seed=s, dtype=torch.float64, rank=max(1, n // 2)) for s in range(4)]
    matrices.append(torch.eye(n, dtype=torch.float64))  # repeated eigenvalues
    audit = HostSyncAudit("cpu")
    with audit:
        batched = linalg.batched_eigh(matrices)
    assert audit.counts.get("linalg_eigh") == (1 if n % 2 == 0 else len(matrices))
    for a, pair in zip(matrices, batched, strict=True):
        assert pair is not None
        values, vectors = torch.linalg.eigh(a)
        assert torch.equal(pair[0], values) and torch.equal(pair[1], vectors)


def test_a_batched_eigh_groups_by_shape_and_a_failed_group_is_left_to_the_caller() -> None:
    """Mixed shapes make one batch each; where torch raises for a batch (here: a NaN matrix,
    which LAPACK rejects), that batch's matrices come back None and the other shape's are
    solved."""
    good = [_factor(6, seed=s, dtype=torch.float64) for s in range(3)]
    bad = [
        _factor(4, seed=9, dtype=torch.float64),
        torch.full((4, 4), float("nan"), dtype=torch.float64),
    ]
    audit = HostSyncAudit("cpu")
    with audit:
        out = linalg.batched_eigh([good[0], bad[0], good[1], bad[1], good[2]])
    assert audit.counts.get("linalg_eigh") == 2
    assert [pair is None for pair in out] == [False, True, False, True, False]


def test_a_bad_block_in_a_batch_of_its_shape_fails_alone() -> None:
    """A NaN factor of the same shape as its neighbours: their batch fails or flags it, and
    each block then takes the checked path's way: the neighbours' results are delivered,
    bitwise those of the checked path, and the bad one is recorded with its message."""
    good = _requests(8, 4)
    request = PreconditionerRequest(
        block="bad", version=2, kind=SolveKind.INVERSE_ROOT, matrix=torch.full((8, 8), float("nan"))
    )
    source = NativeSource()
    for r in [good[0], good[1], request, good[2], good[3]]:
        source.submit(r)
    assert source.take("bad") is None
    assert "NaN or Inf" in (source.record("bad").last_error or "")
    for r in good:
        got = source.take(r.block)
        assert got is not None and torch.equal(got.matrix, compute_locally(r).matrix), r.block
