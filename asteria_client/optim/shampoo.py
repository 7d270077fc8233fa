"""Shampoo with per-tile Adam grafting (Gupta et al. 2018; Anil et al. 2020; Shi et al. 2023).

Per tile with gradient G (order k = number of preconditioned dimensions) and step t:

- momentum ``M = b1 M + (1 - b1) G``; Adam's second moment ``V = b2 V + (1 - b2) G^2``;
- factors ``L_i = b2 L_i + (1 - b2) G_(i) G_(i)^T`` every step;
- every ``precondition_frequency`` steps (starting with the first) the inverse roots
  ``P_i = (L_i / (1 - b2^t) + eps I)^(-1/(2k))`` are recomputed (negative eigenvalues clamped);
- direction ``D = M_hat x_i P_i``, rescaled to the norm of Adam's direction
  ``M_hat / (sqrt(V_hat) + graft_eps)`` (grafting); until the first roots arrive, D is Adam's;
- decoupled weight decay ``p -= lr * wd * p``, then ``p -= lr * D``.

1-D parameters and tiles without preconditioned dims use Adam.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from asteria_client.optim import grouped as batched
from asteria_client.optim.base import AsteriaOptimizer, Mode, check_range, validate_hyperparameters
from asteria_client.optim.blocking import DEFAULT_MAX_DIM_RATIO, BlockingPlan, LargeDimPolicy
from asteria_client.optim.grouped import GroupStep, StorageSpec, set_entry
from asteria_client.optim.installs import Pending
from asteria_client.optim.updates import TINY, adam_direction
from asteria_client.runtime import PreconditionerRequest, PreconditionerResult, TileBlocks
from asteria_server.types import SolveKind


@dataclass(kw_only=True)
class ShampooTile(TileBlocks):
    """One tile's Shampoo state: Adam moments (momentum and the grafting norm), factors and
    their inverse roots (None: not computed yet, or a dim not preconditioned)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    factors: list[torch.Tensor | None]
    roots: list[torch.Tensor | None]


