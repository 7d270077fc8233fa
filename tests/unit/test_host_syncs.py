"""Host syncs on the step path, counted on CPU by :class:`HostSyncAudit` (how it decides what
would sync on a device: see its module docstring — the runtime's own host buffers are marked,
every other CPU tensor stands for a device tensor, and a copy to the host counts unless it is
the transfer layer's non-blocking one).

Each case trains a small stack of 8x8 linear layers for a few steps with the audit around the
whole iteration (forward and backward, where the optimizer's hooks fire, then ``step()``);
an SGD run of the same loop counts 0, so whatever is counted comes from the optimizer and
its runtime. Iterations are sorted by what the runtime did in them: **quiet** ones published no
snapshot and installed no result (target: 0 syncs); **busy** ones published or installed
(target: a count that does not grow with the number of blocks, checked at 2 and 6 layers).

Sources: native, embedded (a real engine), and a real daemon over shared memory and over
gRPC. The finite check made one sync every step (``optim/base.py``'s
``_first_bad_gradient``, still used on a parameter's first step) until it moved to the device
(``_check_on_device``: the step's updates are masked by the flag, the host reads it a step
later); a twin test still counts everything but that function, as a second witness.

Native mode solves every block in the step. Its solver checks are device flags read once per
step, and its eighs are batched per shape (``NativeSource``): ``torch.linalg.eigh`` waits for the
device once per call (ATen reads the solver's info on the host), which the audit counts, so a
busy native step waits once per shape of block, not once per block.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_client.optim.base import AsteriaOptimizer
from asteria_client.runtime.embedded import EngineConfig
from asteria_client.runtime.sync_audit import SOLVER_CHECKS, HostSyncAudit
from asteria_client.transport import DaemonClientConfig, DaemonSource
from tests.integration.test_daemon import Daemon, start_daemon, stop_daemon

OPTIMIZERS = {"SOAP": SOAP, "Shampoo": Shampoo, "KLShampoo": KLShampoo}
MODES = ("native", "embedded", "daemon-shm", "daemon-grpc")
#: the continuous schedule pulls snapshots after every step (no quiet step to count)
CONTINUOUS = [("SOAP", "embedded-continuous"), ("KLShampoo", "embedded-continuous")]
LAYERS = (2, 6)  # 4 and 12 preconditioned blocks
STEPS = 10
FREQUENCY = 3
WAIT_S = 20.0


def _lines(func: Any) -> tuple[str, range]:
    lines, first = inspect.getsourcelines(func)
    path = Path(inspect.getfile(func)).resolve()
    return str(path.relative_to(Path.cwd().resolve())), range(first, first + len(lines))


def _in(site: str, func: Any) -> bool:
    """Whether an audit site (``name at path:line``) lies in ``func``."""
    path, lines = _lines(func)
    file, _, line = site.rsplit(" at ", 1)[-1].rpartition(":")
    return file == path and line.isdigit() and int(line) in lines


@dataclass
class Iteration:
    syncs: int  # every counted call
    others: int  # those outside optim/base.py's finite check
    #: those outside the state's creation (KL-Shampoo's _init_tile reads each new tile's
    #: scale, once: optim/, the grouped step's)
    steady: int
    #: those of them that are torch.linalg.eigh's own check of the solver's info (ATen reads
    #: it on the host after each call: see the audit's docstring)
    eighs: int
    busy: bool  # published a snapshot or installed a result
    sites: str


_daemon: Daemon | None = None


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    global _daemon
    _daemon = start_daemon(tmp_path_factory.mktemp("syncs"))
    yield _daemon
    stop_daemon(_daemon)
    _daemon = None
    _runs.cache_clear()


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(layers)])


def _make(name: str, mode: str, model: torch.nn.Module) -> AsteriaOptimizer:
    kwargs: dict[str, Any] = {"precondition_frequency": FREQUENCY, "model": model}
    if mode == "native":
        kwargs["mode"] = "native"
    elif mode.startswith("embedded"):
        kwargs["mode"] = "embedded"
        kwargs["engine_config"] = EngineConfig(num_workers=1, calibrate=False)
        if mode == "embedded-continuous":
            kwargs["refresh"] = "continuous"
            del kwargs["precondition_frequency"]
    else:
        assert _daemon is not None
        config = DaemonClientConfig(shared_memory=mode == "daemon-shm")
        kwargs["mode"] = "daemon"
        kwargs["source"] = DaemonSource(_daemon.target, config=config)
    return OPTIMIZERS[name](model.parameters(), **kwargs)


def _activity(opt: AsteriaOptimizer) -> tuple[int, int]:
    """Snapshots published and results installed so far (read outside the audit)."""
    installs = sum(e.installs for e in opt.runtime.refresh_log.blocks.values())
    published = sum(max(0, r["submitted_version"]) for r in opt.preconditioner_status())
    return published, installs


def _settle(opt: AsteriaOptimizer) -> None:
    """Let results in flight arrive, so they are installed by the next iteration's hooks."""
    deadline = time.monotonic() + WAIT_S
    source = opt.source
    status = opt.preconditioner_status()
    while any(source.in_flight_version(r["block"]) is not None for r in status):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)


