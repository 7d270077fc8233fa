"""Blocking rules: dropped size-1 dims, merging, tiling, identity dims, split/merge round trip."""

from __future__ import annotations

import pytest
import torch

from asteria_client.optim.blocking import LargeDimPolicy, plan_blocking


@pytest.mark.parametrize(
    "shape,max_dim,merged,diagonal",
    [
        ((128, 64, 3, 3), 1024, (128, 576), False),  # conv kernel merges into fan-in
        ((512, 128), 1024, (512, 128), False),
        ((64, 8), 1024, (64, 8), False),  # the fan-out is never merged into a vector
        ((1, 300, 1), 1024, (300,), True),  # size-1 dims dropped -> a vector -> Adam
        ((7,), 8, (7,), True),
        ((), 8, (1,), True),
        ((6, 5, 7), 8, (6, 5, 7), False),
        ((0, 4), 8, (0,), True),
    ],
)
def test_merged_shape(shape, max_dim, merged, diagonal) -> None:  # type: ignore[no-untyped-def]
    plan = plan_blocking(shape, max_dim)
    assert plan.merged_shape == merged
    assert plan.diagonal is diagonal


def test_large_dims_are_tiled_near_equally() -> None:
    plan = plan_blocking((10, 25), 8)
    assert plan.merged_shape == (10, 25)
    assert [t.shape for t in plan.tiles][:4] == [(5, 7), (5, 6), (5, 6), (5, 6)]
    assert len(plan.tiles) == 2 * 4
    assert all(all(t.preconditioned) for t in plan.tiles)


def test_identity_policy_leaves_large_dims_unpreconditioned() -> None:
    plan = plan_blocking((65, 20000), 1024, LargeDimPolicy.IDENTITY)
    assert len(plan.tiles) == 1
    assert plan.tiles[0].preconditioned == (True, False)


def test_split_merge_round_trip() -> None:
    plan = plan_blocking((10, 3, 9), 8)
    x = torch.randn(10, 3, 9)
    tiles = plan.split(x)
    assert sum(t.numel() for t in tiles) == x.numel()
    assert torch.equal(plan.merge([t.clone() for t in tiles]), x)


def test_invalid_max_dim() -> None:
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        plan_blocking((3, 3), 0)
