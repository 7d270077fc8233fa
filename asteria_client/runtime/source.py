"""Where an optimizer's inverse roots and eigenbases come from.

An optimizer never calls an eigensolver directly. It *submits* a snapshot of a block's factor
matrix, tagged with the optimizer step as its version, to a :class:`PreconditionerSource`, and
later *takes* whatever result is ready. The source decides where and when the work runs:

- :class:`NativeSource` computes synchronously inside ``submit`` with torch.linalg on the
  factor's own device. It is the baseline every benchmark compares against.
- the embedded engine and the daemon (later modules) compute asynchronously in other processes.

Because every result carries the version of the snapshot it came from, the optimizer can install
results from any source with the same rule: only a newer version replaces the one in use.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asteria_client.runtime import linalg
from asteria_client.runtime.transfer import DeviceTransfer, PendingCopy, StagedArrays
from asteria_server.errors import SolverError
from asteria_server.types import SolveKind, SolveResult


@dataclass(frozen=True, kw_only=True)
class PreconditionerRequest:
    """A factor snapshot of one block and what to compute from it.

    For ``EIGENBASIS``, ``basis`` is the basis the optimizer currently uses (``base_version``):
    the result is one QR power-iteration step from it, or a full eigendecomposition when None.
    ``deadline_step`` is the step at which the block would exceed its staleness budget; an
    asynchronous source schedules the earliest deadline first.

    A request the runtime has *staged* (``staged`` set) carries host tensors: ``matrix`` and
    ``basis`` are views of the pinned buffer that one batched copy of the step's snapshots
    fills (:meth:`~asteria_client.runtime.transfer.DeviceTransfer.pack`); ``staged`` holds
    their copies (the matrix's, then the basis's), valid once each ``wait()`` returned.
    ``device`` is then the factor's own device, where results go.
    """

    block: str
    version: int
    kind: SolveKind
    matrix: torch.Tensor
    exponent: float = 0.25
    epsilon: float = 1e-12
    basis: torch.Tensor | None = None
    base_version: int = -1
    deadline_step: int = 0
    staged: tuple[PendingCopy, ...] | None = None
    device: torch.device | None = None

    @property
    def factor_device(self) -> torch.device:
        """Where the block's factor lives (and its results are installed)."""
        return self.matrix.device if self.device is None else self.device


@dataclass(frozen=True, kw_only=True)
class PreconditionerResult:
    """A computed root (``INVERSE_ROOT``) or basis with eigenvalue estimates (``EIGENBASIS``)."""

    block: str
    version: int
    kind: SolveKind
    matrix: torch.Tensor
    eigenvalues: torch.Tensor | None = None
    permutation: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    base_version: int = -1
    solve_time_s: float = 0.0


@dataclass
class SourceRecord:
    """What a source knows about one block, for ``preconditioner_status()``."""

    submitted_version: int = -1
    computed_version: int = -1
    failures: int = 0
    consecutive_failures: int = 0
    last_solve_s: float = 0.0
    last_error: str = ""
    computed_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


#: Seconds per n^3 of an fp64 eigh on one core of this project's hosts (n=1024 in ~0.13 s).
DEFAULT_SECONDS_PER_N3 = 1.2e-10


