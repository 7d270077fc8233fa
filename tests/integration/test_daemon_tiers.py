"""Result tiers on a real daemon (issue 10, item 3): results beyond ``--cache-memory-bytes`` go
to ``--spill-dir`` (checksummed files, brought back on demand) or, without one, are dropped and
their client resubmits; a job's blocks are forgotten on request (``CloseSession(forget_blocks)``,
``asteria forget --job``); a restarted daemon removes the spill files it does not know.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import numpy as np
import torch

from asteria_client.cli import main as asteria_main
from asteria_client.runtime.source import PreconditionerRequest
from asteria_client.transport.connection import DaemonClientConfig
from asteria_client.transport.daemon import DaemonSource
from asteria_server.engine import SolveKind, SolveTask, SubmitOutcome, solve
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from tests.integration.test_daemon import (
    CALL_TIMEOUT_S,
    receive,
    spd,
    start_daemon,
    stop_daemon,
    submit,
)

N = 64
#: one n=64 eigenbasis result is 64*64*4 + 64*4 = 16640 bytes: the host tier holds two.
CACHE_BYTES = 40_000


def _session(stub: object, job: str) -> str:
    reply = stub.OpenSession(pb.OpenSessionRequest(job=job), timeout=CALL_TIMEOUT_S)  # type: ignore[attr-defined]
    return str(reply.session_id)


def _status(stub: object, session: str) -> pb.StatusResponse:
    return stub.Status(pb.StatusRequest(session_id=session), timeout=CALL_TIMEOUT_S)  # type: ignore[attr-defined,no-any-return]


def _wait_computed(stub: object, session: str, blocks: list[str]) -> pb.StatusResponse:
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        reply = _status(stub, session)
        versions = {b.block: b.version for b in reply.blocks}
        if all(versions.get(b, -1) >= 1 for b in blocks):
            return reply
        time.sleep(0.05)
    raise AssertionError(f"not all of {blocks} were computed: {versions}")


def _task(block: str, seed: int) -> SolveTask:
    return SolveTask(block=block, version=1, kind=SolveKind.EIGENBASIS, matrix=spd(N, seed))


def _spill_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".res"))


def test_results_spill_come_back_verified_are_forgotten_and_stale_files_removed(
    tmp_path: Path,
) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    (spill / "asteria-spill-0123-1.res").write_bytes(b"left by a daemon that died")
    (spill / "notes.txt").write_text("not a spill file")
    daemon = start_daemon(
        tmp_path, "--cache-memory-bytes", str(CACHE_BYTES), "--spill-dir", str(spill)
    )
    try:
        assert _spill_files(spill) == []  # the old incarnation's file is gone
        assert (spill / "notes.txt").exists()
        stub = daemon.stub()
        sessions = {"j1": _session(stub, "j1"), "j2": _session(stub, "j2")}
        tasks = {f"b{i}": _task(f"b{i}", i) for i in range(6)}
        for i, (name, task) in enumerate(tasks.items()):
            assert submit(stub, sessions["j1" if i < 3 else "j2"], task) is SubmitOutcome.QUEUED
            _wait_computed(stub, sessions["j1"], [name])  # one at a time: a known LRU order
        reply = _status(stub, sessions["j1"])
        tiers = {b.block: b.tier for b in reply.blocks}
        assert tiers == {"b0": "spill", "b1": "spill", "b2": "spill", "b3": "spill"} | {
            "b4": "host",
            "b5": "host",
        }
        engine = reply.engine
        assert engine.cache_budget_bytes == CACHE_BYTES
        assert 0 < engine.cache_host_bytes <= CACHE_BYTES
        assert engine.results_spilled == 4 == len(_spill_files(spill))
        assert engine.spill_bytes == sum((spill / f).stat().st_size for f in _spill_files(spill))

        # A new session asks for everything: spilled results come back, equal to a fresh solve.
        got = receive(stub, _session(stub, "reader"), list(tasks))
        for name, task in tasks.items():
            want = solve(task)
            assert np.allclose(np.abs(got[name].matrix), np.abs(want.matrix), atol=1e-4), name
            assert np.allclose(got[name].eigenvalues, want.eigenvalues, rtol=1e-4), name
        reply = _status(stub, sessions["j1"])
        assert reply.engine.cache_host_bytes <= CACHE_BYTES  # the budget holds after it
        assert len(_spill_files(spill)) == reply.engine.results_spilled

        # A spill file that fails its checksum is dropped, never sent; the version may come again.
        spilled = [b.block for b in reply.blocks if b.tier == "spill"]
        victim = spilled[0]
        for name in _spill_files(spill):
            path = spill / name
            data = bytearray(path.read_bytes())
            data[-3] ^= 0xFF
            path.write_bytes(bytes(data))
        stream = stub.StreamResults(
            pb.StreamResultsRequest(session_id=_session(stub, "r2"), blocks=[victim]),
            timeout=3.0,
        )
        try:
            delivered = list(stream)
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            delivered = []
        assert not [m for m in delivered if m.HasField("header")]
        reply = _status(stub, sessions["j1"])
        assert reply.engine.results_dropped >= 1
        assert {b.block: b.tier for b in reply.blocks}[victim] == ""
        job = "j1" if victim in ("b0", "b1", "b2") else "j2"
        assert submit(stub, sessions[job], tasks[victim]) is SubmitOutcome.QUEUED
        _wait_computed(stub, sessions["j1"], [victim])

        # Forget job j1 (the CLI): its blocks and spill files go, j2's stay.
        code = asteria_main(["forget", "--address", daemon.target, "--job", "j1"])
        assert code == 0
        reply = _status(stub, sessions["j2"])
        assert sorted(b.block for b in reply.blocks) == ["b3", "b4", "b5"]
        assert len(_spill_files(spill)) == reply.engine.results_spilled
        # and CloseSession(forget_blocks=true) does the same for the session's own job
        stub.CloseSession(
            pb.CloseSessionRequest(session_id=sessions["j2"], forget_blocks=True),
            timeout=CALL_TIMEOUT_S,
        )
        reply = _status(stub, _session(stub, "j3"))
        assert list(reply.blocks) == [] and _spill_files(spill) == []

        # Spill files of a daemon killed outright are removed by the next one.
        session = _session(stub, "j4")
        for task in tasks.values():
            submit(stub, session, task)
        _wait_computed(stub, session, list(tasks))
        assert len(_spill_files(spill)) >= 3
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(timeout=30)
    finally:
        if daemon.proc.poll() is None:
            stop_daemon(daemon)
    again = start_daemon(
        tmp_path, "--cache-memory-bytes", str(CACHE_BYTES), "--spill-dir", str(spill), name="e"
    )
    try:
        assert _spill_files(spill) == [] and (spill / "notes.txt").exists()
    finally:
        stop_daemon(again)


def _spd_tensor(seed: int) -> torch.Tensor:
    return torch.from_numpy(spd(N, seed)).float()


def test_without_a_spill_dir_dropped_results_are_resubmitted_by_a_restarted_trainer(
    tmp_path: Path,
) -> None:
    daemon = start_daemon(tmp_path, "--cache-memory-bytes", str(CACHE_BYTES))
    config = DaemonClientConfig(connect_timeout_s=30.0, shared_memory=False)  # private results
    names = [f"w{i}" for i in range(6)]
    try:
        first = DaemonSource(daemon.target, job="run", config=config)
        try:
            # One block at a time: each result reaches the client before the next one evicts
            # it (a result the stream has not sent yet can be dropped under a budget this small;
            # see the issue 10 note).
            for i, name in enumerate(names):
                first.submit(
                    PreconditionerRequest(
                        block=name, version=5, kind=SolveKind.EIGENBASIS, matrix=_spd_tensor(i)
                    )
                )
                assert first.wait(name, 5, timeout_s=60.0) is not None, name
        finally:
            first.close()
        stats, _ = _status_of(daemon.target)
        assert stats.results_dropped >= 3  # only two fit the host tier; no spill dir

        # The trainer restarts from its checkpoint at step 5: it submits the same versions, the
        # daemon accepts those whose results it dropped, and every block gets its result.
        second = DaemonSource(daemon.target, job="run", config=config)
        try:
            for i, name in enumerate(names):
                second.submit(
                    PreconditionerRequest(
                        block=name, version=5, kind=SolveKind.EIGENBASIS, matrix=_spd_tensor(i)
                    )
                )
                result = second.wait(name, 5, timeout_s=60.0)
                assert result is not None and result.version == 5, name
                assert torch.isfinite(result.matrix).all()
        finally:
            second.close()
    finally:
        stop_daemon(daemon)


def _status_of(target: str) -> tuple[pb.EngineStats, list[pb.BlockStatus]]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.PreconditionerStub(channel)
        reply = stub.Status(pb.StatusRequest(session_id=_session(stub, "probe")), timeout=10.0)
    return reply.engine, list(reply.blocks)
