"""Streams are woken once per burst of results, and miss none of them.

The daemon's dispatcher thread tells the event loop about each newer result; while a wake of a
tenant's streams is already due, further news needs no second one (the wake runs after the
news was booked, so it sees it). Checked with a real daemon: results that finish in a burst,
for many blocks, reach every open stream of the tenant, each block at its newest version.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc

from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.types import SolveKind, SolveResult, SolveTask
from tests.integration.test_daemon import (
    CALL_TIMEOUT_S,
    open_session,
    spd,
    start_daemon,
    stop_daemon,
    submit,
)
from tests.protocol_readers import read_results

NUM_BLOCKS = 40
NUM_STREAMS = 3
VERSIONS = 2


def test_a_burst_of_results_reaches_every_open_stream(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    got: list[dict[str, int]] = [{} for _ in range(NUM_STREAMS)]
    done = [threading.Event() for _ in range(NUM_STREAMS)]
    calls = []
    try:
        stub = daemon.stub()
        session = open_session(stub)
        calls = [
            stub.StreamResults(pb.StreamResultsRequest(session_id=session), timeout=CALL_TIMEOUT_S)
            for _ in range(NUM_STREAMS)
        ]

        def drain(index: int) -> None:
            try:
                for result in read_results(calls[index]):
                    assert isinstance(result, SolveResult)
                    got[index][result.block] = max(got[index].get(result.block, -1), result.version)
                    if len(got[index]) == NUM_BLOCKS and all(
                        v == VERSIONS - 1 for v in got[index].values()
                    ):
                        break
            except grpc.RpcError:
                pass  # cancelled at the end
            done[index].set()

        threads = [
            threading.Thread(target=drain, args=(i,), daemon=True) for i in range(NUM_STREAMS)
        ]
        for thread in threads:
            thread.start()
        for version in range(VERSIONS):  # tiny solves: results finish in bursts
            for i in range(NUM_BLOCKS):
                task = SolveTask(
                    block=f"w{i}", version=version, kind=SolveKind.INVERSE_ROOT, matrix=spd(8, i)
                )
                assert submit(stub, session, task).accepted
        for index, event in enumerate(done):
            assert event.wait(CALL_TIMEOUT_S), f"stream {index} got {len(got[index])} blocks"
            assert got[index] == {f"w{i}": VERSIONS - 1 for i in range(NUM_BLOCKS)}
    finally:
        for call in calls:
            call.cancel()
        stop_daemon(daemon)
