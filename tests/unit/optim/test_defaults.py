"""Defaults that cost no minutes: the max_dim_ratio rule, the costly-block warning, and a first
step that does not wait for the first basis."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_client.optim.blocking import plan_blocking
from asteria_server.engine import EngineConfig


@pytest.mark.parametrize(
    "shape,preconditioned",
    [
        ((12000, 3), (False, True)),  # the long side would cost minutes per solve
        ((1000, 3), (True, True)),  # <= 1024: always cheap enough
        ((4096, 64), (False, True)),  # 4096 > 16 * 64
        ((4096, 1024), (True, True)),
        ((3, 2048), (True, False)),
        ((50257, 768), (False, True)),  # a vocabulary dim, as reference SOAP leaves it
    ],
)
def test_max_dim_ratio_leaves_disproportionate_dims_unpreconditioned(
    shape: tuple[int, int], preconditioned: tuple[bool, bool]
) -> None:
    plan = plan_blocking(shape, 100_000, max_dim_ratio=16.0)
    assert len(plan.tiles) == 1
    assert plan.tiles[0].preconditioned == preconditioned
    off = plan_blocking(shape, 100_000, max_dim_ratio=None)
    assert off.tiles[0].preconditioned == (True, True)


def test_a_tall_thin_parameter_constructs_and_steps_fast_by_default() -> None:
    p = torch.nn.Parameter(torch.randn(12000, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no costly-block warning: the default skips the factor
        opt = SOAP([("w", p)], mode="native")
    start = time.perf_counter()
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    elapsed = time.perf_counter() - start
    # Before the rule: two 6000x6000 factors, 190 s for the first step. Generous bound.
    assert elapsed < 5.0, elapsed
    assert [row["block"] for row in opt.preconditioner_status()] == ["w/tile0/dim1"]


@pytest.mark.parametrize("optimizer", [SOAP, Shampoo, KLShampoo])
def test_costly_blocks_are_named_in_a_construction_warning(optimizer: type) -> None:
    p = torch.nn.Parameter(torch.zeros(5000, 5000))  # 5000^3 * 1.2e-10 s = 15 s per solve
    with pytest.warns(UserWarning, match=r"big\.weight \(5000, 5000\): 5000x5000 factor"):
        opt = optimizer([("big.weight", p)], mode="native", max_preconditioner_dim=8192)
    opt.close()


def test_embedded_first_steps_do_not_wait_for_the_first_basis() -> None:
    """With S >= 1 a tile starts in the identity basis; the first basis arrives later and is
    installed (moments rotated) without a barrier wait."""
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 200)
    # A slow first solve: the pool starts a worker and waits 0.5 s per solve (fault injection
    # is not needed: one worker is busy with the other blocks).
    opt = SOAP(
        model.named_parameters(),
        mode="embedded",
        staleness_budget=1,
        precondition_frequency=5,
        engine_config=EngineConfig(num_workers=1, seconds_per_n3=1.2e-10),
    )
    try:
        x = torch.randn(32, 300)
        for _ in range(4):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        stats = opt.runtime_stats()
        assert stats["barrier_waits"] == 0
        # Within the budget (S * f = 5 steps) the first basis must have been installed.
        for _ in range(8):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        assert all(row["version"] >= 1 for row in opt.preconditioner_status())
    finally:
        opt.close()


def test_budget_zero_still_waits_for_the_first_basis() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 20)
    opt = SOAP(
        model.named_parameters(),
        mode="embedded",
        staleness_budget=0,
        engine_config=EngineConfig(num_workers=1, seconds_per_n3=1.2e-10),
    )
    try:
        x = torch.randn(8, 30)
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        assert all(row["version"] == 1 for row in opt.preconditioner_status())
    finally:
        opt.close()
