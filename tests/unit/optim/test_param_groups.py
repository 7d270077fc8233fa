"""Every way users pass parameters works: the AdamW group idiom, mappings, later groups, names."""

from __future__ import annotations

import warnings

import pytest
import torch

from asteria_client import SOAP, KLShampoo, Shampoo
from asteria_server.errors import InvalidInputError

OPTIMIZERS = [SOAP, Shampoo, KLShampoo]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_adamw_param_group_idiom_trains_with_a_warning(optimizer: type) -> None:
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="order of the parameters"):
        opt = optimizer(
            [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], mode="native"
        )
    _train(model, opt)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert set(opt.state_dict()["state"]) == {f"param{i}" for i in range(4)}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_model_argument_names_unnamed_groups_without_a_warning(optimizer: type) -> None:
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = optimizer(
            [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
            mode="native",
            model=model,
        )
    _train(model, opt)
    assert set(opt.state_dict()["state"]) == {n for n, _ in model.named_parameters()}


def test_attach_before_the_first_step_names_the_parameters() -> None:
    model = _model()
    with pytest.warns(UserWarning):
        opt = SOAP(model.parameters(), mode="native")
    opt.attach(model)
    _train(model, opt)
    assert set(opt.state_dict()["state"]) == {n for n, _ in model.named_parameters()}


def test_attach_after_the_first_step_keeps_positional_keys() -> None:
    model = _model()
    with pytest.warns(UserWarning):
        opt = SOAP(model.parameters(), mode="native")
    _train(model, opt, steps=1)
    opt.attach(model)
    _train(model, opt, steps=1)
    assert set(opt.state_dict()["state"]) == {f"param{i}" for i in range(4)}


def test_a_name_to_parameter_mapping_is_accepted() -> None:
    model = _model()
    opt = SOAP(dict(model.named_parameters()), mode="native")
    _train(model, opt)
    assert set(opt.state_dict()["state"]) == {n for n, _ in model.named_parameters()}


def test_named_and_unnamed_groups_mix() -> None:
    model = _model()
    named = list(model[0].named_parameters(prefix="0"))
    with pytest.warns(UserWarning):
        opt = SOAP([{"params": named}, {"params": list(model[2].parameters())}], mode="native")
    _train(model, opt)
    assert set(opt.state_dict()["state"]) == {"0.weight", "0.bias", "param0", "param1"}


def test_add_param_group_later_accepts_unnamed_parameters() -> None:
    model = _model()
    opt = SOAP(list(model[0].named_parameters(prefix="0")), mode="native", model=model)
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 1e-3})
    _train(model, opt)
    assert set(opt.state_dict()["state"]) == {n for n, _ in model.named_parameters()}
    assert opt.param_groups[1]["lr"] == 1e-3


@pytest.mark.parametrize(
    "params,match",
    [
        ({"w": "not a tensor"}, "expected a tensor or a"),
        ([("w", 3)], "expected a tensor or a"),
        ([], "empty"),
        (torch.zeros(2, 2, requires_grad=True), "single tensor"),
        ([{"params": [torch.zeros(2, 2, requires_grad=True)]}, torch.zeros(2)], "mixes"),
        ([{"lr": 1.0}], "no 'params'"),
    ],
)
def test_bad_params_say_what_to_pass(params: object, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        SOAP(params, mode="native")  # type: ignore[arg-type]
