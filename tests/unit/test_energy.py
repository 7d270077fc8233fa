"""The energy meter: CPU-seconds of the process tree always; RAPL and NVML when present."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from asteria_client.bench.energy import EnergyMeter, tree_cpu_seconds


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_count_this_process_and_its_children() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend=time.process_time()+0.6\n"
            "while time.process_time()<end: pass\ntime.sleep(5)",
        ]
    )
    try:
        meter = EnergyMeter()
        meter.start()
        _spin(0.3)
        time.sleep(0.8)  # the child spins meanwhile
        meter.stop()
        assert meter.reading.cpu_s >= 0.3 + 0.4, meter.reading
        assert "cpu-seconds" in meter.reading.sources and meter.reading.gpu_j is None
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds() > 0


def test_rapl_counters_are_read_per_package_and_wrap_around(tmp_path: Path) -> None:
    packages = {"intel-rapl:0": (1000, 5000), "intel-rapl:1": (4900, 5000)}
    for name, (value, top) in packages.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "energy_uj").write_text(str(value))
        (tmp_path / name / "max_energy_range_uj").write_text(str(top))
    (tmp_path / "intel-rapl:0:0").mkdir()  # a sub-domain: inside package 0, not added again
    (tmp_path / "intel-rapl:0:0" / "energy_uj").write_text("7")
    meter = EnergyMeter(rapl_root=tmp_path)
    assert "rapl" in meter.reading.sources
    meter.start()
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("3000")  # +2000 uJ
    (tmp_path / "intel-rapl:1" / "energy_uj").write_text("100")  # wrapped: +200 uJ
    meter.stop()
    assert meter.reading.cpu_j is not None
    assert abs(meter.reading.cpu_j - 2200e-6) < 1e-12


def test_no_rapl_and_no_gpu_leave_only_cpu_seconds(tmp_path: Path) -> None:
    meter = EnergyMeter(gpu_index=0, rapl_root=tmp_path)  # a GPU reading where there is one
    meter.start()
    _spin(0.05)
    meter.stop()
    assert meter.reading.cpu_j is None and meter.reading.cpu_s > 0
