"""Bad input gets a clear error or a documented safe behaviour, and never NaN weights."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from asteria_client import NonFiniteGradientError
from asteria_client.runtime.source import NativeSource, PreconditionerRequest
from asteria_server.errors import InvalidInputError, UnsupportedParameterError

from .native import SOAP, KLShampoo, Shampoo

OPTIMIZERS = [SOAP, Shampoo, KLShampoo]


def step_with(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()


def _snapshot(opt: Any, *params: torch.nn.Parameter) -> list[torch.Tensor]:
    """The weights and every tensor of the optimizer state, copied."""
    tensors = [p.detach().clone() for p in params]
    for entry in opt.state_dict()["state"].values():
        for tile in entry["tiles"]:
            for value in tile.values():
                values = value if isinstance(value, list) else [value]
                tensors += [v.clone() for v in values if isinstance(v, torch.Tensor)]
    return tensors


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_raises_naming_the_parameter(cls, bad: float) -> None:  # type: ignore[no-untyped-def]
    """A usual step checks its gradients on the device: the bad step applies nothing (weights
    and state unchanged, no host read), and the next step() raises, naming the parameter,
    before it applies anything either."""
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(3))
    opt = cls([("encoder.w", w), ("encoder.b", b)])
    step_with(opt, [w, b], [torch.randn(4, 3), torch.randn(3)])
    step_with(opt, [w, b], [torch.randn(4, 3), torch.randn(3)])
    before = _snapshot(opt, w, b)
    steps = opt.state_dict()["state"]["encoder.w"]["step"]
    g = torch.randn(3)
    g[1] = bad
    step_with(opt, [w, b], [torch.randn(4, 3), g])
    with pytest.raises(NonFiniteGradientError, match=r"encoder\.b.*step 3"):
        step_with(opt, [w, b], [torch.randn(4, 3), torch.randn(3)])
    # nothing changed: neither weights (also the finite one) nor state nor the step count
    assert _same(_snapshot(opt, w, b), before)
    assert opt.state_dict()["state"]["encoder.w"]["step"] == steps
    step_with(opt, [w, b], [torch.randn(4, 3), torch.randn(3)])  # training goes on
    assert opt.state_dict()["state"]["encoder.w"]["step"] == steps + 1


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_first_step_with_a_nonfinite_gradient_raises_at_once(cls) -> None:  # type: ignore[no-untyped-def]
    """A parameter's first step is checked on the host, before its state is created."""
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([("w", w)])
    with pytest.raises(NonFiniteGradientError, match="w"):
        step_with(opt, [w], [torch.full((4, 3), float("inf"))])
    assert not opt.state_dict()["state"]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_usual_step_with_a_nonfinite_gradient_is_skipped_and_counted(cls) -> None:  # type: ignore[no-untyped-def]
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([("w", w)], nonfinite="skip")
    for _ in range(2):
        step_with(opt, [w], [torch.randn(4, 3)])
    before = _snapshot(opt, w)
    steps = opt.state_dict()["state"]["w"]["step"]
    step_with(opt, [w], [torch.full((4, 3), float("nan"))])
    assert opt.skipped_steps == 1  # read on the host only when asked (or by the next step)
    assert _same(_snapshot(opt, w), before)
    assert opt.state_dict()["state"]["w"]["step"] == steps
    step_with(opt, [w], [torch.randn(4, 3)])
    assert opt.skipped_steps == 1 and not _same(_snapshot(opt, w), before)
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_nonfinite_gradient_skip_policy(cls, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([("w", w)], nonfinite="skip")
    before = w.detach().clone()
    with caplog.at_level(logging.WARNING):
        step_with(opt, [w], [torch.full((4, 3), float("nan"))])
        step_with(opt, [w], [torch.full((4, 3), float("nan"))])
    assert torch.equal(w.detach(), before)
    assert opt.skipped_steps == 2
    assert sum("non-finite" in r.message for r in caplog.records) == 1  # warned once
    step_with(opt, [w], [torch.randn(4, 3)])
    step_with(opt, [w], [torch.randn(4, 3)])
    assert torch.isfinite(w).all() and not torch.equal(w.detach(), before)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_zero_gradient_is_safe(cls) -> None:  # type: ignore[no-untyped-def]
    w = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(torch.randn(4))
    opt = cls([("w", w), ("b", b)], weight_decay=0.0)
    before = w.detach().clone(), b.detach().clone()
    for _ in range(12):
        step_with(opt, [w, b], [torch.zeros(5, 4), torch.zeros(4)])
    assert torch.isfinite(w).all() and torch.isfinite(b).all()
    torch.testing.assert_close(w.detach(), before[0])
    torch.testing.assert_close(b.detach(), before[1])


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_empty_parameter_is_skipped(cls) -> None:  # type: ignore[no-untyped-def]
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = cls([("empty", empty), ("w", w)])
    for _ in range(3):
        step_with(opt, [empty, w], [torch.zeros(0, 3), torch.randn(3, 2)])
    assert empty.shape == (0, 3)
    assert "empty" not in opt.state_dict()["state"]


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_unsupported_dtype_is_rejected_at_construction(cls, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    p = torch.zeros(3, 3, dtype=dtype)
    with pytest.raises(UnsupportedParameterError, match=r"'counts'.*dtype"):
        cls([("counts", p)])


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_half_precision_parameters_train_with_float32_state(cls) -> None:  # type: ignore[no-untyped-def]
    w = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16))
    opt = cls([("w", w)])
    for _ in range(5):
        step_with(opt, [w], [torch.randn(6, 4, dtype=torch.bfloat16)])
    assert w.dtype == torch.bfloat16 and torch.isfinite(w.float()).all()
    tile = opt.state_dict()["state"]["w"]["tiles"][0]
    assert tile["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"mode": "turbo"}, "mode"),
        ({"precondition_frequency": 0}, "precondition_frequency"),
        ({"max_preconditioner_dim": 0}, "max_preconditioner_dim"),
        ({"large_dim_policy": "drop"}, "large_dim_policy"),
        ({"nonfinite": "ignore"}, "nonfinite"),
    ],
)
def test_bad_hyperparameters_name_the_field(kwargs: dict, field: str) -> None:
    w = torch.nn.Parameter(torch.randn(2, 2))
    with pytest.raises(ValueError, match=field):
        SOAP([("w", w)], **kwargs)