def _train(opt: AsteriaOptimizer, model: torch.nn.Module, audit: HostSyncAudit) -> list[Iteration]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randn(16, 8, generator=gen)
        before = _activity(opt)
        audit.reset()
        with audit:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        after = _activity(opt)
        sites = audit.sites
        finite = sum(n for site, n in sites.items() if _in(site, opt._first_bad_gradient))
        init = sum(n for site, n in sites.items() if _in(site, KLShampoo._init_tile))
        eighs = sum(n for site, n in sites.items() if site.split(" at ")[0] in SOLVER_CHECKS)
        busy = after != before
        out.append(
            Iteration(
                audit.total, audit.total - finite, audit.total - init, eighs, busy, audit.report()
            )
        )
        _settle(opt)
    return out


@functools.cache
def _runs(name: str, mode: str, layers: int) -> tuple[Iteration, ...]:
    model = _model(layers)
    opt = _make(name, mode, model)
    try:
        opt.attach(model)
        return tuple(_train(opt, model, HostSyncAudit("cpu")))
    finally:
        opt.close()


def _quiet(name: str, mode: str) -> list[Iteration]:
    quiet = [i for layers in LAYERS for i in _runs(name, mode, layers) if not i.busy]
    assert quiet, "no iteration without a publish or an install: the test would be vacuous"
    return quiet


CASES = [(name, mode) for mode in MODES for name in OPTIMIZERS]
BUSY_CASES = CASES + CONTINUOUS


def test_the_audit_counts_a_sync_in_a_hook_and_none_for_sgd() -> None:
    """The loop itself is clean (SGD with momentum, foreach: 0; torch's AdamW keeps its step
    count in a CPU tensor and reads it, which on a GPU is a host read, so on CPU it would
    count), and a sync hidden in a module hook is seen: the counts below cannot pass by seeing
    nothing."""
    model = _model(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    audit = HostSyncAudit("cpu")
    x = torch.randn(16, 8)
    for _ in range(3):
        with audit:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert audit.total == 0, audit.report()

    def reads_a_value(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
        float(output.detach().sum())

    handle = model[0].register_forward_hook(reads_a_value)
    with audit:
        model(x).square().mean().backward()
    handle.remove()
    assert audit.counts == {"__float__": 1}


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_a_quiet_step_makes_no_sync_besides_the_finite_check(
    name: str, mode: str, daemon: Daemon
) -> None:
    bad = [i.sites for i in _quiet(name, mode) if i.others]
    assert not bad, bad[0]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_a_quiet_step_makes_no_host_sync(name: str, mode: str, daemon: Daemon) -> None:
    bad = [i.sites for i in _quiet(name, mode) if i.syncs]
    assert not bad, bad[0]


@pytest.mark.parametrize(("name", "mode"), BUSY_CASES)
def test_a_busy_steps_syncs_do_not_grow_with_blocks(name: str, mode: str, daemon: Daemon) -> None:
    """The most syncs an iteration that published or installed made, at 4 and at 12 blocks
    (the first one publishes every block's first snapshot). Left out: KL-Shampoo's
    ``_init_tile`` (optim/kl_shampoo.py), which reads each new tile's scale on the host
    once, when the state is created."""
    most = {}
    for layers in LAYERS:
        busy = [i for i in _runs(name, mode, layers) if i.busy]
        assert busy, "no iteration published or installed anything"
        worst = max(busy, key=lambda i: i.steady)
        most[layers] = (worst.steady, worst.sites)
    assert most[LAYERS[1]][0] <= most[LAYERS[0]][0], most


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_busy_native_step_waits_once_per_block_shape_not_per_block(name: str) -> None:
    """Native mode batches a step's eighs by shape (``NativeSource``, ``linalg.batched_eigh``):
    every block here is 8x8, so a step that solves 4 or 12 blocks by eigh (the first, and
    Shampoo's refreshes) calls it once, and torch.linalg.eigh's own info check, the one host
    wait ATen cannot skip, comes once. Solving each block alone made 4 and 12."""
    for layers in LAYERS:
        busy = [i for i in _runs(name, "native", layers) if i.busy]
        assert busy, "no iteration published or installed anything"
        assert busy[0].eighs >= 1, busy[0].sites  # the first step solves every block by eigh
        worst = max(busy, key=lambda i: i.eighs)
        assert worst.eighs == 1, (layers, worst.sites)
