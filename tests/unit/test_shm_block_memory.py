"""The daemon's memory per shared-memory block stays under 2 KiB (issue 27's target).

Over shared memory a block's payload lies in its client's memfd: what the daemon pays per block
is its own bookkeeping, the handover's slots and bindings and the engine's record, queue entry
and result. ``tests.shm_block_memory`` puts 1,000 blocks through a real handover and engine and
counts the Python memory they keep (tracemalloc: deterministic, not the noisy RSS). Before the
slots shared their arena's views and the records went to ``__slots__`` and one interned name,
this was ~3,500 bytes a block.
"""

from __future__ import annotations

from tests.shm_block_memory import measure

BLOCKS = 1000
BOUND_BYTES = 2048


def test_the_daemon_keeps_under_2_kib_per_shared_memory_block() -> None:
    result = measure(BLOCKS, top=8)
    largest = "\n".join(f"  {size:.0f} B/block at {where}" for where, size in result.top)
    assert result.bytes_per_block <= BOUND_BYTES, (
        f"the daemon keeps {result.bytes_per_block:.0f} bytes per shared-memory block "
        f"(bound {BOUND_BYTES}); the largest:\n{largest}"
    )
