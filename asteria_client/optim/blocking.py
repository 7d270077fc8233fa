"""How a parameter of any shape is cut into the tiles that get Kronecker-factored preconditioners.

The rules (DESIGN.md, "The math"):

1. Size-1 dimensions are dropped.
2. A parameter with at most one dimension left (bias, norm scale, scalar) is not preconditioned:
   it falls back to the optimizer's diagonal (Adam) update.
3. The first remaining dimension (the fan-out) is kept on its own; the dimensions after it are
   merged left to right while their product stays within ``max_preconditioner_dim``. A conv
   weight ``(128, 64, 3, 3)`` therefore becomes ``(128, 576)``.
4. A merged dimension larger than ``max_preconditioner_dim`` is either split into near-equal tiles
   (``LargeDimPolicy.TILE``) or left unpreconditioned (``LargeDimPolicy.IDENTITY``, as SOAP does
   for vocabulary dimensions).
5. **No factor far more expensive than the update it serves.** A merged dimension ``n`` above
   ``ALWAYS_PRECONDITIONED_DIM`` (1024) is left unpreconditioned when it exceeds
   ``max_dim_ratio`` times the product of the other merged dimensions ``m``. One solve costs about
   ``n^3`` flops while one step's update of the parameter costs about ``n * m * n`` (the rotation by
   the ``n x n`` basis), so the solve is worth about ``n / m`` steps of the parameter's own work;
   the default ratio (16) keeps that below 16 steps — less than two steps per step at the default
   refresh interval of 10. A ``(12000, 3)`` weight thus keeps its ``3 x 3`` factor and Adam's
   diagonal on the long side, instead of two ``6000 x 6000`` factors that take minutes to
   decompose. Dims up to 1024 decompose in about a tenth of a second and are always kept.
   ``max_dim_ratio=None`` turns the rule off.

Each tile is then an independent tensor of order k with one factor matrix per preconditioned
dimension. A ``BlockingPlan`` is a pure description; ``split`` and ``merge`` move data between the
parameter's shape and its tiles.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Dims up to this size are always preconditioned (when within max_preconditioner_dim).
ALWAYS_PRECONDITIONED_DIM = 1024
#: Default of the ``max_dim_ratio`` rule (rule 5 of the module docstring).
DEFAULT_MAX_DIM_RATIO = 16.0


class LargeDimPolicy(enum.Enum):
    """What happens to a (merged) dimension larger than ``max_preconditioner_dim``."""

    TILE = "tile"
    IDENTITY = "identity"


@dataclass(frozen=True)
class TilePlan:
    """One tile: where it lies in the merged tensor and which of its dims carry a factor."""

    index: int
    slices: tuple[slice, ...]
    shape: tuple[int, ...]
    preconditioned: tuple[bool, ...]

    @property
    def num_factors(self) -> int:
        return sum(self.preconditioned)

    @property
    def order(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class BlockingPlan:
    """The tiles of one parameter. ``diagonal`` plans have no factor at all (Adam fallback)."""

    param_shape: tuple[int, ...]
    merged_shape: tuple[int, ...]
    tiles: tuple[TilePlan, ...]

    @property
    def diagonal(self) -> bool:
        return all(t.num_factors == 0 for t in self.tiles)

    @property
    def tiled(self) -> bool:
        return len(self.tiles) > 1

    @functools.cached_property
    def whole(self) -> bool:
        """One tile of the parameter's own shape: tiles and parameter are the same tensor."""
        return not self.tiled and self.tiles[0].shape == self.param_shape

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``tensor`` (shaped like the parameter) for each tile (``tensor`` itself for
        a parameter that is one tile of its own shape: no view to dispatch)."""
        merged = tensor if tensor.shape == self.merged_shape else tensor.reshape(self.merged_shape)
        if not self.tiled:
            return [merged]
        return [merged[t.slices] for t in self.tiles]

    def merge(self, tiles: Sequence[torch.Tensor]) -> torch.Tensor:
        """Assemble per-tile tensors back into one tensor of the parameter's shape."""
        if len(tiles) != len(self.tiles):
            raise ValueError(f"expected {len(self.tiles)} tiles, got {len(tiles)}")
        if not self.tiled:
            tile = tiles[0]
            return tile if tile.shape == self.param_shape else tile.reshape(self.param_shape)
        out = tiles[0].new_empty(self.merged_shape)
        for plan, tile in zip(self.tiles, tiles, strict=True):
            out[plan.slices] = tile
        return out.reshape(self.param_shape)

    def describe(self) -> str:
        dims = " x ".join(str(d) for d in self.merged_shape) or "scalar"
        if self.diagonal:
            return f"{dims}: diagonal (Adam)"
        return f"{dims}: {len(self.tiles)} tile(s), first {self.tiles[0].shape}"


