"""The optimizers `asteria bench peers` compares Asteria's with, configured in one table.

Each peer is another library's SOAP or Shampoo, configured as its own README recommends (the
``readme`` keywords; every other keyword stays at the class's default), for the version it was
written for. The benchmark also runs each peer "at Asteria's settings": the same keywords with
the lr and weight decay that Asteria's optimizer of the same family trains with, so a difference
in the loss is the algorithm's and its defaults', not the learning rate's.

A peer that is not importable is skipped with a line saying why (the ``[peers]`` extra installs
the ones on PyPI: ``pip install 'asteria[peers]'``). Parameter groups follow `asteria train`:
weight decay on matrices only (the peer's own default decay unless the row says otherwise).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from asteria_client.train.optimizers import OptimizerKind, split_for_weight_decay


@dataclass(frozen=True, kw_only=True)
class PeerOptimizer:
    """One peer: where it lives, which version this entry was written for, how its README
    configures it, and which of Asteria's optimizers it is compared with (``family``)."""

    name: str
    library: str
    distribution: str | None  # its PyPI name; None: not on PyPI
    module: str
    class_name: str
    written_for: str
    family: OptimizerKind
    readme: Mapping[str, Any] = field(default_factory=dict)
    # Keywords whose values must be built from the library (config objects), by name.
    readme_objects: Callable[[ModuleType], dict[str, Any]] | None = None
    # The class takes matrices only (2-D): the other parameters get torch's AdamW with the
    # same lr, betas, eps and no weight decay, as its integrations do.
    matrices_only: bool = False
    min_python: tuple[int, int] | None = None
    prepare: Callable[[ModuleType], None] | None = None  # before the first construction
    note: str = ""

    def unavailable_reason(self) -> str | None:
        """Why this peer cannot run here, or None when it can."""
        if self.min_python is not None and sys.version_info[:2] < self.min_python:
            need = ".".join(map(str, self.min_python))
            return (
                f"{self.library} needs Python >= {need}; this is "
                f"{sys.version_info.major}.{sys.version_info.minor}, where it is not installable"
            )
        try:
            self.load()
        except ImportError as exc:
            where = (
                f"pip install 'asteria[peers]' (or {self.distribution}=={self.written_for})"
                if self.distribution
                else "install it from its repository"
            )
            return f"{self.library} is not installed ({exc}); {where}"
        return None

    def load(self) -> type[torch.optim.Optimizer]:
        module = importlib.import_module(self.module)
        if self.prepare is not None:
            self.prepare(importlib.import_module(self.module.split(".")[0]))
        optimizer_class: type[torch.optim.Optimizer] = getattr(module, self.class_name)
        return optimizer_class

    def installed_version(self) -> str | None:
        if self.distribution is None:
            return None
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def keywords(
        self, *, lr: float | None = None, weight_decay: float | None = None
    ) -> dict[str, Any]:
        """The README's keywords, with ``lr`` / ``weight_decay`` replaced when given."""
        kwargs = dict(self.readme)
        if self.readme_objects is not None:
            kwargs.update(self.readme_objects(importlib.import_module(self.module.split(".")[0])))
        if lr is not None:
            kwargs["lr"] = lr
        if weight_decay is not None:
            kwargs["weight_decay"] = weight_decay
        return kwargs

    def factory(self, kwargs: Mapping[str, Any]) -> Callable[[torch.nn.Module], Any]:
        """Builds this peer over a model, with `asteria train`'s two parameter groups."""
        optimizer_class = self.load()
        kwargs = dict(kwargs)
        decay_wd = kwargs.pop("weight_decay", None)

        def build(model: torch.nn.Module) -> torch.optim.Optimizer:
            decay, no_decay = split_for_weight_decay(model)
            decay_group: dict[str, Any] = {"params": [p for _, p in decay]}
            if decay_wd is not None:
                decay_group["weight_decay"] = decay_wd
            rest = {"params": [p for _, p in no_decay], "weight_decay": 0.0}
            if not self.matrices_only:
                return optimizer_class([decay_group, rest], **kwargs)
            matrices = optimizer_class([decay_group], **kwargs)
            adam_keys = {k: kwargs[k] for k in ("lr", "betas", "eps") if k in kwargs}
            return MatricesAndRest(matrices, torch.optim.AdamW([rest], **adam_keys))

        return build


class MatricesAndRest(torch.optim.Optimizer):
    """Two optimizers stepped as one: a matrices-only peer and AdamW for the other parameters.

    ``param_groups`` are both optimizers' own group dicts, so a learning-rate scheduler over
    this one moves both.
    """

    def __init__(self, matrices: torch.optim.Optimizer, rest: torch.optim.Optimizer) -> None:
        # No super().__init__: the parts own the parameters, their state and their hooks.
        self.parts = (matrices, rest)
        self.defaults = matrices.defaults
        self.param_groups = [g for part in self.parts for g in part.param_groups]
        self.state = matrices.state
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def _eager_heavyball(heavyball: ModuleType) -> None:
    # HeavyBall compiles its step with torch.compile by default; eager on the CPU (no compiler
    # toolchain needed, and the step times are of the algorithm, not of a first compilation).
    heavyball.utils.compile_mode = None


