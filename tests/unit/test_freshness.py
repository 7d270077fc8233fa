"""The freshness runtime's bookkeeping: a step scans a tile's blocks only after a result arrived."""

from __future__ import annotations

import torch

from asteria_client import SOAP
from asteria_client.runtime.source import NativeSource, PreconditionerResult


class CountingSource(NativeSource):
    """A real native source that counts ``take`` calls and reports a results epoch (as the
    embedded and daemon sources do): every computed result is an arrival."""

    synchronous = False  # the runtime treats it as asynchronous: it scans and may wait

    def __init__(self) -> None:
        super().__init__()
        self.takes = 0
        self.epoch = 0

    def submit(self, request):  # type: ignore[no-untyped-def]
        super().submit(request)
        self.epoch += 1

    def take(self, block: str) -> PreconditionerResult | None:
        self.takes += 1
        return super().take(block)

    def results_epoch(self) -> int | None:
        return self.epoch


def test_steps_between_arrivals_do_not_ask_the_source_per_block() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    source = CountingSource()
    opt = SOAP(model.named_parameters(), source=source, precondition_frequency=5)
    x = torch.randn(4, 8)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):  # the first snapshot and its results are in
        step()
    assert all(row["version"] == 1 for row in opt.preconditioner_status())
    before = source.takes
    step()  # nothing new arrived: no per-block round trips
    assert source.takes == before
    for _ in range(3):  # the step-6 snapshot arrives, and is installed
        step()
    assert source.takes > before
    assert all(row["version"] == 6 for row in opt.preconditioner_status())
