"""One contract, three transports: the embedded engine (in-process), a real daemon over shared
memory, and the same daemon over gRPC chunks.

Every transport gets the same snapshots and must give the same results (the same solver runs
behind each), keep versions from going back, survive bad snapshots with the block's last result
intact, and compute the next good snapshot. The daemon is a real ``asteria-server`` subprocess;
the shared-memory case checks that its bytes really went through segments.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from asteria_client.runtime.embedded import EmbeddedSource
from asteria_client.runtime.source import (
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
)
from asteria_client.transport import DaemonClientConfig, DaemonSource
from asteria_server.engine import EngineConfig, SolveKind, SolveTask, solve
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon

TRANSPORTS = ("embedded", "shm", "grpc")
N = 24
MAX_N = 48  # the daemon's --max-matrix-n, for the oversized case
WAIT_S = 60.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("transports"), "--max-matrix-n", str(MAX_N))
    yield d
    stop_daemon(d)


def make_source(transport: str, daemon: Daemon) -> PreconditionerSource:
    if transport == "embedded":
        return EmbeddedSource(EngineConfig(num_workers=1))
    config = DaemonClientConfig(shared_memory=transport == "shm")
    source = DaemonSource(daemon.target, config=config)
    assert source.wait_connected(WAIT_S)
    return source


@pytest.fixture(params=TRANSPORTS)
def source(request: pytest.FixtureRequest, daemon: Daemon) -> Iterator[PreconditionerSource]:
    src = make_source(request.param, daemon)
    yield src
    src.close()


def factor(seed: int, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3 * n, generator=g)
    return x @ x.T / (3 * n) + 1e-3 * torch.eye(n)


def request(block: str, version: int, kind: SolveKind, matrix: torch.Tensor, **kw: object) -> Any:
    return PreconditionerRequest(block=block, version=version, kind=kind, matrix=matrix, **kw)


def get(source: PreconditionerSource, block: str, version: int) -> PreconditionerResult:
    result = source.wait(block, version, WAIT_S)
    assert result is not None, f"no result for {block} v{version}"
    assert result.version >= version
    return result


def run_contract_sequence(source: PreconditionerSource) -> dict[str, PreconditionerResult]:
    """The snapshots every transport gets; returns the results by block."""
    out = {}
    source.submit(request("root", 0, SolveKind.INVERSE_ROOT, factor(0)))
    out["root"] = get(source, "root", 0)
    source.submit(request("eig", 0, SolveKind.EIGENBASIS, factor(1)))
    out["eig"] = get(source, "eig", 0)
    basis = out["eig"].matrix
    source.submit(request("eig", 5, SolveKind.EIGENBASIS, factor(2), basis=basis, base_version=0))
    out["refresh"] = get(source, "eig", 5)
    return out


def test_results_match_the_solver_on_every_transport(source: PreconditionerSource) -> None:
    results = run_contract_sequence(source)
    root = results["root"]
    expected = solve(
        SolveTask(block="r", version=0, kind=SolveKind.INVERSE_ROOT, matrix=factor(0).numpy())
    )
    np.testing.assert_allclose(root.matrix.numpy(), expected.matrix, rtol=1e-5, atol=1e-6)
    refresh = results["refresh"]
    assert refresh.base_version == 0 and refresh.rotation is not None
    assert refresh.permutation is not None and sorted(refresh.permutation.tolist()) == list(
        range(N)
    )
    q = refresh.matrix.double()
    np.testing.assert_allclose((q.T @ q).numpy(), np.eye(N), atol=1e-5)


def test_all_transports_give_identical_results(daemon: Daemon) -> None:
    by_transport = {}
    for transport in TRANSPORTS:
        src = make_source(transport, daemon)
        try:
            by_transport[transport] = run_contract_sequence(src)
            if transport != "embedded":
                assert isinstance(src, DaemonSource)
                stats = src.stats()
                if transport == "shm":
                    assert stats["transport"] == "shm"
                    assert stats["shm_snapshots"] >= 3 and stats["chunked_snapshots"] == 0
                    assert stats["shm_results"] >= 3
                else:
                    assert stats["transport"] == "grpc"
                    assert stats["shm_snapshots"] == 0 and stats["chunked_snapshots"] >= 3
        finally:
            src.close()
    reference = by_transport["embedded"]
    for transport in ("shm", "grpc"):
        for name, result in by_transport[transport].items():
            ref = reference[name]
            assert (result.version, result.base_version) == (ref.version, ref.base_version)
            for field in ("matrix", "eigenvalues", "rotation", "permutation"):
                a, b = getattr(result, field), getattr(ref, field)
                assert (a is None) == (b is None), f"{transport} {name}.{field}"
                if a is not None:
                    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_latest_wins_and_versions_never_go_back(source: PreconditionerSource) -> None:
    for version in (1, 2, 3):
        source.submit(request("lw", version, SolveKind.INVERSE_ROOT, factor(version)))
    result = get(source, "lw", 3)
    assert result.version == 3
    source.submit(request("lw", 2, SolveKind.INVERSE_ROOT, factor(9)))  # older: ignored
    assert source.wait("lw", 4, 1.0) is None
    assert source.record("lw").computed_version == 3


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(
            lambda m: m.masked_fill(torch.eye(N, dtype=torch.bool), float("nan")), id="nan"
        ),
        pytest.param(lambda m: m + torch.triu(torch.ones(N, N), 1), id="asymmetric"),
        pytest.param(lambda m: m.to(torch.float16), id="wrong-dtype"),
        pytest.param(lambda m: m[:, : N - 1], id="wrong-shape"),
    ],
)
def test_a_bad_snapshot_leaves_the_last_result_intact(
    source: PreconditionerSource, bad: Any
) -> None:
    source.submit(request("bad", 0, SolveKind.INVERSE_ROOT, factor(3)))
    good = get(source, "bad", 0)
    source.submit(request("bad", 1, SolveKind.INVERSE_ROOT, bad(factor(4))))  # never raises
    assert source.wait("bad", 1, 3.0) is None
    record = source.records()["bad"]  # the engine's or daemon's view too (one status read)
    assert record.computed_version == 0
    assert record.last_error, "the refusal or failure must be visible in the block's record"
    source.submit(request("bad", 2, SolveKind.INVERSE_ROOT, factor(5)))
    after = get(source, "bad", 2)
    assert after.version == 2 and not torch.equal(after.matrix, good.matrix)


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_an_oversized_snapshot_is_refused_with_a_clear_error(
    daemon: Daemon, transport: str
) -> None:
    src = make_source(transport, daemon)
    try:
        src.submit(request("big", 0, SolveKind.INVERSE_ROOT, factor(6, MAX_N + 1)))
        assert src.wait("big", 0, 3.0) is None
        assert "max_matrix_n" in src.record("big").last_error
        src.submit(request("small", 0, SolveKind.INVERSE_ROOT, factor(7)))
        assert get(src, "small", 0).version == 0  # the source keeps working
    finally:
        src.close()
