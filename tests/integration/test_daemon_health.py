"""Health tells the truth about a daemon whose event loop was blocked (a real daemon,
stopped with SIGSTOP: from its clients' side, the same as a loop stuck in a long call)."""

from __future__ import annotations

import os
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asteria_client.daemon_process import DaemonProcess
from asteria_server.service.loopwatch import DEGRADE_AFTER_S, RECOVER_AFTER_S

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(stub: health_pb2_grpc.HealthStub) -> int:
    return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10.0).status)


def _wait_for(stub: health_pb2_grpc.HealthStub, status: int, within_s: float) -> float:
    """Seconds until health says ``status``; fails after ``within_s``."""
    start = time.monotonic()
    while (seen := _health(stub)) != status:
        assert time.monotonic() - start < within_s, f"health still {seen} after {within_s} s"
        time.sleep(0.2)
    return time.monotonic() - start


def test_health_is_not_serving_after_the_loop_was_blocked_and_serving_once_it_keeps_time() -> None:
    with DaemonProcess(workers=1) as daemon:
        channel = grpc.insecure_channel(daemon.address)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            assert _health(stub) == SERVING
            os.kill(daemon.pid, signal.SIGSTOP)
            time.sleep(DEGRADE_AFTER_S + 1.0)
            os.kill(daemon.pid, signal.SIGCONT)
            # The first call after it may still be answered before the heartbeat runs.
            _wait_for(stub, NOT_SERVING, within_s=5.0)
            took = _wait_for(stub, SERVING, within_s=RECOVER_AFTER_S + 10.0)
            assert took >= RECOVER_AFTER_S * 0.5  # it waited for the loop to keep time
            log = daemon.output()[1]
            assert "the event loop has been blocked for" in log, log
            assert "health NOT_SERVING until it keeps time" in log, log
            assert "health SERVING" in log, log
        finally:
            channel.close()