def _distributed_shampoo_grafting(package: ModuleType) -> dict[str, Any]:
    types = importlib.import_module("distributed_shampoo.shampoo_types")
    # README "Example 4: AdamW": grafting beta2 and epsilon are the AdamW run's (ours: 0.99,
    # 1e-8; train/optimizers.py).
    return {"grafting_config": types.AdamGraftingConfig(beta2=0.99, epsilon=1e-8)}


#: The peers, in the order of the report. Versions are those each entry was written for.
PEERS: tuple[PeerOptimizer, ...] = (
    PeerOptimizer(
        name="heavyball-soap",
        library="HeavyBall",
        distribution="heavyball",
        module="heavyball",
        class_name="SOAP",
        written_for="3.2.1",
        family=OptimizerKind.SOAP,
        # README: ``SOAP(model.parameters(), lr=3e-3)``; class defaults: betas (0.9, 0.95),
        # shampoo_beta 0.95, precondition_frequency 2, weight_decay 0.01.
        readme={"lr": 3e-3},
        prepare=_eager_heavyball,
        note="eager (heavyball.utils.compile_mode = None)",
    ),
    PeerOptimizer(
        name="heavyball-kl-shampoo",
        library="HeavyBall",
        distribution="heavyball",
        module="heavyball",
        class_name="KLShampoo",
        written_for="3.2.1",
        family=OptimizerKind.KL_SHAMPOO,
        # The README's SOAP usage applied to its KLShampoo (same defaults: betas (0.9, 0.95),
        # precondition_frequency 2, weight_decay 0.01).
        readme={"lr": 3e-3},
        prepare=_eager_heavyball,
        note="eager (heavyball.utils.compile_mode = None)",
    ),
    PeerOptimizer(
        name="emerging-soap",
        library="NVIDIA Emerging-Optimizers",
        distribution="emerging-optimizers",
        module="emerging_optimizers.soap",
        class_name="SOAP",
        written_for="0.3.0",
        family=OptimizerKind.SOAP,
        # Its README shows no SOAP settings (it points to its tests); lr is required: the SOAP
        # paper's 3e-3; class defaults: betas (0.9, 0.95), shampoo_beta 0.95, weight_decay
        # 0.01, and no precondition_frequency: 0.3.0 refreshes the basis every step.
        readme={"lr": 3e-3},
        matrices_only=True,  # "SOAP is only supported for 2D tensors"
        min_python=(3, 12),
        note="refreshes its basis every step; biases and LayerNorm scales get torch's AdamW",
    ),
    PeerOptimizer(
        name="distributed-shampoo",
        library="Meta distributed_shampoo",
        distribution=None,  # not on PyPI: installed from facebookresearch/optimizers
        module="distributed_shampoo",
        class_name="DistributedShampoo",
        written_for="facebookresearch/optimizers @ d705fcd (README 'Example 4: AdamW')",
        family=OptimizerKind.SHAMPOO,
        # README: take the previous AdamW's settings (ours: lr 6e-3, betas (0.9, 0.99)),
        # epsilon 1e-12, AdamW grafting, decoupled weight decay.
        readme={
            "lr": 6e-3,
            "betas": (0.9, 0.99),
            "epsilon": 1e-12,
            "max_preconditioner_dim": 8192,
            "precondition_frequency": 100,
            "use_decoupled_weight_decay": True,
        },
        readme_objects=_distributed_shampoo_grafting,
    ),
)


def asteria_beta2(kind: OptimizerKind) -> float:
    """The β2 of Asteria's ``kind`` by default (its constructor's ``betas[1]``)."""
    from asteria_client.train.optimizers import _ASTERIA_OPTIMIZERS

    module_name, class_name = _ASTERIA_OPTIMIZERS[kind]
    optimizer_class = getattr(importlib.import_module(module_name), class_name)
    betas = inspect.signature(optimizer_class).parameters["betas"].default
    return float(betas[1])


def continuous_options() -> tuple[tuple[str, Any], ...]:
    """Asteria's keywords for the continuous refresh schedule (``refresh="continuous"``)."""
    return (("refresh", "continuous"),)


def continuous_unavailable_reason() -> str | None:
    """None when SOAP accepts ``refresh="continuous"``; otherwise why not (this build)."""
    from asteria_client.optim.soap import SOAP

    param = torch.nn.Parameter(torch.zeros(2, 2))
    try:
        optimizer = SOAP([param], mode="embedded", refresh="continuous")
    except (TypeError, ValueError) as exc:
        return f"this build's SOAP does not accept refresh='continuous' ({exc})"
    close = getattr(optimizer, "close", None)
    if close is not None:
        close()
    return None
