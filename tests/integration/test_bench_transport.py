"""`asteria bench transport --quick` runs against real daemons and writes a complete report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asteria_client.bench.transport import CASES, report_section
from asteria_client.cli import main


def test_quick_transport_bench_writes_a_complete_report(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    assert main(["bench", "transport", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "transport" and data["sizes"] == [512, 1024]
    assert {"machine", "command", "figures"} <= data.keys()
    assert data["config"]["flush_denormal"] is True
    for row in data["rows"]:
        assert set(row["gb_per_s"]) == set(CASES)
        for case in CASES:
            assert math.isfinite(row["gb_per_s"][case]) and row["gb_per_s"][case] > 0
            assert len(row["samples_s"][case]) == 3
        assert row["vs_memcpy"]["memcpy"] == pytest.approx(1.0)
    assert all((tmp_path / f).is_file() for f in data["figures"])
    section = report_section(data)
    assert "shm write" in section and "target" in section


def test_bad_sizes_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "transport", "--sizes", "12,x"]) == 2
    assert "--sizes" in capsys.readouterr().err
