"""Mode products and factor statistics for tiles of any order.

A tile of order k has one factor per preconditioned dimension i: the mode-i unfolding's outer
product ``G_(i) G_(i)^T``. For a matrix these are ``G G^T`` (i = 0) and ``G^T G`` (i = 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mode_product(tensor: torch.Tensor, matrix: torch.Tensor, dim: int) -> torch.Tensor:
    """Multiply ``tensor`` along ``dim``: ``out[.., i, ..] = sum_j M[i, j] T[.., j, ..]``."""
    if tensor.dim() == 2:
        return matrix @ tensor if dim == 0 else tensor @ matrix.T
    out = torch.tensordot(tensor, matrix, dims=([dim], [1]))
    return out.movedim(-1, dim)


def factor_statistic(
    grad: torch.Tensor, dim: int, other: torch.Tensor | None = None
) -> torch.Tensor:
    """``G_(dim) H_(dim)^T`` contracted over every other dim (H defaults to G)."""
    other = grad if other is None else other
    if grad.dim() == 1:
        return torch.outer(grad, other)
    if grad.dim() == 2:
        return grad @ other.T if dim == 0 else grad.T @ other
    rest = [d for d in range(grad.dim()) if d != dim]
    return torch.tensordot(grad, other, dims=(rest, rest))


def project(
    tensor: torch.Tensor, bases: Sequence[torch.Tensor | None], *, back: bool = False
) -> torch.Tensor:
    """Rotate ``tensor`` into the product basis (``Q_i^T`` on each dim), or back (``Q_i``).

    A ``None`` basis leaves that dimension as it is.
    """
    out = tensor
    for dim, basis in enumerate(bases):
        if basis is None:
            continue
        out = mode_product(out, basis if back else basis.T, dim)
    return out
