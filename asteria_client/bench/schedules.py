"""The report section of `asteria bench convergence --schedules`.

That run writes a benchmark named ``schedules`` (SOAP's refresh schedules on the same batches,
see :mod:`asteria_client.bench.convergence`); ``asteria bench report`` finds its section here.
"""

from __future__ import annotations

from typing import Any

from asteria_client.bench import convergence_summary as summary


def report_section(data: dict[str, Any]) -> str:
    """Notes, the schedules table and the loss-vs-steps and loss-vs-time figures."""
    return summary.report_section(data)
