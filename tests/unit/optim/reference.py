"""Independent float64 reference implementations of the three optimizers, written from the
formulas (DESIGN.md, the SOAP and KL-Shampoo papers) for one 2-D matrix or a 1-D vector, with
plain matrix products and no code shared with ``asteria_client``.

Conventions shared with the implementation on purpose (they are part of the specification):
factors are symmetrized before eigh, bases are sorted by descending eigenvalue, and negative
eigenvalues are clamped at zero before epsilon is added.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Grad = Callable[[torch.Tensor], torch.Tensor]


def _eigh_desc(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = (a + a.T) * 0.5
    vals, vecs = torch.linalg.eigh(a)
    order = torch.argsort(-vals, stable=True)
    return vals[order], vecs[:, order]


def _qr_refresh(factor: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = (factor + factor.T) * 0.5
    est = torch.diag(basis.T @ a @ basis)
    order = torch.argsort(-est, stable=True)
    q, _ = torch.linalg.qr(a @ basis[:, order])
    return q, order


def adam_1d(w, grad_fn: Grad, steps, lr, b1, b2, eps, wd):  # type: ignore[no-untyped-def]
    """Plain AdamW (bias-corrected m/(sqrt(v)+eps)), decoupled decay applied first."""
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t in range(1, steps + 1):
        g = grad_fn(w)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        d = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        w = w * (1 - lr * wd) - lr * d
    return w


def soap_matrix(w, grad_fn: Grad, steps, lr, b1, b2, eps, wd, freq):  # type: ignore[no-untyped-def]
    """SOAP (Vyas et al. 2024) on one matrix, or a vector when ``w`` is 1-D (Adam in SOAP form)."""
    vector = w.dim() == 1
    left = right = None
    q_left = q_right = None
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for s in range(steps):
        g = grad_fn(w)
        if s == 0:
            if not vector:
                left = (1 - b2) * (g @ g.T)
                right = (1 - b2) * (g.T @ g)
                q_left = _eigh_desc(left)[1]
                q_right = _eigh_desc(right)[1]
            continue
        gp = g if vector else q_left.T @ g @ q_right
        m = b1 * m + (1 - b1) * gp
        v = b2 * v + (1 - b2) * gp * gp
        n = m / (v.sqrt() + eps)
        direction = n if vector else q_left @ n @ q_right.T
        step_size = lr * (1 - b2**s) ** 0.5 / (1 - b1**s)
        w = w - step_size * direction
        w = w - lr * wd * w
        if vector:
            continue
        left = b2 * left + (1 - b2) * (g @ g.T)
        right = b2 * right + (1 - b2) * (g.T @ g)
        if s % freq == 0:
            m_orig = q_left @ m @ q_right.T
            q_left, order = _qr_refresh(left, q_left)
            v = v[order, :]
            q_right, order = _qr_refresh(right, q_right)
            v = v[:, order]
            m = q_left.T @ m_orig @ q_right
    return w


def _inverse_root(a, exponent, eps):  # type: ignore[no-untyped-def]
    a = (a + a.T) * 0.5
    vals, vecs = torch.linalg.eigh(a)
    vals = vals.clamp(min=0) + eps
    return vecs @ torch.diag(vals ** (-exponent)) @ vecs.T


def shampoo_matrix(w, grad_fn: Grad, steps, lr, b1, b2, eps, wd, freq, graft_eps):  # type: ignore[no-untyped-def]
    """Shampoo with 1/4 roots, Adam grafting per matrix, decoupled weight decay."""
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    left = torch.zeros(w.shape[0], w.shape[0], dtype=w.dtype)
    right = torch.zeros(w.shape[1], w.shape[1], dtype=w.dtype)
    p_left = p_right = None
    for t in range(1, steps + 1):
        g = grad_fn(w)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        left = b2 * left + (1 - b2) * g @ g.T
        right = b2 * right + (1 - b2) * g.T @ g
        if (t - 1) % freq == 0:
            c = 1 - b2**t
            p_left = _inverse_root(left / c, 0.25, eps)
            p_right = _inverse_root(right / c, 0.25, eps)
        m_hat = m / (1 - b1**t)
        adam = m_hat / ((v / (1 - b2**t)).sqrt() + graft_eps)
        d = p_left @ m_hat @ p_right
        d = d * (torch.linalg.norm(adam) / torch.linalg.norm(d))
        w = w * (1 - lr * wd) - lr * d
    return w


def kl_shampoo_matrix(w, grad_fn: Grad, steps, lr, b1, b2, eps, wd, freq, damping):  # type: ignore[no-untyped-def]
    """KL-Shampoo (Lin et al. 2025) with QR-refreshed bases, for one m x n matrix.

    Eigenvalues are regularized as max(lam, 0) + eps + damping * max(lam)."""

    def reg(lam):  # type: ignore[no-untyped-def]
        lam = lam.clamp(min=0)
        return lam + eps + damping * lam.max()

    rows, cols = w.shape
    m = torch.zeros_like(w)
    left = right = q_left = q_right = lam_left = lam_right = None
    for s in range(steps):
        g = grad_fn(w)
        if s == 0:
            left0 = g @ g.T / cols
            right0 = g.T @ g / rows
            scale = ((g * g).sum() / (torch.trace(left0) * torch.trace(right0))) ** 0.5
            left, right = scale * left0, scale * right0
            q_left = _eigh_desc(left)[1]
            q_right = _eigh_desc(right)[1]
            lam_left = torch.diag(q_left.T @ left @ q_left).clamp(min=0)
            lam_right = torch.diag(q_right.T @ right @ q_right).clamp(min=0)
            continue
        inv_left = q_left @ torch.diag(1 / reg(lam_left)) @ q_left.T
        inv_right = q_right @ torch.diag(1 / reg(lam_right)) @ q_right.T
        h_left = g @ inv_right @ g.T / cols
        h_right = g.T @ inv_left @ g / rows
        left = b2 * left + (1 - b2) * h_left
        right = b2 * right + (1 - b2) * h_right
        lam_left = b2 * lam_left + (1 - b2) * torch.diag(q_left.T @ h_left @ q_left)
        lam_right = b2 * lam_right + (1 - b2) * torch.diag(q_right.T @ h_right @ q_right)
        m = b1 * m + (1 - b1) * g
        m_hat = m / (1 - b1**s)
        scaled = (q_left.T @ m_hat @ q_right) / torch.outer(
            reg(lam_left).sqrt(), reg(lam_right).sqrt()
        )
        w = w * (1 - lr * wd) - lr * (q_left @ scaled @ q_right.T)
        if s % freq == 0:
            q_left = _qr_refresh(left, q_left)[0]
            q_right = _qr_refresh(right, q_right)[0]
            lam_left = torch.diag(q_left.T @ left @ q_left).clamp(min=0)
            lam_right = torch.diag(q_right.T @ right @ q_right).clamp(min=0)
    return w
