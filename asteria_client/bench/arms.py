"""Several `asteria train` runs ("arms") in one process, each measured like a separate run.

`asteria bench peers` and `asteria bench defaults` compare optimizers that `asteria train` cannot
build by name (other libraries', or Asteria's with non-default betas), so they drive
:class:`~asteria_client.train.loop.Trainer` directly with an optimizer factory. For one seed
every arm starts from the same weights and draws the same batches (the trainer's own seeding);
all are scored on the same validation batches.

With ``interleave_steps`` the arms of a seed are alive together and advance in turn, that many
steps each, their order rotating every round: slow drifts of a shared machine then fall on every
arm alike, which is what makes their step times comparable (sequential runs here differed by 15%
with nothing changed; see :mod:`asteria_client.bench.spikes`). Without it they run one after
the other, one alive at a time (cheaper in memory when many arms start engine workers).

CPU seconds of an arm: this process's CPU time during the arm's own steps (``process_time``,
all its threads), plus the CPU time of the solver processes the arm's engine started (the
processes of this one that first appeared while the arm was built or stepped, read before it
closes). The caller sets the thread count and flush-denormal mode before the first arm.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asteria_client.bench.stats import summarize

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One run: its name and label, the ``TrainConfig`` it trains with (schedule, seed, steps,
    and the optimizer when ``factory`` is None), and an optional optimizer factory."""

    name: str
    label: str
    train_config: Any  # asteria_client.train.config.TrainConfig (imported lazily: torch)
    factory: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None
    info: dict[str, Any] | None = None  # what the report shows about it (library, version, ...)


def _child_pids() -> set[int]:
    """Processes whose parent is this one (the embedded engine's solver workers)."""
    me, pids = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == me:
            pids.add(int(entry.name))
    return pids


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Live:
    """One arm being trained: its trainer, the CPU it used, the processes it started."""

    def __init__(self, arm: Arm, corpus: Any) -> None:
        from asteria_client.train.loop import Trainer

        self.arm = arm
        self.error: str | None = None
        self.cpu_s = 0.0
        self.solver_pids: set[int] = set()
        before = _child_pids()
        self.trainer = Trainer(arm.train_config, corpus=corpus, optimizer_factory=arm.factory)
        self.solver_pids |= _child_pids() - before

    @property
    def done(self) -> bool:
        return self.error is not None or self.trainer.done

    def advance(self, num_steps: int) -> None:
        before = _child_pids()
        cpu0 = time.process_time()
        try:
            for _ in range(num_steps):
                if self.trainer.done:
                    break
                self.trainer.step()
        except Exception as exc:  # diverged, or another library's optimizer raised anything
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "%s stopped at step %d: %s", self.arm.label, len(self.trainer.steps), exc
            )
        finally:
            self.cpu_s += time.process_time() - cpu0
            self.solver_pids |= _child_pids() - before

    def finish(self) -> dict[str, Any]:
        """The arm's record (read before closing: its solver processes still exist)."""
        solver_cpu_s = sum(_process_cpu_s(pid) for pid in self.solver_pids)
        self.trainer.close()
        return record_of(self.arm, self.trainer, self.cpu_s, solver_cpu_s, self.error)


def record_of(
    arm: Arm, trainer: Any, trainer_cpu_s: float, solver_cpu_s: float, error: str | None
) -> dict[str, Any]:
    """An arm's measurements, in the shape of `asteria bench convergence`'s run records."""
    cfg = trainer.cfg
    steps = trainer.steps
    times = [s.step_time_s for s in steps]
    ok = error is None and len(steps) == cfg.steps
    record: dict[str, Any] = {
        "config": arm.name,
        "label": arm.label,
        "seed": cfg.seed,
        # The peak lr the optimizer was built with (a factory's own, not the config's).
        "lr": trainer.optimizer.param_groups[0].get("initial_lr", cfg.resolved_lr),
        "info": arm.info or {},
        "ok": ok,
        "error": error,
        "steps_done": len(steps),
        "trainer_cpu_s": trainer_cpu_s,
        "solver_cpu_s": solver_cpu_s,
        "cpu_s": trainer_cpu_s + solver_cpu_s,
    }
    if not ok:
        return record
    evals = [
        {"step": e.step, "val_loss": e.val_loss, "elapsed_s": e.elapsed_s, "wall_s": e.wall_s}
        for e in trainer.evals
    ]
    summary = summarize(times)
    record.update(
        final_val_loss=evals[-1]["val_loss"],
        final_train_loss=steps[-1].loss,
        evals=evals,
        train_s=sum(times),
        median_step_time_s=summary["median"],
        p99_step_time_s=summary["p99"],
        step_times_s=times,
        train_losses=[s.loss for s in steps],
        train_batches_digest=trainer.train_batches.digest(),
        val_batches_digest=trainer.val_sampler.digest(),
        runtime=_runtime_stats(trainer.optimizer),
    )
    return record


def _runtime_stats(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    stats = getattr(optimizer, "runtime_stats", None)
    return dict(stats()) if callable(stats) else {}


def _rounds(live: list[_Live], interleave_steps: int) -> Iterator[_Live]:
    """Arms in turn, rotating the order every round, until all are done."""
    order = list(range(len(live)))
    while not all(arm.done for arm in live):
        for index in order:
            if not live[index].done:
                yield live[index]
        order = order[1:] + order[:1]


def run_arms(
    arms: Sequence[Arm],
    *,
    interleave_steps: int | None,
    corpus: Any,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Train every arm to its end and return their records, in ``arms`` order (module doc).

    An arm whose optimizer cannot be built, or whose training diverges, gets a record with
    ``ok`` False and the ``error``; the others go on.
    """
    records: dict[int, dict[str, Any]] = {}

    def start(index: int) -> _Live | None:
        arm = arms[index]
        try:
            return _Live(arm, corpus)
        except Exception as exc:  # another library's optimizer may raise anything
            records[index] = {
                "config": arm.name,
                "label": arm.label,
                "seed": arm.train_config.seed,
                "info": arm.info or {},
                "ok": False,
                "error": f"could not build it: {type(exc).__name__}: {exc}",
            }
            logger.warning("%s: could not build it: %s", arm.label, exc)
            if progress is not None:
                progress(records[index])
            return None

    def finish(index: int, live: _Live) -> None:
        records[index] = live.finish()
        if progress is not None:
            progress(records[index])

    if interleave_steps is None:
        for index in range(len(arms)):
            one = start(index)
            if one is not None:
                one.advance(one.trainer.cfg.steps)
                finish(index, one)
    else:
        started = {i: start(i) for i in range(len(arms))}
        live = {i: a for i, a in started.items() if a is not None}
        try:
            for arm in _rounds(list(live.values()), interleave_steps):
                arm.advance(interleave_steps)
        finally:
            for index, one in live.items():
                finish(index, one)
    return [records[i] for i in range(len(arms))]
