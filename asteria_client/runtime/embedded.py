"""The embedded source: Asteria's engine inside the training process, solves in worker processes.

``submit`` takes the factor's host copy (packed with the step's other snapshots by the runtime,
off the main stream on CUDA), hands it to the engine once the copy is done and returns at once;
the engine's worker processes compute with SciPy/LAPACK (which holds the GIL, so never in a
thread of this process). ``take`` picks up finished results and brings them to the factor's
device (one staging copy, one host-to-device copy). Anything the engine raises is contained
here: a dead engine means no new results, which the optimizer's staleness budget turns into a
local fallback — never a crash.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from asteria_client.runtime.source import (
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
    SourceRecord,
    result_fields,
    result_from_engine,
)
from asteria_client.runtime.transfer import DeviceTransfer, PendingCopy, StagedArrays
from asteria_server.engine import (
    EighSolver,
    EngineConfig,
    PreconditionerEngine,
    SolverConfig,
    SolveResult,
    SolveTask,
)
from asteria_server.engine.workers import default_num_workers
from asteria_server.errors import AsteriaError

# The engine's public entry, for the rest of the client: this module is the one that imports the
# engine (and with it SciPy), so callers import these from here, inside the function that needs
# them, and ``import asteria_client`` stays free of SciPy.
__all__ = ["EighSolver", "EmbeddedSource", "EngineConfig", "SolverConfig", "default_num_workers"]

logger = logging.getLogger(__name__)


@dataclass
class _PendingSubmit:
    request: PreconditionerRequest
    matrix: PendingCopy
    basis: PendingCopy | None


class EmbeddedSource(PreconditionerSource):
    """Results from an in-process :class:`PreconditionerEngine` (see the module docstring)."""

    synchronous = False

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        tenant: str = "local",
        transfer: DeviceTransfer | None = None,
    ) -> None:
        self.tenant = tenant
        self._engine = PreconditionerEngine(config)
        self._transfer = DeviceTransfer() if transfer is None else transfer
        self._devices: dict[str, torch.device] = {}
        #: snapshots whose host copy may still be in flight; the training thread adds to it,
        #: and it and a DDP exchange thread (through ``take``) move it on: under ``_lock``
        self._pending: list[_PendingSubmit] = []
        #: taken from ``_pending`` by a thread that is handing them to the engine now: still
        #: in flight for ``in_flight_version`` (else a DDP exchange could see a gap and give
        #: the version up)
        self._handing: list[_PendingSubmit] = []
        self._lock = threading.Lock()
        self._submit_errors = 0
        self._refused: dict[str, str] = {}  # block -> why its last refused snapshot was refused
        self._closed = False
        #: results bound for a device are staged in pinned memory as they arrive, by a thread
        #: of this source (the engine tells it), so ``take`` only issues the host-to-device
        #: copy: block -> (version, staging), and the blocks told about, not staged yet
        self._staged: dict[str, tuple[int, StagedArrays]] = {}
        self._taken: dict[str, int] = {}  # block -> newest version taken (never staged again)
        self._to_stage: set[str] = set()
        self._stage_cond = threading.Condition()
        self._stager: threading.Thread | None = None
        self._engine.add_result_listener(self._result_arrived)

    @property
    def engine(self) -> PreconditionerEngine:
        return self._engine

    # ------------------------------------------------------------------ snapshots in
    def submit(self, request: PreconditionerRequest) -> None:
        self._devices[request.block] = request.factor_device
        staged = request.staged
        if staged is None:  # a caller's own request: packed here, as the runtime packs its own
            tensors = [request.matrix] if request.basis is None else [request.matrix, request.basis]
            staged = tuple(self._transfer.pack(tensors))
        item = _PendingSubmit(request, staged[0], staged[1] if len(staged) > 1 else None)
        with self._lock:
            self._pending.append(item)
        self.pump()

    def snapshot_transfer(self) -> DeviceTransfer:
        return self._transfer

    def reuses_bases(self) -> bool:
        return True  # the engine refreshes from its own newest result (engine.submit)

    def seconds_per_n3(self) -> float:
        return self._engine.stats().seconds_per_n3  # calibrated when the engine started

    def results_epoch(self) -> int | None:
        return self._engine.results_epoch

    def results_since(self, epoch: int) -> list[str] | None:
        return self._engine.blocks_with_results_since(epoch, self.tenant)

    def solves_on_this_host(self) -> bool:
        return True

    def credit(self) -> int | None:
        """Idle workers + 1 - snapshots queued in the engine or still being copied; 0 while
        every worker is busy (or the engine is closed)."""
        try:
            idle, queued = self._engine.capacity(self.tenant)  # two counts, no stats snapshot
        except AsteriaError:
            return 0
        if idle <= 0:
            return 0
        with self._lock:
            waiting = len(self._pending) + len(self._handing)
        return max(0, idle + 1 - queued - waiting)

    def pump(self) -> None:
        """Hand every snapshot whose host copy is complete to the engine (each once, whichever
        thread gets it; the hand-over itself runs without the lock)."""
        with self._lock:
            if not self._pending:
                return
            ready: list[_PendingSubmit] = []
            still_pending: list[_PendingSubmit] = []
            for item in self._pending:
                done = item.matrix.ready() and (item.basis is None or item.basis.ready())
                (ready if done else still_pending).append(item)
            self._pending = still_pending
            self._handing.extend(ready)
        for item in ready:
            try:
                self._hand_over(item)
            finally:
                with self._lock:
                    self._handing.remove(item)

    def _hand_over(self, item: _PendingSubmit) -> None:
        req = item.request
        item.matrix.wait()  # ready: returns at once
        if item.basis is not None:
            item.basis.wait()
        try:
            task = SolveTask(
                block=req.block,
                version=req.version,
                kind=req.kind,
                matrix=item.matrix.host.numpy(),
                exponent=req.exponent,
                epsilon=req.epsilon,
                basis=None if item.basis is None else item.basis.host.numpy(),
                base_version=req.base_version,
                deadline=float(req.deadline_step),
                tenant=self.tenant,
            )
            self._engine.submit(task)
        except AsteriaError as exc:
            self._refused[req.block] = str(exc)
            self._submit_errors += 1
            if self._submit_errors == 1 or self._submit_errors % 1000 == 0:
                logger.warning(
                    "embedded engine refused a snapshot (%d so far): %s", self._submit_errors, exc
                )

    def _flush(self, block: str) -> None:
        """Complete the pending copies of ``block`` now (the caller is about to wait for it)."""
        with self._lock:
            mine = [item for item in self._pending if item.request.block == block]
        for item in mine:
            item.matrix.wait()
            if item.basis is not None:
                item.basis.wait()
        self.pump()

    # ------------------------------------------------------------------ results out
    def _result_arrived(self, tenant: str, block: str, version: int | None) -> None:
        """The engine's listener (its dispatcher thread: quick, no copy here): a result bound
        for a device is queued for the staging thread."""
        device = self._devices.get(block)
        if tenant != self.tenant or device is None or not self._transfer.to_accelerator(device):
            return
        with self._stage_cond:
            if self._closed:
                return
            self._to_stage.add(block)
            if self._stager is None:
                self._stager = threading.Thread(
                    target=self._stage_loop, name="asteria-embedded-staging", daemon=True
                )
                self._stager.start()
            self._stage_cond.notify()

    def _stage_loop(self) -> None:
        """Copy each newly arrived result once into pinned staging (this thread pays the host
        copy, never the training thread)."""
        while True:
            with self._stage_cond:
                while not self._to_stage and not self._closed:
                    self._stage_cond.wait()
                if self._closed:
                    return
                block = self._to_stage.pop()
            try:
                result = self._engine.peek_result(block, self.tenant)
            except AsteriaError:
                continue
            if result is None:
                continue
            with self._stage_cond:
                held = self._staged.get(block)
                newest = max(held[0] if held else -1, self._taken.get(block, -1))
            if newest >= result.version:
                continue  # staged already, or taken (and staged by take) meanwhile
            device = self._devices.get(block, torch.device("cpu"))
            staged = self._transfer.stage_arrays(result_fields(result), device)
            with self._stage_cond:
                held = self._staged.get(block)
                if held is None or held[0] < result.version:
                    self._staged[block] = (result.version, staged)

    def _to_torch(self, result: SolveResult | None) -> PreconditionerResult | None:
        if result is None:
            return None
        device = self._devices.get(result.block, torch.device("cpu"))
        with self._stage_cond:
            held = self._staged.pop(result.block, None)
            self._taken[result.block] = max(self._taken.get(result.block, -1), result.version)
        staged = held[1] if held is not None and held[0] == result.version else None
        return result_from_engine(result, device, self._transfer, staged=staged)

    def take(self, block: str) -> PreconditionerResult | None:
        self.pump()
        try:
            return self._to_torch(self._engine.take_result(block, self.tenant))
        except AsteriaError:
            return None

    def wait(self, block: str, min_version: int, timeout_s: float) -> PreconditionerResult | None:
        self._flush(block)
        try:
            result = self._engine.wait_result(block, min_version, timeout_s, self.tenant)
        except AsteriaError:
            return None
        return self._to_torch(result)

    def in_flight_version(self, block: str) -> int | None:
        with self._lock:
            items = self._pending + self._handing
            pending = [i.request.version for i in items if i.request.block == block]
        try:
            engine_version = self._engine.in_flight_version(block, self.tenant)
        except AsteriaError:
            engine_version = None
        versions = pending + ([engine_version] if engine_version is not None else [])
        return max(versions) if versions else None

    # ------------------------------------------------------------------ status
    def records(self) -> dict[str, SourceRecord]:
        out = {}
        for status in self._engine.status(self.tenant):
            out[status.block] = SourceRecord(
                submitted_version=status.submitted_version,
                computed_version=status.version,
                failures=status.failures,
                consecutive_failures=status.consecutive_failures,
                last_solve_s=status.last_solve_s or 0.0,
                last_error=status.last_error or self._refused.get(status.block, ""),
                extra={
                    "state": status.state.value,
                    "queue_position": status.queue_position,
                    "in_flight_version": status.in_flight_version,
                    "age_s": status.age_s,
                },
            )
        for block, error in self._refused.items():  # refused before the engine ever saw it
            out.setdefault(block, SourceRecord(last_error=error))
        return out

    def record(self, block: str) -> SourceRecord:
        return self.records().get(block, SourceRecord())

    def stats(self) -> dict[str, Any]:
        stats = self._engine.stats().to_dict()
        stats["submit_errors"] = self._submit_errors
        stats["transfer"] = self._transfer.stats()
        return stats

    def close(self) -> None:
        if not self._closed:
            with self._stage_cond:
                self._closed = True
                self._stage_cond.notify_all()
            if self._stager is not None:
                self._stager.join(timeout=5.0)
            self._engine.remove_result_listener(self._result_arrived)
            self._transfer.drain()  # no copy lands in a buffer after its source let it go
            self._engine.close()