class PreconditionerSource(abc.ABC):
    """The interface every source of roots and bases implements."""

    #: True when ``submit`` returns only after the result is ready (native, S = 0).
    synchronous: bool = False

    @abc.abstractmethod
    def submit(self, request: PreconditionerRequest) -> None:
        """Hand over a snapshot. Never raises for numerical failures: those are recorded."""

    @abc.abstractmethod
    def take(self, block: str) -> PreconditionerResult | None:
        """The newest ready result for ``block`` not yet taken, or None."""

    def wait(self, block: str, min_version: int, timeout_s: float) -> PreconditionerResult | None:
        """Wait up to ``timeout_s`` for a result with version >= ``min_version``."""
        result = self.take(block)
        return result if result is not None and result.version >= min_version else None

    def in_flight_version(self, block: str) -> int | None:
        """The version being computed (or queued) for ``block``, if any."""
        return None

    def snapshot_transfer(self) -> DeviceTransfer | None:
        """The transfer layer that takes this source's snapshots to the host, when the runtime
        should pack a step's snapshots into one copy for it (requests then come *staged*, see
        :class:`PreconditionerRequest`). None: each request is handed over as it is (native
        mode solves on the factor's own device)."""
        return None

    def reuses_bases(self) -> bool:
        """Whether an eigenbasis request may leave out a basis this source delivered itself:
        ``basis`` None with ``base_version`` >= 0 then asks for a QR refresh from the source's
        own result of that version (the engine keeps its newest result), or, where it no longer
        holds that version, a full eigendecomposition (the result's ``base_version`` -1). The
        basis then never travels back to the engine that produced it."""
        return False

    def plan_blocks(self, blocks: Mapping[str, int]) -> None:  # noqa: B027 - optional
        """The blocks (name -> n) the optimizer will submit, told once at its construction: a
        source that shares blocks among replicas assigns their owners from the whole set."""

    def chooses(self, block: str, n: int) -> bool:
        """Whether this rank chooses the continuous schedule's extra snapshots of ``block``
        (an n x n factor) for all its replicas: a source that shares blocks among replicas
        says so for the blocks it owns (the other replicas follow its versions), and every
        block of a source of one rank's own is its own."""
        return True

    def expect(self, request: PreconditionerRequest) -> None:  # noqa: B027 - optional
        """Another replica hands this snapshot over (``request`` names the block, version and
        device; its tensors are not read): count its result as in flight here."""

    def solves_on_this_host(self) -> bool:
        """Whether this source's solves run on the training process's own host (an engine in
        the process, a daemon on a Unix socket): for a model trained on that host's CPU they
        take cores from the step, so the continuous schedule charges an extra refresh's solve
        time to its overhead budget (``FreshnessRuntime``). False: they cost the step nothing
        (a remote daemon), or the source solves in the training thread itself (native)."""
        return False

    def credit(self) -> int | None:
        """How many more snapshots this source would start promptly (the continuous schedule
        copies no more): free solver workers plus one, less the snapshots already waiting for
        a worker; 0 while every worker is busy. None: no limit (results are ready at once)."""
        return None

    @abc.abstractmethod
    def record(self, block: str) -> SourceRecord:
        """Per-block bookkeeping for status reports: what this source holds itself, without
        a round trip to a daemon (its view of the block, failures in the daemon included, is
        in :meth:`records`)."""

    def records(self) -> dict[str, SourceRecord]:
        """Every block's record at once (one engine round trip for a whole status report)."""
        return {}

    def results_epoch(self) -> int | None:
        """A counter that grows when any result arrives, or None if the source cannot tell.

        Lets the optimizer's hooks skip scanning every block when nothing new arrived."""
        return None

    def results_since(self, epoch: int) -> list[str] | None:
        """The blocks whose newest result arrived after :meth:`results_epoch` read ``epoch``,
        or None if the source cannot tell (the runtime then scans every block). Lets a hook
        that sees one new result install that block's tile alone."""
        return None

    def stats(self) -> dict[str, Any]:
        """Source-wide counters for ``runtime_stats()`` (engine, connection, transfers)."""
        return {}

    def refused_reason(self) -> str | None:
        """Why this source refused the daemon it was given (the daemon runs as an unexpected
        user, transport.peer), while it does; None otherwise. Local fallbacks meanwhile are
        counted apart: a deployment mistake, not a slow daemon."""
        return None

    def seconds_per_n3(self) -> float:
        """The cost model's constant: one eigendecomposition of an n×n factor takes about
        ``seconds_per_n3() * n**3`` seconds on one core. Sources with a calibrated engine
        return its figure; the default is the one measured on this project's hosts."""
        return DEFAULT_SECONDS_PER_N3

    def pump(self) -> None:  # noqa: B027 - optional hook, a no-op for synchronous sources
        """Move finished transfers along (called from hooks and at each step). Optional."""

    def close(self) -> None:  # noqa: B027 - nothing to release for most sources
        """Release workers, connections and memory. Idempotent."""


def compute_locally(request: PreconditionerRequest) -> PreconditionerResult:
    """Run one request with torch.linalg on the matrix's device (raises SolverError)."""
    start = time.perf_counter()
    eigenvalues = permutation = rotation = None
    if request.kind is SolveKind.INVERSE_ROOT:
        matrix = linalg.inverse_root(
            request.matrix, request.exponent, request.epsilon, block=request.block
        )
    elif request.basis is None:
        result = linalg.eigenbasis(request.matrix, block=request.block)
        matrix, eigenvalues = result.basis, result.eigenvalues
    else:
        result = linalg.refresh_eigenbasis(request.matrix, request.basis, block=request.block)
        matrix, eigenvalues, permutation = result.basis, result.eigenvalues, result.permutation
        rotation = result.rotation
    return _result(request, matrix, eigenvalues, permutation, rotation, start)


