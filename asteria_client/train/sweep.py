"""`asteria train --lr-sweep`: short runs at several peak learning rates, and the best one.

Each candidate trains the run's model from the same initial weights on the same batches (the
same seed) for ``sweep_steps`` steps, with the run's schedule compressed to those steps (warmup,
then decay to the floor), and is scored by its validation loss at the end, on the same fixed
validation batches as the full run. The lowest loss wins; a candidate that diverges is recorded
and left out. Short runs favour large rates a little (they end before instability costs much),
so the pick is guidance for this budget of steps, not a tuned value.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from asteria_client.tables import text_table
from asteria_client.train.config import TrainConfig
from asteria_client.train.corpus import Corpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One candidate's short run: its losses, or why it stopped (``diverged``)."""

    lr: float
    val_loss: float | None
    train_loss: float | None
    train_time_s: float
    diverged: str | None = None


@dataclass(frozen=True, kw_only=True)
class LrSweep:
    """Every candidate's short run, and the lr picked for the full run."""

    steps: int
    points: tuple[SweepPoint, ...]
    best_lr: float

    @property
    def best(self) -> SweepPoint:
        return next(p for p in self.points if p.lr == self.best_lr)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "best_lr": self.best_lr,
            "runs": [dataclasses.asdict(p) for p in self.points],
        }

    def format_table(self) -> str:
        """``lr -> val loss, train loss`` per candidate, the pick marked."""
        lines = [
            f"lr sweep: {len(self.points)} peak learning rates, {self.steps} steps each "
            "(same seed and batches)",
        ]
        rows = [["lr", "val loss", "train loss", ""]]
        for p in self.points:
            if p.val_loss is None or p.train_loss is None:
                rows.append([f"{p.lr:.3g}", "diverged"])
                continue
            mark = "<- best" if p.lr == self.best_lr else ""
            rows.append([f"{p.lr:.3g}", f"{p.val_loss:.4f}", f"{p.train_loss:.4f}", mark])
        return "\n".join(lines + text_table(rows, align=">>><"))


def sweep_config(cfg: TrainConfig, lr: float) -> TrainConfig:
    """The short run of candidate ``lr``: ``resolved_sweep_steps`` steps, one evaluation at the
    end, one progress line, no JSON."""
    steps = cfg.resolved_sweep_steps
    warmup = None if cfg.warmup_steps is None else min(cfg.warmup_steps, steps - 1)
    return dataclasses.replace(
        cfg,
        lr=lr,
        lr_sweep=None,
        sweep_steps=None,
        steps=steps,
        warmup_steps=warmup,
        eval_interval=steps,
        log_interval=steps,
        json_path=None,
    )


def run_lr_sweep(cfg: TrainConfig, *, device: torch.device, corpus: Corpus) -> LrSweep:
    """Train every lr of ``cfg.lr_sweep`` briefly (module docstring) and pick the best.

    Raises ``TrainingDivergedError`` when every candidate diverged.
    """
    from asteria_client.train.loop import Trainer, TrainingDivergedError  # loop imports us

    if cfg.lr_sweep is None:
        raise ValueError("run_lr_sweep needs a TrainConfig with lr_sweep set")
    points = []
    for lr in cfg.lr_sweep:
        logger.info("lr sweep: lr %.3g for %d steps", lr, cfg.resolved_sweep_steps)
        with Trainer(sweep_config(cfg, lr), device=device, corpus=corpus) as trainer:
            try:
                while not trainer.done:
                    trainer.step()
            except TrainingDivergedError as exc:
                logger.info("lr sweep: lr %.3g diverged (%s)", lr, exc)
                points.append(
                    SweepPoint(
                        lr=lr,
                        val_loss=None,
                        train_loss=None,
                        train_time_s=trainer.train_time_s,
                        diverged=str(exc),
                    )
                )
                continue
            result = trainer.result()
        val_loss = result.final_val_loss
        finite = math.isfinite(val_loss)
        points.append(
            SweepPoint(
                lr=lr,
                val_loss=val_loss if finite else None,
                train_loss=result.final_train_loss if finite else None,
                train_time_s=trainer.train_time_s,
                diverged=None if finite else f"validation loss {val_loss}",
            )
        )
    finished = [(p.val_loss, p.lr) for p in points if p.val_loss is not None]
    if not finished:
        raise TrainingDivergedError(
            f"every learning rate of the sweep ({', '.join(f'{lr:g}' for lr in cfg.lr_sweep)}) "
            "diverged; try smaller ones"
        )
    _, best_lr = min(finished)  # on a tie, the smaller lr
    return LrSweep(steps=cfg.resolved_sweep_steps, points=tuple(points), best_lr=best_lr)
