"""The layout of a ``torch.distributed`` job, found once by the ranks themselves.

One daemon per node serves every rank on it, so what Asteria needs to know about a job is: how
many ranks, which of them share a node (the *local* ranks, which can share one upload and one
solve per block), which rank leads each node (it registers the job with its daemon), and a name
for the job that every replica agrees on (its blocks' namespace on the daemons).

:func:`discover_layout` asks the process group once — one ``all_gather_object`` of each rank's
host name — so it needs no launcher variables and works for ``torchrun``, ``mp.spawn`` or any
other launcher. The job name is ``ASTERIA_JOB``, else the launcher's run id
(``TORCHELASTIC_RUN_ID``), else the name rank 0 makes up and broadcasts with the gather.

**A group smaller than the world is a job of its own.** Under HSDP each shard's replicas (the
mesh's replicate dim), and on a DP x TP mesh each tensor-parallel slice's data-parallel group,
share blocks among themselves only, and every such group names its blocks alike (the same
parameter names). Under one job name they would be one namespace on a daemon: one slice's
snapshots would replace the other's and its results be installed in the other, and each group's
node leader would register its own layout (and run nonce) over the other's. So such a group's
job is the world's name with a suffix made from the group's global ranks (:func:`group_job`):
the same on every rank of the group, another for every other group, the same after a restart.
"""

from __future__ import annotations

import hashlib
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from asteria_client.config import client_env
from asteria_server.errors import InvalidInputError


@dataclass(frozen=True, kw_only=True)
class JobLayout:
    """Where this rank sits in its job. Nodes are numbered in the order of their lowest rank."""

    job_id: str
    world_size: int
    rank: int
    node: str
    node_rank: int
    num_nodes: int
    local_rank: int
    local_world_size: int
    #: global ranks on each node, by node rank
    ranks_by_node: tuple[tuple[int, ...], ...]
    #: every rank's host name, by rank
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise InvalidInputError(f"JobLayout.rank={self.rank} outside world {self.world_size}")
        if sum(len(r) for r in self.ranks_by_node) != self.world_size:
            raise InvalidInputError("JobLayout.ranks_by_node must list every rank once")

    @property
    def is_node_leader(self) -> bool:
        """The lowest rank of its node: the one that registers the job with its daemon."""
        return self.local_rank == 0

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.ranks_by_node[self.node_rank]

    @classmethod
    def from_hosts(cls, hosts: list[str], rank: int, job_id: str) -> JobLayout:
        """The layout of ``rank`` given every rank's host name (index = rank)."""
        nodes: list[str] = []
        for host in hosts:
            if host not in nodes:
                nodes.append(host)
        ranks_by_node = tuple(tuple(r for r, h in enumerate(hosts) if h == node) for node in nodes)
        node = hosts[rank]
        node_rank = nodes.index(node)
        local = ranks_by_node[node_rank]
        return cls(
            job_id=job_id,
            world_size=len(hosts),
            rank=rank,
            node=node,
            node_rank=node_rank,
            num_nodes=len(nodes),
            local_rank=local.index(rank),
            local_world_size=len(local),
            ranks_by_node=ranks_by_node,
            hosts=tuple(hosts),
        )


def distributed_job() -> bool:
    """True in a process of an initialized ``torch.distributed`` job."""
    return dist.is_available() and dist.is_initialized()


def discover_layout(group: Any = None, *, job_id: str | None = None) -> JobLayout | None:
    """This rank's layout in ``group`` (default: the world), or None when ``torch.distributed``
    is not initialized (a single process). Collective: every rank of the group must call it."""
    if not distributed_job():
        return None
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    proposed = job_id or client_env().job_name or f"job-{uuid.uuid4().hex[:12]}"
    gathered: list[Any] = [None] * world_size
    env = client_env()
    node = env.node or socket.gethostname()
    dist.all_gather_object(gathered, (node, proposed), group=group)
    hosts = [str(host) for host, _ in gathered]
    agreed = str(gathered[0][1])  # rank 0's name wins: replicas must agree on one
    if group is not None and world_size < dist.get_world_size():
        agreed = group_job(agreed, dist.get_process_group_ranks(group))
    return JobLayout.from_hosts(hosts, rank, agreed)


def group_job(job: str, ranks: list[int]) -> str:
    """The job name of the group of global ``ranks`` in job ``job`` (a group smaller than the
    world: see the module's docstring): ``job/g<lowest rank>-<digest of all of them>``. The
    digest tells apart groups that start at one rank (a data-parallel group and a
    tensor-parallel one); the lowest rank is there for the operator reading ``asteria status``."""
    members = sorted(int(r) for r in ranks)
    digest = hashlib.sha256(",".join(map(str, members)).encode()).hexdigest()[:8]
    return f"{job}/g{members[0]}-{digest}"
