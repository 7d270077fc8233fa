"""Inverse roots and eigenbases of Kronecker factors with LAPACK: the engine's numerics.

Everything is computed in float64 and shipped in float32 (float32 eigh is ~1000x less accurate on
ill-conditioned factors). The conventions match the client's native path
(``asteria_client.runtime.linalg``) so results from either are interchangeable:

- inputs must be finite and symmetric within ``symmetry_rtol`` (SciPy's eigh silently reads one
  triangle, so an asymmetric factor is rejected, never silently symmetrized); they are then
  symmetrized exactly as ``(A + A^T) / 2``;
- inverse root: eigenvalues clamped at zero, ``epsilon`` added, ``U diag(lam^-p) U^T`` (as
  ``B B^T``, ``B = U diag(lam^(-p/2))``);
- full eigenbasis: columns in descending eigenvalue order (stable sort);
- QR refresh (SOAP, Vyas et al. 2024): order the old basis by descending ``diag(Q^T A Q)``, then one
  power step ``Q <- qr(A Q)``; the order is returned so the client can permute its moments;
- every basis column's sign is fixed so that its largest-magnitude entry (the first on ties) is
  positive.

:class:`EighSolver` wraps these with validation and retries: a failed attempt (LAPACK did not
converge, a non-finite or non-orthogonal output) is retried with a larger epsilon; a bad *input*
(NaN/Inf, asymmetric, clearly indefinite) fails at once, because no retry can fix it. Garbage is
never returned: the caller gets a :class:`SolveResult` or a :class:`SolverError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import scipy.linalg
from threadpoolctl import ThreadpoolController

from asteria_server.errors import SolverError
from asteria_server.types import SolveKind, SolveResult, SolveTask

_PROBE_SEED = 0x5EED


@functools.lru_cache(maxsize=16)
def _probe(n: int) -> np.ndarray:
    """The checks' fixed Gaussian probe vector of length n (read-only; made once per n: a new
    generator per check cost about as much as the check itself at n = 256)."""
    y = np.random.default_rng(_PROBE_SEED).standard_normal(n)
    y.flags.writeable = False
    return y


@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    """Tolerances and retry policy of :class:`EighSolver`.

    Attributes:
        max_attempts: solver attempts per task; attempt k > 1 uses epsilon ``10^(k-1) * base``
            with ``base = max(epsilon, 1e-12 * trace(A) / n)`` (1e-12 if that is zero).
        blas_threads: BLAS threads while solving; None leaves the process setting alone (worker
            processes set it once for the whole process).
        symmetry_rtol: reject A when ``max|A - A^T| > symmetry_rtol * max(1, max|A|)``.
        psd_rtol: reject A when its smallest eigenvalue (estimate) is below
            ``-psd_rtol * max|lambda|``.
        orthogonality_atol: a basis passes when each column's squared norm is within this of 1
            and a random probe shows ``|Q^T Q y - y| <= orthogonality_atol * |y|``.
        residual_rtol: a decomposition passes a random-probe check
            ``|A U y - U (lam * y)| <= residual_rtol * max|lambda| * |y|``.
    """

    max_attempts: int = 3
    blas_threads: int | None = 1
    symmetry_rtol: float = 1e-4
    psd_rtol: float = 1e-3
    orthogonality_atol: float = 1e-3
    residual_rtol: float = 1e-6

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(
                f"SolverConfig.max_attempts must be an int >= 1, got {self.max_attempts!r}"
            )
        if self.blas_threads is not None and (
            not isinstance(self.blas_threads, int) or self.blas_threads < 1
        ):
            raise ValueError(
                f"SolverConfig.blas_threads must be None or an int >= 1, got {self.blas_threads!r}"
            )
        for name in ("symmetry_rtol", "psd_rtol", "orthogonality_atol", "residual_rtol"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (0.0 < value < math.inf):
                raise ValueError(f"SolverConfig.{name} must be a finite number > 0, got {value!r}")


class InputRejected(Exception):
    """The snapshot itself is unusable (retrying cannot help)."""


class AttemptFailed(Exception):
    """One solve attempt produced something unusable (a larger epsilon may help)."""


# --------------------------------------------------------------------------- pure numerics


def canonicalize_signs(q: np.ndarray) -> np.ndarray:
    """Flip columns of ``q`` in place so each column's largest-|.| entry is positive; return q.

    On ties the first such entry decides (``np.argmax`` semantics); an all-zero column is kept.
    """
    rows = np.argmax(np.abs(q), axis=0)
    signs = np.sign(q[rows, np.arange(q.shape[1])])
    signs[signs == 0] = 1.0
    q *= signs
    return q


#: Bytes of each output row :func:`copy_transposed` writes per pass: one cache line.
_STRIPE_BYTES = 64


def copy_transposed(out: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``out[...] = rows.T`` (cast to ``out``'s dtype), for a C-ordered 2-d ``out`` and ``rows``
    whose rows are contiguous; returns ``out``.

    Stripe by stripe: each pass reads a few rows of ``rows`` side by side and fills one cache
    line of every row of ``out``, where NumPy's whole-matrix transposed copy touches a new
    cache line for every element (measured 2-3x faster at n = 256 to 2048). The values are
    exactly those of the plain copy."""
    step = max(1, _STRIPE_BYTES // out.itemsize)
    for j in range(0, rows.shape[0], step):
        np.copyto(out[:, j : j + step], rows[j : j + step].T, casting="same_kind")
    return out


#: :func:`checked_symmetric` works band by band (of rows) from this many bytes of float64 output
#: on (n = 1024), each band's float64 rows this many bytes: a band's arrays then stay in a
#: core's L2 cache while its passes run. Below it, one band: measured slower banded at n <= 512
#: (NumPy's per-call cost), 2.1-2.7 -> 1.4-1.5 ms at n = 1024 and 10.9 -> 8.1 ms at 2048.
_BANDED_FROM_BYTES = 8 << 20
_BAND_BYTES = 1 << 19


def checked_symmetric(matrix: np.ndarray, *, symmetry_rtol: float = 1e-4) -> np.ndarray:
    """Float64 ``(A + A^T) / 2`` of a finite, nearly symmetric square float matrix, else
    InputRejected. Always a new array, never a view of ``matrix``: a solver worker calls it on
    the client's segment itself, and its result is the worker's private copy (the one read of
    the snapshot).

    The work stays in ``matrix``'s own dtype until the sum (a float32 snapshot is read as
    float32, half the bytes): its transpose is made once, stripe by stripe
    (:func:`copy_transposed`); then, band of rows by band (one band for small matrices), the
    largest magnitude is ``max(max A, -min A)`` (NaN or Inf shows in those reductions), the
    asymmetry ``max |A - A^T|`` is the largest entry of ``A - A^T``, which is exactly
    antisymmetric, so one reduction gives it, and the rows of the sum are written. The sum of
    two float32 numbers in float64 is exact, so the result equals the float64 symmetrization
    of the float32 snapshot, whatever the bands.
    """
    a = np.asarray(matrix)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float64)
    rows = a.shape[0]
    a_t = copy_transposed(np.empty_like(a), a)
    out = np.empty(a.shape, np.float64)
    band = max(1, rows)  # an empty matrix: no band, nothing to check
    if a.size * 8 >= _BANDED_FROM_BYTES:
        band = max(1, _BAND_BYTES // max(1, 8 * a.shape[1]))
    scratch = np.empty((min(band, rows), a.shape[1]), a.dtype)
    high = low = asym = 0.0
    with np.errstate(over="ignore"):  # float32 entries near its range: caught just below
        for start in range(0, rows, band):
            top, left = a[start : start + band], a_t[start : start + band]
            band_high, band_low = float(top.max()), float(top.min())
            if not (math.isfinite(band_high) and math.isfinite(band_low)):  # max/min keep NaN
                raise InputRejected("factor matrix holds NaN or Inf")
            high, low = max(high, band_high), min(low, band_low)
            diff = np.subtract(top, left, out=scratch[: len(top)])
            asym = max(asym, float(diff.max()))
            half = np.add(top, left, out=out[start : start + band], dtype=np.float64)
            half *= 0.5
    scale = max(1.0, high, -low)
    if not asym <= symmetry_rtol * scale:
        raise InputRejected(
            f"factor matrix is not symmetric (max |A - A^T| = {asym:.3g}, "
            f"allowed {symmetry_rtol * scale:.3g})"
        )
    return out


def eigh_fp64(
    a: np.ndarray, *, driver: str = "evd", shift: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Ascending eigenvalues and eigenvectors of exactly symmetric float64 ``a + shift I`` (``a``
    is left intact: LAPACK works in one Fortran-ordered copy, shifted there).

    The copy is of ``a.T``, which for a C-ordered ``a`` is already Fortran-ordered: a straight
    copy instead of a transposing one (several times faster from n = 512 on), equal to ``a``
    because ``a`` is symmetric (LAPACK reads one triangle of it)."""
    work = np.array(a.T, dtype=np.float64, order="F", copy=True)
    if shift:
        work[np.diag_indices_from(work)] += shift
    w, v = scipy.linalg.eigh(work, driver=driver, overwrite_a=True, check_finite=False)
    return np.asarray(w), np.asarray(v)


def inverse_root_from_eigh(
    w: np.ndarray, v: np.ndarray, exponent: float, epsilon: float
) -> np.ndarray:
    """``U diag((max(lam, 0) + epsilon)^-exponent) U^T`` in float64, exactly symmetric.

    Computed as ``B B^T`` with ``B = U diag(lam^(-exponent / 2))``: NumPy hands ``B @ B.T`` to
    BLAS as one symmetric rank-n update (``syrk``), which does half the flops of the general
    product ``(U diag(lam^-exponent)) U^T`` and fills the other triangle by copying, so the
    result is symmetric by construction and needs no symmetrizing pass (measured at n = 1024,
    one thread: 21.6 ms against 32.9 ms for the general product, plus 1.5 ms for its
    symmetrization)."""
    lam = np.maximum(w, 0.0) + epsilon
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # caught by the checks
        half = v * np.power(lam, -0.5 * exponent)
        return half @ half.T


def sorted_basis32(
    w: np.ndarray, v: np.ndarray, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Columns of ``v`` and eigenvalues ``w`` in descending eigenvalue order (stable), each
    column's largest-|.| entry made positive (:func:`canonicalize_signs`), the basis in float32
    (C order), bitwise equal to converting that float64 basis but in fewer passes over memory
    (the float64 form is the tests' reference); the basis is written into
    ``out`` when given (an n x n float32 C-ordered array, e.g. a view of a result segment).

    ``v``'s columns are rows of ``v.T``, contiguous when LAPACK returned ``v`` in Fortran order:
    the signs and the conversion work on those rows (a sign flip commutes with rounding to
    float32), and the one transposition, in descending order, is the striped
    :func:`copy_transposed` into the result (instead of a transposing float64 copy, a sign pass
    and a conversion). AttemptFailed when the basis is not finite."""
    n = w.size
    if n < 2 or bool((w[1:] > w[:-1]).all()):  # no ties: the stable order is the reverse
        order, ascending = np.arange(n - 1, -1, -1), True
        rows = v.T  # reversed by the transposition below
    else:
        order, ascending = np.argsort(-w, kind="stable"), False
        rows = v.T[order]  # fancy indexing made a new array, in order
    # canonicalize_signs on the rows: each one's largest-|.| entry (the first on ties) positive
    at = np.argmax(np.abs(rows), axis=1)
    signs = np.sign(rows[np.arange(n), at]).astype(np.float32)
    signs[signs == 0] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):  # float64 -> float32, as astype rounds
        q_t = rows.astype(np.float32)
    q_t *= signs[:, None]
    if not np.isfinite(q_t).all():
        raise AttemptFailed("basis is not finite in float32")
    if ascending:
        q_t = q_t[::-1]
    target = np.empty((n, n), np.float32) if out is None else out
    return copy_transposed(target, q_t), w[order]


def qr_refresh(
    a: np.ndarray, basis: np.ndarray, epsilon: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One SOAP basis refresh of symmetric float64 ``a`` from ``basis``.

    Returns ``(q_new, estimates, permutation)``: ``permutation`` orders the old columns by
    descending ``diag(Q^T A Q)`` (stable); ``q_new = qr((A + epsilon I) Q[:, permutation])`` with
    canonical signs; ``estimates = diag(q_new^T A q_new)`` in ``q_new``'s column order.
    """
    q = np.asarray(basis, dtype=np.float64)
    aq = a @ q
    estimates = np.einsum("ij,ij->j", q, aq)
    permutation = np.argsort(-estimates, kind="stable").astype(np.int64)
    power = aq[:, permutation]
    if epsilon:
        power += epsilon * q[:, permutation]
    q_new, _ = scipy.linalg.qr(power, mode="economic", overwrite_a=True, check_finite=False)
    q_new = canonicalize_signs(np.asarray(q_new))
    new_estimates = np.einsum("ij,ij->j", q_new, a @ q_new)
    return q_new, new_estimates, permutation


def escalated_epsilons(epsilon: float, trace_over_n: float, max_attempts: int) -> list[float]:
    """The epsilon of each attempt: as given, then 10x, 100x, ... a floor-raised base."""
    base = max(epsilon, 1e-12 * abs(trace_over_n))
    if base == 0.0:
        base = 1e-12
    return [epsilon] + [base * 10.0**k for k in range(1, max_attempts)]


# --------------------------------------------------------------------------- checks


def _check_psd(eigenvalues: np.ndarray, psd_rtol: float) -> None:
    top = float(np.abs(eigenvalues).max()) if eigenvalues.size else 0.0
    low = float(eigenvalues.min()) if eigenvalues.size else 0.0
    if low < -psd_rtol * top:
        raise InputRejected(
            f"factor is not positive semi-definite (smallest eigenvalue {low:.3g}, "
            f"largest magnitude {top:.3g})"
        )


def _check_decomposition(
    a: np.ndarray, w: np.ndarray, v: np.ndarray, cfg: SolverConfig, shift: float = 0.0
) -> None:
    """O(n^2) random-probe check that ``(A + shift I) V = V diag(w)`` and ``V^T V = I``."""
    if not (np.isfinite(w).all() and np.isfinite(v).all()):
        raise AttemptFailed("eigendecomposition returned non-finite values")
    y = _probe(a.shape[0])
    y_norm = float(np.linalg.norm(y))
    vy = v @ y
    scale = max(float(np.abs(w).max()), np.finfo(np.float64).tiny)
    avy = a @ vy
    if shift:
        avy += shift * vy
    residual = float(np.linalg.norm(avy - v @ (w * y)))
    if not residual <= cfg.residual_rtol * scale * y_norm:
        raise AttemptFailed(f"eigendecomposition residual too large ({residual / y_norm:.3g})")
    drift = float(np.linalg.norm(v.T @ vy - y))
    if not drift <= cfg.residual_rtol * y_norm:
        raise AttemptFailed(f"eigenvectors are not orthonormal (probe error {drift / y_norm:.3g})")


def _check_orthonormal(q32: np.ndarray, atol: float) -> None:
    """O(n^2) check that ``Q^T Q = I``: every column norm exactly, the rest by a random probe.

    Passes when ``max_j |q_j^T q_j - 1| <= atol`` and ``|Q^T Q y - y| <= atol * |y|`` for a fixed
    Gaussian ``y``. The full product ``Q^T Q`` would cost a tenth of the eigh it checks.
    """
    if not np.isfinite(q32).all():
        raise AttemptFailed("basis is not finite")
    norms = np.einsum("ij,ij->j", q32, q32, dtype=np.float64)
    err = float(np.abs(norms - 1.0).max()) if norms.size else 0.0
    if not err <= atol:
        raise AttemptFailed(f"basis is not orthonormal (max |q_j^T q_j - 1| = {err:.3g})")
    y = _probe(q32.shape[1])
    q = q32.astype(np.float64, copy=False)
    drift = float(np.linalg.norm(q.T @ (q @ y) - y)) / float(np.linalg.norm(y))
    if not drift <= atol:
        raise AttemptFailed(f"basis is not orthonormal (probe error |Q^T Q y - y| = {drift:.3g})")


def _finite32(array: np.ndarray, what: str, out: np.ndarray | None = None) -> np.ndarray:
    """``array`` in float32, C-ordered (a Fortran-ordered matrix, e.g. LAPACK's Q, is
    converted in its own order and then transposed by stripes), else AttemptFailed. With
    ``out`` (a float32 C-ordered array of the same shape, e.g. a view of a result segment) the
    result is written there, converting straight into it when no transposition is needed."""
    fortran = array.ndim == 2 and array.flags.f_contiguous and not array.flags.c_contiguous
    with np.errstate(over="ignore", invalid="ignore"):
        if out is not None and not fortran:
            np.copyto(out, array, casting="same_kind")
            converted = out
        else:
            converted = array.astype(np.float32, order="K")
    if not np.isfinite(converted).all():
        raise AttemptFailed(f"{what} is not finite in float32")
    if fortran:
        target = np.empty(converted.shape, np.float32) if out is None else out
        return copy_transposed(target, converted.T)
    return converted


# --------------------------------------------------------------------------- the solver


@dataclass(frozen=True)
class _Output:
    matrix: np.ndarray
    eigenvalues: np.ndarray | None = None
    permutation: np.ndarray | None = None
    rotation: np.ndarray | None = None


#: Where a solve writes its float32 n x n outputs, by result field (``"matrix"``,
#: ``"rotation"``): a solver worker passes views of the client's result segment, so the last
#: pass of the solve (the conversion to float32) is the write into shared memory.
OutputArrays = Callable[[str], np.ndarray]


class CheckedInput(NamedTuple):
    """A task's input ready to solve (:meth:`EighSolver.checked_input`)."""

    #: The factor, symmetrized, float64.
    matrix: np.ndarray
    #: The basis to refresh, float64 (None: a full eigendecomposition).
    basis: np.ndarray | None


def _named(task: SolveTask) -> str:
    """How errors name ``task``."""
    return f"block {task.block!r} (tenant {task.tenant!r}) version {task.version}"


class EighSolver:
    """Validated, retried float64 solves of :class:`SolveTask` s.

    Thread-compatible (no shared mutable state besides the BLAS controller); the engine runs it
    in worker processes because SciPy's eigh holds the GIL.
    """

    def __init__(self, config: SolverConfig | None = None) -> None:
        self.config = config if config is not None else SolverConfig()
        self._controller: ThreadpoolController | None = None

    @contextlib.contextmanager
    def _blas_limit(self) -> Iterator[None]:
        if self.config.blas_threads is None:
            yield
            return
        if self._controller is None:
            self._controller = ThreadpoolController()
        with self._controller.limit(limits=self.config.blas_threads, user_api="blas"):
            yield

    def checked_input(self, task: SolveTask) -> CheckedInput:
        """``task``'s factor symmetrized and its basis, both in float64 and new arrays (never
        views of the task's); :class:`SolverError` naming the block when either is unusable.

        A solver worker calls this on views of the client's segment, under its seqlock: this
        is the worker's one read of the snapshot."""
        try:
            a = checked_symmetric(task.matrix, symmetry_rtol=self.config.symmetry_rtol)
            basis = None
            if task.basis is not None:
                basis = np.array(task.basis, dtype=np.float64)
                if not np.isfinite(basis).all():
                    raise InputRejected("the basis to refresh holds NaN or Inf")
        except InputRejected as exc:
            raise SolverError(f"{_named(task)}: {exc}; the last good result stays in use") from exc
        return CheckedInput(a, basis)

    def solve(
        self,
        task: SolveTask,
        outputs: OutputArrays | None = None,
        *,
        checked: CheckedInput | None = None,
    ) -> SolveResult:
        """Compute ``task``; raise :class:`SolverError` naming the block if every attempt fails.
        With ``outputs`` the n x n results are written into the arrays it gives (a failed
        attempt may leave anything there), else into new ones. ``checked``: the task's input
        as :meth:`checked_input` returned it, when the caller read it already (the task's own
        arrays are then not read)."""
        start = time.perf_counter()
        what = _named(task)
        cfg = self.config
        with self._blas_limit():
            a, basis = checked if checked is not None else self.checked_input(task)
            epsilons = escalated_epsilons(
                float(task.epsilon), float(np.trace(a)) / a.shape[0], cfg.max_attempts
            )
            driver = "evd"
            problems: list[str] = []
            for attempt, eps in enumerate(epsilons, start=1):
                try:
                    out = self._attempt(task, a, basis, eps, driver, outputs)
                except InputRejected as exc:
                    raise SolverError(f"{what}: {exc}; the last good result stays in use") from exc
                except np.linalg.LinAlgError as exc:
                    problems.append(f"attempt {attempt} (epsilon {eps:.3g}): LAPACK: {exc}")
                    driver = "ev"  # the QR-iteration driver: slower, more robust than evd
                    continue
                except (AttemptFailed, ValueError, FloatingPointError) as exc:
                    problems.append(f"attempt {attempt} (epsilon {eps:.3g}): {exc}")
                    continue
                return SolveResult(
                    block=task.block,
                    version=task.version,
                    kind=task.kind,
                    matrix=out.matrix,
                    eigenvalues=out.eigenvalues,
                    permutation=out.permutation,
                    rotation=out.rotation,
                    base_version=task.base_version,
                    epsilon_used=eps,
                    solve_time_s=time.perf_counter() - start,
                    attempts=attempt,
                    tenant=task.tenant,
                )
        raise SolverError(
            f"{what}: {task.kind.value} failed after {len(epsilons)} attempts "
            f"({'; '.join(problems)}); the last good result stays in use"
        )

    def _attempt(
        self,
        task: SolveTask,
        a: np.ndarray,
        basis: np.ndarray | None,
        eps: float,
        driver: str,
        outputs: OutputArrays | None,
    ) -> _Output:
        cfg = self.config

        def target(name: str) -> np.ndarray | None:
            return None if outputs is None else outputs(name)

        if task.kind is SolveKind.INVERSE_ROOT:
            w, v = eigh_fp64(a, driver=driver)
            _check_decomposition(a, w, v, cfg)
            _check_psd(w, cfg.psd_rtol)
            root = inverse_root_from_eigh(w, v, float(task.exponent), eps)
            return _Output(matrix=_finite32(root, "inverse root", target("matrix")))
        if basis is None:
            w, v = eigh_fp64(a, driver=driver, shift=eps)  # of A + eps I
            _check_decomposition(a, w, v, cfg, shift=eps)
            w = w - eps
            _check_psd(w, cfg.psd_rtol)
            # No _check_orthonormal(q32) here: the probe above checked V^T V = I in float64,
            # and q32 is V with columns reordered and signs flipped (both keep Q^T Q = I),
            # rounded to float32, which moves Q^T Q by about n * 2^-24, far inside
            # orthogonality_atol; its finiteness sorted_basis32 checks. (A QR refresh has no
            # float64 check, so it keeps the float32 one.)
            q32, w_sorted = sorted_basis32(w, v, target("matrix"))
            return _Output(matrix=q32, eigenvalues=_finite32(w_sorted, "eigenvalues"))
        q_new, estimates, permutation = qr_refresh(a, basis, eps)
        _check_psd(estimates, cfg.psd_rtol)
        q32 = _finite32(q_new, "basis", target("matrix"))
        _check_orthonormal(q32, cfg.orthogonality_atol)
        # The change of basis, so a client moves its moments with one n^2 m product instead of
        # computing this n^3 one on its training path.
        rotation = q_new.T @ np.asarray(basis, dtype=np.float64)
        return _Output(
            matrix=q32,
            eigenvalues=_finite32(estimates, "eigenvalue estimates"),
            permutation=permutation,
            rotation=_finite32(rotation, "rotation", target("rotation")),
        )


def solve(task: SolveTask, config: SolverConfig | None = None, **overrides: Any) -> SolveResult:
    """One-shot :meth:`EighSolver.solve` (``overrides`` are SolverConfig fields)."""
    if overrides:
        config = dataclasses.replace(config if config is not None else SolverConfig(), **overrides)
    return EighSolver(config).solve(task)
