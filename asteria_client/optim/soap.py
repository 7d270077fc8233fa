"""SOAP: Adam in the slowly rotating eigenbasis of Shampoo's preconditioner.

Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam" (2024), reference code
nikhilvyas/SOAP. Per tile with gradient G and factors L_i (one per preconditioned dimension):

- the first step only initializes: L_i = (1 - beta) G_(i) G_(i)^T and Q_i from a full eigh
  (columns by descending eigenvalue); the weights do not move;
- each later step t: G' = G x_i Q_i^T; first and second Adam moments m, v of G' live in the
  basis; the update is ``-lr * sqrt(1 - b2^t) / (1 - b1^t) * (m / (sqrt(v) + eps)) x_i Q_i``,
  then decoupled weight decay ``p -= lr * wd * p``;
- the factors are updated after the parameter step, with the same G;
- every ``precondition_frequency`` steps each basis is refreshed (sort by diag(Q^T L Q),
  permute Q and v, one power-iteration step with QR); m is re-expressed in the new basis.

Where the basis comes from is pluggable (``mode``); a new basis is installed exactly once per
version: m is rotated with ``Q_new^T Q_old``; v is permuted by the refresh's column order when the
refresh started from the basis in use, otherwise rotated with the squared overlaps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from asteria_client.optim import grouped as batched
from asteria_client.optim.base import AsteriaOptimizer, Mode, check_range, validate_hyperparameters
from asteria_client.optim.blocking import DEFAULT_MAX_DIM_RATIO, BlockingPlan, LargeDimPolicy
from asteria_client.optim.grouped import GroupStep, StorageSpec, set_entry, set_tensor
from asteria_client.optim.installs import Pending
from asteria_client.optim.tensor_ops import factor_statistic, mode_product, project
from asteria_client.runtime import PreconditionerResult, TileBlocks


@dataclass(kw_only=True)
class SOAPTile(TileBlocks):
    """One tile's SOAP state: Adam moments in the eigenbasis, factors and their bases (None:
    the identity, until the first basis arrives or where a dim is not preconditioned)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    factors: list[torch.Tensor | None]
    bases: list[torch.Tensor | None]