def _result(
    request: PreconditionerRequest,
    matrix: torch.Tensor,
    eigenvalues: torch.Tensor | None,
    permutation: torch.Tensor | None,
    rotation: torch.Tensor | None,
    start: float,
) -> PreconditionerResult:
    """The result of a solve of ``request`` that began at ``start`` (perf_counter)."""
    return PreconditionerResult(
        block=request.block,
        version=request.version,
        kind=request.kind,
        matrix=matrix,
        eigenvalues=eigenvalues,
        permutation=permutation,
        rotation=rotation,
        base_version=request.base_version,
        solve_time_s=time.perf_counter() - start,
    )


def compute_unchecked(request: PreconditionerRequest) -> tuple[PreconditionerResult, torch.Tensor]:
    """:func:`compute_locally` with its checks left on the device: the result and a flag that
    is True where the checked path would return this very result (see the deferred checks in
    :mod:`.linalg`). Raises (SolverError, RuntimeError) only for what the host sees anyway:
    :func:`compute_locally` then says what went wrong."""
    start = time.perf_counter()
    eigenvalues = permutation = rotation = None
    if request.kind is SolveKind.INVERSE_ROOT:
        matrix, ok = linalg.inverse_root_unchecked(
            request.matrix, request.exponent, request.epsilon
        )
    elif request.basis is None:
        result, ok = linalg.eigenbasis_unchecked(request.matrix)
        matrix, eigenvalues = result.basis, result.eigenvalues
    else:
        result, ok = linalg.refresh_eigenbasis_unchecked(request.matrix, request.basis)
        matrix, eigenvalues, permutation = result.basis, result.eigenvalues, result.permutation
        rotation = result.rotation
    return _result(request, matrix, eigenvalues, permutation, rotation, start), ok


def _needs_eigh(request: PreconditionerRequest) -> bool:
    return request.kind is SolveKind.INVERSE_ROOT or request.basis is None


def compute_unchecked_many(
    requests: Sequence[PreconditionerRequest],
) -> list[tuple[PreconditionerResult, torch.Tensor] | None]:
    """:func:`compute_unchecked` of each request, with the eighs of those that need one
    (inverse roots, first eigenbases) batched by :func:`.linalg.batched_eigh`: one host wait
    per group of equal shape on a GPU, not one per block. None where the host saw a failure
    (the caller solves that request checked, as after :func:`compute_unchecked` raising). A
    result's ``solve_time_s`` is its share of its batch's time plus its own."""
    out: list[tuple[PreconditionerResult, torch.Tensor] | None] = [None] * len(requests)
    start = time.perf_counter()
    prepared: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for i, request in enumerate(requests):
        if not _needs_eigh(request):
            continue
        try:
            a, ok = linalg.symmetrized(request.matrix)
        except SolverError:
            continue
        prepared.append((i, a, ok))
    eighs = linalg.batched_eigh([a for _, a, _ in prepared])
    share = (time.perf_counter() - start) / max(1, len(prepared))
    for (i, _, ok), eigh in zip(prepared, eighs, strict=True):
        if eigh is None:
            continue
        request = requests[i]
        begun = time.perf_counter() - share
        if request.kind is SolveKind.INVERSE_ROOT:
            matrix, ok = linalg.inverse_root_from_eigh(
                request.matrix, ok, *eigh, request.exponent, request.epsilon
            )
            out[i] = _result(request, matrix, None, None, None, begun), ok
        else:
            basis, ok = linalg.eigenbasis_from_eigh(request.matrix, ok, *eigh)
            out[i] = _result(request, basis.basis, basis.eigenvalues, None, None, begun), ok
    for i, request in enumerate(requests):
        if _needs_eigh(request):
            continue
        try:
            out[i] = compute_unchecked(request)
        except (SolverError, RuntimeError):
            continue
    return out


