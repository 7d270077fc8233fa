"""``optimizer.attach(model)`` under ``torch.compile``: the signal hooks must not break graphs.

Before the hooks checked ``torch.compiler.is_compiling()``, the train GPT (2 layers) compiled to
16 graphs with 15 breaks once attached, against 1 graph without: every signal point's weakref,
lock and tensor hook stopped the trace.
"""

from __future__ import annotations

import torch

from asteria_client import SOAP
from asteria_client.bench.step import gpt


def _explain(model: torch.nn.Module, batch: torch.Tensor) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(batch)
    return explained.graph_count, explained.graph_break_count


def test_attached_hooks_add_no_graph_break_to_the_compiled_train_gpt() -> None:
    model = gpt(2, 32)
    batch = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(0))
    graphs, breaks = _explain(model, batch)
    optimizer = SOAP(model.named_parameters(), mode="native")
    optimizer.attach(model)
    try:
        assert len(optimizer.runtime._hooks) > 1  # the hooks are there, and stay quiet
        assert _explain(model, batch) == (graphs, breaks)
    finally:
        optimizer.close()
        torch._dynamo.reset()


def test_the_same_hooks_still_signal_in_eager_mode() -> None:
    model = gpt(1, 16)
    optimizer = SOAP(model.named_parameters(), mode="native")
    calls = []
    optimizer.pump = lambda: calls.append(1)  # type: ignore[method-assign]
    optimizer.attach(model)
    try:
        batch = torch.randint(0, 65, (2, 8))
        model.loss(batch, batch).backward()
        assert len(calls) >= 2  # forward and backward signals
    finally:
        optimizer.close()
