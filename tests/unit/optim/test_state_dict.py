"""Checkpoints: keyed by parameter name and tile; resuming continues bit-identically."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from asteria_server.errors import InvalidInputError

from .native import SOAP, KLShampoo, Shampoo

FACTORIES = {
    "soap": lambda named: SOAP(named, lr=1e-2, precondition_frequency=3),
    "shampoo": lambda named: Shampoo(named, lr=1e-2, precondition_frequency=3),
    "kl_shampoo": lambda named: KLShampoo(named, lr=1e-2, precondition_frequency=3),
}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.conv = torch.nn.Conv1d(6, 8, kernel_size=3, padding=1)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2)
        h = torch.relu(self.conv(h)).transpose(1, 2)
        return self.head(h)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    return [torch.randint(0, 11, (4, 9), generator=g) for _ in range(n)]


def train(model: Net, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> None:
    for x in data:
        opt.zero_grad()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()


def groups(model: Net, reverse: bool = False) -> list[dict]:
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if p.dim() < 2]
    out = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return out[::-1] if reverse else out


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_resume_is_bit_identical(name: str) -> None:
    data = batches(14)
    torch.manual_seed(0)
    model = Net()
    opt = FACTORIES[name](groups(model))
    train(model, opt, data[:7])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    train(model, opt, data[7:])

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    resumed = Net()
    resumed.load_state_dict(checkpoint["model"])
    # param groups in the other order: state is matched by name, not by position
    opt2 = FACTORIES[name](groups(resumed, reverse=True))
    opt2.load_state_dict(checkpoint["optim"])
    train(resumed, opt2, data[7:])

    for (n, p), (_, q) in zip(model.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {n} diverged after resume"
    assert opt2.param_groups[1]["weight_decay"] == opt.param_groups[0]["weight_decay"]


def test_state_is_keyed_by_name_and_tile() -> None:
    model = Net()
    opt = SOAP(model.named_parameters(), max_preconditioner_dim=4)
    train(model, opt, batches(2))
    sd = opt.state_dict()
    assert set(sd["state"]) == {n for n, _ in model.named_parameters()}
    head_tiles = sd["state"]["head.weight"]["tiles"]
    assert len(head_tiles) == 3 * 2  # 11 rows -> 3 tiles, 8 cols -> 2 tiles
    assert head_tiles[0]["blocks"] == ["head.weight/tile0/dim0", "head.weight/tile0/dim1"]


def test_foreign_checkpoint_is_rejected_clearly() -> None:
    model = Net()
    opt = SOAP(model.named_parameters())
    adam_sd = torch.optim.Adam(model.parameters()).state_dict()
    with pytest.raises(InvalidInputError, match="not an Asteria optimizer checkpoint"):
        opt.load_state_dict(adam_sd)


def test_checkpoint_for_other_parameters_is_rejected() -> None:
    model = Net()
    opt = SOAP(model.named_parameters())
    train(model, opt, batches(2))
    sd = opt.state_dict()
    sd["state"]["ghost.weight"] = sd["state"]["head.weight"]
    opt2 = SOAP(Net().named_parameters())
    with pytest.raises(InvalidInputError, match=r"ghost\.weight"):
        opt2.load_state_dict(sd)


def test_changed_blocking_is_rejected() -> None:
    model = Net()
    opt = SOAP(model.named_parameters(), max_preconditioner_dim=4)
    train(model, opt, batches(2))
    opt2 = SOAP(model.named_parameters(), max_preconditioner_dim=64)
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        group["max_preconditioner_dim"] = 64
    with pytest.raises(InvalidInputError, match="tiles"):
        opt2.load_state_dict(sd)


def test_shampoo_epsilon_is_a_deprecated_alias_of_eps_and_old_checkpoints_load() -> None:
    model = Net()
    with pytest.warns(FutureWarning, match="eps="):
        old = Shampoo(model.named_parameters(), epsilon=1e-6, mode="native")
    assert old.param_groups[0]["eps"] == 1e-6
    train(model, old, batches(2))
    sd = old.state_dict()
    for group in sd["param_groups"]:  # as a checkpoint from before the rename
        group["epsilon"] = group.pop("eps")
    new = Shampoo(model.named_parameters(), mode="native")
    new.load_state_dict(sd)
    assert new.param_groups[0]["eps"] == 1e-6 and "epsilon" not in new.param_groups[0]
    assert "epsilon" in sd["param_groups"][0]  # the caller's checkpoint is left as it was


def test_tiles_are_dataclasses_in_memory_and_plain_dicts_in_checkpoints() -> None:
    model = Net()
    opt = SOAP(model.named_parameters(), mode="native")
    train(model, opt, batches(3))
    tiles = [t for state in opt.state.values() for t in state["tiles"]]
    assert tiles and all(dataclasses.is_dataclass(t) for t in tiles)
    sd = opt.state_dict()
    saved = [t for state in sd["state"].values() for t in state["tiles"]]
    assert all(isinstance(t, dict) for t in saved)
    opt2 = SOAP(model.named_parameters(), mode="native")
    opt2.load_state_dict(sd)
    assert all(
        type(t).__name__ == "SOAPTile" for state in opt2.state.values() for t in state["tiles"]
    )
    sd["state"]["head.weight"]["tiles"][0]["stranger"] = 1
    with pytest.raises(InvalidInputError, match="not a tile of SOAP"):
        SOAP(model.named_parameters(), mode="native").load_state_dict(sd)
