"""The character-level GPT: config validation, shapes, causal masking, initial loss."""

from __future__ import annotations

import math

import pytest
import torch

from asteria_client.train.model import GPT, GPTConfig

TINY = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize(
    ("field", "value"),
    [("vocab_size", 0), ("block_size", -1), ("n_layer", 0), ("n_head", 2.0), ("dropout", 1.0)],
)
def test_config_rejects_bad_fields_by_name(field: str, value: object) -> None:
    kwargs: dict[str, object] = {
        "vocab_size": 11,
        "block_size": 8,
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 16,
        field: value,
    }
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_config_needs_heads_that_divide_the_width() -> None:
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=3, n_embd=16)


def test_forward_shapes_and_initial_loss() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(TINY.vocab_size, (3, 5))
    assert model(idx).shape == (3, 5, TINY.vocab_size)
    # Small initial weights give near-uniform predictions: loss close to ln(vocab_size).
    loss = model.loss(idx, torch.randint(TINY.vocab_size, (3, 5)))
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(TINY.vocab_size, (2, TINY.block_size))
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :5], before[:, :5], rtol=0, atol=0)
    assert not torch.allclose(after[:, 5:], before[:, 5:])


def test_sequences_longer_than_the_block_are_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY)(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_every_weight_matrix_is_its_own_parameter() -> None:
    model = GPT(TINY)
    assert model.head.weight is not model.token_embedding.weight
    names = {name for name, _ in model.named_parameters()}
    assert {"token_embedding.weight", "position_embedding.weight", "head.weight"} <= names
    assert "blocks.1.attn.qkv.weight" in names
