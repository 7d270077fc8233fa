"""Gloo groups of Asteria's own, that any mesh can create in any order.

Asteria talks between ranks off the training's own collectives: the embedded result exchange
(a side thread) and the agreement on install steps (the training thread, between two of the
training's collectives). Each needs a gloo group of the optimizer's ranks, whatever the
training's backend. ``torch.distributed.new_group`` is the wrong tool for that on a 2-D mesh:

- without ``use_local_synchronization`` *every* rank of the world must enter every
  ``new_group`` call in the same order, so the data-parallel group of tensor-parallel rank 0
  and that of rank 1, created by different ranks at the same moment, join each other (or hang);
- with it, the group's name is a hash of its ranks *and the number of groups this rank made so
  far*, so two members that made their other groups in different orders wait under different
  names and hang.

A :class:`SideGroup` instead rendezvouses in the job's store under a key made of its purpose,
its members, and how many groups of that purpose over exactly those members this process made
before. Only the members enter; ranks outside it never notice it; and the key agrees between the
members as long as they build their optimizers over that group in the same order, which the
optimizer's constructor (a collective over its group) asks anyway.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

#: groups made so far per (purpose, members): the last part of each group's store key
_MADE: dict[tuple[str, tuple[int, ...]], int] = {}


def group_members(group: Any = None) -> list[int]:
    """The global ranks of ``group`` (None: the world), in order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return sorted(dist.get_process_group_ranks(group))


class SideGroup:
    """A gloo group over ``members`` (global ranks, this rank among them) for ``purpose``; see
    the module docstring. Collective over the members: each calls it once, in the same order
    as its other side groups over the same members and purpose."""

    def __init__(self, members: Sequence[int], purpose: str, *, timeout_s: float) -> None:
        self.members = tuple(sorted(members))
        rank = dist.get_rank()
        if rank not in self.members:
            raise ValueError(f"rank {rank} is not a member of the {purpose} group {self.members}")
        count = _MADE.get((purpose, self.members), 0)
        _MADE[(purpose, self.members)] = count + 1
        names = "_".join(str(m) for m in self.members)
        store = dist.PrefixStore(
            f"asteria/{purpose}/{names}/{count}/", distributed_c10d._get_default_store()
        )
        self.rank = self.members.index(rank)
        self.size = len(self.members)
        # the backend itself (no torch.distributed registry entry: see the module docstring)
        self._pg: Any = dist.ProcessGroupGloo(
            store, self.rank, self.size, datetime.timedelta(seconds=timeout_s)
        )

    def all_min(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum of every member's ``values`` (equal lengths)."""
        return self.start_min(values)()

    def start_min(self, values: Sequence[int]) -> Callable[[], list[int]]:
        """Start :meth:`all_min` on gloo's own threads; the returned call waits for it. Every
        member starts its collectives on this group in the same order."""
        tensor = torch.tensor(list(values), dtype=torch.int64)
        if tensor.numel() == 0 or self.size == 1:
            return lambda: [int(v) for v in tensor.tolist()]
        options: Any = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        work = self._pg.allreduce([tensor], options)

        def finish() -> list[int]:
            work.wait()
            return [int(v) for v in tensor.tolist()]

        return finish

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, by group rank (pickled: members trust each other, as
        ``torch.distributed.all_gather_object`` does)."""
        if self.size == 1:
            return [obj]
        data = pickle.dumps(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._pg.allgather([gathered], [mine]).wait()
        return [
            pickle.loads(g[: int(s.item())].numpy().tobytes())
            for g, s in zip(gathered, sizes, strict=True)
        ]
