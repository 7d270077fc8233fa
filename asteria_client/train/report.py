"""What a training run records, and the JSON file `asteria train --json PATH` writes.

The JSON layout (all times in seconds, losses in nats per character)::

    {
      "config":      the TrainConfig as given, plus "resolved" (lr, warmup_steps, device used,
                     flush_denormal: whether subnormals were flushed to zero, as asked and
                     as the CPU allows),
      "steps":       [{"step", "loss", "step_time_s", "lr"}, ...]  one per optimizer step,
      "evals":       [{"step", "val_loss", "elapsed_s", "wall_s"}, ...]  step 0 is before training,
      "final":       {"val_loss", "train_loss", "total_time_s", "median_step_time_s"},
      "data":        corpus and batch-stream facts (sizes, digests of the batches used),
      "model":       {"num_params"},
      "environment": {"torch", "python", "platform", "device", "num_threads", ...}
      "optimizer":   Asteria's runtime_stats() plus block counts (empty for adamw),
      "lr_sweep":    null, or with --lr-sweep {"steps", "best_lr", "runs": [{"lr", "val_loss",
                     "train_loss", "train_time_s", "diverged"}, ...]} (losses null if diverged)
    }

``step_time_s`` covers forward, backward, gradient clipping and ``optimizer.step()``.
``elapsed_s`` in an eval is training time so far (the sum of step times, no evaluation), which is
the x-axis for loss-vs-wall-clock comparisons; ``wall_s`` is time since the first step including
evaluations. ``final.train_loss`` is the mean training loss of the last ``TRAIN_LOSS_WINDOW`` steps.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from asteria_client.train.config import TrainConfig

TRAIN_LOSS_WINDOW = 20


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    step_time_s: float
    lr: float


@dataclass(frozen=True)
class EvalRecord:
    step: int
    val_loss: float
    elapsed_s: float
    wall_s: float


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Everything a finished run measured."""

    config: TrainConfig
    resolved: dict[str, Any]
    steps: tuple[StepRecord, ...]
    evals: tuple[EvalRecord, ...]
    total_time_s: float
    data: dict[str, Any]
    model: dict[str, Any]
    environment: dict[str, Any]
    optimizer: dict[str, Any] = field(default_factory=dict)
    lr_sweep: dict[str, Any] | None = None

    @property
    def final_val_loss(self) -> float:
        return self.evals[-1].val_loss

    @property
    def final_train_loss(self) -> float:
        window = self.steps[-TRAIN_LOSS_WINDOW:]
        return sum(r.loss for r in window) / len(window)

    @property
    def median_step_time_s(self) -> float:
        return statistics.median(r.step_time_s for r in self.steps)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "config": {**self.config.to_json_dict(), "resolved": self.resolved},
            "steps": [asdict(r) for r in self.steps],
            "evals": [asdict(r) for r in self.evals],
            "final": {
                "val_loss": self.final_val_loss,
                "train_loss": self.final_train_loss,
                "total_time_s": self.total_time_s,
                "median_step_time_s": self.median_step_time_s,
            },
            "data": self.data,
            "model": self.model,
            "environment": self.environment,
            "optimizer": self.optimizer,
            "lr_sweep": self.lr_sweep,
        }

    def write_json(self, path: Path) -> None:
        """Write the result to ``path`` atomically (a reader never sees a half-written file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.to_json_dict(), indent=1) + "\n", encoding="utf-8")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)


def describe_environment(device: torch.device) -> dict[str, Any]:
    """The facts a reader needs to compare this run's timings with another's."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "asteria": _package_version("asteria"),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def format_progress(
    *,
    step: int,
    steps: int,
    train_loss: float,
    val_loss: float | None,
    step_time_s: float,
    eta_s: float,
) -> str:
    """One progress line: ``step 100/500  loss 2.4312  val 2.4511  41.8 ms/step  eta 0:17``.

    ``val_loss`` is None at steps without an evaluation: the line then has no ``val`` field.
    """
    val = f"val {val_loss:.4f}  " if val_loss is not None else ""
    width = len(str(steps))
    return (
        f"step {step:>{width}}/{steps}  loss {train_loss:.4f}  {val}"
        f"{step_time_s * 1e3:.1f} ms/step  eta {_format_duration(eta_s)}"
    )


def _format_duration(seconds: float) -> str:
    minutes, secs = divmod(max(0, round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
