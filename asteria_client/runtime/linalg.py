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

from collections.abc import Callable, Sequence
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


# ---------------------------------------------------------------------------- deferred checks
# Native mode solves every block inside ``step()``. Each check above reads the device on the
# host (``bool(...)``, ``float(...)``): on a GPU that is a wait for the device, once per check
# per block. The functions below compute exactly the same result with the same operations,
# but leave the checks on the device as one flag per solve (True: every check of the checked
# path's first attempt passes). A caller collects a step's flags, reads them once
# (:func:`read_flags`), and for a block whose flag is False reruns the checked function above,
# which then raises today's SolverError or finds today's epsilon retry: results and messages
# are those of the checked path, whichever way a block goes. Only failures that the host
# sees anyway (a wrong shape, an exception from torch.linalg) are raised here; the caller
# then runs the checked path at once. The flags compare in float64, as the checked path's
# Python floats do, so a flag never passes what the checked path would reject.
#
# torch.linalg.eigh itself still waits for the device on a GPU: ATen checks the solver's
# info on the host after every call (``_linalg_check_errors``: ``infos.any().item()``), and
# torch has no eigh that skips it (``torch._linalg_eigh`` runs the same check). QR does not
# (cuSOLVER geqrf's info is checked in debug builds only).


def _symmetric_ok(a: torch.Tensor) -> torch.Tensor:
    """The flag of :func:`_checked_symmetric`'s value checks (``a`` already in its dtype)."""
    finite = torch.isfinite(a).all()
    scale = a.abs().max().double().clamp(min=1.0)
    asym = (a - a.T).abs().max().double()
    return finite & ~(asym > SYMMETRY_RTOL * scale)


def _symmetrized(matrix: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1] or matrix.numel() == 0:
        raise SolverError("shape checked on the host")  # the checked path names the block
    a = matrix.to(dtype)
    return (a + a.T) * 0.5, _symmetric_ok(a)


