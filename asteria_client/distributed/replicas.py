"""Data-parallel replicas share their blocks: one upload and one solve per block and version.

Under DDP every replica averages the same gradients, so every rank holds the same factors and
needs the same roots and bases. Computing them on every rank is waste. Instead each block gets
one **owner**, and only the owner hands its snapshots over:

- **daemon mode** (:class:`NodeShareSource`): the ranks of one node share that node's daemon, so
  the owner is one of the *local* ranks. It uploads the snapshot; the daemon solves it once and
  streams the result to every session of the job (the job id is the blocks' namespace there);
  the other local ranks only note that the version is in flight, so their barrier waits for it.
- **embedded mode** (:class:`ExchangeSource`): each rank runs its own engine, so the owner is any
  rank of the job. The owner's engine solves it; a side thread exchanges finished results among
  all ranks (an ``all_gather_object`` on a gloo group of its own, off the training step) and
  every rank installs them like its own. At S = 0 every rank waits for the same version, so all
  of them install it at the same step.

Owners are chosen by the rule the daemons use between nodes (:func:`asteria_server.owners.
owner_map`: longest processing time first, cost n³), over the blocks the optimizer plans at
construction (:meth:`BlockOwners.plan`); every replica plans the same blocks with the same
sizes, so all of them compute the same map without talking. A block that was not planned (a
param group added later) goes to the member with the least estimated work so far.

On the continuous schedule the owner also chooses the block's extra pulls for its replicas
(:meth:`PreconditionerSource.chooses`); in a job on several nodes one rank of the whole job
does, the uploader on the node whose daemon owns the block (:class:`PullChoosers`).

Blocks of sharded parameters (FSDP2: the name carries the shard's coordinates, ``@``) differ
from rank to rank and are never shared. A failed exchange turns into "every rank computes its
own blocks" with one warning — a lost peer never stops training.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from asteria_client.distributed.groups import SideGroup, group_members
from asteria_client.distributed.layout import JobLayout, discover_layout
from asteria_client.runtime.agreement import InstallAgreement
from asteria_client.runtime.source import (
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
    SourceRecord,
)
from asteria_server.owners import block_cost, is_shard_block, owner_map

if TYPE_CHECKING:
    from asteria_client.runtime.embedded import EngineConfig
    from asteria_client.transport.daemon import DaemonSource

logger = logging.getLogger(__name__)

#: Seconds a result exchange round may take before the exchange is declared failed.
EXCHANGE_TIMEOUT_S = 30.0
#: Pause between exchange rounds: short right after results moved, longer while idle.
_ROUND_PAUSE_MIN_S = 0.001
_ROUND_PAUSE_MAX_S = 0.01


class BlockOwners:
    """Which member (a rank) owns each block: by :func:`~asteria_server.owners.owner_map` over
    the planned blocks, else the least loaded member when an unplanned block is first seen."""

    def __init__(self, members: Sequence[int], shared: Callable[[str], bool] | None = None) -> None:
        if not members:
            raise ValueError("BlockOwners needs at least one member")
        self.members = tuple(members)
        self.shared = _shared if shared is None else shared
        self._load = dict.fromkeys(self.members, 0.0)
        self._owner: dict[str, int] = {}

    def plan(self, blocks: Mapping[str, int]) -> None:
        """Owners for ``blocks`` (name -> n), all of them at once by the shared rule; blocks
        that have an owner already keep it (every replica plans the same blocks alike)."""
        new = {b: n for b, n in blocks.items() if b not in self._owner and self.shared(b)}
        for block, member in owner_map(new, self.members, self.members).items():
            self._owner[block] = member
            self._load[member] += block_cost(new[block])

    def owner(self, block: str, n: int) -> int:
        found = self._owner.get(block)
        if found is None:
            found = min(self.members, key=lambda m: (self._load[m], m))
            self._owner[block] = found
            self._load[found] += block_cost(n)
        return found

    def owned_by(self, member: int) -> list[str]:
        return [b for b, m in self._owner.items() if m == member]

    def load(self) -> dict[int, float]:
        """Estimated work (sum of n³) per member."""
        return dict(self._load)


def _shared(block: str) -> bool:
    return not is_shard_block(block)


def _delegate_rest(cls: type) -> type:
    """Forward every public method of PreconditionerSource that ``cls`` does not define itself
    to ``self.inner``, so a wrapper stays complete when the interface grows."""
    for name, value in vars(PreconditionerSource).items():
        if name.startswith("_") or not callable(value) or name in vars(cls):
            continue

        def forward(self: Any, *args: Any, _name: str = name, **kwargs: Any) -> Any:
            return getattr(self.inner, _name)(*args, **kwargs)

        forward.__name__ = name
        forward.__doc__ = f"``inner.{name}``."
        setattr(cls, name, forward)
    cls.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
    return cls


@_delegate_rest
class NodeShareSource(PreconditionerSource):
    """A daemon source whose blocks are uploaded by one local rank each (module docstring)."""

    synchronous = False

    def __init__(
        self, inner: DaemonSource, layout: JobLayout, shared: Callable[[str], bool] | None = None
    ) -> None:
        self.inner = inner
        self.layout = layout
        #: whether a block is shared among the group's ranks (else this rank's alone)
        self.shared = _shared if shared is None else shared
        self.owners = BlockOwners(layout.local_ranks, self.shared)
        #: in a job on several nodes, the one rank of the job that chooses each block's
        #: continuous pulls (None: one node, where the block's uploader chooses them)
        self.choosers: PullChoosers | None = None
        self.uploaded = 0  # snapshots this rank handed to the daemon
        self.left_to_peers = 0  # snapshots another local rank uploads
        self.uploaded_bytes = 0  # their bytes (factor, and basis when sent)
        self.left_bytes = 0

    def submit(self, request: PreconditionerRequest) -> None:
        n = int(request.matrix.shape[0])
        size = sum(
            t.numel() * t.element_size() for t in (request.matrix, request.basis) if t is not None
        )
        shared = self.shared(request.block)
        if not shared or self.owners.owner(request.block, n) == self.layout.rank:
            self.uploaded += 1
            self.uploaded_bytes += size
            self.inner.submit(request)
        else:
            self.left_to_peers += 1
            self.left_bytes += size
            self.inner.expect(request)

    def plan_blocks(self, blocks: Mapping[str, int]) -> None:
        self.owners.plan(blocks)
        if self.choosers is not None:
            self.choosers.plan(blocks)
        self.inner.plan_blocks(blocks)

    def chooses(self, block: str, n: int) -> bool:
        """The block's uploader chooses its continuous pulls (the others expect them); on
        several nodes only the uploader on the node whose daemon owns it (:class:`PullChoosers`)."""
        if self.choosers is not None:
            return self.choosers.chooses(block, n)
        return not self.shared(block) or self.owners.owner(block, n) == self.layout.rank

    def take(self, block: str) -> PreconditionerResult | None:
        return self.inner.take(block)

    def record(self, block: str) -> SourceRecord:
        return self.inner.record(block)

    def stats(self) -> dict[str, Any]:
        return {
            **self.inner.stats(),
            "share": "node",
            "blocks_owned": len(self.owners.owned_by(self.layout.rank)),
            "snapshots_uploaded": self.uploaded,
            "snapshots_left_to_peers": self.left_to_peers,
            "snapshot_bytes_uploaded": self.uploaded_bytes,
            "snapshot_bytes_left_to_peers": self.left_bytes,
        }

    def __getattr__(self, name: str) -> Any:  # status(), jobs(), segments(), address, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class PullChoosers:
    """The one rank of a job on several nodes that chooses each replicated block's continuous
    pulls: the rank that uploads the block on the node whose daemon owns it.

    Each node's daemon solves only the blocks it owns among the job's daemons and pushes the
    results to the others (:mod:`asteria_server.sync.manager`), so the credit that says when a
    pull would be solved promptly is the owner daemon's, and the rank that hands that daemon
    the block is the one whose credit it is. Every other rank, on every node, follows its
    versions through the step-start agreement round and expects their results: a node whose
    daemon does not own the block gets them by the owner's push, and its daemon is never handed
    a snapshot of such a pull (its own floor snapshots keep the block in its block list).

    The daemon owner is the daemons' base map (every daemon alive) by the shared rule, over the
    planned blocks under the names the daemons see (``job:block``); each node's uploader is
    that node's :class:`BlockOwners` over its local ranks, planned alike on every rank. All
    ranks plan the same blocks, so all of them compute the same chooser without talking. When
    a daemon dies its blocks move but their chooser does not: the agreement keeps the replicas
    identical whoever solves, and a block whose result never comes is computed locally by every
    replica at its deadline."""

    def __init__(
        self,
        layout: JobLayout,
        member_of_node: Sequence[int],
        namespace: str,
        shared: Callable[[str], bool],
        local: BlockOwners | None = None,
    ) -> None:
        self.layout = layout
        self.shared = shared
        self._prefix = f"{namespace}:"
        #: the lowest node each daemon (member) serves: its uploader uploads the owned blocks
        self._node_of_member: dict[int, int] = {}
        for node, member in enumerate(member_of_node):
            self._node_of_member.setdefault(member, node)
        self._daemons = BlockOwners(sorted(self._node_of_member), shared)
        self._uploaders = [
            local if local is not None and node == layout.node_rank else BlockOwners(ranks, shared)
            for node, ranks in enumerate(layout.ranks_by_node)
        ]

    def plan(self, blocks: Mapping[str, int]) -> None:
        """As :meth:`BlockOwners.plan`, for the daemons and every node's uploaders."""
        self._daemons.plan({self._prefix + b: n for b, n in blocks.items()})
        for owners in self._uploaders:  # the local one (the source's) keeps what it planned
            owners.plan(blocks)

    def chooser(self, block: str, n: int) -> int:
        """The rank that chooses ``block``'s pulls (a shared block's; n: its size)."""
        member = self._daemons.owner(self._prefix + block, n)
        return self._uploaders[self._node_of_member[member]].owner(block, n)

    def chooses(self, block: str, n: int) -> bool:
        return not self.shared(block) or self.chooser(block, n) == self.layout.rank


