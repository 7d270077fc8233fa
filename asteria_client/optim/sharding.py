"""FSDP2 shards: where a DTensor parameter's local shard lies in the global tensor, and its name.

With ``fully_shard`` (FSDP2) every parameter is a DTensor: each rank holds one slice of it (its
*local shard*) and, after the backward pass, the matching slice of the averaged gradient. Asteria
preconditions each local shard as a parameter of its own: the shard is blocked and tiled as any
tensor of its shape would be, and every block is named by the parameter's name and the shard's
*global* coordinates (``fc.weight@rows0:12/tile0/dim1``). So

- a rank never needs another rank's gradient rows (nothing is gathered for the optimizer);
- the preconditioner is block-diagonal along the sharded dim: the factor of that dim covers the
  shard's rows only, and the factors of the other dims sum over the shard's rows only (the README
  says how to pick ``max_preconditioner_dim`` so the single-process tiles are the same blocks);
- names do not depend on the rank: the replicas of one shard in HSDP (replicate across nodes,
  shard within) get the same name, so they are the same block, and a checkpoint entry says which
  rows it holds whichever rank wrote it.

Where the shard lies is computed from the mesh coordinate and torch's chunking rule (chunks of
``ceil(n / k)``; trailing shards may be shorter or empty), then checked against the local
tensor's shape. Placements other than ``Shard`` and ``Replicate`` (``Partial``, the strided
shards of FSDP2 + tensor parallel) are refused with a clear error.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from asteria_server.errors import UnsupportedParameterError

_KEY_PART = re.compile(r"^(?:rows|dim(\d+)=)(\d+):(\d+)$")


@dataclass(frozen=True)
class ShardGeometry:
    """Where one local shard lies: its global offset and size along every dim."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    #: the dims the mesh splits (a dim split by several mesh dims is listed once)
    sharded_dims: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> ShardGeometry:
        """A tensor that is not sharded, seen as the one shard along dim 0 that covers it."""
        return cls(shape, (0,) * len(shape), shape, (0,) if shape else ())

    @property
    def key(self) -> str:
        """The shard's global coordinates, e.g. ``rows0:12`` (dim 0) or ``rows0:12,dim2=4:8``."""
        parts = []
        for dim in self.sharded_dims:
            start, stop = self.span(dim)
            parts.append(f"rows{start}:{stop}" if dim == 0 else f"dim{dim}={start}:{stop}")
        return ",".join(parts) or "all"

    def span(self, dim: int) -> tuple[int, int]:
        """The global [start, stop) of the shard along ``dim``."""
        return self.offsets[dim], self.offsets[dim] + self.local_shape[dim]

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def to_dict(self) -> dict[str, list[int]]:
        """Plain lists for checkpoints (no tensors, no classes)."""
        return {
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "local_shape": list(self.local_shape),
            "sharded_dims": list(self.sharded_dims),
        }

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> ShardGeometry:
        return cls(
            tuple(int(v) for v in saved["global_shape"]),
            tuple(int(v) for v in saved["offsets"]),
            tuple(int(v) for v in saved["local_shape"]),
            tuple(int(v) for v in saved["sharded_dims"]),
        )


def parse_key(key: str) -> dict[int, tuple[int, int]] | None:
    """``{dim: (start, stop)}`` of a :attr:`ShardGeometry.key`; None when it is not one."""
    if key == "all":
        return {}
    spans = {}
    for part in key.split(","):
        match = _KEY_PART.match(part)
        if match is None:
            return None
        dim = int(match.group(1)) if match.group(1) is not None else 0
        spans[dim] = (int(match.group(2)), int(match.group(3)))
    return spans


@functools.cache
def _dtensor_types() -> tuple[type, type, type] | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Shard, Replicate


def is_dtensor(tensor: Any) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(tensor, types[0])


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a DTensor (a view: in-place updates reach the DTensor); any other
    tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def chunk_span(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Torch's chunking rule: ``[start, stop)`` of chunk ``index`` of ``num_chunks`` of ``size``
    (chunks of ``ceil(size / num_chunks)``; the last ones shorter or empty)."""
    full = -(-size // num_chunks) if num_chunks else size
    start = min(full * index, size)
    return start, min(start + full, size)


def shard_geometry(name: str, param: torch.Tensor) -> ShardGeometry | None:
    """Where ``param``'s local shard lies, or None when ``param`` is not a DTensor."""
    types = _dtensor_types()
    if types is None or not isinstance(param, types[0]):
        return None
    _, shard_type, replicate_type = types
    mesh = param.device_mesh  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedParameterError(
            f"parameter {name!r} is a DTensor on a device mesh this rank is not part of; "
            "give the optimizer only the parameters this rank holds"
        )
    global_shape = tuple(int(d) for d in param.shape)
    offsets = [0] * len(global_shape)
    sizes = list(global_shape)
    sharded: list[int] = []
    for mesh_dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        if type(placement) is replicate_type:
            continue
        if type(placement) is not shard_type:
            raise UnsupportedParameterError(
                f"parameter {name!r} has the placement {placement} on mesh dim {mesh_dim}; "
                "Asteria preconditions DTensor parameters that are sharded (Shard) or "
                "replicated (Replicate) only, as fully_shard (FSDP2) and HSDP make them"
            )
        dim = placement.dim  # type: ignore[attr-defined]
        start, stop = chunk_span(sizes[dim], mesh.size(mesh_dim), coordinate[mesh_dim])
        offsets[dim] += start
        sizes[dim] = stop - start
        if dim not in sharded:
            sharded.append(dim)
    geometry = ShardGeometry(global_shape, tuple(offsets), tuple(sizes), tuple(sorted(sharded)))
    local_shape = tuple(int(d) for d in param.to_local().shape)  # type: ignore[attr-defined]
    if local_shape != geometry.local_shape:
        raise UnsupportedParameterError(
            f"parameter {name!r}: its local shard has shape {local_shape}, but torch's chunking "
            f"rule over placements {tuple(param.placements)} gives "  # type: ignore[attr-defined]
            f"{geometry.local_shape}; Asteria cannot tell which rows this rank holds"
        )
    return geometry


def param_of_key(key: str) -> str:
    """The parameter name of a state key (``fc.weight@rows0:12`` -> ``fc.weight``)."""
    return key.partition("@")[0]
