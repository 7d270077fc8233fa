"""The freshness runtime's bookkeeping: a step scans a tile's blocks only after a result arrived."""

from __future__ import annotations

import torch

from asteria_client import SOAP
from asteria_client.runtime.freshness import signal_modules
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


class LastDimFirstSource(NativeSource):
    """A real native source, asynchronous, whose results *arrive* last dim first: a block's
    result is visible to ``take`` only once every higher dim of its tile was taken (as when
    another solver worker, or another owner daemon, finishes the later dim first). ``wait``
    (the barrier) delivers what it waits for."""

    synchronous = False

    def _arrived(self, block: str) -> bool:
        head, dim = block.rsplit("/dim", 1)
        return all(f"{head}/dim{d}" not in self._ready for d in range(int(dim) + 1, 4))

    def take(self, block: str) -> PreconditionerResult | None:
        if block not in self._ready or not self._arrived(block):
            return None
        return super().take(block)

    def wait(self, block: str, min_version: int, timeout_s: float) -> PreconditionerResult | None:
        result = super().take(block)
        return result if result is not None and result.version >= min_version else None


def _train_s0(**mode: object) -> tuple[dict[str, torch.Tensor], list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 20), torch.nn.Tanh(), torch.nn.Linear(20, 12))
    opt = SOAP(
        model.named_parameters(), lr=1e-2, precondition_frequency=2, staleness_budget=0, **mode
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        opt.zero_grad()
        model(torch.randn(16, 24, generator=g)).square().mean().backward()
        opt.step()
    versions = [row["version"] for row in opt.preconditioner_status()]
    return {k: v.clone() for k, v in model.state_dict().items()}, versions


def test_at_s0_results_go_into_use_in_dim_order_whatever_order_they_arrive_in() -> None:
    """At S = 0 a run is bitwise the native run even when a tile's later dim arrives first:
    installing dim 1 before dim 0 rotates the moments in another order, which rounds
    differently in float32 (two identical daemon runs used to differ by ~1e-5 that way)."""
    native, native_versions = _train_s0(mode="native")
    reordered, versions = _train_s0(source=LastDimFirstSource())
    assert versions == native_versions == [11] * 4  # every refresh went into use
    for name, value in native.items():
        assert torch.equal(reordered[name], value), (name, (reordered[name] - value).abs().max())


# --------------------------------------------------------------------------- hooks
class _Net(torch.nn.Module):
    """Parameters behind a ModuleList, whose own forward never runs (as in a GPT's blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)
        )
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _signals(model: torch.nn.Module, grad: bool) -> tuple[int, int]:
    """Signals during one forward and during its backward."""
    opt = SOAP(model.named_parameters(), mode="native")
    calls = [0]

    def pump() -> None:
        calls[0] += 1

    opt.runtime.attach(model, pump)
    with torch.set_grad_enabled(grad):
        out = model(torch.randn(3, 4)).square().sum()
    forward = calls[0]
    if grad:
        out.backward()
    return forward, calls[0] - forward


def test_hooks_signal_through_the_forward_and_the_backward_pass() -> None:
    """Every module holding parameters signals after its forward and when the backward pass
    reaches its output, also those inside containers whose forward never runs (a forward
    hook on the model's direct children alone left the backward pass with one signal)."""
    model = _Net()
    assert len(signal_modules(model)) == 5  # embed, three Linear in blocks, head
    forward, backward = _signals(model, grad=True)
    assert (forward, backward) == (6, 6)  # the five, and the model itself
    assert _signals(model, grad=False) == (6, 0)  # no gradient: no backward hooks registered


def test_signal_modules_are_thinned_evenly_in_model_order() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(100)))
    chosen = signal_modules(model, limit=10)
    assert [int(name) for name, m in model.named_children() if any(m is c for c in chosen)] == [
        0,
        10,
        20,
        30,
        40,
        50,
        60,
        70,
        80,
        90,
    ]
    assert signal_modules(torch.nn.Tanh()) == []


# --------------------------------------------------------------------------- pumps
class HeldSource(CountingSource):
    """A counting native source whose results arrive only when the test releases them, and
    which names the blocks that arrived since an epoch (as the embedded and daemon sources
    do)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, PreconditionerResult] = {}
        self.arrivals: dict[str, int] = {}

    def submit(self, request):  # type: ignore[no-untyped-def]
        NativeSource.submit(self, request)
        result = NativeSource.take(self, request.block)  # solved and checked, not counted
        assert result is not None
        self.held[request.block] = result

    def release(self, block: str) -> None:
        self._ready[block] = self.held.pop(block)
        self.epoch += 1
        self.arrivals[block] = self.epoch

    def results_since(self, epoch: int) -> list[str] | None:
        return [block for block, at in self.arrivals.items() if at > epoch]


def test_a_pump_asks_only_for_the_tiles_whose_results_arrived() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
    source = HeldSource()
    opt = SOAP(model.named_parameters(), source=source, precondition_frequency=1)
    x = torch.randn(4, 8)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()  # snapshots of the six blocks, held
    blocks = sorted(source.held)
    assert len(blocks) == 6
    opt.pump()  # records the epoch
    before = source.takes
    source.release(blocks[0])
    opt.pump()
    assert source.takes - before == 2  # the released block's tile (two dims), not all six
    versions = {row["block"]: row["version"] for row in opt.preconditioner_status()}
    assert versions[blocks[0]] == 1
    assert all(versions[b] < 1 for b in blocks[1:])
