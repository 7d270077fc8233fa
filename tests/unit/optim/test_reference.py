"""Each optimizer's first steps against the independent float64 references in ``reference.py``.

Shapes: square, rectangular, merged (3-D that blocks into a matrix), tiled (a dimension above
``max_preconditioner_dim``), and 1-D. Gradients come from fixed quadratic losses, so any
difference in an update changes every later gradient and is amplified, not hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_client.optim.blocking import plan_blocking

from . import reference as ref

STEPS = 25
FREQ = 4
RTOL = 1e-7
ATOL = 1e-9


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def regression_grad(rows: int, cols: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Gradient of 0.5 * |W X - Y|^2 / N for a fixed random X, Y (couples rows and columns)."""
    g = _gen(seed)
    x = torch.randn(cols, 3 * cols, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 3 * cols, generator=g, dtype=torch.float64)
    return lambda w: (w @ x - y) @ x.T / x.shape[1]


def column_separable_grad(
    rows: int, cols: int, seed: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A (W - W*) with A SPD: each column's gradient depends only on that column (tile-safe)."""
    g = _gen(seed)
    b = torch.randn(rows, rows, generator=g, dtype=torch.float64)
    a = b @ b.T / rows + 0.1 * torch.eye(rows, dtype=torch.float64)
    target = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return lambda w: a @ (w - target)


def vector_grad(n: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    g = _gen(seed)
    b = torch.randn(n, n, generator=g, dtype=torch.float64)
    a = b @ b.T / n
    target = torch.randn(n, generator=g, dtype=torch.float64)
    return lambda w: a @ (w - target)


def run_asteria(optimizer_factory, w0: torch.Tensor, grad_fn, steps: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    param = torch.nn.Parameter(w0.clone())
    opt = optimizer_factory([("w", param)])
    for _ in range(steps):
        param.grad = grad_fn(param.detach().clone())
        opt.step()
    return param.detach()


HYPER = {"lr": 0.05, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "wd": 0.01}


def soap_factory(max_dim: int = 64):  # type: ignore[no-untyped-def]
    return lambda params: SOAP(
        mode="native",
        params=params,
        lr=HYPER["lr"],
        betas=(HYPER["b1"], HYPER["b2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["wd"],
        precondition_frequency=FREQ,
        max_preconditioner_dim=max_dim,
    )


def soap_ref(w, grad_fn):  # type: ignore[no-untyped-def]
    h = HYPER
    return ref.soap_matrix(w, grad_fn, STEPS, h["lr"], h["b1"], h["b2"], h["eps"], h["wd"], FREQ)


def shampoo_factory(max_dim: int = 64):  # type: ignore[no-untyped-def]
    return lambda params: Shampoo(
        mode="native",
        params=params,
        lr=HYPER["lr"],
        betas=(HYPER["b1"], HYPER["b2"]),
        eps=1e-6,
        weight_decay=HYPER["wd"],
        graft_eps=HYPER["eps"],
        precondition_frequency=FREQ,
        max_preconditioner_dim=max_dim,
    )


def shampoo_ref(w, grad_fn):  # type: ignore[no-untyped-def]
    h = HYPER
    if w.dim() == 1:
        return ref.adam_1d(w, grad_fn, STEPS, h["lr"], h["b1"], h["b2"], h["eps"], h["wd"])
    return ref.shampoo_matrix(
        w, grad_fn, STEPS, h["lr"], h["b1"], h["b2"], 1e-6, h["wd"], FREQ, h["eps"]
    )


def kl_factory(max_dim: int = 64):  # type: ignore[no-untyped-def]
    return lambda params: KLShampoo(
        mode="native",
        params=params,
        lr=HYPER["lr"],
        betas=(HYPER["b1"], HYPER["b2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["wd"],
        precondition_frequency=FREQ,
        max_preconditioner_dim=max_dim,
    )


def kl_ref(w, grad_fn):  # type: ignore[no-untyped-def]
    h = HYPER
    if w.dim() == 1:
        return ref.adam_1d(w, grad_fn, STEPS, h["lr"], h["b1"], h["b2"], h["eps"], h["wd"])
    return ref.kl_shampoo_matrix(
        w, grad_fn, STEPS, h["lr"], h["b1"], h["b2"], h["eps"], h["wd"], FREQ, 1e-4
    )


OPTIMIZERS = {
    "soap": (soap_factory, soap_ref),
    "shampoo": (shampoo_factory, shampoo_ref),
    "kl_shampoo": (kl_factory, kl_ref),
}


@pytest.fixture(params=sorted(OPTIMIZERS))
def optimizer(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return OPTIMIZERS[request.param]


@pytest.mark.parametrize("shape", [(8, 8), (6, 10), (10, 4)], ids=["square", "wide", "tall"])
def test_matrix_matches_reference(optimizer, shape: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    factory, reference = optimizer
    w0 = torch.randn(*shape, generator=_gen(1), dtype=torch.float64)
    grad_fn = regression_grad(*shape, seed=2)
    got = run_asteria(factory(), w0, grad_fn, STEPS)
    want = reference(w0.clone(), grad_fn)
    assert not torch.allclose(want, w0), "the reference did not move: the test would be vacuous"
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_merged_dims_match_reference_on_merged_matrix(optimizer) -> None:  # type: ignore[no-untyped-def]
    factory, reference = optimizer
    shape = (6, 2, 5)  # blocks as a 6 x 10 matrix
    assert plan_blocking(shape, 64).merged_shape == (6, 10)
    w0 = torch.randn(*shape, generator=_gen(3), dtype=torch.float64)
    flat_grad = regression_grad(6, 10, seed=4)
    got = run_asteria(factory(), w0, lambda w: flat_grad(w.reshape(6, 10)).reshape(shape), STEPS)
    want = reference(w0.reshape(6, 10).clone(), flat_grad).reshape(shape)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_tiles_match_independent_references(optimizer) -> None:  # type: ignore[no-untyped-def]
    factory, reference = optimizer
    shape = (6, 40)
    plan = plan_blocking(shape, 16)
    assert [t.shape for t in plan.tiles] == [(6, 14), (6, 13), (6, 13)]
    w0 = torch.randn(*shape, generator=_gen(5), dtype=torch.float64)
    grad_fn = column_separable_grad(*shape, seed=6)
    got = run_asteria(factory(max_dim=16), w0, grad_fn, STEPS)
    pieces = []
    for tile in plan.tiles:
        cols = tile.slices[1]

        def tile_grad(w, cols=cols):  # type: ignore[no-untyped-def]
            padded = torch.zeros(shape, dtype=torch.float64)
            padded[:, cols] = w  # the other columns do not affect these columns' gradient
            return grad_fn(padded)[:, cols]

        pieces.append(reference(w0[:, cols].clone(), tile_grad))
    want = torch.cat(pieces, dim=1)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_vector_matches_reference(optimizer) -> None:  # type: ignore[no-untyped-def]
    factory, reference = optimizer
    w0 = torch.randn(7, generator=_gen(7), dtype=torch.float64)
    grad_fn = vector_grad(7, seed=8)
    got = run_asteria(factory(), w0, grad_fn, STEPS)
    want = reference(w0.clone(), grad_fn)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_soap_first_step_does_not_move_weights() -> None:
    param = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    before = param.detach().clone()
    opt = soap_factory()([("w", param)])
    param.grad = torch.randn(5, 3, dtype=torch.float64)
    opt.step()
    assert torch.equal(param.detach(), before)
    param.grad = torch.randn(5, 3, dtype=torch.float64)
    opt.step()
    assert not torch.equal(param.detach(), before)


def test_order_three_tile_trains() -> None:
    """(6, 5, 7) with max dim 8 stays an order-3 tile: three factors, exponent 1/6 in Shampoo."""
    assert plan_blocking((6, 5, 7), 8).merged_shape == (6, 5, 7)
    target = torch.randn(6, 5, 7, generator=_gen(9))
    for factory in (soap_factory, shampoo_factory, kl_factory):
        param = torch.nn.Parameter(torch.zeros(6, 5, 7))
        opt = factory(max_dim=8)([("w", param)])
        losses = []
        for _ in range(40):
            opt.zero_grad()
            loss = 0.5 * ((param - target) ** 2).sum()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        assert len(opt.preconditioner_status()) == 3
        assert losses[-1] < 0.5 * losses[0]
