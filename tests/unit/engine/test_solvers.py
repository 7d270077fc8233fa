"""The solvers against independent float64 references (numpy.linalg, explicit formulas)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from asteria_server.engine import solvers
from asteria_server.engine.solvers import (
    EighSolver,
    SolverConfig,
    canonicalize_signs,
    escalated_epsilons,
    solve,
)
from asteria_server.errors import SolverError
from asteria_server.types import SolveKind, SolveTask

# --------------------------------------------------------------------------- references


def ref_fix_signs(q: np.ndarray) -> np.ndarray:
    """Explicit loop: make each column's first largest-|.| entry positive."""
    q = q.copy()
    for j in range(q.shape[1]):
        col = q[:, j]
        i = max(range(len(col)), key=lambda k: (abs(col[k]), -k))
        if col[i] < 0:
            q[:, j] = -col
    return q


def ref_inverse_root(a: np.ndarray, exponent: float, eps: float) -> np.ndarray:
    a = a.astype(np.float64)
    w, v = np.linalg.eigh((a + a.T) / 2)
    lam = np.maximum(w, 0.0) + eps
    return v @ np.diag(lam**-exponent) @ v.T


def ref_qr_refresh(a: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = a.astype(np.float64)
    q = q.astype(np.float64)
    est = np.diag(q.T @ a @ q)
    perm = np.argsort(-est, kind="stable")
    q_new, _ = np.linalg.qr(a @ q[:, perm])
    q_new = ref_fix_signs(q_new)
    return q_new, np.diag(q_new.T @ a @ q_new), perm


def spd(n: int, cond: float = 10.0, seed: int = 0, rank: int | None = None) -> np.ndarray:
    """U diag(w) U^T with w log-spaced over [1/cond, 1] (zeros beyond ``rank``)."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((n, n)))
    w = np.logspace(0.0, -np.log10(cond), n)
    if rank is not None:
        w[rank:] = 0.0
    a = (u * w) @ u.T
    return (a + a.T) / 2


def task(matrix: np.ndarray, kind: SolveKind = SolveKind.INVERSE_ROOT, **kw: Any) -> SolveTask:
    return SolveTask(block="blk", version=7, kind=kind, matrix=matrix, **kw)


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(x.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-300))


# --------------------------------------------------------------------------- inverse root


@pytest.mark.parametrize("n", [1, 2, 8, 33, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("exponent", [0.25, 0.5])
def test_inverse_root_matches_reference(n: int, dtype: Any, exponent: float) -> None:
    a = spd(n, cond=100.0, seed=n).astype(dtype)
    result = solve(task(a, exponent=exponent, epsilon=1e-10))
    assert result.matrix.dtype == np.float32 and result.matrix.shape == (n, n)
    assert result.eigenvalues is None and result.permutation is None
    assert result.attempts == 1 and result.epsilon_used == 1e-10
    assert result.block == "blk" and result.version == 7 and result.kind is SolveKind.INVERSE_ROOT
    assert rel_err(result.matrix, ref_inverse_root(a, exponent, 1e-10)) < 1e-5


def test_inverse_root_ill_conditioned_1e8() -> None:
    a = spd(48, cond=1e8, seed=3)
    root = solve(task(a, epsilon=1e-12)).matrix
    ref = ref_inverse_root(a, 0.25, 1e-12)
    assert rel_err(root, ref) < 1e-5
    # the ill-conditioned end is right too: R u_min = (lambda_min + eps)^(-1/4) u_min
    w, v = np.linalg.eigh(a)
    expected = (w[0] + 1e-12) ** -0.25
    assert expected > 50.0
    assert np.linalg.norm(root.astype(np.float64) @ v[:, 0] - expected * v[:, 0]) < 1e-4 * expected


def test_inverse_root_rank_deficient_clamps_and_regularizes() -> None:
    a = spd(32, cond=10.0, seed=5, rank=12)
    a[0, 0] -= 1e-9  # a tiny negative eigenvalue: clamped, not rejected
    result = solve(task(a, epsilon=1e-4))
    assert np.isfinite(result.matrix).all()
    assert rel_err(result.matrix, ref_inverse_root(a, 0.25, 1e-4)) < 1e-5
    assert np.allclose(result.matrix, result.matrix.T)


def test_zero_matrix_with_zero_epsilon_escalates_epsilon() -> None:
    # attempt 1: (0 + 0)^(-1/4) is infinite -> retried with 10 * 1e-12 (trace is zero)
    result = solve(task(np.zeros((4, 4)), epsilon=0.0))
    assert result.attempts == 2
    assert result.epsilon_used == pytest.approx(1e-11)
    assert np.allclose(result.matrix, (1e-11) ** -0.25 * np.eye(4), rtol=1e-5)


def test_escalated_epsilons() -> None:
    assert escalated_epsilons(1e-12, 5.0, 3) == pytest.approx([1e-12, 5e-11, 5e-10])
    assert escalated_epsilons(1e-3, 5.0, 2) == pytest.approx([1e-3, 1e-2])
    assert escalated_epsilons(0.0, 0.0, 3) == pytest.approx([0.0, 1e-11, 1e-10])
    assert escalated_epsilons(1e-6, 1.0, 1) == [1e-6]


# --------------------------------------------------------------------------- eigenbasis


@pytest.mark.parametrize("n", [1, 3, 16, 64])
def test_full_eigenbasis_matches_reference(n: int) -> None:
    rng = np.random.default_rng(n)
    u, _ = np.linalg.qr(rng.standard_normal((n, n)))
    w = np.linspace(1.0, 2.0, n) ** 3  # distinct eigenvalues: the basis is unique up to signs
    a = (u * w) @ u.T
    result = solve(task(a.astype(np.float32), SolveKind.EIGENBASIS))
    assert result.matrix.dtype == np.float32 and result.eigenvalues is not None
    assert result.eigenvalues.dtype == np.float32 and result.permutation is None
    ref_w, ref_v = np.linalg.eigh(a.astype(np.float32).astype(np.float64))
    order = np.argsort(-ref_w, kind="stable")
    assert np.allclose(result.eigenvalues, ref_w[order], rtol=1e-5, atol=1e-6)
    assert np.all(np.diff(result.eigenvalues) <= 0)
    ref_q = ref_fix_signs(ref_v[:, order])
    assert np.abs(result.matrix - ref_q).max() < 1e-4


def test_eigenbasis_ill_conditioned_and_rank_deficient_is_orthonormal() -> None:
    for a in (spd(40, cond=1e8, seed=1), spd(40, cond=10.0, seed=2, rank=10)):
        result = solve(task(a, SolveKind.EIGENBASIS))
        q = result.matrix.astype(np.float64)
        assert np.abs(q.T @ q - np.eye(40)).max() < 1e-5
        assert result.eigenvalues is not None
        ref = np.sort(np.linalg.eigvalsh(a))[::-1]
        assert np.abs(result.eigenvalues - ref).max() < 1e-6 * np.abs(ref).max() + 1e-7
        assert np.array_equal(q, ref_fix_signs(q))


def test_sign_convention_examples() -> None:
    q = np.array([[0.6, -0.8], [-0.8, -0.6]])
    assert np.array_equal(canonicalize_signs(q.copy()), np.array([[-0.6, 0.8], [0.8, 0.6]]))
    tie = np.array([[-0.5, 0.5], [0.5, -0.5]])  # ties: the first entry decides
    assert np.array_equal(canonicalize_signs(tie.copy()), np.array([[0.5, 0.5], [-0.5, -0.5]]))
    zero = np.zeros((2, 1))
    assert np.array_equal(canonicalize_signs(zero.copy()), zero)


# --------------------------------------------------------------------------- QR refresh


@pytest.mark.parametrize("n", [2, 8, 40])
def test_qr_refresh_matches_hand_written_reference(n: int) -> None:
    rng = np.random.default_rng(100 + n)
    a = spd(n, cond=1e3, seed=n) + 0.1 * np.eye(n)
    # an outdated basis: the eigenbasis of a nearby matrix, columns shuffled and signs random
    _, v = np.linalg.eigh(a + 0.05 * spd(n, seed=n + 1))
    old = v[:, rng.permutation(n)] * rng.choice([-1.0, 1.0], size=n)
    result = solve(task(a, SolveKind.EIGENBASIS, basis=old, base_version=3))
    ref_q, ref_est, ref_perm = ref_qr_refresh(a, old)
    assert result.permutation is not None and result.permutation.dtype == np.int64
    assert np.array_equal(result.permutation, ref_perm)
    assert np.abs(result.matrix - ref_q).max() < 1e-5
    assert result.eigenvalues is not None
    assert np.allclose(result.eigenvalues, ref_est, rtol=1e-5, atol=1e-7)
    assert result.base_version == 3


def test_qr_refresh_from_float32_basis_of_rank_deficient_factor() -> None:
    a = spd(24, seed=9, rank=6)
    basis = np.linalg.qr(np.random.default_rng(0).standard_normal((24, 24)))[0].astype(np.float32)
    result = solve(task(a.astype(np.float32), SolveKind.EIGENBASIS, basis=basis))
    q = result.matrix.astype(np.float64)
    assert np.abs(q.T @ q - np.eye(24)).max() < 1e-5
    assert result.eigenvalues is not None and np.isfinite(result.eigenvalues).all()


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("kind", list(SolveKind))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_fails_at_once(kind: SolveKind, bad: float, monkeypatch: Any) -> None:
    calls = []
    monkeypatch.setattr(solvers, "eigh_fp64", lambda *a, **k: calls.append(1))
    a = np.eye(6)
    a[2, 3] = a[3, 2] = bad
    with pytest.raises(SolverError, match="NaN or Inf") as info:
        solve(task(a, kind))
    assert "'blk'" in str(info.value)
    assert calls == []  # never reached the solve, never retried


@pytest.mark.parametrize("where", [(0, 7), (7, 0)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_asymmetric_input_is_rejected_not_symmetrized(where: tuple[int, int], sign: float) -> None:
    a = spd(8)
    a[where] += sign * 1e-2
    with pytest.raises(SolverError, match=r"not symmetric \(max \|A - A\^T\| = 0\.01,"):
        solve(task(a))


def test_asymmetry_within_tolerance_is_symmetrized() -> None:
    a = spd(8)
    noisy = a.copy()
    noisy[0, 7] += 1e-7
    result = solve(task(noisy, epsilon=1e-9))
    sym = (noisy + noisy.T) / 2
    assert rel_err(result.matrix, ref_inverse_root(sym, 0.25, 1e-9)) < 1e-5


@pytest.mark.parametrize("n", [1, 5, 64, 300])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_checked_input_is_a_private_float64_symmetrization(n: int, dtype: Any) -> None:
    # A solver worker runs checked_symmetric on the client's segment itself: what it returns
    # must be its own copy, equal to (A + A^T) / 2 of the snapshot's values in float64 (for a
    # float32 snapshot, of its values converted first), however the work is ordered.
    rng = np.random.default_rng(n)
    g = rng.standard_normal((n, n))
    a = (g @ g.T + 1e-6 * rng.standard_normal((n, n))).astype(dtype)
    out = solvers.checked_symmetric(a)
    wide = a.astype(np.float64)
    assert out.dtype == np.float64 and not np.shares_memory(out, a)
    np.testing.assert_array_equal(out, (wide + wide.T) / 2)
    a[0, 0] += 1.0  # the snapshot changes afterwards: the copy does not
    np.testing.assert_array_equal(out, (wide + wide.T) / 2)
    wide = a.astype(np.float64)
    checked = EighSolver().checked_input(task(wide, SolveKind.EIGENBASIS))
    assert checked.basis is None and not np.shares_memory(checked.matrix, wide)


@pytest.mark.parametrize("band_bytes", [8, 8 * 7, 8 * 64 * 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_banded_check_reads_and_rejects_like_the_whole_matrix_one(
    band_bytes: int, dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Large matrices are checked band of rows by band (cache-sized): every band size, the last
    # one short, must give the same symmetrization and see a fault in any band.
    n = 64
    rng = np.random.default_rng(7)
    g = rng.standard_normal((n, n))
    a = (g @ g.T + 1e-6 * rng.standard_normal((n, n))).astype(dtype)
    whole = solvers.checked_symmetric(a)
    monkeypatch.setattr(solvers, "_BANDED_FROM_BYTES", 0)
    monkeypatch.setattr(solvers, "_BAND_BYTES", band_bytes)
    np.testing.assert_array_equal(solvers.checked_symmetric(a), whole)
    wide = a.astype(np.float64)
    np.testing.assert_array_equal(whole, (wide + wide.T) / 2)
    skewed = a.copy()
    skewed[40, 3] += dtype(1.0)  # in a middle band; its mirror entry in an early one
    with pytest.raises(solvers.InputRejected, match=r"max \|A - A\^T\| = 1,"):
        solvers.checked_symmetric(skewed)
    for at in [(0, 5), (n - 1, n - 2)]:  # first band, last band
        bad = a.copy()
        bad[at] = np.nan
        with pytest.raises(solvers.InputRejected, match="NaN or Inf"):
            solvers.checked_symmetric(bad)
    assert solvers.checked_symmetric(np.empty((0, 0), dtype)).shape == (0, 0)


def test_a_float32_asymmetry_is_measured_like_a_float64_one() -> None:
    a = spd(8).astype(np.float32)
    a[0, 7] += np.float32(1e-2)
    with pytest.raises(SolverError, match=r"not symmetric \(max \|A - A\^T\| = 0\.01,"):
        solve(task(a))


def test_a_refreshed_basis_is_read_into_a_copy() -> None:
    basis = np.eye(4)
    checked = EighSolver().checked_input(task(spd(4), SolveKind.EIGENBASIS, basis=basis))
    assert checked.basis is not None and not np.shares_memory(checked.basis, basis)
    np.testing.assert_array_equal(checked.basis, basis)


@pytest.mark.parametrize("kind", list(SolveKind))
def test_indefinite_input_is_rejected(kind: SolveKind) -> None:
    a = np.diag([1.0, 0.5, -0.5])
    with pytest.raises(SolverError, match="positive semi-definite"):
        solve(task(a, kind))


def test_nonfinite_basis_is_rejected() -> None:
    basis = np.eye(4)
    basis[1, 1] = np.nan
    with pytest.raises(SolverError, match="basis"):
        solve(task(np.eye(4), SolveKind.EIGENBASIS, basis=basis))


# --------------------------------------------------------------------------- retries, threads


def test_lapack_failure_is_retried_with_larger_epsilon(monkeypatch: Any) -> None:
    real = solvers.eigh_fp64
    drivers: list[str] = []

    def flaky(a: np.ndarray, *, driver: str = "evd", **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        drivers.append(driver)
        if len(drivers) == 1:
            raise np.linalg.LinAlgError("did not converge")
        return real(a, driver=driver, **kw)

    monkeypatch.setattr(solvers, "eigh_fp64", flaky)
    a = spd(10, seed=4)
    result = solve(task(a, epsilon=1e-12))
    assert result.attempts == 2
    base = max(1e-12, 1e-12 * np.trace(a) / 10)
    assert result.epsilon_used == pytest.approx(10 * base)
    assert drivers == ["evd", "ev"]
    assert rel_err(result.matrix, ref_inverse_root(a, 0.25, 10 * base)) < 1e-5


def test_every_attempt_failing_raises_solver_error_naming_block(monkeypatch: Any) -> None:
    def broken(a: np.ndarray, *, driver: str = "evd", **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        n = a.shape[0]
        return np.ones(n), np.full((n, n), np.nan)  # garbage "decomposition"

    monkeypatch.setattr(solvers, "eigh_fp64", broken)
    with pytest.raises(SolverError) as info:
        solve(task(spd(5), SolveKind.EIGENBASIS), max_attempts=4)
    message = str(info.value)
    assert "'blk'" in message and "after 4 attempts" in message and "non-finite" in message


def test_blas_threads_are_capped_during_the_solve(monkeypatch: Any) -> None:
    real = solvers.eigh_fp64
    seen: list[int] = []

    def spy(a: np.ndarray, *, driver: str = "evd", **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        seen.extend(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")
        return real(a, driver=driver, **kw)

    monkeypatch.setattr(solvers, "eigh_fp64", spy)
    EighSolver(SolverConfig(blas_threads=1)).solve(task(spd(6)))
    assert seen and set(seen) == {1}


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_attempts", 0), ("blas_threads", 0), ("symmetry_rtol", 0.0), ("psd_rtol", -1.0)],
)
def test_solver_config_validation_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SolverConfig(**{field: value})  # type: ignore[arg-type]


def sorted_eigenbasis(w: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference of ``solvers.sorted_basis32``, in float64: columns and eigenvalues in
    descending eigenvalue order (stable), signs canonicalized."""
    if w.size < 2 or bool((w[1:] > w[:-1]).all()):  # no ties: the stable order is the reverse
        order = np.arange(w.size - 1, -1, -1)
        q = solvers.canonicalize_signs(np.ascontiguousarray(v[:, ::-1]))
    else:
        order = np.argsort(-w, kind="stable")
        q = solvers.canonicalize_signs(v[:, order])  # fancy indexing made a new array
    return q, w[order]


@pytest.mark.parametrize("ties", [False, True])
def test_sorted_eigenbasis_is_the_stable_descending_order(ties: bool) -> None:
    """The no-ties shortcut (reversed columns) and the tie path give the stable argsort order."""
    rng = np.random.default_rng(7)
    w = np.sort(rng.standard_normal(9))
    if ties:
        w[3] = w[4] = w[5]
    v = rng.standard_normal((9, 9))
    q, w_sorted = sorted_eigenbasis(w, v)
    order = np.argsort(-w, kind="stable")
    np.testing.assert_array_equal(w_sorted, w[order])
    np.testing.assert_array_equal(q, solvers.canonicalize_signs(v[:, order].copy()))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("order", ["F", "C"])
@pytest.mark.parametrize("n", [1, 2, 9, 40])
def test_sorted_basis32_is_the_float32_of_sorted_eigenbasis(ties: bool, order: str, n: int) -> None:
    """The fused path (signs and conversion on v's rows, one striped transposition) gives the
    float32 basis bitwise equal to converting sorted_eigenbasis's, C-ordered, whatever v's
    layout; a tie in the largest magnitude of a column picks its first entry."""
    rng = np.random.default_rng(n)
    w = np.sort(rng.standard_normal(n))
    if ties and n > 5:
        w[3] = w[4] = w[5]
    v = np.array(rng.standard_normal((n, n)), order=order)
    if n > 2:
        v[0, 1], v[2, 1] = -3.0, 3.0  # a tie of magnitudes: the first (negative) decides
    q, w_sorted = sorted_eigenbasis(w, v.copy(order=order))
    q32, w32 = solvers.sorted_basis32(w, v)
    assert q32.dtype == np.float32 and q32.flags.c_contiguous
    np.testing.assert_array_equal(q32, q.astype(np.float32))
    np.testing.assert_array_equal(w32, w_sorted)
    np.testing.assert_array_equal(q32.astype(np.float64), ref_fix_signs(q32.astype(np.float64)))


def test_sorted_basis32_rejects_a_basis_not_finite_in_float32() -> None:
    v = np.eye(3, order="F")
    v[1, 1] = 1e300  # finite in float64, Inf in float32
    with pytest.raises(solvers.AttemptFailed, match="not finite"):
        solvers.sorted_basis32(np.arange(3.0), v)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (17, 17), (70, 33)])