def _eigh_ok(eigenvalues: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """The flag of :func:`_eigh`'s checks."""
    finite = torch.isfinite(eigenvalues).all() & torch.isfinite(vectors).all()
    top = eigenvalues.abs().max().double().clamp(min=1e-30)
    return finite & ~(eigenvalues.min().double() < -PSD_RTOL * top)


def _orthonormal_ok(basis: torch.Tensor) -> torch.Tensor:
    """The flag of :func:`_check_orthonormal`."""
    eye = torch.eye(basis.shape[1], dtype=basis.dtype, device=basis.device)
    return (basis.T @ basis - eye).abs().max().double() <= ORTHOGONALITY_TOL


def symmetrized(
    matrix: torch.Tensor, compute_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix an unchecked eigh-based solve decomposes, in ``compute_dtype``, and the flag
    of the checked path's input checks. Raises SolverError for what the host sees (not square,
    empty): the checked path then names the block."""
    return _symmetrized(matrix, compute_dtype)


def _batches_exactly(a: torch.Tensor) -> bool:
    """Whether ``a`` in a batch of its shape rounds as a single eigh of it (see below)."""
    n = a.shape[-1]
    return n % 2 == 0 and (a.device.type != "cuda" or n > 32)


def batched_eigh(
    matrices: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """``torch.linalg.eigh`` of each matrix, with the same bits as one call per matrix, in one
    call per group of equal shape, dtype and device where a batch rounds as single calls do: on
    a GPU the host then waits once per group (ATen's info check, above), not once per matrix.
    None for the matrices of a call that raised (LAPACK did not converge on one of them): their
    caller solves each alone, checked, and so names the bad one.

    Why not every shape: native results must not depend on which blocks share a step, because
    a first-step factor is rank-deficient and its null space's basis is whatever the rounding
    picks (a last-bit change there changes the trajectory, by 0.09 in ``test_reference``'s
    tiled case). ATen copies a batch into one dense buffer and solves each matrix in place. On
    CPU, MKL's rounding depends on whether a matrix starts 16-byte aligned, which every matrix
    of even order does in float64 and every other one of odd order does not (measured; kept by
    ``test_native_checks``), so odd orders are solved alone. On CUDA a batch of order <= 32 goes
    to cuSOLVER's Jacobi solver (``syevjBatched``) where a single matrix goes to ``syevd``, so
    those are solved alone too; larger ones loop ``syevd`` over the batch."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(matrices)
    groups: dict[object, list[int]] = {}
    for i, a in enumerate(matrices):
        key = (a.shape, a.dtype, a.device) if _batches_exactly(a) else i
        groups.setdefault(key, []).append(i)
    for indices in groups.values():
        if len(indices) == 1:
            batch = matrices[indices[0]]
        else:
            batch = torch.stack([matrices[i] for i in indices])
        try:
            eigenvalues, vectors = torch.linalg.eigh(batch)
        except RuntimeError:
            continue
        if len(indices) == 1:
            out[indices[0]] = (eigenvalues, vectors)
            continue
        for j, i in enumerate(indices):
            out[i] = (eigenvalues[j], vectors[j])
    return out


def inverse_root_from_eigh(
    matrix: torch.Tensor,
    ok: torch.Tensor,
    eigenvalues: torch.Tensor,
    vectors: torch.Tensor,
    exponent: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`inverse_root_unchecked` from the eigh of ``symmetrized(matrix)`` (flag ``ok``)."""
    ok = ok & _eigh_ok(eigenvalues, vectors)
    lam = eigenvalues.clamp(min=0.0) + epsilon
    ok = ok & (lam > 0).all()
    root = (vectors * lam.pow(-exponent)) @ vectors.T
    ok = ok & torch.isfinite(root).all()
    return root.to(device=matrix.device, dtype=matrix.dtype), ok


def eigenbasis_from_eigh(
    matrix: torch.Tensor, ok: torch.Tensor, eigenvalues: torch.Tensor, vectors: torch.Tensor
) -> tuple[Eigenbasis, torch.Tensor]:
    """:func:`eigenbasis_unchecked` from the eigh of ``symmetrized(matrix)`` (flag ``ok``)."""
    ok = ok & _eigh_ok(eigenvalues, vectors)
    order = torch.argsort(-eigenvalues, stable=True)
    basis = fix_signs(vectors[:, order])
    ok = ok & _orthonormal_ok(basis)
    result = Eigenbasis(
        basis=basis.to(device=matrix.device, dtype=matrix.dtype),
        eigenvalues=eigenvalues[order].to(device=matrix.device, dtype=matrix.dtype),
    )
    return result, ok


def inverse_root_unchecked(
    matrix: torch.Tensor,
    exponent: float,
    epsilon: float,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`inverse_root`'s first attempt and the flag of its checks (see above)."""
    a, ok = _symmetrized(matrix, compute_dtype)
    eigenvalues, vectors = torch.linalg.eigh(a)
    return inverse_root_from_eigh(matrix, ok, eigenvalues, vectors, exponent, epsilon)


def eigenbasis_unchecked(
    matrix: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> tuple[Eigenbasis, torch.Tensor]:
    """:func:`eigenbasis` and the flag of its checks (see above)."""
    a, ok = _symmetrized(matrix, compute_dtype)
    eigenvalues, vectors = torch.linalg.eigh(a)
    return eigenbasis_from_eigh(matrix, ok, eigenvalues, vectors)


def refresh_eigenbasis_unchecked(
    matrix: torch.Tensor, previous: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> tuple[Eigenbasis, torch.Tensor]:
    """:func:`refresh_eigenbasis` and the flag of its checks (see above)."""
    a, ok = _symmetrized(matrix, compute_dtype)
    q = previous.to(compute_dtype)
    if q.shape != a.shape:
        raise SolverError("shape checked on the host")
    aq = a @ q
    estimates = (q * aq).sum(dim=0)
    order = torch.argsort(-estimates, stable=True)
    new_q, _ = torch.linalg.qr(aq[:, order])
    ok = ok & torch.isfinite(new_q).all()
    new_q = fix_signs(new_q)
    ok = ok & _orthonormal_ok(new_q)
    new_estimates = (new_q * (a @ new_q)).sum(dim=0)
    result = Eigenbasis(
        basis=new_q.to(device=matrix.device, dtype=matrix.dtype),
        eigenvalues=new_estimates.to(device=matrix.device, dtype=matrix.dtype),
        permutation=order.to(device=matrix.device),
        rotation=(new_q.T @ q).to(device=matrix.device, dtype=matrix.dtype),
    )
    return result, ok


def read_flags(flags: list[torch.Tensor]) -> list[bool]:
    """The host values of many solves' flags: one read per device, not one per flag."""
    values: list[bool] = [False] * len(flags)
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(i)
    for indices in by_device.values():
        read = torch.stack([flags[i] for i in indices]).tolist()
        for i, value in zip(indices, read, strict=True):
            values[i] = bool(value)
    return values
