"""An optimizer's worker processes end with it: when it is collected without close(), and when
its training process is interrupted (SIGTERM, SIGKILL) — with nothing left behind and no
"leaked shared_memory objects" warnings from a resource tracker."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from asteria_client import SOAP
from asteria_server.engine import EngineConfig

TINY_TRAIN = [
    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
    "--batch-size", "8", "--eval-batches", "2", "--device", "cpu",
]  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes (its parent has not reaped it yet)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_dropping_an_attached_optimizer_stops_its_workers() -> None:
    model = torch.nn.Linear(20, 10)
    opt = SOAP(model.named_parameters(), mode="embedded", engine_config=EngineConfig(num_workers=1))
    opt.attach(model)  # the model's hooks must not keep the optimizer alive
    model(torch.randn(3, 20)).sum().backward()
    opt.step()
    pids = opt.source.engine.worker_pids()  # type: ignore[attr-defined]
    assert pids and all(_alive(p) for p in pids)
    del opt
    gc.collect()
    assert _wait_gone(pids) == []
    model(torch.randn(3, 20)).sum().backward()  # the hooks of a dead optimizer are harmless


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_trainer_leaves_no_workers_and_no_tracker_warnings(sig: int) -> None:
    command = [sys.executable, "-m", "asteria_client.cli", "train", "--optimizer", "soap"]
    command += ["--mode", "embedded", "--engine-workers", "1", "--steps", "100000"]
    command += ["--log-interval", "1", "--eval-interval", "1000", *TINY_TRAIN]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until a few steps have run (workers are up)
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if (line.lstrip().startswith("step") and "step 5" in line) or len(lines) > 40:
                break
        workers = _children(proc.pid)
        assert workers, f"no solver workers under the trainer; stderr so far: {''.join(lines)}"
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    stderr = "".join(lines) + rest
    assert "resource_tracker" not in stderr and "leaked" not in stderr, stderr[-2000:]
    assert _wait_gone(workers) == [], "solver workers outlived their trainer"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"asteria_{proc.pid}_")]
