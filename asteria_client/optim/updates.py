"""First-order pieces the second-order optimizers share: Adam's state and direction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TINY = 1e-30


@dataclass(kw_only=True)
class AdamTile:
    """The state of a tile that no factor preconditions (1-D parameters): Adam's moments."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def adam_direction(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    betas: tuple[float, float],
    eps: float,
) -> torch.Tensor:
    """Bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)``."""
    m_hat = exp_avg / (1 - betas[0] ** step)
    v_hat = exp_avg_sq / (1 - betas[1] ** step)
    return m_hat / v_hat.sqrt().add_(eps)
