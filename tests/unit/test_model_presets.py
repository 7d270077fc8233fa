"""Model presets for `asteria train` and `asteria bench spikes`, and the energy figures."""

from __future__ import annotations

import pytest

from asteria_client.bench.spikes import SpikesConfig, _train_config, energy_summary
from asteria_client.cli import build_parser
from asteria_client.train.config import MODEL_PRESETS, TrainConfig, model_preset


def test_tiny_is_the_defaults_and_gpt2_small_its_shape() -> None:
    defaults = TrainConfig()
    assert model_preset("tiny") == {
        "n_layer": defaults.n_layer,
        "n_head": defaults.n_head,
        "n_embd": defaults.n_embd,
        "block_size": defaults.block_size,
    }
    assert model_preset("gpt2-small") == {
        "n_layer": 12,
        "n_head": 12,
        "n_embd": 768,
        "block_size": 256,
    }
    with pytest.raises(ValueError, match="gpt2-small"):
        model_preset("gpt3")
    assert set(MODEL_PRESETS) == {"tiny", "gpt2-small"}


def test_spikes_trains_the_preset() -> None:
    cfg = SpikesConfig(model="gpt2-small", steps=20, pin_solver=False)
    train = _train_config(cfg, "soap", "native", None)
    assert (train.n_layer, train.n_embd, train.n_head, train.block_size) == (12, 768, 12, 256)
    with pytest.raises(ValueError, match="model='big'"):
        SpikesConfig(model="big", pin_solver=False)


def test_train_cli_takes_the_preset_and_single_fields_over_it() -> None:
    parser, _ = build_parser()
    args = parser.parse_args(["train", "--model", "gpt2-small", "--n-layer", "4"])
    assert args.model == "gpt2-small" and args.n_layer == 4


def test_energy_per_step_and_to_adamws_final_loss() -> None:
    reading = {"gpu_j": 20.0, "cpu_j": None, "cpu_s": 4.0, "sources": ["nvml", "cpu-seconds"]}
    losses = [5.0] * 10 + [1.0] * 10  # trailing 10-step mean reaches 3.0 at step 15
    out = energy_summary(reading, losses, target_loss=3.0)
    assert out["gpu_j_per_step"] == 1.0 and out["cpu_s_per_step"] == 0.2
    assert out["cpu_j_per_step"] is None and out["cpu_j_to_adamw_final_loss"] is None
    assert out["steps_to_adamw_final_loss"] == 15
    assert out["gpu_j_to_adamw_final_loss"] == 15.0
    never = energy_summary(reading, losses, target_loss=0.5)
    assert never["steps_to_adamw_final_loss"] is None
    assert never["gpu_j_to_adamw_final_loss"] is None
