"""The pieces of `asteria bench peers` and `asteria bench defaults` that decide something: the
peer table (availability, keywords, parameter groups), the targets and the defaults rule."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import torch

from asteria_client.bench import defaults, peers
from asteria_client.bench.peers_table import PEERS, MatricesAndRest, PeerOptimizer
from asteria_client.train.model import GPT, GPTConfig
from asteria_client.train.optimizers import OptimizerKind

ROOT = Path(__file__).resolve().parents[2]


def _entry(**overrides: object) -> PeerOptimizer:
    fields: dict[str, object] = {
        "name": "torch-sgd",
        "library": "torch",
        "distribution": "torch",
        "module": "torch.optim",
        "class_name": "SGD",
        "written_for": "2.6",
        "family": OptimizerKind.SOAP,
        "readme": {"lr": 0.1, "weight_decay": 0.01},
    }
    fields.update(overrides)
    return PeerOptimizer(**fields)  # type: ignore[arg-type]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.0))


def test_the_table_names_each_peer_once_with_the_version_it_was_written_for() -> None:
    assert len({p.name for p in PEERS}) == len(PEERS)
    for peer in PEERS:
        assert peer.written_for and peer.readme.get("lr", 0) > 0
    assert {p.library for p in PEERS} >= {"HeavyBall", "NVIDIA Emerging-Optimizers"}


def test_the_peers_extra_pins_pypi_peers_and_gates_emerging_optimizers_on_python() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = extra["optional-dependencies"]["peers"]
    by_name = {r.split("==")[0].strip(): r for r in requirements}
    for peer in PEERS:
        if peer.distribution is None:
            continue
        requirement = by_name[peer.distribution]
        assert f"=={peer.written_for}" in requirement  # the version the table was written for
    # On Python 3.11 this requirement must not resolve at all (never to a placeholder release).
    assert 'python_version >= "3.12"' in by_name["emerging-optimizers"]


def test_an_unavailable_peer_says_why_instead_of_raising() -> None:
    too_new = _entry(min_python=(sys.version_info.major, sys.version_info.minor + 1))
    reason = too_new.unavailable_reason()
    assert reason is not None and "needs Python >=" in reason
    missing = _entry(module="asteria_no_such_library", distribution="no-such-library")
    reason = missing.unavailable_reason()
    assert reason is not None and "not installed" in reason and "asteria[peers]" in reason
    assert _entry().unavailable_reason() is None


def test_keywords_are_the_readme_s_with_asterias_lr_and_weight_decay_on_request() -> None:
    entry = _entry()
    assert entry.keywords() == {"lr": 0.1, "weight_decay": 0.01}
    assert entry.keywords(lr=3e-3, weight_decay=0.1) == {"lr": 3e-3, "weight_decay": 0.1}


def test_a_peer_gets_train_s_parameter_groups_decay_on_matrices_only() -> None:
    model = _gpt()
    optimizer = _entry().factory(_entry().keywords())(model)
    decay, rest = optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and rest["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in rest["params"])
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))


def test_a_matrices_only_peer_trains_the_rest_with_adamw_under_one_schedule() -> None:
    model = _gpt()
    entry = _entry(matrices_only=True)
    optimizer = entry.factory(entry.keywords())(model)
    assert isinstance(optimizer, MatricesAndRest)
    assert [type(p).__name__ for p in optimizer.parts] == ["SGD", "AdamW"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, 11, (2, 8))
    optimizer.zero_grad()
    model.loss(x, x).backward()
    optimizer.step()
    scheduler.step()
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert all(moved)  # matrices by the peer, biases and LayerNorm scales by AdamW
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.05]


def _summary(config: str, kind: str, steps: float, seconds: float) -> dict:  # type: ignore[type-arg]
    return {
        "config": config,
        "label": config,
        "kind": kind,
        "num_reached": 2,
        "steps_to_target_mean": steps,
        "train_s_to_target_mean": seconds,
    }


def _runs(config: str, steps: list[float]) -> list[dict]:  # type: ignore[type-arg]
    return [{"config": config, "seed": s, "steps_to_target": v} for s, v in enumerate(steps)]


def test_targets_compare_asterias_best_with_the_best_peer() -> None:
    summaries = [
        _summary("soap-embedded", "asteria", 100, 8.0),
        _summary("soap-native", "asteria", 96, 12.0),
        _summary("hb-readme", "peer", 95, 11.0),
        _summary("hb-asteria-settings", "peer", 120, 10.5),
    ]
    runs = _runs("soap-native", [94, 98]) + _runs("hb-readme", [96, 94])
    result = peers.checks(summaries, runs, (0, 1))
    assert result["steps"]["asteria"] == "soap-native" and result["steps"]["peer"] == "hb-readme"
    # Paired differences -2 and +4: mean +1, standard error 3: within noise.
    assert result["steps"]["mean_diff"] == pytest.approx(1.0)
    assert result["steps"]["stderr"] == pytest.approx(3.0)
    assert result["steps"]["met"] is True
    # Training seconds: Asteria's best (8.0) over the best peer's (10.5).
    assert result["wall_clock"]["asteria"] == "soap-embedded"
    assert result["wall_clock"]["peer"] == "hb-asteria-settings"
    assert result["wall_clock"]["ratio"] == pytest.approx(8.0 / 10.5)
    assert result["wall_clock"]["met"] is True

    slower = peers.checks(summaries, _runs("soap-native", [110, 112]) + runs[2:], (0, 1))
    assert slower["steps"]["met"] is False  # 16 steps more on both seeds


def test_the_defaults_rule_takes_the_cheapest_setting_within_noise_of_the_best() -> None:
    pairs = [("native", 0), ("native", 1), ("embedded", 0), ("embedded", 1)]

    def losses(*values: float) -> dict[tuple[str, int], float]:
        return dict(zip(pairs, values, strict=True))

    per_setting = {
        (0.9, 1): losses(2.00, 2.02, 2.01, 2.03),
        (0.9, 5): losses(2.01, 2.01, 2.02, 2.03),  # within noise of f=1: differences +-0.01
        (0.9, 10): losses(2.10, 2.12, 2.11, 2.13),  # 0.1 worse on every pair
        (0.95, 10): losses(2.20, 2.22, 2.21, 2.23),
    }
    choice = defaults._choose(per_setting)
    assert choice is not None
    assert choice["best"]["beta1"] == 0.9 and choice["best"]["frequency"] == 1
    assert (choice["pick"]["beta1"], choice["pick"]["frequency"]) == (0.9, 5)
    within = {(c["beta1"], c["frequency"]) for c in choice["candidates"] if c["within_noise"]}
    assert within == {(0.9, 1), (0.9, 5)}

    # A setting missing a pair is judged on the pairs every setting has.
    del per_setting[(0.95, 10)][("embedded", 1)]
    assert defaults._choose(per_setting)["pairs"] == 3  # type: ignore[index]


@pytest.mark.parametrize("name", ["SOAP", "KLShampoo"])
def test_the_swept_defaults_hold_and_the_reference_is_one_keyword_away(name: str) -> None:
    import asteria_client

    optimizer_class = getattr(asteria_client, name)
    param = torch.nn.Parameter(torch.zeros(3, 2))
    chosen = optimizer_class([("w", param)], mode="native")
    reference = optimizer_class([("w", param)], mode="native", **optimizer_class.REFERENCE_SETTINGS)
    group, ref_group = chosen.param_groups[0], reference.param_groups[0]
    assert (group["betas"], group["precondition_frequency"]) == ((0.9, 0.95), 5)
    assert (ref_group["betas"], ref_group["precondition_frequency"]) == ((0.95, 0.95), 10)
    chosen.close()
    reference.close()


def test_the_defaults_sweep_trains_the_shape_it_is_given() -> None:
    """`--shape` reaches every run's model (in this process and in a --jobs child's command),
    and a shape the convergence bench does not know is refused by name."""
    from asteria_client.bench.convergence import SHAPES

    cfg = defaults.DefaultsConfig(shape="deep", seeds=(0,), frequencies=(5,), beta1s=(0.9,))
    arms = defaults.plan(cfg)
    assert {a.train_config.n_layer for a in arms} == {SHAPES["deep"].n_layer}
    assert {a.train_config.n_embd for a in arms} == {SHAPES["deep"].n_embd}
    plain = defaults.plan(defaults.DefaultsConfig(seeds=(0,), frequencies=(5,), beta1s=(0.9,)))
    assert {a.train_config.n_layer for a in plain} == {SHAPES["train"].n_layer}
    soap = next(a for a in arms if a.info is not None)
    cmd = defaults._single_run_command(cfg, soap, Path("x.json"))
    assert cmd[cmd.index("--shape") + 1] == "deep"
    with pytest.raises(ValueError, match="shape"):
        defaults.DefaultsConfig(shape="tall")
