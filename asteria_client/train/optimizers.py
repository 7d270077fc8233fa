"""Which optimizer `asteria train` builds, with which defaults: the one place that decides.

AdamW is the baseline. Asteria's optimizers are imported only when asked for, so training with
AdamW works in a checkout where they are missing or broken. Every optimizer gets the same two
parameter groups: weight decay on matrices (>= 2-D), none on biases and LayerNorm scales.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asteria_client.optim.base import Mode
from asteria_server.errors import AsteriaError, InvalidInputError


class OptimizerKind(enum.Enum):
    ADAMW = "adamw"
    SHAMPOO = "shampoo"
    SOAP = "soap"
    KL_SHAMPOO = "kl-shampoo"

    @property
    def is_second_order(self) -> bool:
        return self is not OptimizerKind.ADAMW


# Peak learning rates used when the user gives none. Every optimizer runs the same schedule
# (warmup, then cosine decay to 10% of the peak), batches, clipping and weight decay.
#
# adamw: the best of a sweep at the default config (500 steps, seed 0, CPU), run as
#   `OMP_NUM_THREADS=1 asteria train --optimizer adamw --device cpu --lr LR`; final validation
#   loss (nats/char; the thread count moves these by about 0.003):
#     lr 1e-3: 2.109   2e-3: 1.974   3e-3: 1.921   6e-3: 1.883   1e-2: 1.886
#   The optimum is flat between 6e-3 and 1e-2; 6e-3 is the lower, safer end.
# shampoo, kl-shampoo: a two-point sweep at the same config (native mode, `--threads 1`):
#     shampoo     lr 1e-3: 1.915   3e-3: 1.795
#     kl-shampoo  lr 1e-3: 1.919   3e-3: 1.762
#   3e-3 for both; higher rates were not tried yet.
# soap: its reference implementation's 3e-3 (final val loss 1.781 at this config).
DEFAULT_LR: dict[OptimizerKind, float] = {
    OptimizerKind.ADAMW: 6e-3,
    OptimizerKind.SHAMPOO: 3e-3,
    OptimizerKind.SOAP: 3e-3,
    OptimizerKind.KL_SHAMPOO: 3e-3,
}

ADAMW_BETAS = (0.9, 0.99)

# Where each of Asteria's optimizers lives: (module, class name).
_ASTERIA_OPTIMIZERS: dict[OptimizerKind, tuple[str, str]] = {
    OptimizerKind.SHAMPOO: ("asteria_client.optim.shampoo", "Shampoo"),
    OptimizerKind.SOAP: ("asteria_client.optim.soap", "SOAP"),
    OptimizerKind.KL_SHAMPOO: ("asteria_client.optim.kl_shampoo", "KLShampoo"),
}


class OptimizerUnavailableError(AsteriaError):
    """The requested optimizer cannot be imported in this installation."""


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """What the training loop asks of the optimizer; ``None`` means the optimizer's own default."""

    kind: OptimizerKind
    lr: float
    weight_decay: float
    mode: Mode | None = None  # None: the optimizer's default (embedded without a daemon)
    precondition_frequency: int | None = None
    betas: tuple[float, float] | None = None  # second-order only; None: the optimizer's own
    staleness_budget: int | None = None
    engine_workers: int | None = None
    engine_cpu_affinity: tuple[int, ...] | None = None  # the embedded engine's solver CPUs
    # Further keyword arguments of Asteria's optimizer (benchmarks: a refresh schedule, ...).
    options: tuple[tuple[str, Any], ...] = ()


NamedParams = list[tuple[str, nn.Parameter]]


def split_for_weight_decay(model: nn.Module) -> tuple[NamedParams, NamedParams]:
    """(matrices, the rest): decay applies to parameters with two or more dimensions."""
    decay: NamedParams = []
    no_decay: NamedParams = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append((name, param))
    return decay, no_decay


def build_optimizer(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    """The optimizer ``settings`` describe, over ``model``'s trainable parameters."""
    decay, no_decay = split_for_weight_decay(model)
    if settings.kind is OptimizerKind.ADAMW:
        return torch.optim.AdamW(
            [
                {"params": [p for _, p in decay], "weight_decay": settings.weight_decay},
                {"params": [p for _, p in no_decay], "weight_decay": 0.0},
            ],
            lr=settings.lr,
            betas=ADAMW_BETAS,
        )
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra: dict[str, Any] = {"mode": None if settings.mode is None else settings.mode.value}
    if settings.precondition_frequency is not None:
        extra["precondition_frequency"] = settings.precondition_frequency
    if settings.betas is not None:
        extra["betas"] = settings.betas
    extra.update(settings.options)
    if settings.staleness_budget is not None:
        extra["staleness_budget"] = settings.staleness_budget
    engine: dict[str, Any] = {}
    if settings.engine_workers is not None:
        engine["num_workers"] = settings.engine_workers
    if settings.engine_cpu_affinity is not None:
        engine["cpu_affinity"] = settings.engine_cpu_affinity
    if engine:
        from asteria_client.runtime.embedded import EngineConfig

        extra["engine_config"] = EngineConfig(**engine)
    optimizer_class = _import_asteria_optimizer(settings.kind)
    try:
        return optimizer_class(groups, lr=settings.lr, weight_decay=settings.weight_decay, **extra)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, AsteriaError):
            raise
        raise InvalidInputError(f"{settings.kind.value} rejected its settings: {exc}") from exc


def _import_asteria_optimizer(kind: OptimizerKind) -> Callable[..., torch.optim.Optimizer]:
    module_name, class_name = _ASTERIA_OPTIMIZERS[kind]
    try:
        module = importlib.import_module(module_name)
        optimizer_class: Callable[..., torch.optim.Optimizer] = getattr(module, class_name)
    except (ImportError, AttributeError) as exc:
        raise OptimizerUnavailableError(
            f"optimizer '{kind.value}' is not available in this installation "
            f"({module_name}.{class_name}: {exc}); train with --optimizer adamw, "
            "or install a build of Asteria that includes it"
        ) from exc
    return optimizer_class
