"""Grouped optimizer math: a step's dispatched operations are set by the tile shapes.

The count is taken with a ``TorchDispatchMode`` around ``optimizer.step()`` on the ``asteria
train`` GPT (d 128, batch 4 x 64), in a step that refreshes nothing, and compared with
``torch.optim.AdamW(foreach=True)`` on the same model: every dispatched operation is a kernel
launch on a GPU, so this is the step's launch count. Before grouping, SOAP dispatched 1085
(8.5x AdamW's 128) and twice as many layers dispatched twice as many.
"""

from __future__ import annotations

import pytest
import torch

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_client.bench.step import DispatchCounter
from asteria_client.optim import grouped, tensor_ops
from asteria_client.train.model import GPT, GPTConfig
from asteria_client.train.optimizers import split_for_weight_decay

OPTIMIZERS = {"soap": SOAP, "shampoo": Shampoo, "kl-shampoo": KLShampoo}


def _model(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=layers, n_head=4, n_embd=128))


def _make(kind: str, model: GPT) -> torch.optim.Optimizer:
    decay, no_decay = split_for_weight_decay(model)
    if kind == "adamw":
        groups = [{"params": [p for _, p in decay]}, {"params": [p for _, p in no_decay]}]
        return torch.optim.AdamW(groups, foreach=True)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    # native mode and a refresh interval longer than the test: no step after the first refreshes
    return OPTIMIZERS[kind](groups, mode="native", precondition_frequency=1000)


def step_dispatches(kind: str, layers: int, steps: int = 3) -> int:
    """Operations dispatched by the last of ``steps`` steps (the first ones initialize)."""
    model = _model(layers)
    optimizer = _make(kind, model)
    batch = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(1))
    counter = DispatchCounter()
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            model.loss(batch, batch).backward()
            counter = DispatchCounter()
            with counter:
                optimizer.step()
    finally:
        if hasattr(optimizer, "close"):
            optimizer.close()
    return counter.count


@pytest.fixture(scope="module")
def adamw_dispatches() -> int:
    return step_dispatches("adamw", 4)


@pytest.mark.parametrize(("kind", "limit"), [("soap", 3.0), ("shampoo", 4.0), ("kl-shampoo", 4.0)])
def test_a_step_that_refreshes_nothing_dispatches_a_few_times_adamw(
    kind: str, limit: float, adamw_dispatches: int
) -> None:
    ours = step_dispatches(kind, 4)
    assert ours <= limit * adamw_dispatches, (kind, ours, adamw_dispatches)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_twice_the_layers_of_the_same_shapes_dispatch_about_the_same(kind: str) -> None:
    four, eight = step_dispatches(kind, 4), step_dispatches(kind, 8)
    assert eight <= 1.10 * four, (kind, four, eight)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_groups_are_built_once_and_reused_while_the_same_tiles_step(kind: str) -> None:
    model = _model(2)
    optimizer = _make(kind, model)
    batch = torch.randint(0, 65, (2, 16))
    for _ in range(5):
        optimizer.zero_grad()
        model.loss(batch, batch).backward()
        optimizer.step()
        if _ == 1:
            built = optimizer._tile_groups.builds
    assert built > 0
    assert optimizer._tile_groups.builds == built


def test_a_tile_rebound_outside_the_group_makes_the_group_rebuild() -> None:
    model = _model(1)
    optimizer = _make("soap", model)
    batch = torch.randint(0, 65, (2, 16))
    for _ in range(3):
        optimizer.zero_grad()
        model.loss(batch, batch).backward()
        optimizer.step()
    tile = optimizer.state[model.token_embedding.weight]["tiles"][0]
    tile.exp_avg = tile.exp_avg.clone()  # rebound by code that knows nothing of groups
    builds = optimizer._tile_groups.builds
    before = tile.exp_avg.clone()
    optimizer.step()
    assert optimizer._tile_groups.builds > builds
    assert not torch.equal(tile.exp_avg, before), "the rebound moment must be the one updated"


@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 6)], ids=["order2", "order3"])
def test_batched_products_equal_the_per_tile_ones(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    tiles = torch.randn(3, *shape, generator=gen, dtype=torch.float64)
    for dim, size in enumerate(shape):
        mats = torch.randn(3, size, size, generator=gen, dtype=torch.float64)
        got = grouped.mode_product(tiles, mats, dim)
        want = torch.stack(
            [tensor_ops.mode_product(t, m, dim) for t, m in zip(tiles, mats, strict=True)]
        )
        torch.testing.assert_close(got, want)
        stat = grouped.factor_statistic(tiles, dim)
        want = torch.stack([tensor_ops.factor_statistic(t, dim) for t in tiles])
        torch.testing.assert_close(stat, want)
    bases = [torch.linalg.qr(torch.randn(3, n, n, generator=gen, dtype=torch.float64))[0]
             for n in shape]  # fmt: skip
    rotated = grouped.project(tiles, bases)
    want = torch.stack([tensor_ops.project(t, [b[i] for b in bases]) for i, t in enumerate(tiles)])
    torch.testing.assert_close(rotated, want)
    torch.testing.assert_close(grouped.project(rotated, bases, back=True), tiles)


def _train_soap(compile: bool | str, steps: int) -> tuple[torch.nn.Module, SOAP]:
    """Two layers of one shape (one group of weights, one of biases), f = 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    optimizer = SOAP(
        model.named_parameters(), mode="native", precondition_frequency=2, compile=compile
    )
    _train_more(model, optimizer, steps)
    return model, optimizer


def _train_more(model: torch.nn.Module, optimizer: SOAP, steps: int) -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(64, 16, generator=generator)
        optimizer.zero_grad()
        (model(x) - x).square().mean().backward()
        optimizer.step()


def test_compiled_soap_matches_eager_and_compiles_each_group_once() -> None:
    """``compile=`` with the "eager" backend: dynamo traces each group's math as one graph
    (fullgraph) without inductor's compile time; later steps, refreshes included, reuse them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, optimizer = _train_soap("eager", 4)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    _train_more(model, optimizer, 4)  # refreshes every other step: installs change no graph
    assert counters["stats"]["unique_graphs"] == graphs
    reference, eager = _train_soap(False, 4)
    _train_more(reference, eager, 4)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    torch._dynamo.reset()


def test_compile_is_refused_where_it_is_not_built() -> None:
    from asteria_server.errors import InvalidInputError

    model = _model(1)
    with pytest.raises(InvalidInputError, match="compile"):
        Shampoo(model.named_parameters(), mode="native", compile=True)
    with pytest.raises(InvalidInputError, match="backend"):
        SOAP(model.named_parameters(), mode="native", compile="no-such-backend")
