"""An idle daemon idles: open result streams cost no CPU, because results are pushed to them.

Before results were pushed, every StreamResults call woke every 20 ms to poll the engine, so 500
idle streams kept the daemon busy; this test failed then. It measures the daemon process's own
CPU time (all its threads: event loop, gRPC, handover, dispatcher) from /proc, not wall time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import numpy as np

from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc
from asteria_server.types import SolveKind, SolveTask, SubmitOutcome
from tests.integration.test_daemon import (
    open_session,
    receive,
    spd,
    start_daemon,
    stop_daemon,
    submit,
)

NUM_STREAMS = 500
STREAMS_PER_CHANNEL = 50
MEASURE_S = 5.0
MAX_CORE_SHARE = 0.05


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (every thread of it), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5), after "pid (comm)"
    return ticks / os.sysconf("SC_CLK_TCK")


def test_500_idle_result_streams_cost_the_daemon_almost_no_cpu(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    channels: list[grpc.Channel] = []
    calls = []
    try:
        stub = daemon.stub()
        session = open_session(stub)
        for _ in range(NUM_STREAMS // STREAMS_PER_CHANNEL):
            channel = grpc.insecure_channel(daemon.target)
            channels.append(channel)
            idle = pb_grpc.PreconditionerStub(channel)
            request = pb.StreamResultsRequest(session_id=session, blocks=["never-submitted"])
            calls += [idle.StreamResults(request) for _ in range(STREAMS_PER_CHANNEL)]
        time.sleep(1.0)  # let every stream reach its wait
        assert all(call.is_active() for call in calls)

        before, started = cpu_seconds(daemon.proc.pid), time.monotonic()
        time.sleep(MEASURE_S)
        used, elapsed = cpu_seconds(daemon.proc.pid) - before, time.monotonic() - started
        assert used / elapsed < MAX_CORE_SHARE, (
            f"the daemon used {used:.2f} CPU-s in {elapsed:.1f} s with {NUM_STREAMS} idle streams"
        )

        # The streams are open, not stuck: another client still gets its result (pushed).
        other = open_session(stub)
        task = SolveTask(block="b", version=0, kind=SolveKind.INVERSE_ROOT, matrix=spd(16, 0))
        assert submit(stub, other, task) is SubmitOutcome.QUEUED
        result = receive(stub, other, ["b"])["b"]
        assert result.version == 0 and np.isfinite(result.matrix).all()
        assert all(call.is_active() for call in calls)
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
        stop_daemon(daemon)
