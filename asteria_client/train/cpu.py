"""The CPU floating-point mode of a training run: subnormal numbers flushed to zero.

Why: as training goes on, some of the optimizer's state and gradients (AdamW's second moments,
products of tiny gradients) fall below float32's normal range (about 1.2e-38). x86 cores do
arithmetic on such subnormal numbers in microcode, many times slower than on normal ones, so a
CPU step gets slower as the run goes on, by how many subnormals each optimizer happens to make:
AdamW's step on `asteria train`'s GPT went from 0.162 s with flushing to 0.289 s without, which
distorts every comparison of step times. Flushing treats them as zero (FTZ/DAZ), which changes
numbers no loss can feel.

The trap: the mode is a per-thread register (MXCSR on x86), and a new thread copies its
creator's. ``torch.set_flush_denormal`` sets it only for the calling thread, so it must be set
before torch starts its intra-op thread pool (at the start of a run, before the first parallel
op); threads already running keep computing subnormals. ``torch.set_flush_denormal`` returns
False where the CPU cannot flush (no SSE3), so a run records what took effect, not what it asked.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


def set_flush_denormal(enabled: bool) -> bool:
    """Flush subnormals to zero (or stop) in this thread and the threads it starts later.

    Returns whether flushing is now on (False when asked off, or when the CPU cannot).
    """
    supported = torch.set_flush_denormal(enabled)
    if enabled and not supported:
        logger.warning("this CPU cannot flush denormals to zero: step times may drift upward")
    return enabled and supported


@contextlib.contextmanager
def flush_denormal(enabled: bool) -> Iterator[bool]:
    """``set_flush_denormal(enabled)`` for the body (yields whether it took effect), then
    torch's default (off) again."""
    try:
        yield set_flush_denormal(enabled)
    finally:
        torch.set_flush_denormal(False)