def _merge_dims(dims: Sequence[int], max_dim: int) -> list[int]:
    """Keep the first dim; merge the following ones left to right while the product fits."""
    merged = [dims[0]]
    current = 0
    for d in dims[1:]:
        if current and current * d <= max_dim:
            current *= d
        else:
            if current:
                merged.append(current)
            current = d
    if current:
        merged.append(current)
    return merged


def _chunks(size: int, max_dim: int) -> list[tuple[int, int]]:
    """Split ``size`` into ceil(size / max_dim) near-equal (start, stop) ranges."""
    count = math.ceil(size / max_dim)
    base, extra = divmod(size, count)
    ranges = []
    start = 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def _too_costly(dim: int, others: int, max_dim_ratio: float | None) -> bool:
    """Rule 5: a factor whose solve would cost far more than the update it serves."""
    if max_dim_ratio is None or dim <= ALWAYS_PRECONDITIONED_DIM:
        return False
    return dim > max_dim_ratio * others


def plan_blocking(
    shape: Sequence[int],
    max_preconditioner_dim: int,
    large_dim_policy: LargeDimPolicy = LargeDimPolicy.TILE,
    max_dim_ratio: float | None = None,
) -> BlockingPlan:
    """Decide the tiles of a parameter of ``shape``. See the module docstring for the rules."""
    if max_preconditioner_dim < 1:
        raise ValueError(f"max_preconditioner_dim must be >= 1, got {max_preconditioner_dim}")
    if max_dim_ratio is not None and not max_dim_ratio > 0:
        raise ValueError(f"max_dim_ratio must be > 0 or None, got {max_dim_ratio!r}")
    param_shape = tuple(int(d) for d in shape)
    core = [d for d in param_shape if d != 1]
    numel = math.prod(param_shape)
    merged_shape: tuple[int, ...]
    if len(core) <= 1 or numel == 0:
        merged_shape = (numel,)
        tile = TilePlan(0, (slice(0, numel),), merged_shape, (False,))
        return BlockingPlan(param_shape, merged_shape, (tile,))

    merged_shape = tuple(_merge_dims(core, max_preconditioner_dim))
    per_dim: list[list[tuple[int, int]]] = []
    preconditioned: list[bool] = []
    merged_numel = math.prod(merged_shape)
    for d in merged_shape:
        if _too_costly(d, merged_numel // d, max_dim_ratio):
            per_dim.append([(0, d)])
            preconditioned.append(False)
        elif d <= max_preconditioner_dim:
            per_dim.append([(0, d)])
            preconditioned.append(True)
        elif large_dim_policy is LargeDimPolicy.TILE:
            per_dim.append(_chunks(d, max_preconditioner_dim))
            preconditioned.append(True)
        else:
            per_dim.append([(0, d)])
            preconditioned.append(False)

    tiles = []
    for index, ranges in enumerate(itertools.product(*per_dim)):
        slices = tuple(slice(a, b) for a, b in ranges)
        tile_shape = tuple(b - a for a, b in ranges)
        tiles.append(TilePlan(index, slices, tile_shape, tuple(preconditioned)))
    return BlockingPlan(param_shape, merged_shape, tuple(tiles))
