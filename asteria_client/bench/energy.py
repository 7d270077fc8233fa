"""Energy a benchmark run used, from what the machine exposes.

- **GPU**: NVML's board energy counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules
  since the driver loaded; Volta and later) through ``pynvml`` (the ``nvidia-ml-py`` package)
  when it imports and the device answers.
- **CPU**: RAPL package counters under ``/sys/class/powercap/intel-rapl:N/energy_uj`` (one per
  socket; sub-domains are inside them and not added again) when they are readable, with their
  wrap-around at ``max_energy_range_uj``.
- otherwise **CPU-seconds** of this process and every process under it (the embedded engine's
  workers, a daemon this benchmark started), from ``/proc``: not energy, but the quantity it
  scales with on a host of one kind.

:class:`EnergyMeter` is read around the spans to charge (``start`` / ``stop``); it adds
up the spans, so interleaved runs each get their own. Which sources were available is part
of every reading: a figure never hides what it is.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RAPL_ROOT = Path("/sys/class/powercap")


def _rapl_domains(root: Path = RAPL_ROOT) -> list[Path]:
    """The package-level RAPL domains whose counters this process can read."""
    domains = []
    for path in sorted(root.glob("intel-rapl:*")):
        if path.name.count(":") != 1:  # intel-rapl:0:0 is inside intel-rapl:0
            continue
        try:
            int((path / "energy_uj").read_text())
        except (OSError, ValueError):
            continue
        domains.append(path)
    return domains


def _read_int(path: Path) -> int:
    return int(path.read_text())


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU-seconds of ``pid`` (default: this process) and its descendants alive
    now, from /proc; this process's own times where /proc is absent."""
    root = os.getpid() if pid is None else pid
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        t = os.times()
        return t.user + t.system
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks
    wanted, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in wanted:
                wanted.add(child)
                frontier.append(child)
    return sum(times.get(p, 0.0) for p in wanted)


@dataclass
class EnergyReading:
    """What one meter measured over its spans; None where the source was not available."""

    gpu_j: float | None = None
    cpu_j: float | None = None
    cpu_s: float = 0.0
    sources: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_j": self.gpu_j,
            "cpu_j": self.cpu_j,
            "cpu_s": self.cpu_s,
            "sources": list(self.sources),
        }


class EnergyMeter:
    """Adds up energy over ``start()``/``stop()`` spans (see the module docstring).

    ``gpu_index``: the NVML device to read (None: no GPU reading); ``rapl_root``: where the
    powercap domains are."""

    def __init__(self, gpu_index: int | None = None, *, rapl_root: Path = RAPL_ROOT) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        if gpu_index is not None:
            with contextlib.suppress(Exception):  # no pynvml, no driver, no counter
                import pynvml

                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
                pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                self._nvml, self._handle = pynvml, handle
        self._rapl = _rapl_domains(rapl_root)
        self._ranges: dict[Path, int] = {}
        for domain in self._rapl:
            try:
                self._ranges[domain] = _read_int(domain / "max_energy_range_uj")
            except (OSError, ValueError):
                self._ranges[domain] = 0
        self.reading = EnergyReading(
            gpu_j=0.0 if self._nvml is not None else None,
            cpu_j=0.0 if self._rapl else None,
            sources=(["nvml"] if self._nvml is not None else [])
            + (["rapl"] if self._rapl else [])
            + ["cpu-seconds"],
        )
        self._started: tuple[float | None, dict[Path, int], float] | None = None

    def _gpu_mj(self) -> float | None:
        if self._nvml is None:
            return None
        return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def start(self) -> None:
        rapl = {}
        for domain in self._rapl:
            with contextlib.suppress(OSError, ValueError):
                rapl[domain] = _read_int(domain / "energy_uj")
        self._started = (self._gpu_mj(), rapl, tree_cpu_seconds())

    def stop(self) -> None:
        if self._started is None:
            return
        gpu0, rapl0, cpu0 = self._started
        self._started = None
        gpu1 = self._gpu_mj()
        reading = self.reading
        if gpu0 is not None and gpu1 is not None and reading.gpu_j is not None:
            reading.gpu_j += (gpu1 - gpu0) / 1e3
        if reading.cpu_j is not None:
            for domain, before in rapl0.items():
                try:
                    after = _read_int(domain / "energy_uj")
                except (OSError, ValueError):
                    continue
                delta = after - before
                if delta < 0:  # the counter wrapped
                    delta += self._ranges.get(domain, 0)
                reading.cpu_j += max(delta, 0) / 1e6
        reading.cpu_s += max(0.0, tree_cpu_seconds() - cpu0)

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None
