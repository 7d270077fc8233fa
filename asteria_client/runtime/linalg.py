"""Native (in-step, torch.linalg) inverse roots and eigenbases, with the engine's numerics.

These are the synchronous counterparts of ``asteria_server.engine.solvers`` and follow the same
conventions so that results from either source are interchangeable:

- inputs must be finite and symmetric within a tolerance; they are symmetrized before the solve;
- eigenvalues are clamped at zero and ``epsilon`` is added (the ``epsilon * I`` regularizer);
- bases are sorted by descending eigenvalue, and every column's sign is fixed so that its entry of
  largest magnitude is positive;
- the computation runs in ``compute_dtype`` (float64 by default) and is retried with a larger
  epsilon when it fails; the result is returned on the input's device in the input's dtype.

A failure that no retry fixes raises :class:`~asteria_server.errors.SolverError`; the optimizer
then keeps the last good result, so a bad root never reaches the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from asteria_server.errors import SolverError

SYMMETRY_RTOL = 1e-4
ORTHOGONALITY_TOL = 1e-3
PSD_RTOL = 1e-3
EPSILON_ESCALATION = (1.0, 10.0, 100.0)

T = TypeVar("T")


@dataclass(frozen=True)
class Eigenbasis:
    """An orthonormal basis (columns), its eigenvalue estimates, and for a QR refresh the column
    order applied to the previous basis before the QR step."""

    basis: torch.Tensor
    eigenvalues: torch.Tensor
    permutation: torch.Tensor | None = None
    rotation: torch.Tensor | None = None


def _checked_symmetric(matrix: torch.Tensor, block: str, dtype: torch.dtype) -> torch.Tensor:
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise SolverError(f"block {block}: factor must be square, got shape {tuple(matrix.shape)}")
    a = matrix.to(dtype)
    if not bool(torch.isfinite(a).all()):
        raise SolverError(f"block {block}: factor matrix holds NaN or Inf; kept the last result")
    scale = max(1.0, float(a.abs().max()))
    asym = float((a - a.T).abs().max())
    if asym > SYMMETRY_RTOL * scale:
        raise SolverError(
            f"block {block}: factor matrix is not symmetric (max |A - A^T| = {asym:.3g})"
        )
    return (a + a.T) * 0.5


def fix_signs(basis: torch.Tensor) -> torch.Tensor:
    """Flip columns so each column's largest-magnitude entry is positive (first one on ties)."""
    idx = basis.abs().argmax(dim=0)
    signs = torch.sign(basis.gather(0, idx.unsqueeze(0))).squeeze(0)
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return basis * signs


def _eigh(a: torch.Tensor, block: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        eigenvalues, vectors = torch.linalg.eigh(a)
    except RuntimeError as exc:  # LAPACK did not converge
        raise SolverError(f"block {block}: eigh failed: {exc}") from exc
    if not (bool(torch.isfinite(eigenvalues).all()) and bool(torch.isfinite(vectors).all())):
        raise SolverError(f"block {block}: eigh returned non-finite values")
    top = float(eigenvalues.abs().max()) if eigenvalues.numel() else 0.0
    if float(eigenvalues.min()) < -PSD_RTOL * max(top, 1e-30):
        raise SolverError(
            f"block {block}: factor is not positive semi-definite "
            f"(smallest eigenvalue {float(eigenvalues.min()):.3g}, largest {top:.3g})"
        )
    return eigenvalues, vectors


def _check_orthonormal(basis: torch.Tensor, block: str) -> None:
    eye = torch.eye(basis.shape[1], dtype=basis.dtype, device=basis.device)
    err = float((basis.T @ basis - eye).abs().max())
    if not err <= ORTHOGONALITY_TOL:
        raise SolverError(f"block {block}: basis is not orthonormal (error {err:.3g})")


def _with_retries(epsilon: float, attempt_fn: Callable[[float], T]) -> T:
    """Run ``attempt_fn(eps)`` with escalating epsilon; re-raise the last failure.

    Input validation happens before this: a NaN or asymmetric matrix is never retried.
    """
    last: SolverError | None = None
    for factor in EPSILON_ESCALATION:
        eps = epsilon if factor == 1.0 else max(epsilon, 1e-12) * factor
        try:
            return attempt_fn(eps)
        except SolverError as exc:
            last = exc
    assert last is not None
    raise last


def inverse_root(
    matrix: torch.Tensor,
    exponent: float,
    epsilon: float,
    *,
    block: str = "?",
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``(A_+ + epsilon I)^(-exponent)`` where ``A_+`` is A with negative eigenvalues clamped."""
    a = _checked_symmetric(matrix, block, compute_dtype)

    def attempt(eps: float) -> torch.Tensor:
        eigenvalues, vectors = _eigh(a, block)
        lam = eigenvalues.clamp(min=0.0) + eps
        if not bool((lam > 0).all()):
            raise SolverError(f"block {block}: zero eigenvalue with epsilon={eps:g}")
        root = (vectors * lam.pow(-exponent)) @ vectors.T
        if not bool(torch.isfinite(root).all()):
            raise SolverError(f"block {block}: inverse root is not finite (epsilon={eps:g})")
        return root

    root = _with_retries(epsilon, attempt)
    return root.to(device=matrix.device, dtype=matrix.dtype)


def eigenbasis(
    matrix: torch.Tensor, *, block: str = "?", compute_dtype: torch.dtype = torch.float64
) -> Eigenbasis:
    """Full eigendecomposition; columns sorted by descending eigenvalue, signs fixed."""
    a = _checked_symmetric(matrix, block, compute_dtype)
    eigenvalues, vectors = _eigh(a, block)
    order = torch.argsort(-eigenvalues, stable=True)
    basis = fix_signs(vectors[:, order])
    _check_orthonormal(basis, block)
    return Eigenbasis(
        basis=basis.to(device=matrix.device, dtype=matrix.dtype),
        eigenvalues=eigenvalues[order].to(device=matrix.device, dtype=matrix.dtype),
    )


def refresh_eigenbasis(
    matrix: torch.Tensor,
    previous: torch.Tensor,
    *,
    block: str = "?",
    compute_dtype: torch.dtype = torch.float64,
) -> Eigenbasis:
    """One power-iteration step with QR from ``previous`` (SOAP's basis refresh).

    Columns of ``previous`` are first ordered by descending ``diag(Q^T A Q)``; that order is
    returned as ``permutation`` so a client can reorder its second moments the same way.
    """
    a = _checked_symmetric(matrix, block, compute_dtype)
    q = previous.to(compute_dtype)
    if q.shape != a.shape:
        raise SolverError(
            f"block {block}: basis shape {tuple(q.shape)} does not match factor {tuple(a.shape)}"
        )
    aq = a @ q
    estimates = (q * aq).sum(dim=0)
    order = torch.argsort(-estimates, stable=True)
    try:
        new_q, _ = torch.linalg.qr(aq[:, order])
    except RuntimeError as exc:
        raise SolverError(f"block {block}: QR failed: {exc}") from exc
    if not bool(torch.isfinite(new_q).all()):
        raise SolverError(f"block {block}: QR refresh returned non-finite values")
    new_q = fix_signs(new_q)
    _check_orthonormal(new_q, block)
    new_estimates = (new_q * (a @ new_q)).sum(dim=0)
    return Eigenbasis(
        basis=new_q.to(device=matrix.device, dtype=matrix.dtype),
        eigenvalues=new_estimates.to(device=matrix.device, dtype=matrix.dtype),
        permutation=order.to(device=matrix.device),
        rotation=(new_q.T @ q).to(device=matrix.device, dtype=matrix.dtype),
    )