class SOAP(AsteriaOptimizer):
    """SOAP with Asteria's blocking and pluggable eigenbasis source.

    Args:
        params: ``model.named_parameters()`` or param groups whose ``"params"`` are
            ``(name, tensor)`` pairs.
        lr, betas, eps, weight_decay: as in Adam(W); lr, eps and weight decay follow the
            reference code, β1 = 0.9 (the reference's 0.95) comes from ``asteria bench
            defaults`` (README, "Defaults from evidence").
        shampoo_beta: EMA factor of the Kronecker factors; ``None`` uses ``betas[1]``.
        precondition_frequency: steps between basis refreshes: 5 by the same evidence (the
            reference's 10). ``SOAP(params, **SOAP.REFERENCE_SETTINGS)`` restores both.
        max_preconditioner_dim: largest factor dimension; see :mod:`blocking`.
        large_dim_policy: ``"tile"`` (default) or ``"identity"`` for dims above the limit.
        max_dim_ratio: dims above 1024 and above this many times the parameter's other dims are
            left unpreconditioned (their solve would cost far more than the update it serves);
            ``None`` preconditions them. See :mod:`blocking`.
        model: the model the parameters belong to: names unnamed parameters (checkpoints).
        correct_bias: Adam bias correction of the step size.
        mode: where bases are computed: ``"embedded"`` (default without ``ASTERIA_ADDRESS``:
            an engine in this process, worker processes), ``"native"`` (in step, on the
            parameter's device; the baseline), ``"daemon"`` (the node daemon).
        staleness_budget: S, the refresh intervals a basis may lag behind native (0 = sync).
            With S >= 1 the first steps use the identity basis (plain Adam) until the first
            basis arrives, at most S intervals later; S = 0 waits for it, as native mode does.
        barrier_timeout_s: the longest wait for a late result before computing it locally.
        engine_config: :class:`~asteria_server.engine.EngineConfig` of the embedded engine.
        nonfinite: ``"raise"`` (default) or ``"skip"`` steps whose gradients hold NaN/Inf.
        compile: run each tile group's math through ``torch.compile`` (``True``: inductor, or
            a backend's name); off by default: on the CPU inductor compiled it slower than
            eager (see :mod:`asteria_client.bench.step`); meant for GPUs, unmeasured there yet.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        shampoo_beta: float | None = None,
        precondition_frequency: int = 5,
        max_preconditioner_dim: int = 10000,
        large_dim_policy: LargeDimPolicy | str = LargeDimPolicy.TILE,
        max_dim_ratio: float | None = DEFAULT_MAX_DIM_RATIO,
        correct_bias: bool = True,
        mode: Mode | str | None = None,
        nonfinite: str = "raise",
        **kwargs: Any,
    ) -> None:
        validate_hyperparameters(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
        if shampoo_beta is not None:
            check_range("shampoo_beta", shampoo_beta, 0.0, 1.0)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "shampoo_beta": shampoo_beta,
            "precondition_frequency": precondition_frequency,
            "max_preconditioner_dim": max_preconditioner_dim,
            "large_dim_policy": large_dim_policy,
            "max_dim_ratio": max_dim_ratio,
            "correct_bias": correct_bias,
        }
        super().__init__(params, defaults, mode=mode, nonfinite=nonfinite, **kwargs)

    #: The reference implementation's β1 and refresh interval, where Asteria's defaults differ.
    REFERENCE_SETTINGS: ClassVar[dict[str, Any]] = {
        "betas": (0.95, 0.95),
        "precondition_frequency": 10,
    }

    needs_first_result = True
    supports_continuous = True
    supports_compile = True
    tile_types = (SOAPTile,)

    storage_spec: ClassVar[dict[type, StorageSpec]] = {
        SOAPTile: StorageSpec(
            tensors=("exp_avg", "exp_avg_sq"), lists=("factors",), optional=("bases",)
        )
    }

    # ------------------------------------------------------------------ the step
    def _first_step(
        self,
        name: str,
        param: torch.Tensor,
        tiles: list[torch.Tensor],
        state: dict[str, Any],
        group: dict[str, Any],
        plan: BlockingPlan,
    ) -> bool:
        """Initialization only: factors and first bases, no parameter update."""
        state["tiles"] = [
            self._init_tile(name, tp.index, g) for tp, g in zip(plan.tiles, tiles, strict=True)
        ]
        beta = _shampoo_beta(group)
        for tile, g in zip(state["tiles"], tiles, strict=True):
            for dim, factor in enumerate(tile.factors):
                if factor is not None:
                    factor.lerp_(factor_statistic(g, dim), 1 - beta)
            self._refresh_tile(tile, 1, group, due=True)
        return False

    def _step_groups(self, steps: list[GroupStep]) -> None:
        for work in steps:
            if work.group.has_blocks:
                self._sync_tiles(work.tiles, work.step, work.hyper)  # results; the budget
        updates = []
        for work in steps:
            group, stacks = work.hyper, work.group
            t = work.step - 1  # the reference counts steps after the initialization
            beta1, beta2 = group["betas"]
            direction = self.kernels(stacks, soap_direction)
            update = direction(
                work.grads,
                stacks.tensors["exp_avg"],
                stacks.tensors["exp_avg_sq"],
                tuple(stacks.stacked_all("bases")),
                group["eps"],
                (beta1, batched.coefficients(work.mask, beta1)),
                (beta2, batched.coefficients(work.mask, beta2)),
            )
            step_size = group["lr"]
            if group["correct_bias"]:
                step_size = step_size * (1 - beta2**t) ** 0.5 / (1 - beta1**t)
            updates.append((work, update, -step_size, group["lr"] * group["weight_decay"]))
        self._apply_updates(updates, decay_first=False)
        for work in steps:  # the factors after the parameter step, with the same gradient
            update_factors = self.kernels(work.group, soap_factors)
            factors = tuple(work.group.stacked_all("factors"))
            update_factors(
                work.grads, factors, batched.weight(work.mask, 1 - _shampoo_beta(work.hyper))
            )
            if not work.group.has_blocks:
                continue
            due = (work.step - 1) % work.hyper["precondition_frequency"] == 0
            for tile in work.tiles:
                self._refresh_tile(tile, work.step, work.hyper, due=due)

    # ------------------------------------------------------------------ tiles and blocks
    def _init_tile(self, name: str, tile: int, grad: torch.Tensor) -> SOAPTile:
        blocks = self._block_names(name, tile)
        factors = self._zero_factors(blocks, grad)
        return SOAPTile.named(
            blocks,
            exp_avg=torch.zeros_like(grad),
            exp_avg_sq=torch.zeros_like(grad),
            factors=factors,
            bases=[None] * len(factors),
        )

    _make_request = AsteriaOptimizer._eigenbasis_request

    @staticmethod
    def _install(tile: SOAPTile, dim: int, result: PreconditionerResult) -> None:
        """Move the moments into the new basis along ``dim`` — once per installed version."""
        same_base = result.base_version == tile.versions[dim] and tile.bases[dim] is not None
        SOAP._rotate(tile, dim, result, same_base)
        tile.versions[dim] = result.version

    @staticmethod
    def _rotate(tile: SOAPTile, dim: int, result: PreconditionerResult, same_base: bool) -> None:
        """The moments into ``result``'s basis along ``dim``, and the basis into use;
        ``same_base``: the result was computed from the basis in use (its rotation and
        permutation apply)."""
        exp_avg, exp_avg_sq = tile.exp_avg, tile.exp_avg_sq
        new = result.matrix.to(device=exp_avg.device, dtype=exp_avg.dtype)
        overlap = _overlap(tile, dim, result, same_base, new)
        set_tensor(tile, "exp_avg", mode_product(exp_avg, overlap, dim))
        if same_base and result.permutation is not None:
            perm = result.permutation.to(exp_avg.device)
            set_tensor(tile, "exp_avg_sq", exp_avg_sq.index_select(dim, perm))
        else:
            set_tensor(tile, "exp_avg_sq", mode_product(exp_avg_sq, overlap.square(), dim))
        set_entry(tile, "bases", dim, new)

    # ------------------------------------------------------------------ batched installs
    def _batches_installs(self) -> bool:
        return "_install" not in vars(self) and type(self)._install is SOAP._install

    def _note_install(self, tile: SOAPTile, dim: int, result: PreconditionerResult) -> bool:
        same_base = result.base_version == tile.versions[dim] and tile.bases[dim] is not None
        tile.versions[dim] = result.version
        return same_base

    def _apply_noted(self, item: Pending) -> None:
        tile, dim, result, same_base = item
        SOAP._rotate(tile, dim, result, same_base)

    def _install_group(self, item: Pending) -> batched.TileGroup | None:
        """2-D tiles only: their rotations are products that batch exactly."""
        group = batched.backing_group(item[0], ("exp_avg", "exp_avg_sq"), ("bases", item[1]))
        return group if group is not None and len(group.shape) == 2 else None

    def _install_group_rows(self, group: batched.TileGroup, dim: int, rows: list[Pending]) -> None:
        _rotate_rows(group, dim, rows)

    # ------------------------------------------------------------------ resharding
    def _moments_in_param_coords(self, tile: SOAPTile) -> dict[str, torch.Tensor]:
        """The moments out of the eigenbasis: exactly for the first, through the squared basis
        for the second (as :meth:`_install` moves it between bases)."""
        squared = [None if basis is None else basis.square() for basis in tile.bases]
        return {
            "exp_avg": project(tile.exp_avg, tile.bases, back=True),
            "exp_avg_sq": project(tile.exp_avg_sq, squared, back=True),
        }

    def _tile_from_parts(
        self,
        key: str,
        index: int,
        moments: dict[str, torch.Tensor],
        factors: list[torch.Tensor | None],
        diagonals: list[torch.Tensor | None],
    ) -> SOAPTile:
        return SOAPTile.named(
            self._block_names(key, index),
            exp_avg=moments["exp_avg"],
            exp_avg_sq=moments["exp_avg_sq"],
            factors=factors,
            bases=[None] * len(factors),
        )


def _overlap(
    tile: SOAPTile, dim: int, result: PreconditionerResult, same_base: bool, new: torch.Tensor
) -> torch.Tensor:
    """The change of basis along ``dim`` from the basis in use to ``new``."""
    old = tile.bases[dim]
    if old is None:
        return new.T
    if same_base and result.rotation is not None:
        return result.rotation.to(device=new.device, dtype=new.dtype)
    return new.T @ old  # an intermediate version was skipped: from the one in use


def _permutation(result: PreconditionerResult, device: torch.device) -> torch.Tensor:
    assert result.permutation is not None  # a permuted row's
    return result.permutation.to(device)


def _rotate_rows(group: batched.TileGroup, dim: int, rows: list[Pending]) -> None:
    """:meth:`SOAP._rotate` of several tiles of one group along one dim, batched: one stack
    of the overlaps, one product per moment (a gather for permuted second moments), one
    indexed copy back, one for the bases."""
    exp_avg, exp_avg_sq = group.tensors["exp_avg"], group.tensors["exp_avg_sq"]
    device, dtype = exp_avg.device, exp_avg.dtype
    index = torch.tensor([batched.row_of(tile) for tile, *_ in rows], device=device)
    news, overlaps, permuted = [], [], []
    for tile, _, result, same_base in rows:
        new = result.matrix.to(device=device, dtype=dtype)
        news.append(new)
        overlaps.append(_overlap(tile, dim, result, same_base, new))
        permuted.append(same_base and result.permutation is not None)
    overlap = torch.stack(overlaps)
    exp_avg.index_copy_(0, index, batched.mode_product(exp_avg[index], overlap, dim))
    if all(permuted):
        perms = torch.stack([_permutation(r[2], device) for r in rows])
        exp_avg_sq.index_copy_(0, index, batched.permute_along(exp_avg_sq[index], perms, dim))
    elif not any(permuted):
        squared = overlap.square()
        exp_avg_sq.index_copy_(0, index, batched.mode_product(exp_avg_sq[index], squared, dim))
    else:  # some of each: one batch for each kind
        for kind in (True, False):
            part = [i for i, p in enumerate(permuted) if p is kind]
            at = index[part]
            if kind:
                perms = torch.stack([_permutation(rows[i][2], device) for i in part])
                moved = batched.permute_along(exp_avg_sq[at], perms, dim)
            else:
                moved = batched.mode_product(exp_avg_sq[at], overlap[part].square(), dim)
            exp_avg_sq.index_copy_(0, at, moved)
    batched.set_rows(group, "bases", dim, index, torch.stack(news), [r[0] for r in rows])


def _shampoo_beta(group: dict[str, Any]) -> float:
    """The factors' EMA coefficient: ``shampoo_beta``, else β2."""
    beta = group["shampoo_beta"]
    return group["betas"][1] if beta is None else beta