class NativeSource(PreconditionerSource):
    """Synchronous torch.linalg on the parameter's device: results are ready at the next take.

    The blocks submitted since the last ``take`` (or status read) are solved there, together
    (:func:`compute_unchecked_many`: one batched eigh per shape of even order, so a GPU waits
    once per shape, not once per block), and their checks stay on the device until one host
    read of every flag. A block whose flag says a check failed, or whose solve the host saw
    fail, is solved again by the checked path (:func:`compute_locally`), which raises the
    SolverError that is recorded, or finds the epsilon retry that succeeds. Results, failures
    and messages are those of solving each block checked, bitwise: a batch is made only where
    it rounds as single calls (:func:`.linalg.batched_eigh`). A request's tensors are the
    optimizer's own factor and basis, so they must not change between its ``submit`` and the
    next ``take`` (the runtime takes a step's results before it installs any, and the
    optimizer updates factors only before it submits them).
    """

    synchronous = True

    def __init__(self) -> None:
        self._ready: dict[str, PreconditionerResult] = {}
        self._records: dict[str, SourceRecord] = {}
        #: submitted, not yet solved, in submit order
        self._to_solve: list[PreconditionerRequest] = []

    def submit(self, request: PreconditionerRequest) -> None:
        rec = self._records.setdefault(request.block, SourceRecord())
        rec.submitted_version = max(rec.submitted_version, request.version)
        self._to_solve.append(request)

    def _settle(self) -> None:
        """Solve every block submitted since the last call, read their flags (one host read),
        and solve again, checked, those that failed."""
        queued, self._to_solve = self._to_solve, []
        if not queued:
            return
        solved = compute_unchecked_many(queued)
        flags = [pair[1] for pair in solved if pair is not None]
        passed = iter(linalg.read_flags(flags))
        for request, pair in zip(queued, solved, strict=True):
            if pair is not None and next(passed):
                self._accept(pair[0])
            else:
                self._solve_checked(request)

    def _solve_checked(self, request: PreconditionerRequest) -> None:
        try:
            result = compute_locally(request)
        except SolverError as exc:
            rec = self._records[request.block]
            rec.failures += 1
            rec.consecutive_failures += 1
            rec.last_error = str(exc)
            return
        self._accept(result)

    def _accept(self, result: PreconditionerResult) -> None:
        rec = self._records[result.block]
        rec.consecutive_failures = 0
        rec.last_solve_s = result.solve_time_s
        rec.computed_version = max(rec.computed_version, result.version)
        rec.computed_at = time.monotonic()
        current = self._ready.get(result.block)
        if current is None or result.version > current.version:
            self._ready[result.block] = result

    def take(self, block: str) -> PreconditionerResult | None:
        self._settle()
        return self._ready.pop(block, None)

    def record(self, block: str) -> SourceRecord:
        self._settle()
        return self._records.setdefault(block, SourceRecord())

    def records(self) -> dict[str, SourceRecord]:
        self._settle()
        return dict(self._records)

    def close(self) -> None:
        self._to_solve = []


def result_from_engine(
    result: SolveResult,
    device: torch.device,
    transfer: DeviceTransfer,
    *,
    block: str | None = None,
    staged: StagedArrays | None = None,
) -> PreconditionerResult:
    """An engine's NumPy result as the optimizer's torch result on ``device``.

    ``staged``: the result's arrays (:func:`result_fields`) as the thread that received it
    staged them (:meth:`DeviceTransfer.stage`): one host-to-device copy. Without it they are
    staged here, on this thread. ``block`` overrides the name (a transport's namespace
    removed).
    """
    name = result.block if block is None else block
    if staged is None:
        staged = transfer.stage_arrays(result_fields(result), device)
    matrix, eigenvalues, permutation, rotation = transfer.staged_to_device(
        staged, device, name=name
    )
    assert matrix is not None
    return PreconditionerResult(
        block=name,
        version=result.version,
        kind=result.kind,
        matrix=matrix,
        eigenvalues=eigenvalues,
        permutation=permutation,
        rotation=rotation,
        base_version=result.base_version,
        solve_time_s=result.solve_time_s,
    )


def result_fields(result: SolveResult) -> list[np.ndarray | None]:
    """A result's arrays in ``RESULT_FIELDS`` order (matrix, eigenvalues, permutation,
    rotation), the permutation as int64, the dtype the optimizer indexes with."""
    permutation = result.permutation
    if permutation is not None:
        permutation = permutation.astype(np.int64, copy=False)
    return [result.matrix, result.eigenvalues, permutation, result.rotation]