class Shampoo(AsteriaOptimizer):
    """Shampoo with Adam grafting and a pluggable source of inverse roots.

    Args:
        params: ``model.named_parameters()`` or param groups of ``(name, tensor)`` pairs.
        lr: learning rate (applied to the grafted direction, so Adam-like values work).
        betas: (momentum, second-moment/factor EMA).
        eps: added to the factors' eigenvalues before the root (``epsilon=`` is a deprecated
            alias).
        weight_decay: decoupled weight decay.
        graft_eps: Adam epsilon of the grafting direction.
        root_exponent: override the root exponent (default ``1 / (2k)`` for k factors).
        precondition_frequency, max_preconditioner_dim, large_dim_policy, mode, nonfinite,
            staleness_budget, barrier_timeout_s, engine_config: as in
            :class:`~asteria_client.optim.soap.SOAP`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        *,
        epsilon: float | None = None,
        graft_eps: float = 1e-8,
        root_exponent: float | None = None,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 1024,
        large_dim_policy: LargeDimPolicy | str = LargeDimPolicy.TILE,
        max_dim_ratio: float | None = DEFAULT_MAX_DIM_RATIO,
        mode: Mode | str | None = None,
        nonfinite: str = "raise",
        **kwargs: Any,
    ) -> None:
        if epsilon is not None:
            warnings.warn(
                "Shampoo(epsilon=...) is deprecated: the optimizers spell it eps=",
                FutureWarning,
                stacklevel=2,
            )
            eps = epsilon
        validate_hyperparameters(
            lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, graft_eps=graft_eps
        )
        if root_exponent is not None:
            check_range("root_exponent", root_exponent, 0.0, float("inf"))
            if root_exponent == 0:
                raise ValueError("root_exponent must be > 0")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "graft_eps": graft_eps,
            "root_exponent": root_exponent,
            "precondition_frequency": precondition_frequency,
            "max_preconditioner_dim": max_preconditioner_dim,
            "large_dim_policy": large_dim_policy,
            "max_dim_ratio": max_dim_ratio,
        }
        super().__init__(params, defaults, mode=mode, nonfinite=nonfinite, **kwargs)

    tile_types = (ShampooTile,)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Checkpoints from before the rename spell the root epsilon "epsilon".
        groups = [
            {("eps" if k == "epsilon" else k): v for k, v in group.items()}
            for group in state_dict.get("param_groups", [])
        ]
        super().load_state_dict({**state_dict, "param_groups": groups})

    storage_spec: ClassVar[dict[type, StorageSpec]] = {
        ShampooTile: StorageSpec(
            tensors=("exp_avg", "exp_avg_sq"), lists=("factors",), optional=("roots",)
        )
    }

    def _first_step(
        self,
        name: str,
        param: torch.Tensor,
        tiles: list[torch.Tensor],
        state: dict[str, Any],
        group: dict[str, Any],
        plan: BlockingPlan,
    ) -> bool:
        state["tiles"] = [
            self._init_tile(name, tp.index, g) for tp, g in zip(plan.tiles, tiles, strict=True)
        ]
        return True  # the first step also updates (with Adam's direction until roots arrive)

    def _step_groups(self, steps: list[GroupStep]) -> None:
        for work in steps:
            group, stacks, g = work.hyper, work.group, work.grads
            beta1, beta2 = group["betas"]
            first = batched.coefficients(work.mask, beta1)
            second = batched.coefficients(work.mask, beta2)
            batched.ema_(stacks.tensors["exp_avg"], g, beta1, first)
            batched.ema_square_(stacks.tensors["exp_avg_sq"], g, beta2, second)
            for dim, factor in enumerate(stacks.stacked_all("factors")):
                if factor is not None:
                    batched.ema_(factor, batched.factor_statistic(g, dim), beta2, second)
            if stacks.has_blocks and (work.step - 1) % group["precondition_frequency"] == 0:
                for tile in work.tiles:
                    self._submit_tile(tile, work.step, group)
        for work in steps:  # after every submit: the step's snapshots leave in one copy
            if work.group.has_blocks:
                self._sync_tiles(work.tiles, work.step, work.hyper)
        updates = [
            (work, self._direction(work), -work.hyper["lr"], _decay(work.hyper)) for work in steps
        ]
        self._apply_updates(updates, decay_first=True)

    def _init_tile(self, name: str, tile: int, grad: torch.Tensor) -> ShampooTile:
        blocks = self._block_names(name, tile)
        factors = self._zero_factors(blocks, grad)
        return ShampooTile.named(
            blocks,
            exp_avg=torch.zeros_like(grad),
            exp_avg_sq=torch.zeros_like(grad),
            factors=factors,
            roots=[None] * len(factors),
        )

    def _make_request(
        self, tile: ShampooTile, dim: int, version: int, group: dict[str, Any]
    ) -> PreconditionerRequest:
        num_factors = sum(f is not None for f in tile.factors)
        factor = tile.factors[dim]
        block = tile.blocks[dim]
        assert factor is not None and block is not None  # only preconditioned dims have blocks
        return PreconditionerRequest(
            block=block,
            version=version,
            kind=SolveKind.INVERSE_ROOT,
            matrix=factor / (1 - group["betas"][1] ** version),
            exponent=group["root_exponent"] or 1.0 / (2 * num_factors),
            epsilon=group["eps"],
            deadline_step=self.runtime.deadline_step(version, group["precondition_frequency"]),
        )

    def _install(self, tile: ShampooTile, dim: int, result: PreconditionerResult) -> None:
        self._put_root(tile, dim, result)
        tile.versions[dim] = result.version

    @staticmethod
    def _put_root(tile: ShampooTile, dim: int, result: PreconditionerResult) -> None:
        factor = tile.factors[dim]
        assert factor is not None
        set_entry(tile, "roots", dim, result.matrix.to(factor.device, factor.dtype))

    # ------------------------------------------------------------------ batched installs
    def _batches_installs(self) -> bool:
        return "_install" not in vars(self) and type(self)._install is Shampoo._install

    def _note_install(self, tile: ShampooTile, dim: int, result: PreconditionerResult) -> None:
        tile.versions[dim] = result.version  # a root request reads the factor alone

    def _apply_noted(self, item: Pending) -> None:
        tile, dim, result, _ = item
        self._put_root(tile, dim, result)

    def _install_group(self, item: Pending) -> batched.TileGroup | None:
        return batched.backing_group(item[0], (), ("roots", item[1]))

    def _install_group_rows(self, group: batched.TileGroup, dim: int, rows: list[Pending]) -> None:
        """The round's roots with one indexed copy."""
        like = group.entries[("roots", dim)]
        index = torch.tensor([batched.row_of(r[0]) for r in rows], device=like.device)
        roots = torch.stack([r[2].matrix.to(like.device, like.dtype) for r in rows])
        batched.set_rows(group, "roots", dim, index, roots, [r[0] for r in rows])

    @staticmethod
    def _direction(work: GroupStep) -> torch.Tensor:
        """Per tile: ``M_hat x_i P_i`` grafted to the norm of Adam's direction; Adam's own
        direction for a tile with no root yet."""
        group, stacks = work.hyper, work.group
        exp_avg = stacks.tensors["exp_avg"]
        adam = adam_direction(
            exp_avg, stacks.tensors["exp_avg_sq"], work.step, group["betas"], group["graft_eps"]
        )
        roots = stacks.stacked_all("roots")
        if all(r is None for r in roots):
            return adam
        m_hat = exp_avg / (1 - group["betas"][0] ** work.step)
        direction = batched.apply_on_dims(m_hat, roots)
        dims = batched.tile_dims(direction)
        adam_norm = torch.linalg.vector_norm(adam, dim=dims, keepdim=True)
        norm = torch.linalg.vector_norm(direction, dim=dims, keepdim=True).clamp_min(TINY)
        direction.mul_(adam_norm / norm)
        has_root = stacks.masks["roots"].reshape(adam_norm.shape)
        return torch.where(has_root, direction, adam)

    def _tile_from_parts(
        self,
        key: str,
        index: int,
        moments: dict[str, torch.Tensor],
        factors: list[torch.Tensor | None],
        diagonals: list[torch.Tensor | None],
    ) -> ShampooTile:
        """A resharded tile (see :mod:`~asteria_client.optim.reshard`): moments are in the
        parameter's coordinates already; the roots come with the next result."""
        return ShampooTile.named(
            self._block_names(key, index),
            exp_avg=moments["exp_avg"],
            exp_avg_sq=moments["exp_avg_sq"],
            factors=factors,
            roots=[None] * len(factors),
        )


def _decay(group: dict[str, Any]) -> float:
    """Decoupled weight decay of one step: ``p *= 1 - lr * wd``."""
    return group["lr"] * group["weight_decay"]