def soap_direction(
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    bases: tuple[torch.Tensor | None, ...],
    eps: float,
    first: tuple[float, batched.Coefficients | None],
    second: tuple[float, batched.Coefficients | None],
) -> torch.Tensor:
    """One group's Adam step in its eigenbases: update the moments (in place) from the rotated
    gradients and return the direction, rotated back (bias correction is the caller's).
    ``first`` and ``second`` are each moment's beta and, for a step masked by a finite flag on
    the device, its coefficients (:class:`~asteria_client.optim.grouped.StepMask`)."""
    g_rot = batched.project(grads, bases)
    batched.ema_(exp_avg, g_rot, first[0], first[1])
    batched.ema_square_(exp_avg_sq, g_rot, second[0], second[1])
    denom = exp_avg_sq.sqrt().add_(eps)
    return batched.project(exp_avg / denom, bases, back=True)


def soap_factors(
    grads: torch.Tensor, factors: tuple[torch.Tensor | None, ...], weight: float | torch.Tensor
) -> None:
    """One group's factor EMAs: ``L_i <- L_i + weight * (G_(i) G_(i)^T - L_i)``, in place."""
    for dim, factor in enumerate(factors):
        if factor is not None:
            factor.lerp_(batched.factor_statistic(grads, dim), weight)
