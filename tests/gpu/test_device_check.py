"""What scripts/device_check.sh proves on a GPU (skipped without CUDA, like all of tests/gpu):

- **sync audit**: a step that installs nothing runs under ``torch.cuda.set_sync_debug_mode``
  (``"error"``: nothing may sync; ``"warn"`` and :class:`HostSyncAudit`: every sync is named,
  and none may come from outside optim/base.py's finite check) in embedded and daemon mode,
  over shared memory and over gRPC;
- **the host runs ahead**: with a long kernel queued (``torch.cuda._sleep``), ``opt.step()``
  returns while the stream is still busy;
- **GPU -> host race**: a factor changed on the main stream right after its snapshot was taken
  does not reach the snapshot (the root computed from it is the old factor's);
- **host -> GPU race**: results staged in one reused pinned buffer are not overwritten while
  their copies are in flight;
- **close() with a copy in flight**: the copy completes before close() returns;
- **bf16**: a bfloat16 model trains in every mode;
- **native busy steps**: a native SOAP step syncs once for its solver checks and once per
  batched ``torch.linalg.eigh`` (ATen reads its info on the host; native mode batches a step's
  eighs by shape), at 2 and at 6 blocks; a batch keeps the bits of single calls.

The finite check runs on the device since ``_check_on_device`` (a step's updates are masked by
its flag, read on the host a step later), so the quiet-step cases expect no sync at all; they
have not run on a GPU yet.
"""

from __future__ import annotations

import inspect
import math
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asteria_client import SOAP
from asteria_client.optim.base import AsteriaOptimizer
from asteria_client.runtime.embedded import EmbeddedSource, EngineConfig
from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.runtime.sync_audit import HostSyncAudit
from asteria_client.runtime.transfer import DeviceTransfer
from asteria_client.transport import DaemonClientConfig, DaemonSource
from asteria_server.types import SolveKind
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
WAIT_S = 30.0
#: GPU clock cycles of the kernel queued ahead of a step (about 0.5 s at the H200's 1.98 GHz)
SLEEP_CYCLES = 1_000_000_000
ASYNC_MODES = ("embedded", "daemon-shm", "daemon-grpc")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("gpu-daemon"))
    yield d
    stop_daemon(d)


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64, bias=False) for _ in range(3)]
    return torch.nn.Sequential(*layers).to(device=CUDA, dtype=dtype)


def _optimizer(mode: str, model: torch.nn.Module, daemon: Daemon, **kw: Any) -> AsteriaOptimizer:
    kwargs: dict[str, Any] = {"model": model, **kw}
    if mode in ("native", "embedded"):
        kwargs["mode"] = mode
        if mode == "embedded":
            kwargs["engine_config"] = EngineConfig(num_workers=1, calibrate=False)
    else:
        config = DaemonClientConfig(shared_memory=mode == "daemon-shm")
        kwargs["mode"] = "daemon"
        kwargs["source"] = DaemonSource(daemon.target, config=config)
    opt = SOAP(model.parameters(), **kwargs)
    opt.attach(model)
    return opt


