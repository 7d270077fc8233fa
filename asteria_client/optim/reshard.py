"""Optimizer state saved with one shard geometry, loaded with another (FSDP2 at another world
size, or a sharded checkpoint loaded into a whole parameter and back).

A checkpoint holds one entry per saved shard, keyed ``name@rows0:12`` (see :mod:`sharding`). When
this rank's shard has no entry of its own, its tiles are rebuilt from the saved tiles that cover
the same rows. Shards split dim 0 only (FSDP2's default), and dim 0 of the parameter is the first
dim of its blocking, so a tile is known by its global rows ``[a, b)`` and its slices along the
other (merged) dims, which sharding does not change. For each new tile:

- **a saved tile with the same rows and slices** is the same block under another name: it is kept
  as saved (moments, factors, installed roots or bases with their versions) and only renamed;
- otherwise it is **rebuilt** from the saved tiles whose rows overlap ``[a, b)``:
  moments are cut and concatenated along the rows in the parameter's coordinates (SOAP's are
  taken out of their eigenbasis first: exactly for the first moment, through the squared basis
  for the second, as SOAP does when a basis changes); the factor of dim 0 is the block-diagonal
  of the saved dim-0 factors' overlapping sub-blocks (exact for rows inside one saved tile; the
  cross terms between saved shards were never computed); a factor of another dim sums over
  rows, so it is the saved factors weighted by the share of their rows that falls in ``[a, b)``
  (exact when whole saved tiles are merged, a proportional estimate when one is split). The
  rebuilt tile starts without a root or basis and is submitted at once, so the next step uses a
  result of its own factors (the optimizer's staleness rules apply as to any new snapshot);
- a tile that no saved tile covers (a partial checkpoint) restarts from zero moments and factors.

Anything else (a shard along another dim, a one-row shard that blocking sees as a vector) also
restarts its tiles from zero. The optimizer reports all of it in one warning per load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asteria_client.optim.blocking import BlockingPlan, TilePlan, plan_blocking
from asteria_client.optim.sharding import ShardGeometry
from asteria_server.errors import InvalidInputError

if TYPE_CHECKING:
    from asteria_client.optim.base import AsteriaOptimizer


@dataclass
class ReshardReport:
    """What a load did to the tiles of parameters saved with another shard geometry."""

    params: list[str] = field(default_factory=list)
    example: str = ""
    kept: int = 0
    rebuilt: int = 0
    restarted: int = 0

    def message(self) -> str:
        more = f"; {len(self.params) - 1} more likewise" if len(self.params) > 1 else ""
        return (
            f"optimizer checkpoint: {len(self.params)} parameter(s) were saved with another shard "
            f"geometry ({self.example}{more}); their tiles were matched by global rows: "
            f"{self.kept} kept as saved (the same rows: renamed, results and versions intact), "
            f"{self.rebuilt} rebuilt from the saved factors and moments (blocks resubmitted for "
            f"new roots/bases now), {self.restarted} restarted from zero (no saved rows to build "
            "them from)"
        )


@dataclass(frozen=True)
class _SavedTile:
    rows: tuple[int, int]  # global [start, stop)
    plan: TilePlan
    tile: Any


def _rows_lead(shape: tuple[int, ...]) -> bool:
    """Whether dim 0 of a tensor of ``shape`` is dim 0 of its blocking (a one-row matrix shard
    is blocked as a vector along its columns)."""
    return len(shape) == 1 or (len(shape) > 0 and shape[0] != 1)


def _lines_up(geometry: ShardGeometry) -> bool:
    return set(geometry.sharded_dims) <= {0} and _rows_lead(geometry.local_shape)


def _tile_rows(geometry: ShardGeometry, plan: TilePlan) -> tuple[int, int]:
    offset = geometry.offsets[0]
    return offset + plan.slices[0].start, offset + plan.slices[0].stop


def reshard_state(
    opt: AsteriaOptimizer,
    name: str,
    key: str,
    geometry: ShardGeometry,
    local: torch.Tensor,
    group: dict[str, Any],
    pieces: Mapping[str, dict[str, Any]],
    report: ReshardReport,
) -> tuple[dict[str, Any], list[Any]]:
    """The state of this rank's shard of ``name`` (state key ``key``) from saved ``pieces``
    (state key -> checkpoint entry, already on the right device); also the rebuilt tiles, which
    the caller submits."""
    plan = opt.plan(key, local, group)
    saved: list[_SavedTile] = []
    step = 0
    aligned = _lines_up(geometry)
    for piece_key, entry in pieces.items():
        saved_geometry = (
            ShardGeometry.from_dict(entry["shard"])
            if "shard" in entry
            else ShardGeometry.whole(geometry.global_shape)
        )
        saved_plan = _plan_of(saved_geometry, group)
        tiles = entry.get("tiles", [])
        if len(tiles) != len(saved_plan.tiles):
            raise InvalidInputError(
                f"checkpoint entry {piece_key!r} has {len(tiles)} tiles but a shard of shape "
                f"{saved_geometry.local_shape} is blocked into {len(saved_plan.tiles)}; "
                "max_preconditioner_dim or the parameter's shape changed"
            )
        step = max(step, int(entry.get("step", 0)))
        aligned = aligned and _lines_up(saved_geometry)
        for tile_plan, tile in zip(saved_plan.tiles, tiles, strict=True):
            saved.append(
                _SavedTile(
                    _tile_rows(saved_geometry, tile_plan),
                    tile_plan,
                    tile if not isinstance(tile, dict) else opt._tile_from_dict(name, tile),
                )
            )
    report.params.append(name)
    if not report.example:
        report.example = f"{', '.join(sorted(pieces))} loaded as {key}"
    new_tiles, rebuilt = [], []
    for tile_plan in plan.tiles:
        tile, how = _match(opt, key, geometry, tile_plan, saved) if aligned else (None, "restarted")
        if tile is None:
            tile = _zero_tile(opt, key, tile_plan, local)
        if how == "rebuilt":
            rebuilt.append(tile)
        setattr(report, how, getattr(report, how) + 1)
        new_tiles.append(tile)
    return {"step": step, "tiles": new_tiles}, rebuilt


def _plan_of(geometry: ShardGeometry, group: dict[str, Any]) -> BlockingPlan:
    return plan_blocking(
        geometry.local_shape,
        int(group["max_preconditioner_dim"]),
        group["large_dim_policy"],
        group.get("max_dim_ratio"),
    )


def _match(
    opt: AsteriaOptimizer,
    key: str,
    geometry: ShardGeometry,
    tile_plan: TilePlan,
    saved: list[_SavedTile],
) -> tuple[Any, str]:
    a, b = _tile_rows(geometry, tile_plan)
    same_cut = [
        s
        for s in saved
        if s.plan.slices[1:] == tile_plan.slices[1:]
        and s.plan.preconditioned[1:] == tile_plan.preconditioned[1:]
    ]
    for s in same_cut:
        if s.rows == (a, b) and s.plan.preconditioned == tile_plan.preconditioned:
            tile = s.tile
            if hasattr(tile, "blocks"):
                tile.blocks = opt._block_names(key, tile_plan.index)
            return tile, "kept"
    overlaps = sorted(
        (max(a, s.rows[0]), min(b, s.rows[1]), s)
        for s in same_cut
        if s.rows[0] < b and a < s.rows[1]
    )
    covered = a
    for start, stop, _ in overlaps:
        if start != covered:
            return None, "restarted"
        covered = stop
    if covered != b:
        return None, "restarted"
    return _combine(
        opt, key, tile_plan, [(start, stop, s) for start, stop, s in overlaps]
    ), "rebuilt"


def _combine(
    opt: AsteriaOptimizer,
    key: str,
    tile_plan: TilePlan,
    overlaps: list[tuple[int, int, _SavedTile]],
) -> Any:
    rows = sum(stop - start for start, stop, _ in overlaps)
    moments: dict[str, list[torch.Tensor]] = {}
    diagonals: list[list[torch.Tensor | None]] = []
    for start, stop, s in overlaps:
        cut = slice(start - s.rows[0], stop - s.rows[0])
        for field_name, value in opt._moments_in_param_coords(s.tile).items():
            moments.setdefault(field_name, []).append(value[cut])
        diagonals.append(opt._diagonals(s.tile))
    joined = {k: torch.cat(v, dim=0) for k, v in moments.items()}
    reference = next(iter(joined.values()))
    factors: list[torch.Tensor | None] = []
    for dim, (size, pre) in enumerate(zip(tile_plan.shape, tile_plan.preconditioned, strict=True)):
        if not pre:
            factors.append(None)
            continue
        parts: list[torch.Tensor] = []
        for start, stop, s in overlaps:
            factor = s.tile.factors[dim] if dim < len(s.tile.factors) else None
            cut = slice(start - s.rows[0], stop - s.rows[0])
            if dim == 0:
                parts.append(
                    factor[cut, cut]
                    if factor is not None
                    else reference.new_zeros(stop - start, stop - start)
                )
            elif factor is not None:
                share = (stop - start) / (rows if opt.factors_are_means else s.rows[1] - s.rows[0])
                parts.append(factor * share)
        if dim == 0:
            factors.append(torch.block_diag(*parts))
        else:
            factors.append(_total(parts) if parts else reference.new_zeros(size, size))
    # diagonal preconditioners of unpreconditioned dims (KL-Shampoo): rows are cut and joined
    # along dim 0; along another dim they are means over rows, weighted by the rows they cover
    combined_diagonals: list[torch.Tensor | None] = []
    for dim in range(len(tile_plan.shape)):
        found = [d[dim] if dim < len(d) else None for d in diagonals]
        values = [v for v in found if v is not None]
        if not values or len(values) != len(found):
            combined_diagonals.append(None)
        elif dim == 0:
            combined_diagonals.append(
                torch.cat(
                    [
                        v[start - s.rows[0] : stop - s.rows[0]]
                        for v, (start, stop, s) in zip(values, overlaps, strict=True)
                    ]
                )
            )
        else:
            weighted = [
                v * ((stop - start) / rows)
                for v, (start, stop, _) in zip(values, overlaps, strict=True)
            ]
            combined_diagonals.append(_total(weighted))
    return opt._tile_from_parts(key, tile_plan.index, joined, factors, combined_diagonals)


def _total(tensors: list[torch.Tensor]) -> torch.Tensor:
    out = tensors[0].clone()
    for tensor in tensors[1:]:
        out += tensor
    return out


def _zero_tile(opt: AsteriaOptimizer, key: str, tile_plan: TilePlan, local: torch.Tensor) -> Any:
    dtype = torch.float64 if local.dtype == torch.float64 else torch.float32
    zeros = torch.zeros(tile_plan.shape, dtype=dtype, device=local.device)
    moments = {field_name: zeros.clone() for field_name in opt.param_coordinate_moments}
    factors = [
        zeros.new_zeros(size, size) if pre else None
        for size, pre in zip(tile_plan.shape, tile_plan.preconditioned, strict=True)
    ]
    diagonals: list[torch.Tensor | None] = [None] * len(tile_plan.shape)
    return opt._tile_from_parts(key, tile_plan.index, moments, factors, diagonals)
