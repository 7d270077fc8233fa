"""On an ill-conditioned least-squares problem, every second-order optimizer beats tuned Adam.

The problem is min |A W B - C|^2: its Hessian is the Kronecker product (B B^T) x (A^T A), with
rotated ill-conditioning on both sides, so Adam's per-coordinate scaling cannot fix it and a
Kronecker-factored preconditioner can. Adam gets a learning-rate sweep and its best run counts;
each second-order optimizer runs with one fixed learning rate.
"""

from __future__ import annotations

import pytest
import torch

from .native import SOAP, KLShampoo, Shampoo

STEPS = 150
LOG10_COND = 1.5  # per side: singular values span 10**1.5


def _orthonormal(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=g))
    return q


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    spectrum_a = torch.diag(torch.logspace(0, LOG10_COND, 16))
    spectrum_b = torch.diag(torch.logspace(0, LOG10_COND, 32))
    a = _orthonormal(64, 16, g) @ spectrum_a @ _orthonormal(16, 16, g).T
    b = _orthonormal(32, 32, g) @ spectrum_b @ _orthonormal(64, 32, g).T
    c = a @ torch.randn(16, 32, generator=g) @ b
    scale = float(torch.linalg.norm(c)) / c.numel() ** 0.5
    return a / scale**0.5, b / scale**0.5, c / scale


def final_loss(make_optimizer) -> float:  # type: ignore[no-untyped-def]
    a, b, c = problem()
    w = torch.nn.Parameter(torch.zeros(16, 32))
    opt = make_optimizer([("w", w)])
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((a @ w @ b - c) ** 2).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(((a @ w @ b - c) ** 2).mean())


@pytest.fixture(scope="module")
def best_adam() -> float:
    losses = {
        lr: final_loss(lambda named, lr=lr: torch.optim.Adam([p for _, p in named], lr=lr))
        for lr in (1e-2, 3e-2, 1e-1, 3e-1, 1.0)
    }
    best = min(losses.values())
    assert best < 0.01, f"the Adam sweep itself failed to make progress: {losses}"
    return best


@pytest.mark.parametrize(
    "name,factory",
    [
        ("soap", lambda named: SOAP(named, lr=0.3, weight_decay=0.0)),
        ("shampoo", lambda named: Shampoo(named, lr=0.3)),
        ("kl-shampoo", lambda named: KLShampoo(named, lr=0.3, weight_decay=0.0)),
    ],
)
def test_second_order_beats_best_adam(name: str, factory, best_adam: float) -> None:  # type: ignore[no-untyped-def]
    loss = final_loss(factory)
    assert loss < best_adam, f"{name}: {loss:.3g} not below the best Adam loss {best_adam:.3g}"