def _batch(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(128, 64, generator=g).to(device=CUDA, dtype=dtype)


def _settled(mode: str, daemon: Daemon) -> tuple[torch.nn.Module, AsteriaOptimizer]:
    """A model whose first bases are installed and whose next refresh is far off: the next
    iterations install nothing."""
    model = _model()
    opt = _optimizer(mode, model, daemon, precondition_frequency=1000, staleness_budget=1)
    for step in range(4):
        model(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        deadline = time.monotonic() + WAIT_S
        blocks = [r["block"] for r in opt.preconditioner_status()]
        while any(opt.source.in_flight_version(b) is not None for b in blocks):
            assert time.monotonic() < deadline, "results did not arrive"
            time.sleep(0.01)
    installs = sum(e.installs for e in opt.runtime.refresh_log.blocks.values())
    assert installs == len(blocks), "the first bases were not all installed"
    torch.cuda.synchronize()
    return model, opt


def _iteration(model: torch.nn.Module, opt: AsteriaOptimizer, x: torch.Tensor) -> None:
    """Forward, backward (the hooks fire), step. ``x`` is on the device already: its copy
    from pageable host memory would count as a sync itself."""
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _in_finite_check(filename: str, lineno: int) -> bool:
    lines, first = inspect.getsourcelines(AsteriaOptimizer._first_bad_gradient)
    path = Path(inspect.getfile(AsteriaOptimizer)).resolve()
    return Path(filename).resolve() == path and first <= lineno < first + len(lines)


def _site_in_finite_check(site: str) -> bool:
    """An audit site, ``name at path:line``, in the finite check."""
    file, _, line = site.rsplit(" at ", 1)[-1].rpartition(":")
    return line.isdigit() and _in_finite_check(file, int(line))


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_a_quiet_step_syncs_nowhere_but_the_finite_check(mode: str, daemon: Daemon) -> None:
    model, opt = _settled(mode, daemon)
    audit = HostSyncAudit("cuda")
    x = _batch(100)
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with audit:
                    _iteration(model, opt, x)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        others = [
            f"{w.filename}:{w.lineno}" for w in syncs if not _in_finite_check(w.filename, w.lineno)
        ]
        assert others == [], others
        audited = [s for s in audit.sites if not _site_in_finite_check(s)]
        assert audited == [], audit.report()
    finally:
        opt.close()


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_a_quiet_step_runs_under_sync_debug_mode_error(mode: str, daemon: Daemon) -> None:
    model, opt = _settled(mode, daemon)
    x = _batch(101)
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            _iteration(model, opt, x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        opt.close()


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_the_host_runs_ahead_of_the_device_through_a_quiet_step(mode: str, daemon: Daemon) -> None:
    model, opt = _settled(mode, daemon)
    try:
        model(_batch(102)).square().mean().backward()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - start
        still_busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert still_busy, f"step() returned after the queued kernel finished ({elapsed:.3f} s)"
    finally:
        opt.close()


def _spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return (a @ a.T / n + torch.eye(n, dtype=torch.float64)).float()


def _root(matrix: torch.Tensor) -> np.ndarray:
    lam, vec = torch.linalg.eigh(matrix.double())
    return ((vec * lam.clamp_min(0).add(1e-12).pow(-0.25)) @ vec.T).numpy()


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_a_snapshot_holds_the_factor_as_it_was_when_taken(mode: str, daemon: Daemon) -> None:
    """GPU -> host: the main stream is busy (a queued sleep), the snapshot is asked for, and
    the factor is changed on the main stream right after: the root must be the old one's."""
    if mode == "embedded":
        source: Any = EmbeddedSource(EngineConfig(num_workers=1, calibrate=False))
    else:
        config = DaemonClientConfig(shared_memory=mode == "daemon-shm")
        source = DaemonSource(daemon.target, config=config)
    try:
        for version in (1, 2):  # the first snapshot, then one into the block's segment
            old = _spd(256, version)
            factor = old.to(CUDA)
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            source.submit(
                PreconditionerRequest(
                    block="race", version=version, kind=SolveKind.INVERSE_ROOT, matrix=factor
                )
            )
            factor.mul_(3.0).add_(1.0)  # after the snapshot, in stream order
            result = source.wait("race", version, WAIT_S)
            assert result is not None and result.version == version
            np.testing.assert_allclose(
                result.matrix.double().cpu().numpy(), _root(old), rtol=2e-3, atol=1e-5
            )
    finally:
        source.close()


def test_results_staged_in_one_pinned_buffer_are_not_overwritten_in_flight() -> None:
    """Host -> GPU: eight results through one staging key, back to back, with the main stream
    busy; each device copy must hold its own value."""
    transfer = DeviceTransfer()
    n = 2048
    torch.cuda._sleep(SLEEP_CYCLES // 4)
    outs = [
        transfer.to_device(np.full((n, n), float(v), dtype=np.float32), CUDA, key="blk/matrix")
        for v in range(8)
    ]
    firsts = torch.stack([o.min() for o in outs] + [o.max() for o in outs]).cpu().tolist()
    assert firsts == [float(v) for v in range(8)] * 2
    assert transfer.stats()["pinned_buffers"] == 1


def test_close_waits_for_a_snapshot_copy_in_flight(daemon: Daemon) -> None:
    """A snapshot's copy into pinned memory is queued behind a long kernel; close() right
    after must wait for it before the source lets its buffers and segments go."""
    source = DaemonSource(daemon.target)
    factor = _spd(512, 0).to(CUDA)
    request = PreconditionerRequest(
        block="c", version=1, kind=SolveKind.INVERSE_ROOT, matrix=factor
    )
    source.submit(request)
    assert source.wait("c", 1, WAIT_S) is not None
    deadline = time.monotonic() + WAIT_S
    while len(source.segments()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    torch.cuda._sleep(SLEEP_CYCLES)
    source.submit(
        PreconditionerRequest(block="c", version=2, kind=SolveKind.INVERSE_ROOT, matrix=factor)
    )
    source.close()
    side = list(source._transfer._streams.values())
    assert side and all(s.query() for s in side), "close() returned with a copy in flight"
    torch.cuda.synchronize()  # and no CUDA error surfaced from a copy into freed memory


@pytest.mark.parametrize("mode", ("native", *ASYNC_MODES))
def test_a_bf16_model_trains(mode: str, daemon: Daemon) -> None:
    model = _model(torch.bfloat16)
    opt = _optimizer(mode, model, daemon, precondition_frequency=2, staleness_budget=1)
    target = torch.nn.Linear(64, 64, bias=False).to(device=CUDA, dtype=torch.bfloat16)
    losses = []
    try:
        for step in range(16):
            x = _batch(step % 4, torch.bfloat16)
            loss = (model(x) - target(x).detach()).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    finally:
        opt.close()
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    assert all(
        p.dtype is torch.bfloat16 and bool(torch.isfinite(p).all()) for p in model.parameters()
    )


def _native_step_syncs(layers: int) -> list[tuple[int, int]]:
    """(eigh syncs, other syncs) of each of SOAP native's first four steps (f = 3: step 1
    solves the first bases by eigh, step 4 refreshes them by QR), as the CUDA runtime sees
    them (``set_sync_debug_mode("warn")``), on ``layers`` 64x64 layers."""
    import linecache

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(layers)]).to(
        CUDA
    )
    opt = SOAP(model.parameters(), mode="native", precondition_frequency=3)
    out = []
    try:
        for step in range(4):
            x = _batch(step)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _iteration(model, opt, x)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
            eighs = sum("linalg.eigh" in linecache.getline(w.filename, w.lineno) for w in syncs)
            out.append((eighs, len(syncs) - eighs))
    finally:
        opt.close()
    return out


def test_native_busy_steps_sync_once_per_eigh_batch_and_once_for_the_checks() -> None:
    """Native mode's solver checks are read once per step (runtime/linalg.py's deferred
    checks), and its eighs are batched per shape; torch.linalg.eigh waits for the device once
    per call (ATen reads its info on the host), which the CPU audit counts for that reason. At
    2 and 6 blocks, all 64x64: the QR refresh step's syncs and the eigh step's other syncs stay
    the same, and the eigh step makes one eigh sync (if this fails with 0, eigh no longer
    syncs: update the audit)."""
    small, large = _native_step_syncs(2), _native_step_syncs(6)
    assert small[3] == large[3], (small, large)  # QR refresh: no eigh, nothing per block
    assert small[3][0] == 0, small
    assert small[0][1] == large[0][1], (small, large)  # first bases: the checks, once
    assert (small[0][0], large[0][0]) == (1, 1), (small, large)  # one batch of one shape


@pytest.mark.parametrize("n", [16, 33, 64, 128])
def test_a_batched_eigh_on_cuda_keeps_the_bits_of_single_calls(n: int) -> None:
    """``linalg.batched_eigh`` on the GPU batches only even orders above 32 (a batch of order
    <= 32 would go to cuSOLVER's Jacobi solver), which ATen solves by syevd per matrix, as it
    solves a single one: every matrix's values and vectors are a single call's, bit for bit
    (if this fails for 64 or 128 only, cuSOLVER rounds by alignment as MKL does for odd
    orders: batch those alone too)."""
    from asteria_client.runtime import linalg

    gen = torch.Generator().manual_seed(n)
    matrices = []
    for _ in range(5):
        g = torch.randn(n, n // 2, generator=gen, dtype=torch.float64)
        matrices.append((g @ g.T / n).to(CUDA))  # rank-deficient, as first factors are
    for a, pair in zip(matrices, linalg.batched_eigh(matrices), strict=True):
        assert pair is not None
        values, vectors = torch.linalg.eigh(a)
        assert torch.equal(pair[0], values) and torch.equal(pair[1], vectors)
