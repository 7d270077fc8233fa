"""Installs batched per tile group: a refresh's results go into use in a few operations per
group, not about ten per block.

A result is *installed* once per version: the tile's version moves on, and (SOAP) its moments
are rotated into the new basis and the basis written into the tile group's storage. One result
at a time, that is a handful of small kernels per block, so a refresh step of a model with
hundreds of blocks paid hundreds of launches for its installs alone.

So the optimizer collects the installs that one call into the runtime makes (a step's syncs, a
hook's pump, a step end's pulls, the hand-over of a step's snapshots, where native mode solves)
in an :class:`InstallBatch`, and applies them when the call returns. What the runtime reads in
between is true at once: the tile's version is set when the result is collected. What it does
not read — the moments and the basis — is written when the batch is applied, grouped by tile
group and dim: one stack of the overlaps, one batched product per moment, one indexed copy back
(:meth:`~asteria_client.optim.soap.SOAP._install_rows`). A tile's own installs keep their order:
the batch is applied in rounds, each taking at most one install per tile.

Anything that reads a tile's basis along a dim while an install along that dim waits (a
snapshot request, a drift estimate, a local solve) first applies that tile's installs
(:meth:`InstallBatch.settle`), and a second result for the same block in one batch does the
same, so nothing ever sees a version whose basis is not in place. (An install changes the
moments, which no request reads, and its own dim's basis only.)
Batched products equal the one-at-a-time ones exactly here: ``torch.bmm`` of k matrices gives
each the bits of its own ``mm`` (checked on CPU from n = 8 to 128), and only 2-D tiles, whose
rotations are such products, are batched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from asteria_client.runtime import PreconditionerResult

#: One collected install: the tile, the dim, the result, and what the optimizer noted when it
#: was collected (for SOAP: whether the result was computed from the basis in use).
Pending = tuple[Any, int, PreconditionerResult, Any]


class InstallBatch:
    """The installs collected while a window is open (see the module docstring).

    ``note(tile, dim, result)`` records what the install needs to know of the tile as it is and
    moves its version on; ``apply(items)`` applies one round (at most one install per tile),
    ``apply_one(item)`` one install on its own."""

    def __init__(
        self,
        note: Callable[[Any, int, PreconditionerResult], Any],
        apply: Callable[[list[Pending]], None],
        apply_one: Callable[[Pending], None],
    ) -> None:
        self._note = note
        self._apply = apply
        self._apply_one = apply_one
        self._depth = 0
        #: id(tile) -> its collected installs, in order
        self._pending: dict[int, list[Pending]] = {}
        self.batches = 0  # rounds applied together (for tests and benchmarks)

    @property
    def collecting(self) -> bool:
        return self._depth > 0

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Collect the installs made inside; apply them when the outermost window closes."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.apply_all()

    def add(self, tile: Any, dim: int, result: PreconditionerResult) -> None:
        waiting = self._pending.get(id(tile))
        if waiting is not None and any(item[1] == dim for item in waiting):
            self.settle(tile, dim)  # the block's first result must be in place before its second
            waiting = None
        item = (tile, dim, result, self._note(tile, dim, result))
        if waiting is None:
            self._pending[id(tile)] = [item]
        else:
            waiting.append(item)

    def settle(self, tile: Any, dim: int | None = None) -> None:
        """Apply ``tile``'s collected installs now: something is about to read its state
        (along ``dim`` only: then only if an install along ``dim`` waits, since an install
        changes its own dim's basis alone)."""
        waiting = self._pending.get(id(tile))
        if waiting is None or (dim is not None and all(item[1] != dim for item in waiting)):
            return
        del self._pending[id(tile)]
        for item in waiting:
            self._apply_one(item)

    def apply_all(self) -> None:
        """Apply everything collected, in rounds of at most one install per tile."""
        queues = list(self._pending.values())
        self._pending = {}
        while queues:
            self._apply([queue.pop(0) for queue in queues])
            self.batches += 1
            queues = [queue for queue in queues if queue]
