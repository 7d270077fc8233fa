"""One job's peer group on this daemon: the snapshot gate, the claims, the results, the status.

A :class:`JobSync` joins the three parts of a group: its membership (:mod:`.membership`), its
push links (:mod:`.links`) and the decisions about the snapshots it holds for another member's
push (:mod:`.decide`), which it carries out. The protocol is described in
:mod:`asteria_server.sync.manager`, whose :class:`~asteria_server.sync.manager.SyncManager`
runs the group's heartbeats, senders and claims on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from asteria_server.owners import block_cost
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.sync import decide
from asteria_server.sync.decide import Held
from asteria_server.sync.links import PeerLink
from asteria_server.sync.membership import Membership, Peer, synced
from asteria_server.sync.push import BlockUse
from asteria_server.types import SolveKind, SolveResult, SolveTask, SubmitOutcome

if TYPE_CHECKING:
    from asteria_server.sync.manager import SyncManager

logger = logging.getLogger(__name__)

#: Versions solved here that a block's status lists.
SOLVED_VERSIONS_KEPT = 256


@dataclass
class _BlockStats:
    n: int
    solves: int = 0
    received: int = 0
    fallbacks: int = 0
    version: int = -1
    origin: str = ""
    superseded: int = 0
    taken_over: int = 0
    handed_over: int = 0
    solved: collections.deque[int] = field(
        default_factory=lambda: collections.deque(maxlen=SOLVED_VERSIONS_KEPT)
    )


class JobSync:
    """One job's peer group on this daemon (see the module docstring): its membership
    (``view``), its push links (``links``), the snapshots it holds for a push (``held``), and
    the executor of the decisions :mod:`.decide` returns about them."""

    def __init__(
        self,
        manager: SyncManager,
        tenant: str,
        layout: jpb.JobLayout,
        node_rank: int,
    ) -> None:
        self.manager = manager
        self.tenant = tenant
        self.job = layout.job
        #: this run of the job (JobLayout.run_nonce): its peer calls' token is bound to it
        self.run_nonce = layout.run_nonce
        self.view = Membership(tenant, layout, node_rank, manager.config, now=time.monotonic())
        self.links: dict[int, PeerLink] = {
            m: PeerLink(m, peer.address) for m, peer in self.view.peers.items()
        }
        self.kinds: dict[str, SolveKind] = {}  # what the local ranks need of each block
        self.stats: dict[str, _BlockStats] = {}
        self.held: dict[str, Held] = {}
        self.deadlines: dict[str, float] = {}  # block -> deadline of its newest local snapshot
        self.left_to_owner = 0
        self.fallbacks = 0
        #: claims: sent by this member and granted to it; granted by it, as owner, to others
        self.claims_sent = 0
        self.claims_granted = 0
        self.claims_handed_over = 0
        self.solves_withdrawn = 0
        #: block -> (member, version) this member, as owner, let another member solve
        self.handed: dict[str, tuple[int, int]] = {}
        #: block -> version this member won a claim of (solve here, push to every peer)
        self.taken: dict[str, int] = {}
        #: owners whose last grant was of a version not arrived there (their ranks are behind)
        self.behind: set[int] = set()
        self.job_of: dict[str, str] = {}
        self.fallback_reasons: dict[str, int] = {}
        self.late_arrivals = 0
        self.max_arrival_lag = 0
        self.newest_step = -1
        self._step_at = 0.0
        self.step_s: float | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ membership

    @property
    def peers(self) -> dict[int, Peer]:
        return self.view.peers

    @property
    def me(self) -> int:
        return self.view.me

    @property
    def prefix(self) -> str:
        return self.view.prefix

    @property
    def syncing(self) -> bool:
        return self.view.syncing

    def node_of(self, member: int) -> int:
        return self.view.node_of(member)

    def refresh_states(self, now: float) -> None:
        for peer in self.view.refresh_states(now):
            self.links[peer.member].has.clear()  # it may come back with nothing

    def heard(self, peer: Peer, state: ppb.PeerState) -> None:
        """A heartbeat of ``peer`` arrived (its call or its answer)."""
        link = self.links[peer.member]
        reborn, died = self.view.heard(peer, state, time.monotonic())
        if reborn:
            link.has.clear()  # a new incarnation holds nothing yet: push everything again
        for other in died:
            self.links[other.member].has.clear()
        if peer.state == "alive":
            self.queue_missing(peer)

    def my_state(self, known_digest: str) -> ppb.PeerState:
        stats = self.manager.engine.stats()
        return self.view.my_state(
            known_digest,
            incarnation_id=self.manager.engine.incarnation_id,
            workers_busy=stats.workers_busy,
            workers=stats.num_workers,
            queue_depth=stats.queue_depth,
        )

    # ------------------------------------------------------------------ the gate

    def note_step(self, version: int, now: float) -> None:
        """Learn the job's pace from its snapshots' versions (optimizer steps)."""
        if version > self.newest_step:
            if self.newest_step >= 0 and now > self._step_at:
                pace = (now - self._step_at) / (version - self.newest_step)
                self.step_s = pace if self.step_s is None else 0.7 * self.step_s + 0.3 * pace
            self.newest_step, self._step_at = version, now

    def submit(self, task: SolveTask, job: str) -> SubmitOutcome:
        now = time.monotonic()
        view = self.view
        self.note_step(task.version, now)
        if view.learn(task.block, task.n):
            self.stats.setdefault(task.block, _BlockStats(task.n))
        self.deadlines[task.block] = task.deadline
        self.kinds[task.block] = task.kind
        if not self.syncing:  # a job on this daemon alone: the engine's own rules
            return self.manager.engine.submit(task, job=job)
        stats = self.stats[task.block]
        if stats.version >= task.version:  # a push brought it (or a newer one) already ...
            kept = self.manager.engine.peek_result(task.block, task.tenant)
            if kept is not None and kept.version >= task.version:
                return SubmitOutcome.DUPLICATE
            # ... but the cache dropped it, and the rank sent it again: solve it here
            return self._solve_here(task, job, fallback=False)
        held = self.held.get(task.block)
        if held is not None and held.task.version >= task.version:
            return (
                SubmitOutcome.DUPLICATE
                if held.task.version == task.version
                else SubmitOutcome.STALE_IGNORED
            )
        self.job_of[task.block] = job
        route = decide.route(
            view,
            task,
            job,
            handed=self.handed.get(task.block),
            behind=self.behind,
            step_s=self.step_s,
            now=now,
        )
        if isinstance(route, decide.Submit):
            if route.fallback:
                self.fallback_reasons[route.reason] = self.fallback_reasons.get(route.reason, 0) + 1
            return self._solve_here(task, job, fallback=route.fallback)
        if held is not None:
            stats.superseded += 1
        self.manager.engine.note_elsewhere(task, job=job)
        self.held[task.block] = route.held
        self.left_to_owner += 1
        self.manager.wake_ticker()
        return SubmitOutcome.SUPERSEDED_QUEUED if held is not None else SubmitOutcome.QUEUED

    def _solve_here(self, task: SolveTask, job: str, *, fallback: bool) -> SubmitOutcome:
        outcome = self.manager.engine.submit(task, job=job)
        if outcome.accepted and fallback:
            self.fallbacks += 1
            self.stats[task.block].fallbacks += 1
        return outcome

    def tick(self, now: float) -> None:
        """Look at the waiting snapshots again (the decisions: :func:`.decide.tick`)."""
        self.refresh_states(now)
        for action in decide.tick(self.view, list(self.held.values()), self._solved, now):
            self._carry_out(action)

    def _solved(self, block: str) -> int:
        return self.stats[block].version

    def _carry_out(self, action: decide.Action) -> None:
        """Do what a decision of :mod:`.decide` says."""
        match action:
            case decide.Drop(held=held):
                del self.held[held.task.block]
            case decide.SolveHere(held=held, fallback=fallback, reason=reason, why=why):
                if action.taken:
                    self.taken[held.task.block] = held.task.version
                self._solve_held(held, fallback=fallback, reason=reason, why=why)
            case decide.WaitFor(held=held, member=member, incarnation=incarnation, due=due):
                held.wait_for, held.had_by, held.due = member, (member, incarnation), due
            case decide.Postpone(held=held, due=due):
                held.due = due
            case decide.Restart(held=held, since=since):
                held.since = since
            case decide.StartClaim(held=held, owner=owner):
                self.manager.start_claim(self, held, owner)
            case decide.TakeOver(held=held):
                self._take_over(held)
            case decide.Disowned(held=held, since=since):
                held.disowned_since = since
            case decide.NoteBehind(owner=owner, behind=behind):
                if behind:
                    self.behind.add(owner)
                else:
                    self.behind.discard(owner)
            case decide.QueuePush(member=member, block=block):
                self.links[member].queue(block)

    def _solve_held(self, held: Held, *, fallback: bool, reason: str = "", why: str = "") -> None:
        block = held.task.block
        if fallback:
            self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
            logger.info(
                "job %r: solving block %r version %d here: %s",
                self.job,
                block,
                held.task.version,
                why,
                extra={"tenant": self.tenant, "job": self.job},
            )
        if self.held.get(block) is held:
            del self.held[block]
        if held.wait_for is not None and self.handed.get(block, (-1, -1))[0] == held.wait_for:
            del self.handed[block]
        try:
            self._solve_here(held.task, held.job, fallback=fallback)
        except Exception:  # the engine closed or broke: the ranks compute it themselves
            logger.warning("job %r: could not solve block %r here", self.job, block)

    # ------------------------------------------------------------------ claims
    def claim_answered(self, held: Held, owner: int, reply: ppb.ClaimResponse) -> None:
        """The owner's answer to a claim of ``held`` (see the Claim RPC and
        :func:`.decide.claim_answered`)."""
        held.claiming = False
        if reply.granted:
            self.claims_granted += 1
        actions = decide.claim_answered(
            self.view,
            held,
            owner,
            granted=reply.granted,
            reason=reply.reason,
            current=self.held.get(held.task.block) is held,
            now=time.monotonic(),
        )
        for action in actions:
            self._carry_out(action)

    def _take_over(self, held: Held) -> None:
        block, version = held.task.block, held.task.version
        del self.held[block]
        self.taken[block] = version
        self.stats[block].taken_over += 1
        logger.info(
            "job %r: solving block %r version %d here: its owner's push would come too "
            "late and the owner let this daemon take it",
            self.job,
            block,
            version,
            extra={"tenant": self.tenant, "job": self.job},
        )
        try:
            self._solve_here(held.task, held.job, fallback=False)
        except Exception:
            logger.warning("job %r: could not solve block %r here", self.job, block)

    def claim_failed(self, held: Held, owner: int, exc: BaseException) -> None:
        """A claim got no answer: ask again soon, or solve here when its owner is suspect (a
        stopped owner does not answer) or cannot take claims (:func:`.decide.claim_failed`)."""
        held.claiming = False
        if self.held.get(held.task.block) is not held:
            return
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        name = code.name if code is not None else None
        detail = name if name is not None else repr(exc)
        now = time.monotonic()
        self._carry_out(decide.claim_failed(self.view, held, owner, name, detail, now))

    def claim(self, peer: Peer, block: str, version: int) -> ppb.ClaimResponse:
        """``peer`` asks to solve ``version`` of ``block`` itself (this member owns it)."""
        now = time.monotonic()
        me = self.node_of(self.me)
        if not synced(block, self.prefix) or block not in self.view.known:
            return ppb.ClaimResponse(granted=False, reason="not_owner", by=-1)
        owner = self.view.owner_of(block, now)
        if owner != self.me:
            by = -1 if owner is None else self.node_of(owner)
            return ppb.ClaimResponse(granted=False, reason="not_owner", by=by)
        stats = self.stats[block]
        if stats.version >= version:  # solved: its push is queued (again, if it was lost)
            link = self.links[peer.member]
            if block in peer.blocks and link.lacks(block, stats.version):
                link.queue(block)
            return ppb.ClaimResponse(granted=False, reason="solved", by=me)
        engine = self.manager.engine
        if engine.computed_version(block, self.tenant) >= version:
            # Solved here, but the result listener has not told this group yet (local_result
            # runs later on the loop, and queues the push then). The version is neither
            # queued nor running any more: granting it as "not arrived" solved it twice.
            return ppb.ClaimResponse(granted=False, reason="solved", by=me)
        handed = self.handed.get(block)
        if handed is not None and handed[1] >= version:
            if handed[0] == peer.member:
                return ppb.ClaimResponse(granted=True, by=self.node_of(peer.member))
            if self.peers[handed[0]].state != "dead":
                return ppb.ClaimResponse(
                    granted=False, reason="claimed", by=self.node_of(handed[0])
                )
        held = self.held.get(block)
        if (
            held is not None
            and held.task.version >= version
            and held.had_by is not None
            and held.had_by[0] != peer.member
            and decide.waits_for_quiet(self.view, held, now)
        ):
            # Held for a quiet member that had it (a buried owner): it may be solving it.
            return ppb.ClaimResponse(
                granted=False, reason="claimed", by=self.node_of(held.had_by[0])
            )
        task = engine.withdraw(block, self.tenant, version)
        if task is None:
            running = engine.in_flight_version(block, self.tenant)
            if running is not None and running >= version:
                return ppb.ClaimResponse(granted=False, reason="running", by=me)
            # Not here yet (this member's ranks are behind): it will not be solved here.
        else:  # taken out of the queue: it waits for the winner's push like a non-owner's
            self.held[block] = Held(
                task,
                self.job_of.get(block, ""),
                now,
                now + self.manager.config.push_timeout_s,
                wait_for=peer.member,
                had_by=(peer.member, peer.incarnation),
            )
        self.handed[block] = (peer.member, version)
        arrived = task is not None
        stats.handed_over += 1
        self.claims_handed_over += 1
        logger.info(
            "job %r: member %d takes block %r version %d (%s here)",
            self.job,
            peer.member,
            block,
            version,
            "queued" if task is not None else "not arrived",
            extra={"tenant": self.tenant, "job": self.job},
        )
        return ppb.ClaimResponse(
            granted=True,
            reason="queued" if arrived else "not_arrived",
            by=self.node_of(peer.member),
        )

    # ------------------------------------------------------------------ results

    def local_result(self, block: str, version: int) -> None:
        """The engine's own workers solved ``version`` of ``block``, newer than its result then.

        Every solve is counted, with its version, even when the block holds a newer result by
        the time this runs on the loop (a later solve, or a peer's push, got here first): the
        solved versions are how a version solved on two daemons is seen (``asteria status``,
        the sync tests). Only a result newer than the block's is pushed."""
        stats = self.stats.get(block)
        if stats is None:
            return
        stats.solves += 1
        stats.solved.append(version)
        if version <= stats.version:
            return
        stats.version, stats.origin = version, "local"
        self.held.pop(block, None)
        if not self.syncing:
            return
        taken = self.taken.get(block, -1)
        if block in self.taken and self.taken[block] <= version:
            del self.taken[block]
        if block in self.handed and self.handed[block][1] <= version:
            del self.handed[block]
        for action in decide.result_pushes(self.view, block, version, taken):
            self._carry_out(action)

    def queue_missing(self, peer: Peer) -> None:
        """Queue every result solved here of a block that ``peer`` uses and lacks: of a block
        this member owns, or one it took over while ``peer`` was gone (a returning owner then
        drops its own queued snapshots of those versions instead of solving them again)."""
        link = self.links[peer.member]
        for block, node in self.view.decided_owners().items():
            stats = self.stats.get(block)
            if (
                (node == self.me or node == peer.member)
                and stats is not None
                and stats.version >= 0
                and stats.origin == "local"  # one a claim's winner solved, it pushed itself
                and block in peer.blocks
                and link.lacks(block, stats.version)
                and block not in link.queued
            ):
                link.queue(block)

    def received(self, peer: Peer | None, result: SolveResult, num_bytes: int) -> bool:
        """A pushed result arrived: keep it if newer (True)."""
        if peer is not None:
            link = self.links[peer.member]
            link.bytes_received += num_bytes
            link.results_received += 1
            link.got(result.block, result.version)
        stats = self.stats.get(result.block)
        n = int(result.matrix.shape[0])
        if stats is None:
            stats = self.stats[result.block] = _BlockStats(n)
        if stats.n != n:  # not what its ranks use: dropped, never served
            logger.warning(
                "job %r: dropped a pushed result of block %r: %dx%d, its ranks use n=%d",
                self.job,
                result.block,
                n,
                n,
                stats.n,
            )
            return False
        if result.version <= stats.version:
            return False
        if not self.manager.engine.install_result(result):
            return False
        stats.version = result.version
        stats.origin = "local" if peer is None else f"node{self.node_of(peer.member)}"
        stats.received += 1
        # A snapshot of that version (or older) still queued here is not solved: latest wins.
        withdrawn = self.manager.engine.withdraw(result.block, self.tenant, result.version)
        if withdrawn is not None:
            self.solves_withdrawn += 1
            if withdrawn.version < result.version:
                stats.superseded += 1
        if result.block in self.handed and self.handed[result.block][1] <= result.version:
            del self.handed[result.block]
        held = self.held.get(result.block)
        if held is not None and held.task.version <= result.version:
            del self.held[result.block]
            if self.newest_step >= held.task.deadline:
                self.late_arrivals += 1
        self.max_arrival_lag = max(self.max_arrival_lag, self.newest_step - result.version)
        return True

    def use(self, block: str) -> BlockUse | None:
        """How the ranks here use ``block`` (None: not at all): what a push of it must match."""
        n = self.view.known.get(block)
        if n is None:
            return None
        _, submitted = self.manager.engine.block_versions(block, self.tenant)
        stats = self.stats.get(block)
        newest = max(submitted, -1 if stats is None else stats.version)
        return BlockUse(n, self.kinds.get(block), newest)

    def next_push(self, peer: Peer) -> list[SolveResult]:
        """The queued results for ``peer``, the most urgent first (newest of each block)."""
        engine = self.manager.engine
        return self.links[peer.member].next_push(
            self.deadlines, lambda block: engine.peek_result(block, self.tenant)
        )

    # ------------------------------------------------------------------ status

    def status(self, now: float) -> ppb.PeerGroup:
        self.refresh_states(now)
        owners = self.view.owners() if self.view.agreed(now) else {}
        cost_of: dict[int, float] = {}
        count_of: dict[int, int] = {}
        spn3 = self.manager.engine.stats().seconds_per_n3
        for block, member in owners.items():
            count_of[member] = count_of.get(member, 0) + 1
            n = self.view.known.get(block) or max(
                p.blocks.get(block, 0) for p in self.peers.values()
            )
            cost_of[member] = cost_of.get(member, 0.0) + spn3 * block_cost(n)
        peers = [
            ppb.PeerInfo(
                node=self.node_of(self.me),
                address=self.view.addresses[self.me],
                incarnation_id=self.manager.engine.incarnation_id,
                state="self",
                last_heard_s=0.0,
                owned_blocks=count_of.get(self.me, 0),
                owned_cost_s=cost_of.get(self.me, 0.0),
            )
        ]
        for member, peer in sorted(self.peers.items()):
            link = self.links[member]
            lag_versions = 0
            for block in link.queued:
                stats = self.stats.get(block)
                if stats is not None:
                    lag_versions = max(lag_versions, stats.version - link.has.get(block, -1))
            peers.append(
                ppb.PeerInfo(
                    node=self.node_of(member),
                    address=peer.address,
                    incarnation_id=peer.incarnation,
                    state=peer.state,
                    last_heard_s=-1.0 if peer.last_heard is None else now - peer.last_heard,
                    owned_blocks=count_of.get(member, 0),
                    owned_cost_s=cost_of.get(member, 0.0),
                    push_lag_versions=lag_versions,
                    push_lag_s=0.0
                    if link.oldest_queued_at is None
                    else now - link.oldest_queued_at,
                    bytes_sent=link.bytes_sent,
                    bytes_received=link.bytes_received,
                    results_sent=link.results_sent,
                    results_received=link.results_received,
                    workers_busy=peer.workers_busy,
                    queue_depth=peer.queue_depth,
                    suspected=peer.suspected,
                    died=peer.died,
                    rejoined=peer.rejoined,
                )
            )
        blocks = [
            ppb.PeerBlock(
                block=block,
                n=stats.n,
                owner=self.node_of(owners[block]) if block in owners else -1,
                version=stats.version,
                origin=stats.origin,
                solves=stats.solves,
                received=stats.received,
                fallbacks=stats.fallbacks,
                solved_versions=list(stats.solved),
                superseded=stats.superseded,
                taken_over=stats.taken_over,
                handed_over=stats.handed_over,
                discarded_versions=self.manager.engine.discarded_versions(block, self.tenant),
            )
            for block, stats in sorted(self.stats.items())
        ]
        return ppb.PeerGroup(
            job=self.job,
            node=self.node_of(self.me),
            peers=peers,
            blocks=blocks,
            agreed=bool(owners),
            waiting=len(self.held),
            left_to_owner=self.left_to_owner,
            fallbacks=self.fallbacks,
            late_arrivals=self.late_arrivals,
            max_arrival_lag_steps=max(0, self.max_arrival_lag),
            fallback_reasons=self.fallback_reasons,
            claims_sent=self.claims_sent,
            claims_granted=self.claims_granted,
            claims_handed_over=self.claims_handed_over,
            solves_withdrawn=self.solves_withdrawn,
        )
