"""`TrainConfig`: everything one `asteria train` run depends on, validated once, then frozen."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from asteria_client.optim.base import Mode
from asteria_client.runtime.staleness import Refresh
from asteria_client.train.optimizers import DEFAULT_LR, OptimizerKind
from asteria_server.errors import InvalidInputError

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class TrainConfigError(InvalidInputError):
    """A ``TrainConfig`` field holds a value it cannot take; ``field`` names it."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(f"TrainConfig.{field}={value!r} {problem}")
        self.field = field
        self.value = value
        self.problem = problem


#: Model shapes by name: ``tiny`` is the default (a CPU run in about a minute), ``gpt2-small``
#: the GPT-2 small shape (12 layers, width 768, 12 heads; context 256 characters), whose step
#: on a GPU is tens of milliseconds of real work rather than launch overhead.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64},
    "gpt2-small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 256},
}


def model_preset(name: str) -> dict[str, int]:
    """The TrainConfig model fields of preset ``name`` (ValueError naming the choices)."""
    try:
        return dict(MODEL_PRESETS[name])
    except KeyError:
        choices = ", ".join(MODEL_PRESETS)
        raise ValueError(f"model={name!r} is not a model preset; pick one of {choices}") from None


class Schedule(enum.Enum):
    """How the learning rate moves after the linear warmup."""

    COSINE = "cosine"  # cosine decay from the peak to ``min_lr_ratio`` of it at the last step
    CONSTANT = "constant"  # the peak until the end


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. The defaults finish in about a minute (AdamW) on two CPU cores.

    ``lr=None`` picks the optimizer's tuned default (``DEFAULT_LR``); ``warmup_steps=None`` picks
    5% of ``steps`` (at most 100); ``precondition_frequency=None`` keeps the optimizer's own;
    ``num_threads=None`` leaves torch's intra-op thread count as it is, except on the CPU with
    the embedded engine, where the trainer takes the cores its workers leave (at least one).
    ``flush_denormal`` flushes subnormal floats to zero on the CPU for the run (see
    :mod:`asteria_client.train.cpu`). ``lr_sweep`` (instead of ``lr``) first trains each of
    these peak learning rates for ``sweep_steps`` steps (None: ``min(steps, 100)``) and runs
    with the one of lowest validation loss (see :mod:`asteria_client.train.sweep`).
    ``engine_cpu_affinity`` confines the embedded engine's solver workers to those CPUs (None:
    the trainer's own); a benchmark that pins the trainer to one core uses it.
    Enum fields also accept their string values (``optimizer="soap"``); sequences become tuples.
    """

    optimizer: OptimizerKind = OptimizerKind.ADAMW
    mode: Mode | None = None
    steps: int = 500
    lr: float | None = None
    weight_decay: float = 0.1
    schedule: Schedule = Schedule.COSINE
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 32
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    seed: int = 0
    device: str = "auto"
    num_threads: int | None = None
    eval_interval: int = 100
    eval_batches: int = 16
    log_interval: int = 50
    precondition_frequency: int | None = None
    staleness_budget: int | None = None
    refresh: Refresh | None = None
    refresh_overhead: float | None = None
    engine_workers: int | None = None
    engine_cpu_affinity: tuple[int, ...] | None = None
    flush_denormal: bool = True
    #: Register the optimizer's hooks on the model (``optimizer.attach(model)``); False trains
    #: without them, as a user who leaves ``attach`` out does.
    attach: bool = True
    #: Under torchrun: shard the model with FSDP2 (fully_shard) instead of replicating it (DDP).
    fsdp: bool = False
    lr_sweep: tuple[float, ...] | None = None
    sweep_steps: int | None = None
    json_path: Path | None = None

    def __post_init__(self) -> None:
        self._coerce_enum("optimizer", OptimizerKind)
        if self.mode is not None:
            self._coerce_enum("mode", Mode)
        if self.refresh is not None:
            self._coerce_enum("refresh", Refresh)
        self._coerce_enum("schedule", Schedule)
        if self.json_path is not None and not isinstance(self.json_path, Path):
            object.__setattr__(self, "json_path", Path(self.json_path))
        for name in ("lr_sweep", "engine_cpu_affinity"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

        for name in (
            "steps",
            "batch_size",
            "block_size",
            "n_layer",
            "n_head",
            "n_embd",
            "eval_interval",
            "eval_batches",
            "log_interval",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("seed", self.seed, minimum=0)
        if self.warmup_steps is not None:
            _require_int("warmup_steps", self.warmup_steps, minimum=0)
            if self.warmup_steps >= self.steps:
                _fail("warmup_steps", self.warmup_steps, f"must be less than steps ({self.steps})")
        if self.num_threads is not None:
            _require_int("num_threads", self.num_threads, minimum=1)
        if self.precondition_frequency is not None:
            _require_int("precondition_frequency", self.precondition_frequency, minimum=1)
        if self.staleness_budget is not None:
            _require_int("staleness_budget", self.staleness_budget, minimum=0)
        if self.engine_workers is not None:
            _require_int("engine_workers", self.engine_workers, minimum=1)
        if self.refresh_overhead is not None:
            if self.refresh is not Refresh.CONTINUOUS:
                _fail(
                    "refresh_overhead",
                    self.refresh_overhead,
                    "applies only to refresh='continuous' (--refresh continuous)",
                )
            overhead = self.refresh_overhead
            if isinstance(overhead, bool) or not isinstance(overhead, int | float):
                _fail("refresh_overhead", overhead, "must be a number in (0, 1]")
            if not 0 < overhead <= 1:
                _fail("refresh_overhead", overhead, "must be a share of the step time in (0, 1]")
        if self.lr is not None:
            _require_positive_float("lr", self.lr)
        if not isinstance(self.flush_denormal, bool):
            _fail("flush_denormal", self.flush_denormal, "must be True or False")
        if not isinstance(self.attach, bool):
            _fail("attach", self.attach, "must be True or False")
        self._check_lr_sweep()
        if self.engine_cpu_affinity is not None:
            _require_cpus("engine_cpu_affinity", self.engine_cpu_affinity)
        _require_positive_float("grad_clip", self.grad_clip)
        if not isinstance(self.weight_decay, int | float) or self.weight_decay < 0:
            _fail("weight_decay", self.weight_decay, "must be a number >= 0")
        if not isinstance(self.min_lr_ratio, int | float) or not 0 <= self.min_lr_ratio <= 1:
            _fail("min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            _fail("dropout", self.dropout, "must be in [0, 1)")
        if self.n_embd % self.n_head != 0:
            _fail("n_embd", self.n_embd, f"must be divisible by n_head ({self.n_head})")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            _fail("device", self.device, "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")

        if not self.optimizer.is_second_order:
            if self.mode is not None:
                _fail(
                    "mode",
                    self.mode.value,
                    "applies only to Asteria's second-order optimizers; adamw has no "
                    "preconditioner (leave --mode out or pick shampoo, soap or kl-shampoo)",
                )
            for name in (
                "staleness_budget",
                "refresh",
                "refresh_overhead",
                "engine_workers",
                "engine_cpu_affinity",
            ):
                if getattr(self, name) is not None:
                    _fail(name, getattr(self, name), "applies only to second-order optimizers")
            if self.precondition_frequency is not None:
                _fail(
                    "precondition_frequency",
                    self.precondition_frequency,
                    "applies only to Asteria's second-order optimizers, not adamw",
                )

    def _check_lr_sweep(self) -> None:
        if self.lr_sweep is None:
            if self.sweep_steps is not None:
                _fail("sweep_steps", self.sweep_steps, "applies only with lr_sweep (--lr-sweep)")
            return
        if self.lr is not None:
            _fail(
                "lr_sweep",
                self.lr_sweep,
                f"cannot be combined with lr ({self.lr}): give one peak lr (--lr) or a list "
                "to sweep (--lr-sweep)",
            )
        if not isinstance(self.lr_sweep, tuple) or not self.lr_sweep:
            _fail("lr_sweep", self.lr_sweep, "must be a non-empty list of learning rates")
        for lr in self.lr_sweep:
            if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < math.inf:
                _fail("lr_sweep", self.lr_sweep, f"holds {lr!r}: every lr must be a number > 0")
        if len(set(self.lr_sweep)) != len(self.lr_sweep):
            _fail("lr_sweep", self.lr_sweep, "lists a learning rate twice")
        if self.sweep_steps is not None:
            _require_int("sweep_steps", self.sweep_steps, minimum=1)
            if self.sweep_steps > self.steps:
                _fail("sweep_steps", self.sweep_steps, f"must be at most steps ({self.steps})")

    def _coerce_enum(self, name: str, enum_type: type[enum.Enum]) -> None:
        value = getattr(self, name)
        if isinstance(value, enum_type):
            return
        try:
            object.__setattr__(self, name, enum_type(value))
        except ValueError:
            choices = ", ".join(repr(member.value) for member in enum_type)
            _fail(name, value, f"must be one of {choices}")

    @property
    def resolved_lr(self) -> float:
        """The peak learning rate this run uses: ``lr``, or the optimizer's tuned default."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    @property
    def resolved_sweep_steps(self) -> int:
        """Steps of each lr-sweep run: ``sweep_steps``, or ``min(steps, 100)``."""
        return self.sweep_steps if self.sweep_steps is not None else min(self.steps, 100)

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(100, self.steps // 20)

    def to_json_dict(self) -> dict[str, Any]:
        """The config as plain JSON values (enums by value, paths as strings)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, Path):
                value = str(value)
            out[field.name] = value
        return out


def _fail(name: str, value: object, problem: str) -> NoReturn:
    raise TrainConfigError(name, value, problem)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "must be an integer")
    elif value < minimum:
        _fail(name, value, f"must be >= {minimum}")


def _require_cpus(name: str, value: object) -> None:
    if not isinstance(value, tuple) or not value:
        _fail(name, value, "must be a non-empty tuple of CPU numbers")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in value):
        _fail(name, value, "must hold CPU numbers (integers >= 0)")
    if len(set(value)) != len(value):
        _fail(name, value, "names a CPU twice")
    num_cpus = os.cpu_count() or 1
    if max(value) >= num_cpus:  # not this thread's affinity: a pinned trainer gives others
        _fail(name, value, f"names CPUs this host does not have (it has {num_cpus})")


def _require_positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        _fail(name, value, "must be a number > 0")
    elif value != value or value == float("inf"):
        _fail(name, value, "must be finite")
