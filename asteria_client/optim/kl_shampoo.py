"""KL-Shampoo: Shampoo's factors estimated by Kullback-Leibler minimization (Lin et al. 2025,
arXiv 2509.03378), run in an eigenbasis refreshed by QR as in SOAP.

Per tile W in R^{d_1 x ... x d_k} with gradient G, each preconditioned dimension i keeps a factor
L_i, a basis Q_i and eigenvalue estimates lambda_i; an unpreconditioned dimension keeps only a
diagonal lambda_i (Q_i = I). With ``P_j^{-1} = Q_j diag(reg(lambda_j))^{-1} Q_j^T`` from the
*stored* (possibly stale) bases and eigenvalues, and N_i = numel / d_i:

- ``H_i = G_(i) (kron_{j != i} P_j^{-1}) G_(i)^T / N_i`` (for a matrix: ``G R^-1 G^T / n``);
- ``L_i = b2 L_i + (1 - b2) H_i`` — every factor from the old ones;
- ``lambda_i = b2 lambda_i + (1 - b2) diag(Q_i^T H_i Q_i)`` — eigenvalues refreshed every step;
- momentum ``M = b1 M + (1 - b1) G`` (kept in the parameter's own coordinates);
- update ``-lr * (M_hat x_i Q_i^T) / prod_i sqrt(reg(lambda_i)) x_i Q_i`` (that is
  ``L^{-1/2} M R^{-1/2}`` applied in the eigenbasis), then decoupled weight decay;
- every ``precondition_frequency`` steps each basis is refreshed by one QR power step (full eigh
  at the start); on install, lambda_i becomes diag(Q_i^T L_i Q_i) with L_i the *snapshot* Q_i
  was computed from (the solver returns it with the basis): a basis and its eigenvalues are one
  pair even when the basis arrives steps later. No Adam second moment is kept for
  preconditioned tiles.

The first step only initializes: ``L_i = s * G_(i) G_(i)^T / N_i`` with s chosen so the Kronecker
product of the factors has the trace of ``vec(G) vec(G)^T`` (the KL fixed point's scale), and the
first bases come from eigh. 1-D parameters use Adam. ``reg(lam) = max(lam, 0) + eps +
damping * max(lam)`` (see :func:`regularized`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from asteria_client.optim import grouped as batched
from asteria_client.optim.base import AsteriaOptimizer, Mode, check_range, validate_hyperparameters
from asteria_client.optim.blocking import DEFAULT_MAX_DIM_RATIO, BlockingPlan, LargeDimPolicy
from asteria_client.optim.grouped import GroupStep, StorageSpec, set_entry
from asteria_client.optim.installs import Pending
from asteria_client.optim.tensor_ops import factor_statistic
from asteria_client.optim.updates import AdamTile, adam_direction
from asteria_client.runtime import PreconditionerResult, TileBlocks


@dataclass(kw_only=True)
class KLTile(TileBlocks):
    """One tile's KL-Shampoo state: momentum (in the parameter's coordinates), factors, their
    bases (None: the identity) and the eigenvalue estimates of every dim in its basis."""

    exp_avg: torch.Tensor
    factors: list[torch.Tensor | None]
    bases: list[torch.Tensor | None]
    eigenvalues: list[torch.Tensor]


def regularized(eigenvalues: torch.Tensor, eps: float, damping: float) -> torch.Tensor:
    """``max(lam, 0) + eps + damping * max(lam)``: bounds each factor's condition number by about
    1 / damping, so directions a gradient never visited (rank-deficient factors, unused embedding
    rows) are not amplified by 1 / eps when rounding noise reaches them."""
    lam = eigenvalues.clamp_min(0)
    if lam.dim() == 1:
        top = lam.max() if lam.numel() else lam.new_zeros(())
    else:  # [k, n]: one maximum per tile
        top = lam.amax(dim=-1, keepdim=True)
    return lam + (eps + damping * top)


class KLShampoo(AsteriaOptimizer):
    """KL-Shampoo with QR-refreshed eigenbases and a pluggable basis source.

    Args:
        params: ``model.named_parameters()`` or param groups of ``(name, tensor)`` pairs.
        lr, betas, weight_decay: step size, (momentum, factor/eigenvalue EMA), decoupled decay.
            β1 = 0.9 and precondition_frequency = 5 come from ``asteria bench defaults``
            (README, "Defaults from evidence"); ``KLShampoo(params,
            **KLShampoo.REFERENCE_SETTINGS)`` restores the earlier (0.95, 0.95) and 10.
        eps, damping: eigenvalues are regularized as ``max(lam, 0) + eps + damping * max(lam)``
            before the inverse (square) roots.
        precondition_frequency, max_preconditioner_dim, large_dim_policy, mode, nonfinite,
            staleness_budget, barrier_timeout_s, engine_config: as in
            :class:`~asteria_client.optim.soap.SOAP`.
    """

    #: The β1 and refresh interval before ``asteria bench defaults`` (SOAP's reference ones).
    REFERENCE_SETTINGS: ClassVar[dict[str, Any]] = {
        "betas": (0.95, 0.95),
        "precondition_frequency": 10,
    }

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        damping: float = 1e-4,
        precondition_frequency: int = 5,
        max_preconditioner_dim: int = 10000,
        large_dim_policy: LargeDimPolicy | str = LargeDimPolicy.TILE,
        max_dim_ratio: float | None = DEFAULT_MAX_DIM_RATIO,
        mode: Mode | str | None = None,
        nonfinite: str = "raise",
        **kwargs: Any,
    ) -> None:
        validate_hyperparameters(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
        check_range("damping", damping, 0.0, 1.0)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "damping": damping,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "max_preconditioner_dim": max_preconditioner_dim,
            "large_dim_policy": large_dim_policy,
            "max_dim_ratio": max_dim_ratio,
        }
        super().__init__(params, defaults, mode=mode, nonfinite=nonfinite, **kwargs)

    needs_first_result = True
    supports_continuous = True
    tile_types = (KLTile, AdamTile)

    storage_spec: ClassVar[dict[type, StorageSpec]] = {
        KLTile: StorageSpec(
            tensors=("exp_avg",), lists=("factors", "eigenvalues"), optional=("bases",)
        ),
        AdamTile: StorageSpec(tensors=("exp_avg", "exp_avg_sq")),
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
        """Adam tiles for a 1-D parameter (which steps now); otherwise initialization only."""
        if plan.diagonal:
            g = tiles[0]
            state["tiles"] = [AdamTile(exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g))]
            return True
        state["tiles"] = [
            self._init_tile(name, tp.index, g) for tp, g in zip(plan.tiles, tiles, strict=True)
        ]
        for tile in state["tiles"]:
            self._refresh_tile(tile, 1, group, due=True)
        return False

    def _step_groups(self, steps: list[GroupStep]) -> None:
        updates = []
        for work in steps:
            group, stacks, g = work.hyper, work.group, work.grads
            beta1, beta2 = group["betas"]
            decay = group["lr"] * group["weight_decay"]
            if isinstance(work.tiles[0], AdamTile):
                exp_avg, exp_avg_sq = stacks.tensors["exp_avg"], stacks.tensors["exp_avg_sq"]
                batched.ema_(exp_avg, g, beta1, batched.coefficients(work.mask, beta1))
                batched.ema_square_(exp_avg_sq, g, beta2, batched.coefficients(work.mask, beta2))
                direction = adam_direction(
                    exp_avg, exp_avg_sq, work.step, group["betas"], group["eps"]
                )
                updates.append((work, direction, -group["lr"], decay))
                continue
            self._sync_tiles(work.tiles, work.step, group)
            self._update_statistics(work, beta2, group["eps"], group["damping"])
            exp_avg = stacks.tensors["exp_avg"]
            batched.ema_(exp_avg, g, beta1, batched.coefficients(work.mask, beta1))
            # the direction is linear in the momentum: its bias correction goes into the step
            bias_correction = 1 - beta1 ** (work.step - 1)
            bases = stacks.stacked_all("bases")
            rotated = batched.project(exp_avg, bases)
            order = len(stacks.shape)
            for dim in range(order):
                lam = stacks.entries[("eigenvalues", dim)]
                scale = regularized(lam, group["eps"], group["damping"]).rsqrt()
                rotated = rotated * batched.along(scale, dim, order)
            direction = batched.project(rotated, bases, back=True)
            updates.append((work, direction, -group["lr"] / bias_correction, decay))
        self._apply_updates(updates, decay_first=True)
        for work in steps:
            if isinstance(work.tiles[0], AdamTile):
                continue
            due = (work.step - 1) % work.hyper["precondition_frequency"] == 0
            for tile in work.tiles:
                self._refresh_tile(tile, work.step, work.hyper, due=due)

    # ------------------------------------------------------------------ statistics
    def _init_tile(self, name: str, tile: int, grad: torch.Tensor) -> KLTile:
        numel = grad.numel()
        stats = [factor_statistic(grad, d) / (numel // size) for d, size in enumerate(grad.shape)]
        traces = torch.stack([s.trace() for s in stats])
        total = grad.square().sum()
        if bool(total > 0) and bool((traces > 0).all()):
            scale = float((total / traces.prod()) ** (1.0 / len(stats)))
        else:
            scale = 1.0
        blocks = self._block_names(name, tile)
        stats = [stat * scale for stat in stats]
        factors = [
            None if block is None else stat for block, stat in zip(blocks, stats, strict=True)
        ]
        return KLTile.named(
            blocks,
            exp_avg=torch.zeros_like(grad),
            factors=factors,
            bases=[None] * len(factors),
            # unpreconditioned dims keep a diagonal preconditioner: eigenvalues in basis I
            eigenvalues=[stat.diagonal().clone() for stat in stats],
        )

    @staticmethod
    def _update_statistics(work: GroupStep, beta: float, eps: float, damping: float) -> None:
        """Factors and eigenvalue EMAs of a group's tiles from the *old* bases and eigenvalues."""
        stacks, grad = work.group, work.grads
        order = len(stacks.shape)
        bases = stacks.stacked_all("bases")
        eigenvalues = [stacks.entries[("eigenvalues", dim)] for dim in range(order)]
        inv_sqrt = [regularized(lam, eps, damping).rsqrt() for lam in eigenvalues]
        rotated = batched.project(grad, bases)
        numel = math.prod(stacks.shape)
        new_terms = []
        for dim in range(order):
            whitened = rotated
            for other in range(order):
                if other != dim:
                    whitened = whitened * batched.along(inv_sqrt[other], other, order)
            norm = stacks.shape[dim] / numel
            others = [d + 1 for d in range(order) if d != dim]
            squared = whitened.square()
            new_terms.append(squared.sum(dim=others) if others else squared)
            factor = stacks.stacked("factors", dim)
            if factor is not None:
                basis = bases[dim]
                unrotated = (
                    whitened if basis is None else batched.mode_product(whitened, basis, dim)
                )
                statistic = batched.factor_statistic(unrotated, dim)
                coef = batched.coefficients(work.mask, beta, norm)
                batched.ema_(factor, statistic, beta, coef, scale=norm)
        for dim, (lam, term) in enumerate(zip(eigenvalues, new_terms, strict=True)):
            norm = stacks.shape[dim] / numel  # each term's 1 / N_i, applied with the EMA
            coef = batched.coefficients(work.mask, beta, norm)
            batched.ema_(lam, term, beta, coef, scale=norm)

    # ------------------------------------------------------------------ bases
    _make_request = AsteriaOptimizer._eigenbasis_request

    @staticmethod
    def _install(tile: KLTile, dim: int, result: PreconditionerResult) -> None:
        KLShampoo._put_basis(tile, dim, result)
        tile.versions[dim] = result.version

    @staticmethod
    def _put_basis(tile: KLTile, dim: int, result: PreconditionerResult) -> None:
        """The basis and its eigenvalues into use along ``dim``."""
        factor = tile.factors[dim]
        assert factor is not None  # only preconditioned dims have blocks
        basis = result.matrix.to(device=factor.device, dtype=factor.dtype)
        set_entry(tile, "bases", dim, basis)
        if result.eigenvalues is not None:
            # The eigenvalues of the snapshot the basis was computed from, never the factor's
            # newer value in another basis: a basis and its eigenvalues stay one pair.
            eigenvalues = result.eigenvalues.to(device=factor.device, dtype=factor.dtype)
        else:
            eigenvalues = (basis * (factor @ basis)).sum(dim=0)
        set_entry(tile, "eigenvalues", dim, eigenvalues.clamp_min(0))

    # ------------------------------------------------------------------ batched installs
    def _batches_installs(self) -> bool:
        return "_install" not in vars(self) and type(self)._install is KLShampoo._install

    def _note_install(self, tile: KLTile, dim: int, result: PreconditionerResult) -> None:
        tile.versions[dim] = result.version

    def _apply_noted(self, item: Pending) -> None:
        tile, dim, result, _ = item
        KLShampoo._put_basis(tile, dim, result)

    def _install_group(self, item: Pending) -> batched.TileGroup | None:
        """Results with their eigenvalues, into a group backing the basis and eigenvalues."""
        tile, dim, result = item[0], item[1], item[2]
        group = batched.backing_group(tile, (), ("bases", dim))
        if result.eigenvalues is None or group is None:
            return None
        return group if batched.backing_group(tile, (), ("eigenvalues", dim)) is group else None

    def _install_group_rows(self, group: batched.TileGroup, dim: int, rows: list[Pending]) -> None:
        """The round's bases and eigenvalues with one indexed copy each."""
        like = group.entries[("eigenvalues", dim)]
        index = torch.tensor([batched.row_of(r[0]) for r in rows], device=like.device)
        tiles = [r[0] for r in rows]
        bases = torch.stack([r[2].matrix.to(like.device, like.dtype) for r in rows])
        lams = torch.stack([_eigenvalues(r[2]).to(like.device, like.dtype) for r in rows])
        batched.set_rows(group, "bases", dim, index, bases, tiles)
        batched.set_rows(group, "eigenvalues", dim, index, lams.clamp_min(0), tiles)

    # ------------------------------------------------------------------ resharding
    factors_are_means = True  # each factor is divided by the tile's other elements

    def _moments_in_param_coords(self, tile: KLTile | AdamTile) -> dict[str, torch.Tensor]:
        if isinstance(tile, AdamTile):
            return {"exp_avg": tile.exp_avg, "exp_avg_sq": tile.exp_avg_sq}
        return {"exp_avg": tile.exp_avg}

    def _diagonals(self, tile: KLTile | AdamTile) -> list[torch.Tensor | None]:
        """The eigenvalues of unpreconditioned dims: a diagonal preconditioner in basis I."""
        if isinstance(tile, AdamTile):
            return []
        return [
            lam if factor is None else None
            for lam, factor in zip(tile.eigenvalues, tile.factors, strict=True)
        ]

    def _tile_from_parts(
        self,
        key: str,
        index: int,
        moments: dict[str, torch.Tensor],
        factors: list[torch.Tensor | None],
        diagonals: list[torch.Tensor | None],
    ) -> KLTile | AdamTile:
        exp_avg = moments["exp_avg"]
        if all(factor is None for factor in factors):  # a 1-D parameter: Adam
            exp_avg_sq = moments.get("exp_avg_sq")
            return AdamTile(
                exp_avg=exp_avg,
                exp_avg_sq=torch.zeros_like(exp_avg) if exp_avg_sq is None else exp_avg_sq,
            )
        eigenvalues = []
        for dim, factor in enumerate(factors):
            diagonal = diagonals[dim] if dim < len(diagonals) else None
            if factor is not None:  # basis I until the first basis arrives
                eigenvalues.append(factor.diagonal().clamp_min(0))
            elif diagonal is not None:
                eigenvalues.append(diagonal)
            else:
                eigenvalues.append(exp_avg.new_zeros(exp_avg.shape[dim]))
        return KLTile.named(
            self._block_names(key, index),
            exp_avg=exp_avg,
            factors=factors,
            bases=[None] * len(factors),
            eigenvalues=eigenvalues,
        )


def _eigenvalues(result: PreconditionerResult) -> torch.Tensor:
    assert result.eigenvalues is not None  # batched only with their eigenvalues
    return result.eigenvalues