@_delegate_rest
@dataclass(eq=False, slots=True)
class _Exchanged:
    """What the exchange knows about one shared block (under the exchange's lock)."""

    device: torch.device
    expected: int = -1  # newest version submitted (on every rank alike)
    received: int = -1  # newest version received
    given_up: int = -1  # newest version its owner could not compute
    ready: PreconditionerResult | None = None  # newest result not taken yet


class ExchangeSource(PreconditionerSource):
    """An embedded source whose blocks are solved on one rank each and exchanged (module
    docstring). ``group`` is the job's process group (None: the world)."""

    synchronous = False

    def __init__(
        self,
        inner: PreconditionerSource,
        layout: JobLayout,
        group: Any = None,
        shared: Callable[[str], bool] | None = None,
    ) -> None:
        self.inner = inner
        self.layout = layout
        #: whether a block is shared among the group's ranks (else this rank's alone)
        self.shared = _shared if shared is None else shared
        ranks = list(range(layout.world_size))
        self.owners = BlockOwners(ranks, self.shared)
        # A group of its own, on gloo whatever the training backend: the exchange runs on a
        # side thread and must never interleave with the training's collectives; made by the
        # group's members alone, so any mesh can make it in any order (see .groups).
        self._group = SideGroup(group_members(group), "exchange", timeout_s=EXCHANGE_TIMEOUT_S)
        self._cond = threading.Condition()
        self._blocks: dict[str, _Exchanged] = {}  # the shared blocks submitted here
        self._mine: set[str] = set()  # owned blocks with a result still to come from ``inner``
        self._epoch = 0
        self._closing = False
        self.failed = ""  # why the exchange stopped ("" while it runs)
        self.counts = {"rounds": 0, "results_sent": 0, "results_received": 0, "given_up": 0}
        self._thread = threading.Thread(
            target=self._run, name="asteria-result-exchange", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ snapshots in
    def plan_blocks(self, blocks: Mapping[str, int]) -> None:
        with self._cond:
            self.owners.plan(blocks)
        self.inner.plan_blocks(blocks)

    def chooses(self, block: str, n: int) -> bool:
        """The block's owner chooses its continuous pulls (the others expect them)."""
        if not self.shared(block):
            return True
        with self._cond:
            return self.owners.owner(block, n) == self.layout.rank

    def expect(self, request: PreconditionerRequest) -> None:
        """Another replica (the owner) submitted this version: wait for it from the exchange."""
        if not self.shared(request.block):
            return
        with self._cond:
            entry = self._entry(request.block)
            entry.device = request.factor_device
            entry.expected = max(entry.expected, request.version)

    def credit(self) -> int | None:
        return self.inner.credit()  # this rank's engine solves the blocks it owns

    def seconds_per_n3(self) -> float:
        return self.inner.seconds_per_n3()

    def _is_mine(self, block: str, n: int) -> bool:
        return bool(self.failed) or self.owners.owner(block, n) == self.layout.rank

    def submit(self, request: PreconditionerRequest) -> None:
        block = request.block
        if not self.shared(block):  # a shard's block: this rank's alone, never exchanged
            self.inner.submit(request)
            return
        with self._cond:
            entry = self._entry(block)
            entry.device = request.factor_device
            mine = self._is_mine(block, int(request.matrix.shape[0]))
        if mine:  # handed over before the exchange looks for it: never a false give-up
            self.inner.submit(request)
        with self._cond:
            entry.expected = max(entry.expected, request.version)
            if mine:
                self._mine.add(block)

    def _entry(self, block: str) -> _Exchanged:
        """``block``'s entry (locked); a block first seen in a result (this rank has not
        submitted it yet) is kept on the host until a snapshot names its device."""
        entry = self._blocks.get(block)
        if entry is None:
            entry = self._blocks[block] = _Exchanged(torch.device("cpu"))
        return entry

    # ------------------------------------------------------------------ the exchange
    def _outgoing(self) -> list[tuple[str, Any]]:
        """Results (and give-ups) of owned blocks, to broadcast this round (exchange thread)."""
        out: list[tuple[str, Any]] = []
        with self._cond:
            mine = list(self._mine)
        for block in mine:
            running = self.inner.in_flight_version(block)  # look first, then take: no gap
            result = self.inner.take(block)
            if result is not None:
                out.append(("result", _to_cpu(result)))
            elif running is None:
                with self._cond:
                    entry = self._blocks[block]
                    if entry.received < entry.expected:
                        out.append(("given_up", (block, entry.expected)))
            if running is None:
                with self._cond:
                    self._mine.discard(block)
        return out

    def _run(self) -> None:
        pause = _ROUND_PAUSE_MAX_S
        try:
            while True:
                out = self._outgoing()
                closing = self._closing
                gathered = self._group.all_gather_object((closing, out))
                moved = sum(len(items) for _, items in gathered)
                arrived = self._to_devices(
                    [i for _, items in gathered for k, i in items if k == "result"]
                )
                with self._cond:
                    self.counts["rounds"] += 1
                    self.counts["results_sent"] += sum(kind == "result" for kind, _ in out)
                    for result in arrived:
                        self._deliver(result)
                    for _, items in gathered:
                        for kind, item in items:
                            if kind != "result":
                                block, version = item
                                entry = self._entry(block)
                                entry.given_up = max(entry.given_up, version)
                                self.counts["given_up"] += 1
                    if moved:
                        self._cond.notify_all()
                if all(flag for flag, _ in gathered):
                    return  # every rank closed: the last round
                pause = _ROUND_PAUSE_MIN_S if moved else min(2 * pause, _ROUND_PAUSE_MAX_S)
                time.sleep(pause)
        except Exception as exc:  # a lost peer: every rank computes its own blocks from now on
            with self._cond:
                self.failed = f"{type(exc).__name__}: {exc}"
                self._cond.notify_all()
            if not self._closing:
                logger.warning(
                    "the result exchange between ranks stopped (%s); this rank computes all its "
                    "blocks itself from now on",
                    self.failed,
                )

    def _to_devices(self, results: list[PreconditionerResult]) -> list[PreconditionerResult]:
        """The received results newer than those held, on their blocks' devices: the copies
        run without the lock that the training thread's ``take`` and ``wait`` need."""
        with self._cond:
            entries = [(r, self._entry(r.block)) for r in results]
            newer = [(r, e.device) for r, e in entries if r.version > e.received]
        return [_to_device(r, device) for r, device in newer]

    def _deliver(self, result: PreconditionerResult) -> None:
        """Keep a received result (on its device already) if it is newer (locked)."""
        entry = self._entry(result.block)
        if result.version <= entry.received:
            return
        entry.received = result.version
        self.counts["results_received"] += 1
        entry.ready = result
        self._epoch += 1

    # ------------------------------------------------------------------ results out
    def take(self, block: str) -> PreconditionerResult | None:
        if not self.shared(block):
            return self.inner.take(block)
        with self._cond:
            entry = self._blocks.get(block)
            result = None if entry is None else entry.ready
            if entry is not None:
                entry.ready = None
            failed = bool(self.failed)
        if result is None and failed:
            return self.inner.take(block)
        return result

    def wait(self, block: str, min_version: int, timeout_s: float) -> PreconditionerResult | None:
        if not self.shared(block):
            return self.inner.wait(block, min_version, timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                entry = self._blocks.get(block)
                ready = None if entry is None else entry.ready
                if entry is not None and ready is not None and ready.version >= min_version:
                    entry.ready = None
                    return ready
                if self.failed:
                    break
                left = deadline - time.monotonic()
                hopeless = (
                    entry is None or entry.expected < min_version or entry.given_up >= min_version
                )
                if hopeless or left <= 0:
                    return None
                self._cond.wait(left)
        return self.inner.wait(block, min_version, max(0.0, deadline - time.monotonic()))

    def in_flight_version(self, block: str) -> int | None:
        if not self.shared(block):
            return self.inner.in_flight_version(block)
        with self._cond:
            if self.failed:
                return self.inner.in_flight_version(block)
            entry = self._blocks.get(block)
            if entry is None or entry.expected <= entry.received:
                return None
            return entry.expected

    def results_epoch(self) -> int | None:
        inner = self.inner.results_epoch()  # a shard's results arrive there directly
        return None if inner is None else self._epoch + inner

    def records(self) -> dict[str, SourceRecord]:
        out = self.inner.records()
        with self._cond:
            for block, entry in self._blocks.items():
                owner = self.owners.owner(block, 0) if self.shared(block) else self.layout.rank
                record = out.setdefault(block, SourceRecord(submitted_version=entry.expected))
                record.computed_version = max(record.computed_version, entry.received)
                record.extra["owner_rank"] = owner
        return out

    def record(self, block: str) -> SourceRecord:
        return self.records().get(block, SourceRecord())

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                **self.inner.stats(),
                "share": "job",
                "blocks_owned": len(self.owners.owned_by(self.layout.rank)),
                "exchange_failed": self.failed,
                **{f"exchange_{k}": v for k, v in self.counts.items()},
            }

    def close(self) -> None:
        """Leave the exchange once every rank has closed (the last round tells), then close
        the engine. Collective in effect: a rank that never closes keeps the others here until
        the exchange's timeout."""
        with self._cond:
            self._closing = True
        self._thread.join(timeout=2 * EXCHANGE_TIMEOUT_S)
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # engine, tenant, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _to_cpu(result: PreconditionerResult) -> PreconditionerResult:
    return _to_device(result, torch.device("cpu"))


def _to_device(result: PreconditionerResult, device: torch.device) -> PreconditionerResult:
    def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(device)

    return PreconditionerResult(
        block=result.block,
        version=result.version,
        kind=result.kind,
        matrix=result.matrix.to(device),
        eigenvalues=move(result.eigenvalues),
        permutation=move(result.permutation),
        rotation=move(result.rotation),
        base_version=result.base_version,
        solve_time_s=result.solve_time_s,
    )


def _everything(block: str) -> bool:
    return True


def replica_agreement(
    group: Any = None, *, timeout_s: float, share_shards: bool = False
) -> InstallAgreement | None:
    """The agreement on install steps among the data-parallel replicas of ``group`` (None: the
    world), over a gloo side group of its own; None for a group of one. Collective over the
    group. Its collectives wait up to ``timeout_s`` (longer than any barrier: a replica that
    waits for a late result keeps the others in the collective meanwhile)."""
    members = group_members(group)
    if len(members) < 2:
        return None
    shared = _everything if share_shards else _shared
    return InstallAgreement(SideGroup(members, "agree", timeout_s=timeout_s), shared)


def job_source(
    mode: Any,
    engine_config: EngineConfig | None,
    *,
    address: str | None,
    group: Any = None,
    share_shards: bool = False,
    pulls: bool = False,
) -> tuple[PreconditionerSource, JobLayout | None]:
    """The embedded or daemon source of this rank of a ``torch.distributed`` job, sharing its
    blocks with the job's other replicas, and the job's layout. ``share_shards``: ``group`` is
    the replicas of this rank's shards (HSDP's replicate dim), so a shard's blocks (``@``) are
    shared among it too; ``pulls``: the continuous schedule pulls from it (a daemon source
    then asks for the daemon's Credit messages). Collective: every rank of
    ``group`` calls it (the optimizer's constructor does). Outside a job (one process, or a
    world of one) it is the plain source, and the layout is None for a single process."""
    from asteria_client.runtime import Mode

    layout = discover_layout(group)
    shared = _everything if share_shards else _shared
    if mode is Mode.EMBEDDED:
        from asteria_client.runtime.embedded import EmbeddedSource

        embedded = EmbeddedSource(engine_config)
        if layout is None or layout.world_size == 1:
            return embedded, layout
        return ExchangeSource(embedded, layout, group, shared), layout
    from asteria_client.config import resolve_address
    from asteria_client.transport.daemon import DaemonSource

    daemon = DaemonSource(
        address=resolve_address(address),
        job=None if layout is None else layout.job_id,
        rank=0 if layout is None else layout.rank,
        pulls=pulls,
    )
    if layout is None:
        return daemon, None
    # Across synced daemons a block's results can come from another node's daemon, and its
    # refresh from them is not checked there (tests/integration/test_bases_stay_home.py is
    # one node): bases travel with their refreshes in a job on several nodes.
    daemon.bases_home = layout.num_nodes == 1
    member_of_node = register_job(daemon, layout, group)
    # On one node a rank alone on it chooses its own pulls; on several one rank per block
    # chooses them for the whole job (PullChoosers), so even a node of one rank follows.
    across = pulls and layout.num_nodes > 1
    if layout.local_world_size == 1 and not across:
        return daemon, layout
    source = NodeShareSource(daemon, layout, shared)
    if across:
        source.choosers = PullChoosers(
            layout, member_of_node, daemon.namespace, shared, local=source.owners
        )
    return source, layout


def register_job(daemon: DaemonSource, layout: JobLayout, group: Any = None) -> list[int]:
    """Tell every node's daemon the job's layout: each rank's daemon address and incarnation
    are gathered (collective), and the lowest rank of each node registers the whole. Returns
    each node's daemon as the daemons number them (members: the distinct daemon addresses in
    node order; nodes that share a daemon are one member), on every rank alike.

    Rank 0's random run nonce travels in the same gather and every node leader registers it:
    the daemons bind the job's peer-call token to it, so each run of a job id (a restart
    included) gets a token of its own and an earlier run's stops working."""
    from asteria_client.transport.connection import JobNodeInfo, RegisteredJob

    gathered: list[Any] = [None] * layout.world_size
    # A daemon with a peer listener is named by it: the address its ranks use is often a Unix
    # socket, the same path on every node, that no other node's daemon can reach.
    reachable = daemon.peer_address or daemon.address
    mine = (reachable, daemon.incarnation_id, secrets.token_hex(16))
    dist.all_gather_object(gathered, mine, group=group)
    run_nonce = str(gathered[0][2])
    nodes = tuple(
        JobNodeInfo(
            host=layout.hosts[ranks[0]],
            ranks=ranks,
            daemon_address=str(gathered[ranks[0]][0]),
            daemon_incarnation=str(gathered[ranks[0]][1]),
        )
        for ranks in layout.ranks_by_node
    )
    if layout.is_node_leader:
        daemon.register_job(
            RegisteredJob(
                job=layout.job_id,
                world_size=layout.world_size,
                nodes=nodes,
                node_rank=layout.node_rank,
                run_nonce=run_nonce,
            )
        )
    return _members(nodes)


def _members(nodes: Sequence[Any]) -> list[int]:
    """Each node's member number, as :class:`asteria_server.sync.group.JobSync` gives it."""
    addresses: list[str] = []
    for node in nodes:
        if node.daemon_address not in addresses:
            addresses.append(node.daemon_address)
    return [addresses.index(node.daemon_address) for node in nodes]
