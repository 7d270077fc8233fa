"""Every `asteria bench` takes --no-flush-denormal, flushes by default, and hands the setting to
the training processes it starts (the real runs are in tests/integration/test_bench_*.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asteria_client import cli
from asteria_client.bench import convergence, sharing, spikes, throughput, transport


class _Captured(Exception):
    """Stops a benchmark once its configuration is built: nothing is measured."""


def _capture(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake(*args: Any, **kwargs: Any) -> Any:
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    monkeypatch.setattr(module, name, fake)
    return seen


@pytest.mark.parametrize(
    ("bench", "module", "function"),
    [
        ("convergence", convergence, "run_convergence"),
        ("spikes", spikes, "run_spikes"),
        ("sharing", sharing, "run_sharing"),
        ("throughput", throughput, "run_throughput"),
    ],
)
@pytest.mark.parametrize("flag", [[], ["--no-flush-denormal"]])
def test_the_flag_reaches_the_benchmark_config(
    monkeypatch: pytest.MonkeyPatch, bench: str, module: Any, function: str, flag: list[str]
) -> None:
    seen = _capture(monkeypatch, module, function)
    with pytest.raises(_Captured):
        cli.main(["bench", bench, *flag])
    (cfg,) = seen["args"]
    assert cfg.flush_denormal is (not flag)


@pytest.mark.parametrize("flag", [[], ["--no-flush-denormal"]])
def test_the_flag_reaches_transport(monkeypatch: pytest.MonkeyPatch, flag: list[str]) -> None:
    seen = _capture(monkeypatch, transport, "run_transport")
    with pytest.raises(_Captured):
        cli.main(["bench", "transport", *flag])
    assert seen["kwargs"]["flush_denormal"] is (not flag)


def test_training_subprocesses_get_the_setting(tmp_path: Path) -> None:
    run = convergence.CONFIGS["soap-embedded-s1"]
    on, off = convergence.ConvergenceConfig(), convergence.ConvergenceConfig(flush_denormal=False)
    assert "--no-flush-denormal" not in convergence._train_command(on, run, 0, None)
    assert "--no-flush-denormal" in convergence._train_command(off, run, 0, None)
    json_path = tmp_path / "c.json"
    assert "--no-flush-denormal" not in sharing._train_command(
        sharing.SharingConfig(), json_path, 0
    )
    off_sharing = sharing.SharingConfig(flush_denormal=False)
    command = sharing._train_command(off_sharing, json_path, 0)
    assert command[:4] == [command[0], "-m", "asteria_client.cli", "train"]
    assert command[-1] == "--no-flush-denormal"
    # and `asteria train` parses what they pass
    parser, _ = cli.build_parser()
    assert parser.parse_args(command[3:]).flush_denormal is False


def test_the_convergence_report_says_whether_subnormals_were_flushed() -> None:
    from asteria_client.bench.convergence_summary import cpu_note

    runs = [{"ok": True, "flush_denormal": True}, {"ok": True, "flush_denormal": False}]
    note = cpu_note({"config": {"flush_denormal": True}, "runs": runs})
    assert "flushed to zero" in note and "1 of 2" in note and "no pinning" in note
    kept = cpu_note({"config": {"flush_denormal": False}, "runs": runs})
    assert "kept" in kept and "could not" not in kept
    assert "not recorded" in cpu_note({"config": {}, "runs": []})
