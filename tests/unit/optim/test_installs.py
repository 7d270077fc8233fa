"""Installs batched per tile group (optim/installs.py): the same bits as one at a time, a
count of operations that does not follow the blocks, and no basis read before it is in place."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_client.optim.installs import InstallBatch
from tests.unit.test_continuous import DelayedSource


class _Dispatches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(12, 12) for _ in range(layers)))


def _train(model: torch.nn.Module, opt: Any, steps: int, tick: Any = None) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if tick is not None:
            tick()
        opt.zero_grad()
        model(torch.randn(8, 12, generator=gen)).square().mean().backward()
        opt.step()


def _one_at_a_time(opt: Any) -> Any:
    opt._batches_installs = lambda: False  # type: ignore[method-assign]
    return opt


@pytest.mark.parametrize("optimizer", [SOAP, Shampoo, KLShampoo])
@pytest.mark.parametrize("source", ["native", "delayed"])
def test_batched_installs_equal_installs_one_at_a_time_bit_for_bit(
    source: str, optimizer: type
) -> None:
    """Native (every block installs at its refresh step: first eigh, then QR refreshes with
    their rotation and permutation) and a simulated asynchronous source whose results
    arrive late and skip versions (the change of basis from the one in use)."""
    params = []
    for batched in (True, False):
        model = _model(4)
        delayed = DelayedSource(2, [0, 3, 1, 5]) if source == "delayed" else None
        kwargs: dict[str, Any] = (
            {"mode": "native"} if delayed is None else {"source": delayed, "staleness_budget": 2}
        )
        opt = optimizer(model.named_parameters(), precondition_frequency=2, **kwargs)
        if not batched:
            _one_at_a_time(opt)
        _train(model, opt, 16, tick=None if delayed is None else delayed.tick)
        if batched:
            assert opt._installs.batches > 0, "nothing was installed in a batch"
        params.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    for a, b in zip(*params, strict=True):
        assert torch.equal(a, b)


def _install_dispatches(optimizer: type, layers: int, batched: bool) -> int:
    """Operations dispatched by the installs of 10 native steps (the solves excluded)."""
    model = _model(layers)
    opt = optimizer(model.named_parameters(), mode="native", precondition_frequency=3)
    counted = _Dispatches()
    if batched:
        apply, apply_one = opt._installs._apply, opt._installs._apply_one

        def rows(items: Any) -> None:
            with counted:
                apply(items)

        def one(item: Any) -> None:
            with counted:
                apply_one(item)

        opt._installs._apply, opt._installs._apply_one = rows, one
    else:
        _one_at_a_time(opt)
        install = opt._install

        def each(tile: Any, dim: int, result: Any) -> None:
            with counted:
                install(tile, dim, result)

        opt._install = each  # type: ignore[method-assign]
    _train(model, opt, 10)
    opt.close()
    return counted.count


@pytest.mark.parametrize("optimizer", [SOAP, Shampoo, KLShampoo])
def test_installs_of_twice_the_blocks_dispatch_far_fewer_than_twice_the_operations(
    optimizer: type,
) -> None:
    """One at a time, each install is a few operations (SOAP about 8, Shampoo 2), so twice
    the layers install with twice the operations; batched per group they add about one per
    install."""
    small, large = _install_dispatches(optimizer, 4, True), _install_dispatches(optimizer, 8, True)
    assert large <= 1.5 * small, (small, large)
    alone_small = _install_dispatches(optimizer, 4, False)
    alone_large = _install_dispatches(optimizer, 8, False)
    assert alone_large >= 1.9 * alone_small  # the comparison that makes the bound mean something
    assert large < alone_large / 2, (large, alone_large)


def test_a_basis_is_in_place_before_anything_reads_it_and_a_tiles_order_is_kept() -> None:
    applied: list[tuple[str, int, int]] = []
    rounds: list[list[tuple[str, int]]] = []

    def note(tile: Any, dim: int, result: Any) -> None:
        return None

    def apply(items: Any) -> None:
        rounds.append([(t["name"], d) for t, d, _, _ in items])
        applied.extend((t["name"], d, r) for t, d, r, _ in items)

    def apply_one(item: Any) -> None:
        tile, dim, result, _ = item
        applied.append((tile["name"], dim, result))

    batch = InstallBatch(note, apply, apply_one)  # type: ignore[arg-type]
    a, b = {"name": "a"}, {"name": "b"}
    with batch.window():
        batch.add(a, 0, 1)  # type: ignore[arg-type]
        batch.add(a, 1, 1)  # type: ignore[arg-type]
        batch.add(b, 0, 1)  # type: ignore[arg-type]
        batch.settle(a, 2)  # nothing of a's waits along dim 2: nothing applied
        assert applied == []
        batch.add(b, 0, 2)  # b's second result along dim 0: its first goes in first
        assert applied == [("b", 0, 1)]
        batch.settle(a, 1)  # a request along dim 1 of a: a's installs, in order
        assert applied == [("b", 0, 1), ("a", 0, 1), ("a", 1, 1)]
        batch.add(a, 0, 2)  # type: ignore[arg-type]
        batch.add(a, 1, 2)  # type: ignore[arg-type]
    # the rest at the window's end, in rounds of one install per tile, each tile in order
    assert rounds == [[("b", 0), ("a", 0)], [("a", 1)]]
    assert applied[3:] == [("b", 0, 2), ("a", 0, 2), ("a", 1, 2)]
