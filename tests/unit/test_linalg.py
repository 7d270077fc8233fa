"""Native roots and eigenbases against float64 SciPy, and their failure behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from asteria_client.runtime import linalg
from asteria_server.errors import SolverError


def spd(n: int, cond: float, seed: int, rank: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    vals = np.logspace(0, -np.log10(cond), n)
    if rank is not None:
        vals[rank:] = 0.0
    return (q * vals) @ q.T


@pytest.mark.parametrize("n,cond", [(4, 10.0), (32, 1e4), (64, 1e8)])
@pytest.mark.parametrize("exponent", [0.25, 0.5, 1.0 / 6])
def test_inverse_root_matches_scipy(n: int, cond: float, exponent: float) -> None:
    a = spd(n, cond, seed=n)
    eps = 1e-10
    want = scipy.linalg.fractional_matrix_power(a + eps * np.eye(n), -exponent).real
    got = linalg.inverse_root(torch.from_numpy(a), exponent, eps).numpy()
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8 * np.abs(want).max())


def test_inverse_root_clamps_negative_eigenvalues() -> None:
    a = spd(8, 10.0, seed=1, rank=5)
    a_noisy = a - 1e-9 * np.eye(8)  # tiny negative eigenvalues, as rounding produces
    eps = 1e-6
    vals, vecs = np.linalg.eigh(a_noisy)
    want = (vecs * (np.maximum(vals, 0) + eps) ** -0.25) @ vecs.T
    got = linalg.inverse_root(torch.from_numpy(a_noisy), 0.25, eps).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)
    assert np.isfinite(got).all()


def test_float32_input_returns_float32_on_same_device() -> None:
    a = torch.from_numpy(spd(16, 100.0, seed=2)).float()
    root = linalg.inverse_root(a, 0.25, 1e-8)
    assert root.dtype == torch.float32 and root.device == a.device


@pytest.mark.parametrize("n,cond", [(8, 10.0), (48, 1e6)])
def test_eigenbasis_matches_scipy(n: int, cond: float) -> None:
    a = spd(n, cond, seed=3)
    vals, _ = scipy.linalg.eigh(a)
    result = linalg.eigenbasis(torch.from_numpy(a))
    q = result.basis.numpy()
    np.testing.assert_allclose(result.eigenvalues.numpy(), vals[::-1], rtol=1e-8, atol=1e-14)
    np.testing.assert_allclose(q.T @ q, np.eye(n), atol=1e-10)
    np.testing.assert_allclose(q.T @ a @ q, np.diag(vals[::-1]), atol=1e-10)
    # sign convention: the largest-magnitude entry of every column is positive
    idx = np.abs(q).argmax(axis=0)
    assert (q[idx, np.arange(n)] > 0).all()


def test_refresh_matches_hand_written_power_step() -> None:
    n = 12
    a = spd(n, 1e3, seed=4)
    rng = np.random.default_rng(5)
    q0, _ = np.linalg.qr(rng.standard_normal((n, n)))
    est = np.diag(q0.T @ a @ q0)
    order = np.argsort(-est, kind="stable")
    q_ref, _ = np.linalg.qr(a @ q0[:, order])
    result = linalg.refresh_eigenbasis(torch.from_numpy(a), torch.from_numpy(q0))
    assert result.permutation is not None
    np.testing.assert_array_equal(result.permutation.numpy(), order)
    got = result.basis.numpy()
    # same columns up to sign
    signs = np.sign(np.sum(got * q_ref, axis=0))
    np.testing.assert_allclose(got, q_ref * signs, atol=1e-10)
    np.testing.assert_allclose(result.eigenvalues.numpy(), np.diag(got.T @ a @ got), rtol=1e-10)


@pytest.mark.parametrize(
    "bad,match",
    [
        (np.full((4, 4), np.nan), "NaN or Inf"),
        (np.array([[1.0, 2.0], [0.0, 1.0]]), "not symmetric"),
        (np.ones((3, 4)), "square"),
        (-np.eye(4), "positive semi-definite"),
    ],
    ids=["nan", "asymmetric", "not-square", "negative-definite"],
)
def test_bad_factor_raises_solver_error_naming_the_block(bad: np.ndarray, match: str) -> None:
    with pytest.raises(SolverError, match=match) as info:
        linalg.inverse_root(torch.from_numpy(bad), 0.25, 1e-12, block="layer.weight/tile0/dim1")
    assert "layer.weight/tile0/dim1" in str(info.value)
    with pytest.raises(SolverError, match=match):
        linalg.eigenbasis(torch.from_numpy(bad))