def test_copy_transposed_equals_the_plain_transpose(dtype: type, shape: tuple[int, int]) -> None:
    """Every stripe width's edge: widths that do and do not divide the row count."""
    rows = np.random.default_rng(3).standard_normal(shape)
    out = np.empty(shape[::-1], dtype)
    assert solvers.copy_transposed(out, rows) is out
    np.testing.assert_array_equal(out, rows.T.astype(dtype))
    fortran = np.asfortranarray(rows.T)  # LAPACK's layout: its .T has contiguous rows
    copied = solvers.copy_transposed(np.empty(shape[::-1]), fortran.T)
    np.testing.assert_array_equal(copied, fortran)


def _kind_task(kind: str, *, seed: int, n: int = 24) -> SolveTask:
    """A float32 task of ``kind``: "inverse_root", "eigenbasis" or "refresh" (with a basis)."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, n + 2))
    basis = np.linalg.qr(rng.standard_normal((n, n)))[0].astype(np.float32)
    return SolveTask(
        block="b",
        version=1,
        kind=SolveKind.INVERSE_ROOT if kind == "inverse_root" else SolveKind.EIGENBASIS,
        matrix=(g @ g.T / n).astype(np.float32),
        basis=basis if kind == "refresh" else None,
        epsilon=1e-6,
    )


@pytest.mark.parametrize("kind", ["inverse_root", "eigenbasis", "refresh"])
def test_solver_outputs_are_c_ordered(kind: str) -> None:
    """Results are C-ordered (they are copied into result segments as such), LAPACK's Fortran
    Q of a QR refresh included, and equal to the reference."""
    task = _kind_task(kind, seed=11)
    a = task.matrix
    result = solve(task)
    for name in ("matrix", "eigenvalues", "rotation"):
        array = getattr(result, name)
        if array is not None:
            assert array.flags.c_contiguous, name
    if kind == "inverse_root":
        ref = ref_inverse_root(a, 0.25, 1e-6)
        np.testing.assert_allclose(result.matrix, ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(result.matrix, result.matrix.T)


@pytest.mark.parametrize("kind", ["inverse_root", "eigenbasis", "refresh"])
def test_a_solve_writes_its_n_by_n_results_into_the_arrays_it_is_given(kind: str) -> None:
    """A solver worker hands the solver views of the client's result segment: the n x n
    results (the matrix; a refresh's rotation too) are converted straight into them, bitwise
    what a solve into new arrays gives; the small ones (eigenvalues, permutation) are new."""
    n = 24
    task = _kind_task(kind, seed=12, n=n)
    given = {name: np.full((n, n), np.nan, np.float32) for name in ("matrix", "rotation")}
    asked: list[str] = []

    def outputs(name: str) -> np.ndarray:
        asked.append(name)
        return given[name]

    into = EighSolver().solve(task, outputs=outputs)
    fresh = EighSolver().solve(task)
    assert into.matrix is given["matrix"]
    assert (into.rotation is given["rotation"]) == (kind == "refresh")
    assert set(asked) == ({"matrix", "rotation"} if kind == "refresh" else {"matrix"})
    for name in ("matrix", "eigenvalues", "permutation", "rotation"):
        got, ref = getattr(into, name), getattr(fresh, name)
        assert (got is None) == (ref is None), name
        if got is not None:
            np.testing.assert_array_equal(got, ref)