def test_duplicate_names_are_rejected() -> None:
    a, b = torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(torch.randn(2, 2))
    with pytest.raises(InvalidInputError, match="unique"):
        SOAP([{"params": [("w", a)]}, {"params": [("w", b)]}])


def test_unnamed_parameters_work_with_a_warning() -> None:
    w = torch.nn.Parameter(torch.randn(3, 3))
    with pytest.warns(UserWarning, match="named_parameters"):
        opt = SOAP([w])
    w.grad = torch.randn(3, 3)
    opt.step()
    assert "param0" in opt.state_dict()["state"]


class FailingSource(NativeSource):
    """A real native source whose solves fail from a given version on (a numerical fault)."""

    def __init__(self, fail_from: int) -> None:
        super().__init__()
        self.fail_from = fail_from

    def submit(self, request: PreconditionerRequest) -> None:
        if request.version >= self.fail_from:
            poisoned = torch.full_like(request.matrix, float("nan"))
            request = PreconditionerRequest(**{**request.__dict__, "matrix": poisoned})
        super().submit(request)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_failed_solve_keeps_last_good_result(cls) -> None:  # type: ignore[no-untyped-def]
    w = torch.nn.Parameter(torch.randn(6, 5))
    opt = cls([("w", w)], precondition_frequency=2, source=FailingSource(fail_from=4))
    for _ in range(10):
        step_with(opt, [w], [torch.randn(6, 5)])
    assert torch.isfinite(w).all()
    rows = {r["block"]: r for r in opt.preconditioner_status()}
    assert set(rows) == {"w/tile0/dim0", "w/tile0/dim1"}
    for row in rows.values():
        assert 0 <= row["version"] < 4, row  # the last good version stays installed
        assert row["failures"] >= 2
        assert "NaN or Inf" in row["last_error"]
        assert row["staleness_steps"] == 10 - row["version"]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_closure_and_lr_scheduler(cls) -> None:  # type: ignore[no-untyped-def]
    """step(closure) re-evaluates the loss with gradients enabled; schedulers drive the lr."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(32, 4), torch.randn(32, 3)
    opt = cls(model.named_parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    losses = []
    for _ in range(6):
        losses.append(float(opt.step(closure).detach()))
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    assert losses[-1] < losses[0]
