"""The peer groups of a daemon: one per (tenant, job) registered with more than one daemon.

Everything runs on the daemon's event loop (heartbeats, pushes, the snapshot gate the servicer
calls) except the engine's result listener, which hands its news to the loop.

**Membership.** A job's layout (RegisterJob) lists its nodes and the daemon of each; nodes
served by the same daemon are one *member*. Every member calls Heartbeat on every other one
every ``heartbeat_s``; the answer carries the callee's state, so each call tells both sides.
A member not heard for ``suspect_s`` is *suspect* (snapshots waiting for its push are claimed
from it at once), for ``dead_s`` *dead* (its blocks move to the living by the owner rule), and
``takeover_grace_s`` later *gone*. Until it is gone, a quiet owner's versions (those it had and
those that arrive meanwhile: its ranks send it the same ones) are held for its push, not solved
elsewhere: stopped, it may be solving them, and it solves them when it runs again. One never
heard counts as pending for ``dead_s`` after the job was registered here, then as dead.
A new incarnation (a restarted daemon) or a dead one heard again *rejoins*: the owner rule moves
exactly its blocks back, and everything it needs is pushed to it again (versions never go back:
a peer keeps a pushed result only when newer than its own).

**Agreement.** The owner map depends on the job's blocks and on which members use each one, so
owners are decided only while every live member holds the same block lists of all of them (a
digest of its own list in every heartbeat, the list itself when it changed, and a digest of
all the lists it holds), and that for ``settle_s``. Before, a snapshot waits (at most
``patience_s``). A replicated block is used by every member; a block of a parameter shard (a
name with the shard mark ``@``) only by the members whose ranks hold that shard (HSDP: its
replicas on several nodes; plain FSDP: one member, which then owns it), and it is owned by one
of them (:func:`asteria_server.owners.owner_map` with ``users``).

**The gate.** A snapshot of a block in the job's namespace is solved here only when this
member owns it. Otherwise it waits for the owner's
push. When the push has not come by the snapshot's deadline, ``max(patience_s, (deadline -
version) * step_s)`` after it arrived (``step_s`` being the job's seconds per step as seen from
its snapshots), or at once when the owner is suspect or its ranks are behind, it is *claimed*
(Peer.Claim): the owner grants a version it has not started (taken out of its queue, or not
arrived there yet, in which case it will not solve it when it comes: it waits for this
member's push instead), and refuses one it runs or has solved, by its engine's computed
version (its push is on its way; asked again after ``patience_s``). A granted version is
solved here and pushed to every peer, the owner included, so each (block, version) is still
solved once in the cluster. It is solved here without a grant (a *fallback*, which may
duplicate the owner's work) only when the owner is gone, cannot take claims, or the members
do not agree on the blocks in time. A push that brings the version (or a newer one) ends the
wait, and takes an older-or-equal snapshot of the block out of this member's queue (latest
wins).

**Pushes.** When a block this member owns gets a result, it is queued for every live member
whose ranks use the block; a sender per peer sends the queue (the most urgent deadline first,
only each block's newest result, never one the peer already got) as one PushResults stream, in
``chunk_bytes`` chunks. A peer that does not read (SIGSTOPped) holds up only its own sender,
for at most ``push_timeout_s``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import grpc

from asteria_server.engine import PreconditionerEngine
from asteria_server.errors import AuthenticationError, DaemonBusyError, InvalidInputError
from asteria_server.owners import block_cost, owner_map
from asteria_server.protocol import convert, framing
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2_grpc as ppb_grpc
from asteria_server.protocol.shm import private_result
from asteria_server.service.budget import UploadBudget
from asteria_server.service.limits import AuthThrottle, RefusalLog
from asteria_server.sync.policy import UNPROVEN_HEARTBEAT_MAX_S, PeerPolicy, RateLimit
from asteria_server.sync.push import BlockUse, PushStream, PushTimeouts, check_header
from asteria_server.types import SolveKind, SolveResult, SolveTask, SubmitOutcome

logger = logging.getLogger(__name__)

#: Seconds between heartbeats to a peer declared dead.
DEAD_PEER_HEARTBEAT_S = 1.0
#: Versions solved here that a block's status lists.
SOLVED_VERSIONS_KEPT = 256
#: PushResults streams one tenant may have open on a daemon at once (tenant_max_push_streams).
MAX_PUSH_STREAMS = 16
#: Environment variables that override :class:`SyncConfig`'s defaults (seconds).
ENV_PREFIX = "ASTERIA_SYNC_"


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Timings of the peer groups (seconds); see the module docstring."""

    heartbeat_s: float = 0.25
    suspect_s: float = 2.0
    dead_s: float = 5.0
    patience_s: float = 2.0
    settle_s: float = 0.3
    call_timeout_s: float = 1.0
    push_timeout_s: float = 10.0
    #: How long a member declared dead is still trusted with the snapshots it had accepted
    #: (queued or on a worker): only after this is a version it held solved elsewhere.
    takeover_grace_s: float = 10.0
    #: A job's peer group ends once no session of the job has been open here for this long
    #: (long enough for its ranks to reconnect after a restart).
    group_idle_s: float = 120.0
    #: Heartbeats to peers not yet proven, all peer groups of the daemon together, per second.
    unproven_heartbeats_per_s: float = 16.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"SyncConfig.{f.name} must be a number > 0, got {value!r}")
        if not self.heartbeat_s < self.suspect_s < self.dead_s:
            raise ValueError(
                "SyncConfig needs heartbeat_s < suspect_s < dead_s, got "
                f"{self.heartbeat_s}, {self.suspect_s}, {self.dead_s}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SyncConfig:
        """Defaults overridden by ``ASTERIA_SYNC_HEARTBEAT_S`` etc. (ValueError if malformed)."""
        env = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for f in dataclasses.fields(cls):
            text = env.get(ENV_PREFIX + f.name.upper(), "").strip()
            if text:
                try:
                    values[f.name] = float(text)
                except ValueError:
                    raise ValueError(
                        f"{ENV_PREFIX}{f.name.upper()} must be a number of seconds, got {text!r}"
                    ) from None
        return cls(**values)


def job_token(token: str, job: str, run_nonce: str = "") -> str:
    """The job token: hex HMAC-SHA256 under the tenant's token of the job id and the run nonce
    its layout was registered with (``job + "\\n" + run_nonce``), or of the job id alone for a
    layout without a nonce (a client older than ``JobLayout.run_nonce``). A new run of the job
    draws a new nonce, so a token of an earlier run stops working once the job registers again
    or leaves the registry."""
    message = job if not run_nonce else f"{job}\n{run_nonce}"
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def blocks_digest(blocks: Mapping[str, int]) -> str:
    if not blocks:
        return ""
    text = "\n".join(f"{name}:{n}" for name, n in sorted(blocks.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def synced(block: str, prefix: str) -> bool:
    """Whether ``block`` is one of the job's (``prefix``: its namespace): replicated, or of a
    shard some members share."""
    return block.startswith(prefix)


@dataclass
class _Held:
    """A snapshot waiting for a push: its owner's, or (``wait_for``, on the owner) that of the
    daemon it let claim this version."""

    task: SolveTask
    job: str
    since: float
    #: when to claim it from its owner (again), or, waiting for a claim's winner, to give up
    due: float
    #: the member whose push it waits for, when not the owner's (a claim's winner)
    wait_for: int | None = None
    #: a claim of it is on its way
    claiming: bool = False
    #: since when its owner has answered that it does not own the block (maps not agreed)
    disowned_since: float | None = None
    #: the member (and its incarnation) that had this version when it arrived here: the owner,
    #: alive then (its ranks send it the same versions), or a claim's winner. That member has it
    #: queued or on a worker, so it is solved here only once that member has lost it (see
    #: :meth:`JobSync.lost`), never merely because it went quiet.
    had_by: tuple[int, str] | None = None


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


@dataclass
class _Peer:
    """Another member of a job, as this daemon sees it."""

    member: int
    address: str
    incarnation: str = ""
    last_heard: float | None = None
    state: str = "unknown"
    blocks: dict[str, int] = field(default_factory=dict)
    #: the digest of ``blocks`` (the list held here), the digest it reports now, and the
    #: digest of this daemon's list it holds (its last answer said)
    digest: str = ""
    reported: str = ""
    acked: str = ""
    #: the digest of every member's list as it holds them (its last heartbeat said)
    view: str = ""
    workers_busy: int = 0
    workers: int = 0
    queue_depth: int = 0
    #: block -> newest version pushed to (or received from) it in this incarnation
    has: dict[str, int] = field(default_factory=dict)
    #: blocks with a result to push, and the wake-up of its sender
    queued: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    oldest_queued_at: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    results_sent: int = 0
    results_received: int = 0
    suspected: int = 0
    died: int = 0
    rejoined: int = 0
    #: it answered a heartbeat or called with the job token: a daemon of the job, heartbeated
    #: every heartbeat_s; until then asked at most once a second, backing off (misses)
    proven: bool = False
    misses: int = 0
    channel: grpc.aio.Channel | None = None
    stub: ppb_grpc.PeerStub | None = None


class JobSync:
    """One job's peer group on this daemon (see the module docstring)."""

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
        self.prefix = f"{layout.job}:"
        self.registered_at = time.monotonic()
        addresses: list[str] = []
        self.member_of_node: list[int] = []
        for node in layout.nodes:
            if node.daemon_address not in addresses:
                addresses.append(node.daemon_address)
            self.member_of_node.append(addresses.index(node.daemon_address))
        self.addresses = addresses
        self.me = self.member_of_node[node_rank]
        self.members = list(range(len(addresses)))
        self.peers: dict[int, _Peer] = {
            m: _Peer(m, a) for m, a in enumerate(addresses) if m != self.me
        }
        self.known: dict[str, int] = {}  # replicated blocks the local ranks use
        self.kinds: dict[str, SolveKind] = {}  # ... and what they need of each
        self.digest = ""
        self.stats: dict[str, _BlockStats] = {}
        self.held: dict[str, _Held] = {}
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
        self._agreed_key: tuple[str, tuple[int, ...]] | None = None
        self._agreed_since = 0.0
        self._owners_key: tuple[str, tuple[int, ...]] | None = None
        self._owners: dict[str, int] = {}
        #: the owner map among the members not gone (see buried_owner), and its key
        self._home_key: tuple[str, tuple[int, ...]] | None = None
        self._home: dict[str, int] = {}
        self.newest_step = -1
        self._step_at = 0.0
        #: when the peers' states were last judged, and the seconds this daemon did not run
        #: (SIGSTOP, a stalled host) that were not counted against its peers
        self._judged_at = self.registered_at
        self.own_pauses = 0
        self.own_pause_s = 0.0
        self.step_s: float | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ membership

    @property
    def syncing(self) -> bool:
        return len(self.addresses) > 1

    def peer_state(self, peer: _Peer, now: float) -> str:
        config = self.manager.config
        if peer.last_heard is None:
            return "unknown" if now - self.registered_at < config.dead_s else "dead"
        quiet = now - peer.last_heard
        if quiet < config.suspect_s:
            return "alive"
        return "suspect" if quiet < config.dead_s else "dead"

    def refresh_states(self, now: float) -> None:
        gap = now - self._judged_at
        if gap > self.manager.config.suspect_s:
            # Nothing here ran for a while (this daemon was stopped, or its host stalled): the
            # silence was its own, not its peers'. Judged by the clock alone, every peer would be
            # dead now and this daemon would solve what they already solved for it.
            self.own_pauses += 1
            self.own_pause_s += gap
            self.registered_at += gap
            for peer in self.peers.values():
                if peer.last_heard is not None:
                    peer.last_heard = min(now, peer.last_heard + gap)
            logger.info(
                "job %r: this daemon did not run for %.1f s; its peers are not blamed for it",
                self.job,
                gap,
                extra={"tenant": self.tenant, "job": self.job},
            )
        self._judged_at = now
        for peer in self.peers.values():
            state = self.peer_state(peer, now)
            if state != peer.state:
                if state == "suspect":
                    peer.suspected += 1
                elif state == "dead":
                    peer.died += 1
                    peer.has.clear()  # it may come back with nothing
                elif state == "alive" and peer.state == "dead":
                    peer.rejoined += 1
                logger.info(
                    "job %r: peer %d (%s) is %s",
                    self.job,
                    peer.member,
                    peer.address,
                    state,
                    extra={"tenant": self.tenant, "job": self.job},
                )
                peer.state = state

    def lost(self, held: _Held, now: float) -> bool:
        """Whether the member that had ``held``'s version may no longer deliver it: it came back
        as a new incarnation (a restart holds nothing), or it has been dead for
        ``takeover_grace_s``. A member merely quiet (suspect, or dead for a shorter while: a
        SIGSTOPped daemon whose worker may be solving that very version) is waited for, so the
        version is not solved twice in the cluster; the ranks meanwhile keep their budget with
        the barrier and, past it, a local solve."""
        if held.had_by is None or held.had_by[0] == self.me:
            return True
        member, incarnation = held.had_by
        peer = self.peers[member]
        if peer.incarnation != incarnation:
            return True
        return self.gone(peer, now)

    def gone(self, peer: _Peer, now: float) -> bool:
        """Whether ``peer`` has been dead for ``takeover_grace_s``: only then are versions it
        may hold (queued or on a worker) solved elsewhere."""
        if peer.state != "dead":
            return False
        config = self.manager.config
        quiet_since = peer.last_heard if peer.last_heard is not None else self.registered_at
        return now - quiet_since >= config.dead_s + config.takeover_grace_s

    def buried_owner(self, block: str, now: float) -> int | None:
        """The member that owns ``block`` while it is quiet (suspect, or dead but not yet
        :meth:`gone`), or None. Its ranks send it the versions they send here, so it may hold
        (or, stopped, be solving) any version that arrives here meanwhile: such a version is
        held for its push, like one it had when it went quiet (``_Held.had_by``), and solved
        here only once it is gone. Taken over at once (the owner map already moves its blocks
        when it is dead), the quiet owner solved the same version again when it came back.
        Its owner is the block's owner among the members not gone; a member never heard from
        holds nothing and is not waited for."""
        quiet = [
            m
            for m, p in self.peers.items()
            if p.state in ("suspect", "dead") and p.last_heard is not None
        ]
        if not quiet:
            return None
        staying = tuple(
            m for m in self.members if m == self.me or not self.gone(self.peers[m], now)
        )
        key = (self.view_digest(), staying)
        if key != self._home_key:  # (one map per change, not one per snapshot)
            blocks, users = self.all_blocks()
            self._home = owner_map(blocks, self.members, staying, users=users)
            self._home_key = key
        owner = self._home.get(block)
        return owner if owner in quiet else None

    def stand_in(self, held: _Held, now: float) -> int | None:
        """The member that solves ``held``'s version, held for an owner that came back as a
        new incarnation (a restart holds nothing): the block's owner while that owner was
        dead. One member, so the members that held the version do not all solve it."""
        if held.had_by is None or held.had_by[0] == self.me or held.wait_for is not None:
            return None
        member, incarnation = held.had_by
        if self.peers[member].incarnation == incarnation:
            return None
        staying = [
            m
            for m in self.members
            if m != member and (m == self.me or not self.gone(self.peers[m], now))
        ]
        blocks, users = self.all_blocks()
        return owner_map(blocks, self.members, staying, users=users).get(held.task.block)

    def waits_for_quiet(self, held: _Held, now: float) -> bool:
        """Whether ``held`` waits for the member that had its version, quiet now and not yet
        lost (see :meth:`lost`): solving it here would solve it twice in the cluster."""
        if held.had_by is None or held.had_by[0] == self.me:
            return False
        return self.peers[held.had_by[0]].state != "alive" and not self.lost(held, now)

    def living(self) -> list[int]:
        """Members not dead (alive, suspect or not yet heard), this one included."""
        return [self.me] + [m for m, p in self.peers.items() if p.state != "dead"]

    def heard(self, peer: _Peer, state: ppb.PeerState) -> None:
        """A heartbeat of ``peer`` arrived (its call or its answer)."""
        now = time.monotonic()
        if peer.incarnation and state.incarnation_id != peer.incarnation:
            peer.rejoined += 1
            peer.has.clear()  # a new incarnation holds nothing yet: push everything again
            logger.info(
                "job %r: peer %d came back as a new incarnation",
                self.job,
                peer.member,
                extra={"tenant": self.tenant, "job": self.job},
            )
        peer.incarnation = state.incarnation_id
        peer.last_heard = now
        peer.proven, peer.misses = True, 0
        peer.workers_busy = state.workers_busy
        peer.workers = state.workers
        peer.queue_depth = state.queue_depth
        if state.blocks_included:
            peer.blocks = {b.block: b.n for b in state.blocks if synced(b.block, self.prefix)}
            peer.digest = state.blocks_digest
        peer.reported = state.blocks_digest
        peer.view = state.view_digest
        self.refresh_states(now)
        if peer.state == "alive":
            self.queue_missing(peer)

    def my_state(self, known_digest: str) -> ppb.PeerState:
        stats = self.manager.engine.stats()
        include = known_digest != self.digest
        return ppb.PeerState(
            node=self.me,
            incarnation_id=self.manager.engine.incarnation_id,
            workers_busy=stats.workers_busy,
            workers=stats.num_workers,
            queue_depth=stats.queue_depth,
            blocks_digest=self.digest,
            blocks=[ppb.BlockUse(block=b, n=n) for b, n in sorted(self.known.items())]
            if include
            else [],
            blocks_included=include,
            alive_members=self.living(),
            view_digest=self.view_digest(),
        )

    # ------------------------------------------------------------------ owners

    def view_digest(self) -> str:
        """A digest of every member's block list as held here (this member's own included)."""
        digests = [(self.me, self.digest)] + [(m, p.digest) for m, p in self.peers.items()]
        text = "\n".join(f"{m}:{d}" for m, d in sorted(digests))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def agreed(self, now: float) -> bool:
        """Every member not dead holds the same block lists of all members as this one (and
        this one holds its current list), for ``settle_s``."""
        living = tuple(self.living())
        view = self.view_digest()
        same = bool(self.digest) and all(
            self.peers[m].reported == self.peers[m].digest
            and self.peers[m].view == view
            and self.peers[m].state != "unknown"
            for m in living
            if m != self.me
        )
        if not same:
            self._agreed_key = None
            return False
        key = (view, living)
        if self._agreed_key is None or self._agreed_key[0] != view:
            self._agreed_key = key
            self._agreed_since = now
        self._agreed_key = key
        return now - self._agreed_since >= self.manager.config.settle_s

    def all_blocks(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """The job's blocks used by any member (name -> n) and the members that use each."""
        blocks = dict(self.known)
        users: dict[str, list[int]] = {b: [self.me] for b in self.known}
        for m, peer in sorted(self.peers.items()):
            for b, n in peer.blocks.items():
                blocks.setdefault(b, n)
                users.setdefault(b, []).append(m)
        return blocks, users

    def owners(self) -> dict[str, int]:
        key = (self.view_digest(), tuple(self.living()))
        if key != self._owners_key:
            blocks, users = self.all_blocks()
            self._owners = owner_map(blocks, self.members, key[1], users=users)
            self._owners_key = key
        return self._owners

    def owner_of(self, block: str, now: float) -> int | None:
        """The block's owner, or None while the members do not agree on the blocks."""
        if not self.agreed(now):
            return None
        return self.owners().get(block)

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
        self.note_step(task.version, now)
        if task.block not in self.known:
            self.known[task.block] = task.n
            self.digest = blocks_digest(self.known)
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
        owner = self.owner_of(task.block, now)
        buried = self.buried_owner(task.block, now)
        wait_for = None
        if owner == self.me and buried is None:
            handed = self.handed.get(task.block)
            if handed is None or handed[1] < task.version or self.peers[handed[0]].state == "dead":
                return self._solve_here(task, job, fallback=False)
            wait_for = handed[0]  # this version was claimed by another member: its push
        elif owner is not None and buried is None and self.peers[owner].state == "dead":
            self.fallback_reasons["owner_down"] = self.fallback_reasons.get("owner_down", 0) + 1
            return self._solve_here(task, job, fallback=True)
        config = self.manager.config
        if wait_for is not None:
            due = now + config.push_timeout_s
        elif owner not in (None, self.me) and (
            self.peers[owner].state == "suspect" or owner in self.behind
        ):
            # Claimed from it at once: a stopped owner does not answer, and one whose ranks
            # are behind (its last grant: not arrived there yet) would only make it wait.
            due = now
        else:
            budget = max(0.0, task.deadline - task.version) if math.isfinite(task.deadline) else 0
            due = now + max(config.patience_s, budget * (self.step_s or 0.0))
        if held is not None:
            stats.superseded += 1
        had_by = wait_for if wait_for is not None else buried if buried is not None else owner
        self.manager.engine.note_elsewhere(task, job=job)
        self.held[task.block] = _Held(
            task,
            job,
            now,
            due,
            wait_for=wait_for,
            had_by=(had_by, self.peers[had_by].incarnation)
            if had_by is not None and (had_by == buried or self.peers[had_by].state == "alive")
            else None,
        )
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
        """Look at the waiting snapshots again: solve here those whose owner is this member now
        or is dead (or whose claim's winner is down or never pushed); claim from its owner each
        one whose push would come too late (see :meth:`claim_answered`)."""
        self.refresh_states(now)
        for block, held in list(self.held.items()):
            if self.stats[block].version >= held.task.version:
                del self.held[block]
                continue
            stand_in = self.stand_in(held, now)
            if stand_in == self.me:  # solved here, pushed to every peer (its owner included)
                self.taken[block] = held.task.version
                self._solve_held(held, fallback=False)
                continue
            if stand_in is not None:  # that member solves it: its push
                held.wait_for, held.had_by = stand_in, (stand_in, self.peers[stand_in].incarnation)
                held.due = now + self.manager.config.push_timeout_s
                continue
            owner = self.owner_of(block, now)
            fallback: bool | None = None
            why = reason = ""
            if held.wait_for is not None:  # this member, as owner, let another one claim it
                state = self.peers[held.wait_for].state
                if state in ("suspect", "dead"):
                    if not self.lost(held, now):
                        continue  # the winner has it queued or on a worker: not solved twice
                    fallback, reason = True, "owner_down"
                    why = f"member {held.wait_for}, whose push it waits for, is {state}"
                elif now >= held.due:
                    winner = self.peers[held.wait_for]
                    if winner.queue_depth > 0 or winner.workers_busy > 0:
                        held.due = now + self.manager.config.patience_s  # still at work
                    else:
                        fallback, reason = True, "claim_lapsed"
                        why = f"member {held.wait_for} won its claim, is idle and did not push it"
            elif owner == self.me:
                if self.waits_for_quiet(held, now):
                    continue  # its old owner, quiet now, has this version: not solved twice
                fallback = False
            elif owner is None:
                if self.waits_for_quiet(held, now):
                    # The members agree again once a quiet one is declared dead or is back;
                    # patience_s counts from then, or every member that held this version for
                    # a returning owner would solve it at once as a fallback.
                    held.since = now
                    continue
                fallback = True if now >= held.since + self.manager.config.patience_s else None
                why = "the daemons did not agree on the job's blocks in time"
                reason = "not_agreed"
            elif self.peers[owner].state == "dead":
                if not self.lost(held, now):
                    continue
                fallback, why = True, f"its owner (member {owner}) is dead"
                reason = "owner_down"
            elif not held.claiming and (now >= held.due or self.peers[owner].state == "suspect"):
                self.manager.start_claim(self, held, owner)
            if fallback is None:
                continue
            self._solve_held(held, fallback=fallback, reason=reason, why=why)

    def _solve_held(self, held: _Held, *, fallback: bool, reason: str = "", why: str = "") -> None:
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

    def claim_answered(self, held: _Held, owner: int, reply: ppb.ClaimResponse) -> None:
        """The owner's answer to a claim of ``held`` (see the Claim RPC)."""
        block, version = held.task.block, held.task.version
        held.claiming = False
        current = self.held.get(block) is held
        if reply.granted:
            self.claims_granted += 1
            if reply.reason == "not_arrived":
                self.behind.add(owner)
            else:
                self.behind.discard(owner)
            if not current:  # a push or a newer snapshot came meanwhile: the owner, which
                return  # waits for this version, solves it itself after push_timeout_s
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
            return
        if not current:
            return
        now = time.monotonic()
        config = self.manager.config
        if reply.reason == "not_owner":  # the owner maps differ for a moment: ask again soon
            if held.disowned_since is None:
                held.disowned_since = now
            if now - held.disowned_since < config.patience_s:
                held.due = now + config.heartbeat_s
                return
            self._solve_held(
                held,
                fallback=True,
                reason="not_agreed",
                why=f"its owner (member {owner}) does not see itself as its owner",
            )
            return
        # Solved or running there, or won by another member: its push is on its way. Asked
        # again after patience_s should it not come (a push lost on the way, a winner gone).
        self.behind.discard(owner)
        held.disowned_since = None
        held.due = now + config.patience_s

    def claim_failed(self, held: _Held, owner: int, exc: BaseException) -> None:
        """A claim got no answer: ask again soon, or solve here when its owner is suspect (a
        stopped owner does not answer) or cannot take claims."""
        held.claiming = False
        if self.held.get(held.task.block) is not held:
            return
        state = self.peers[owner].state
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        reason = code.name if code is not None else repr(exc)
        hopeless = code in (
            grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
        )
        now = time.monotonic()
        if not hopeless and (state == "alive" or not self.lost(held, now)):
            # Asked again soon. A quiet owner that had this version is waited for (it may be
            # stopped with the version on a worker): solving it here would solve it twice.
            held.due = now + self.manager.config.heartbeat_s
            return
        self._solve_held(
            held,
            fallback=True,
            reason="owner_down" if not hopeless else "claim_failed",
            why=f"its owner (member {owner}, {state}) did not answer a claim: {reason}",
        )

    def claim(self, peer: _Peer, block: str, version: int) -> ppb.ClaimResponse:
        """``peer`` asks to solve ``version`` of ``block`` itself (this member owns it)."""
        now = time.monotonic()
        me = self.node_of(self.me)
        if not synced(block, self.prefix) or block not in self.known:
            return ppb.ClaimResponse(granted=False, reason="not_owner", by=-1)
        owner = self.owner_of(block, now)
        if owner != self.me:
            by = -1 if owner is None else self.node_of(owner)
            return ppb.ClaimResponse(granted=False, reason="not_owner", by=by)
        stats = self.stats[block]
        if stats.version >= version:  # solved: its push is queued (again, if it was lost)
            if block in peer.blocks and peer.has.get(block, -1) < stats.version:
                self._queue(peer, block)
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
            and self.waits_for_quiet(held, now)
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
            self.held[block] = _Held(
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

    def local_result(self, block: str) -> None:
        """The engine got a newer result of ``block`` from its own workers."""
        result = self.manager.engine.peek_result(block, self.tenant)
        if result is None:
            return
        stats = self.stats.get(block)
        if stats is None or result.version <= stats.version:
            return
        stats.version, stats.origin = result.version, "local"
        stats.solves += 1
        stats.solved.append(result.version)
        self.held.pop(block, None)
        if not self.syncing:
            return
        owner = self.owners().get(block) if self._owners_key is not None else None
        taken = self.taken.get(block, -1) >= result.version
        if block in self.taken and self.taken[block] <= result.version:
            del self.taken[block]
        if block in self.handed and self.handed[block][1] <= result.version:
            del self.handed[block]
        # Its owner's result, one whose claim this member won, or one solved here because the
        # owner could not (not decided, suspect or dead): the peers that wait for it get it
        # from here (the owner too, once it answers: its own queued solve of that version is
        # then dropped).
        if taken or owner is None or owner == self.me or self.peers[owner].state != "alive":
            for peer in self.peers.values():
                if block in peer.blocks and peer.state != "dead":
                    self._queue(peer, block)

    def _queue(self, peer: _Peer, block: str) -> None:
        if not peer.queued:
            peer.oldest_queued_at = time.monotonic()
        peer.queued.add(block)
        peer.wake.set()

    def queue_missing(self, peer: _Peer) -> None:
        """Queue every result solved here of a block that ``peer`` uses and lacks: of a block
        this member owns, or one it took over while ``peer`` was gone (a returning owner then
        drops its own queued snapshots of those versions instead of solving them again)."""
        owners = self.owners() if self._owners_key is not None else {}
        for block, node in owners.items():
            stats = self.stats.get(block)
            if (
                (node == self.me or node == peer.member)
                and stats is not None
                and stats.version >= 0
                and stats.origin == "local"  # one a claim's winner solved, it pushed itself
                and block in peer.blocks
                and peer.has.get(block, -1) < stats.version
                and block not in peer.queued
            ):
                self._queue(peer, block)

    def received(self, peer: _Peer | None, result: SolveResult, num_bytes: int) -> bool:
        """A pushed result arrived: keep it if newer (True)."""
        if peer is not None:
            peer.bytes_received += num_bytes
            peer.results_received += 1
            peer.has[result.block] = max(peer.has.get(result.block, -1), result.version)
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

    def node_of(self, member: int) -> int:
        return self.member_of_node.index(member)

    def use(self, block: str) -> BlockUse | None:
        """How the ranks here use ``block`` (None: not at all): what a push of it must match."""
        n = self.known.get(block)
        if n is None:
            return None
        _, submitted = self.manager.engine.block_versions(block, self.tenant)
        stats = self.stats.get(block)
        newest = max(submitted, -1 if stats is None else stats.version)
        return BlockUse(n, self.kinds.get(block), newest)

    def next_push(self, peer: _Peer) -> list[SolveResult]:
        """The queued results for ``peer``, the most urgent first (newest of each block)."""
        blocks = sorted(peer.queued, key=lambda b: (self.deadlines.get(b, math.inf), b))
        peer.queued.clear()
        peer.oldest_queued_at = None
        out = []
        for block in blocks:
            result = self.manager.engine.peek_result(block, self.tenant)
            if result is None or result.version <= peer.has.get(block, -1):
                continue
            if result.shm is not None:
                result = private_result(result)
                if result is None:
                    continue  # overwritten by a newer result: queued again when it lands
            out.append(result)
        return out

    # ------------------------------------------------------------------ status

    def status(self, now: float) -> ppb.PeerGroup:
        self.refresh_states(now)
        owners = self.owners() if self.agreed(now) else {}
        cost_of: dict[int, float] = {}
        count_of: dict[int, int] = {}
        spn3 = self.manager.engine.stats().seconds_per_n3
        for block, member in owners.items():
            count_of[member] = count_of.get(member, 0) + 1
            n = self.known.get(block) or max(p.blocks.get(block, 0) for p in self.peers.values())
            cost_of[member] = cost_of.get(member, 0.0) + spn3 * block_cost(n)
        peers = [
            ppb.PeerInfo(
                node=self.node_of(self.me),
                address=self.addresses[self.me],
                incarnation_id=self.manager.engine.incarnation_id,
                state="self",
                last_heard_s=0.0,
                owned_blocks=count_of.get(self.me, 0),
                owned_cost_s=cost_of.get(self.me, 0.0),
            )
        ]
        for member, peer in sorted(self.peers.items()):
            lag_versions = 0
            for block in peer.queued:
                stats = self.stats.get(block)
                if stats is not None:
                    lag_versions = max(lag_versions, stats.version - peer.has.get(block, -1))
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
                    if peer.oldest_queued_at is None
                    else now - peer.oldest_queued_at,
                    bytes_sent=peer.bytes_sent,
                    bytes_received=peer.bytes_received,
                    results_sent=peer.results_sent,
                    results_received=peer.results_received,
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


class SyncManager:
    """Every peer group of this daemon; the gate the servicer submits through."""

    def __init__(
        self,
        engine: PreconditionerEngine,
        tokens: Mapping[str, str],
        *,
        chunk_bytes: int,
        max_message_bytes: int,
        max_matrix_n: int,
        config: SyncConfig | None = None,
        tls_root: bytes | None = None,
        peer_credentials: grpc.ChannelCredentials | None = None,
        peer_server_name: str | None = None,
        uploads: UploadBudget | None = None,
        push_timeouts: PushTimeouts | None = None,
        policy: PeerPolicy | None = None,
        max_push_streams: int = MAX_PUSH_STREAMS,
    ) -> None:
        self.engine = engine
        self.policy = policy or PeerPolicy()
        self.config = config or SyncConfig.from_env()
        self._tokens = dict(tokens)
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.max_matrix_n = max_matrix_n
        self._tls_root = tls_root
        #: mutual TLS to peer listeners (the cluster CA and this daemon's certificate), checked
        #: against ``peer_server_name`` rather than the address dialed; None: ``tls_root``
        self._peer_credentials = peer_credentials
        self._peer_server_name = peer_server_name
        self.jobs: dict[tuple[str, str], JobSync] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._tick_wake: asyncio.Event | None = None
        self._claims: set[asyncio.Task[None]] = set()
        self._closed = False
        #: How many sessions of (tenant, job) are open here; None: never ends a group (set by
        #: the daemon to its session table's count).
        self.job_sessions: Callable[[str, str], int] | None = None
        self._idle_since: dict[tuple[str, str], float] = {}
        self.groups_removed = 0
        #: the daemon's upload budget, which pushes share with clients' uploads (None: none)
        self.uploads: UploadBudget | None = uploads
        self.push_timeouts = push_timeouts or PushTimeouts()
        #: PushResults streams one tenant may have open here at once, and those open now
        self.max_push_streams = max_push_streams
        self._pushes: dict[str, int] = {}
        #: failed authentications (the daemon sets the one its OpenSession uses)
        self.auth_throttle = AuthThrottle()
        #: told the claimed tenant of every failed authentication (the daemon's counter)
        self.on_auth_failed: Callable[[str], None] | None = None
        self._refusals = RefusalLog(logger)
        #: every peer group's heartbeats to unproven peers, together (see sync.policy)
        self.unproven_heartbeats = RateLimit(
            self.config.unproven_heartbeats_per_s,
            burst=max(1, int(self.config.unproven_heartbeats_per_s)),
        )
        self.heartbeats_delayed = 0
        engine.add_result_listener(self._on_result)

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Start the ticker on the running loop (the daemon's)."""
        self._loop = asyncio.get_running_loop()
        self._tick_wake = asyncio.Event()
        self._ticker = self._loop.create_task(self._tick_loop())

    def set_tokens(self, tokens: Mapping[str, str]) -> None:
        """New tenant tokens (SIGHUP): job tokens and peers' credentials are checked with them
        from now on."""
        self._tokens = dict(tokens)

    async def stop(self) -> None:
        self._closed = True
        self.engine.remove_result_listener(self._on_result)
        tasks = [t for js in self.jobs.values() for t in js._tasks] + list(self._claims)
        if self._ticker is not None:
            tasks.append(self._ticker)
        await _cancel(tasks)
        for js in self.jobs.values():
            await _close_channels(js)

    def wake_ticker(self) -> None:
        if self._tick_wake is not None:
            self._tick_wake.set()

    async def _tick_loop(self) -> None:
        assert self._tick_wake is not None
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tick_wake.wait(), self.config.heartbeat_s / 2)
            self._tick_wake.clear()
            now = time.monotonic()
            for js in list(self.jobs.values()):
                try:
                    js.tick(now)
                except Exception:
                    logger.exception("job %r: the sync tick failed", js.job)
            await self._end_idle_groups(now)

    async def _end_idle_groups(self, now: float) -> None:
        """End the peer group of every job with no session here for ``group_idle_s``: its
        heartbeat and push tasks stop and its state goes (the peers see it gone and fail its
        blocks over, as for a dead daemon, if their ranks still train)."""
        if self.job_sessions is None:
            return
        for key, js in list(self.jobs.items()):
            if self.job_sessions(*key) > 0:
                self._idle_since.pop(key, None)
                continue
            since = self._idle_since.setdefault(key, now)
            if now - since < self.config.group_idle_s or self.jobs.get(key) is not js:
                continue
            del self.jobs[key]
            self._idle_since.pop(key, None)
            self.groups_removed += 1
            logger.info(
                "job %r: peer group ended, no session of the job here for %g s",
                js.job,
                self.config.group_idle_s,
                extra={"tenant": key[0], "job": js.job},
            )
            await _cancel(js._tasks)
            await _close_channels(js)

    def forget_job(self, tenant: str, job: str) -> None:
        """End the job's peer group now (its blocks were forgotten here); on the event loop."""
        js = self.jobs.pop((tenant, job), None)
        self._idle_since.pop((tenant, job), None)
        if js is None or self._loop is None:
            return
        self.groups_removed += 1
        task = self._loop.create_task(self._end_group(js))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def _end_group(self, js: JobSync) -> None:
        await _cancel(js._tasks)
        await _close_channels(js)

    # ------------------------------------------------------------------ jobs

    def check_job(self, tenant: str, layout: jpb.JobLayout, node_rank: int) -> None:
        """Refuse a layout whose peer group the operator's rules do not allow (before the job
        registry keeps it): too many daemons, for the job or the tenant, or an address outside
        ``peer_allow`` (see :mod:`asteria_server.sync.policy`)."""
        addresses = list(dict.fromkeys(n.daemon_address for n in layout.nodes))
        if len(addresses) < 2:
            return
        others = sum(
            len(js.peers) for (t, job), js in self.jobs.items() if t == tenant and job != layout.job
        )
        me = layout.nodes[node_rank].daemon_address
        self.policy.check(layout.job, me, addresses, others)

    def job_registered(self, tenant: str, layout: jpb.JobLayout, node_rank: int) -> None:
        """A node leader registered ``layout`` here (RegisterJob; on the event loop)."""
        if self._closed:
            return
        key = (tenant, layout.job)
        old = self.jobs.get(key)
        addresses = [n.daemon_address for n in layout.nodes]
        if old is not None:
            same = (
                [old.addresses[old.member_of_node[i]] for i in range(len(old.member_of_node))]
                == addresses
                and old.node_of(old.me) == node_rank
                and old.run_nonce == layout.run_nonce  # a new run: a new token, a new group
            )
            if same:
                return
            for task in old._tasks:
                task.cancel()
        js = JobSync(self, tenant, layout, node_rank)
        if old is not None:  # what its ranks use and what it holds stay known
            js.known, js.digest, js.stats = old.known, old.digest, old.stats
            js.kinds = old.kinds
        self.jobs[key] = js
        if js.syncing:
            unreachable = [a for a in js.addresses if a.startswith("unix:")]
            if unreachable:
                logger.warning(
                    "job %r spans %d daemons but some listen on Unix sockets (%s), which other "
                    "nodes cannot reach: start one daemon per node on TCP (--listen HOST:PORT "
                    "with tenant tokens) for the daemons to sync",
                    layout.job,
                    len(js.addresses),
                    ", ".join(unreachable),
                )
            logger.info(
                "job %r: peer group of %d daemons, this one is member %d",
                layout.job,
                len(js.addresses),
                js.me,
                extra={"tenant": tenant, "job": layout.job},
            )
            loop = self._loop or asyncio.get_running_loop()
            for peer in js.peers.values():
                js._tasks.append(loop.create_task(self._heartbeats(js, peer)))
                js._tasks.append(loop.create_task(self._sender(js, peer)))

    def _job_of(self, tenant: str, block: str) -> JobSync | None:
        for (t, _), js in self.jobs.items():
            if t == tenant and synced(block, js.prefix):
                return js
        return None

    # ------------------------------------------------------------------ the gate

    def submit(self, task: SolveTask, job: str = "") -> SubmitOutcome:
        """The servicer's submit: the engine's, unless another daemon owns the block."""
        js = self._job_of(task.tenant, task.block) if self.jobs else None
        if js is None:
            return self.engine.submit(task, job=job)
        return js.submit(task, job)

    def _on_result(self, tenant: str, block: str) -> None:
        """The engine's news (dispatcher thread, or an install on the loop)."""
        loop = self._loop
        if loop is None or self._closed or not self.jobs:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._result_ready, tenant, block)

    def _result_ready(self, tenant: str, block: str) -> None:
        js = self._job_of(tenant, block)
        if js is not None:
            js.local_result(block)

    # ------------------------------------------------------------------ calls out

    def credentials(self, js: JobSync) -> ppb.PeerCredentials:
        return ppb.PeerCredentials(
            tenant=js.tenant,
            job=js.job,
            job_token=job_token(self._tokens.get(js.tenant, ""), js.job, js.run_nonce),
            node=js.node_of(js.me),
            incarnation_id=self.engine.incarnation_id,
        )

    def _stub(self, peer: _Peer) -> ppb_grpc.PeerStub:
        if peer.stub is None:
            options: list[tuple[str, Any]] = [
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.keepalive_time_ms", 5000),
                ("grpc.keepalive_timeout_ms", int(1000 * self.config.call_timeout_s)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", int(1000 * self.config.heartbeat_s * 4)),
            ]
            target = peer.address.removeprefix("dns:")
            if self._peer_credentials is not None:
                if self._peer_server_name:
                    options.append(("grpc.ssl_target_name_override", self._peer_server_name))
                peer.channel = grpc.aio.secure_channel(
                    target, self._peer_credentials, options=options
                )
            elif self._tls_root is not None:
                creds = grpc.ssl_channel_credentials(root_certificates=self._tls_root)
                peer.channel = grpc.aio.secure_channel(target, creds, options=options)
            else:
                peer.channel = grpc.aio.insecure_channel(target, options=options)
            peer.stub = ppb_grpc.PeerStub(peer.channel)
        return peer.stub

    async def _heartbeats(self, js: JobSync, peer: _Peer) -> None:
        if peer.address.startswith("unix:"):
            return  # unreachable from another node: it stays unknown, then dead
        while not self._closed:
            if not peer.proven:  # the daemon-wide cap on heartbeats to strangers
                wait = self.unproven_heartbeats.reserve(time.monotonic())
                if wait > 0:
                    self.heartbeats_delayed += 1
                    await asyncio.sleep(wait)
            started = time.monotonic()
            try:
                reply = await self._stub(peer).Heartbeat(
                    ppb.HeartbeatRequest(
                        credentials=self.credentials(js),
                        state=js.my_state(peer.acked),
                        known_digest=peer.digest,
                    ),
                    timeout=self.config.call_timeout_s,
                )
                peer.acked = reply.known_digest
                js.heard(peer, reply.state)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    # Not (or no longer) a daemon of this run of the job: asked at most once
                    # a second again, and pushed nothing, until it proves itself (so a peer
                    # that restarted and has not registered the job yet does not use up its
                    # authentication throttle on our calls).
                    peer.proven = False
                    self._refusals.refused(
                        "heartbeat of ours by a peer",
                        f"job {js.job!r}, {peer.address}: {exc.details()}",
                    )
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("job %r: heartbeat to %s failed", js.job, peer.address)
            js.refresh_states(time.monotonic())
            # A dead peer (or a job that ended there) is asked less often, never given up: it
            # may come back (a restart, SIGCONT) and must be heard within a few seconds. One
            # never heard (an address a layout names, perhaps no daemon at all) is asked at
            # most once a second, backing off: it proves itself by calling here meanwhile.
            if not peer.proven:
                peer.misses += 1
                every = min(
                    UNPROVEN_HEARTBEAT_MAX_S,
                    max(self.config.heartbeat_s, DEAD_PEER_HEARTBEAT_S) * 2 ** (peer.misses - 1),
                )
            elif peer.state != "dead":
                every = self.config.heartbeat_s
            else:
                every = DEAD_PEER_HEARTBEAT_S
            left = every - (time.monotonic() - started)
            await asyncio.sleep(max(0.01, left))

    async def _sender(self, js: JobSync, peer: _Peer) -> None:
        while not self._closed:
            await peer.wake.wait()
            peer.wake.clear()
            if peer.state != "alive" or not peer.proven or not peer.queued:
                if peer.queued:  # try again once it is heard (and took our token)
                    await asyncio.sleep(self.config.heartbeat_s)
                    peer.wake.set()
                continue
            results = js.next_push(peer)
            if not results:
                continue
            sent: list[tuple[str, int, int]] = []
            try:
                await self._stub(peer).PushResults(
                    self._frames(js, results, sent), timeout=self.config.push_timeout_s
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # it missed them: queued again, pushed once it answers
                logger.info("job %r: push to %s failed: %s", js.job, peer.address, exc)
                for result in results:
                    js._queue(peer, result.block)
                peer.wake.clear()
                await asyncio.sleep(self.config.heartbeat_s)
                peer.wake.set()
                continue
            for block, version, size in sent:
                peer.has[block] = max(peer.has.get(block, -1), version)
                peer.bytes_sent += size
                peer.results_sent += 1

    def start_claim(self, js: JobSync, held: _Held, owner: int) -> None:
        """Ask ``owner`` for ``held``'s version (a task on the loop; the answer goes to
        :meth:`JobSync.claim_answered`)."""
        if self._loop is None or self._closed:
            return
        held.claiming = True
        js.claims_sent += 1
        task = self._loop.create_task(self._claim(js, js.peers[owner], held))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def _claim(self, js: JobSync, peer: _Peer, held: _Held) -> None:
        config = self.config
        # A suspect owner gets a short deadline: a stopped one must not hold up its ranks.
        timeout = config.call_timeout_s
        if peer.state != "alive":
            timeout = min(timeout, config.suspect_s / 2)
        try:
            reply = await self._stub(peer).Claim(
                ppb.ClaimRequest(
                    credentials=self.credentials(js),
                    block=held.task.block,
                    version=held.task.version,
                ),
                timeout=timeout,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            js.claim_failed(held, peer.member, exc)
        else:
            js.claim_answered(held, peer.member, reply)
        self.wake_ticker()

    async def _frames(
        self, js: JobSync, results: list[SolveResult], sent: list[tuple[str, int, int]]
    ) -> AsyncIterator[ppb.PushResultsRequest]:
        """A push's messages: the hello, then each result's frames; ``sent`` gets (block,
        version, bytes) of each result once all its frames went."""
        yield ppb.PushResultsRequest(hello=ppb.PushHello(credentials=self.credentials(js)))
        for result in results:
            size = 0
            for message in framing.result_messages(result, chunk_bytes=self.chunk_bytes):
                data = message.SerializeToString()
                size += len(data)
                yield ppb.PushResultsRequest(frame=data)
            sent.append((result.block, result.version, size))

    # ------------------------------------------------------------------ calls in

    def authenticate(self, creds: ppb.PeerCredentials, caller: str = "") -> tuple[JobSync, _Peer]:
        """The caller's job and peer record; AuthenticationError otherwise.

        The token is checked against the job as registered here (its run nonce), so the job is
        looked up first. ``caller`` is the peer host the call came from: its failures count in
        the daemon's authentication throttle (per host and claimed tenant, shared with
        OpenSession), which refuses it with DaemonBusyError once used up; each class of refusal
        is logged, at most one line per class every few seconds. An unknown tenant, a job not
        registered here (not yet, or no longer) and a wrong token (one of an earlier run of the
        job included) get one message: a caller learns neither which tenants nor which jobs
        exist. (A daemon of the job that calls before its peer's ranks registered it is asked
        again, at most once a second while unproven: within the throttle's refill.)"""
        key = f"{caller or 'unknown peer'} for tenant {creds.tenant[:64]!r}"
        self.auth_throttle.check(key)
        token = self._tokens.get(creds.tenant)
        js = self.jobs.get((creds.tenant, creds.job))
        expected = job_token(token or "", creds.job, js.run_nonce if js is not None else "")
        wrong = not hmac.compare_digest(expected.encode(), creds.job_token.encode())
        if (token is None and self._tokens) or js is None or wrong:
            self.auth_throttle.failed(key)
            if self.on_auth_failed is not None:
                self.on_auth_failed(creds.tenant)
            self._refusals.refused("peer call with a wrong job token", f"from {key}")
            raise AuthenticationError(
                f"unknown tenant, job not registered here or wrong job token for job "
                f"{creds.job[:64]!r}; the daemons of a job must share the tenant's token, and "
                "a token is good for the run of the job registered here only"
            )
        if not 0 <= creds.node < len(js.member_of_node):
            raise InvalidInputError(f"node {creds.node} is not one of the job's nodes")
        member = js.member_of_node[creds.node]
        peer = js.peers.get(member)
        if peer is None:
            raise InvalidInputError(f"node {creds.node} is served by this daemon itself")
        return js, peer

    def claim(self, request: ppb.ClaimRequest, caller: str = "") -> ppb.ClaimResponse:
        js, peer = self.authenticate(request.credentials, caller)
        return js.claim(peer, request.block, request.version)

    def heartbeat(self, request: ppb.HeartbeatRequest, caller: str = "") -> ppb.HeartbeatResponse:
        js, peer = self.authenticate(request.credentials, caller)
        js.heard(peer, request.state)
        return ppb.HeartbeatResponse(
            state=js.my_state(request.known_digest), known_digest=peer.digest
        )

    async def receive(
        self, requests: AsyncIterator[ppb.PushResultsRequest], caller: str = ""
    ) -> ppb.PushResultsResponse:
        """A peer's push (see :mod:`asteria_server.sync.push`): authenticated, then each result
        checked by its header before its arrays are allocated, held in the upload budget while
        it arrives, and validated as a local result once complete."""
        stream = PushStream(requests, self.push_timeouts)
        first = await stream.next_request()
        if first is None or first.WhichOneof("part") != "hello":
            raise InvalidInputError("PushResults: the first message must be a hello")
        js, peer = self.authenticate(first.hello.credentials, caller)
        pushing = self._pushes.get(js.tenant, 0)
        if pushing >= self.max_push_streams:
            raise DaemonBusyError(
                f"PushResults: tenant {js.tenant!r} has {pushing} pushes open on this daemon "
                f"(tenant_max_push_streams = {self.max_push_streams}); push again once they end"
            )
        self._pushes[js.tenant] = pushing + 1
        try:
            return await self._receive(stream, js, peer)
        finally:
            left = self._pushes[js.tenant] - 1
            if left:
                self._pushes[js.tenant] = left
            else:
                del self._pushes[js.tenant]

    async def _receive(
        self, stream: PushStream, js: JobSync, peer: _Peer
    ) -> ppb.PushResultsResponse:
        receiver = framing.ResultReceiver(
            max_chunk_bytes=self.chunk_bytes, max_matrix_n=self.max_matrix_n
        )
        kept = dropped = 0
        while (frame := await stream.next_frame()) is not None:
            frames_before = stream.frame_bytes - stream.last_frame_bytes
            if frame.WhichOneof("part") != "header":
                raise InvalidInputError("PushResults: a chunk arrived before any result header")
            header = frame.header
            announced = convert.result_arrays_announced(header, max_matrix_n=self.max_matrix_n)
            num_bytes = sum(array.num_bytes for array in announced)
            what = f"PushResults: result of block {header.block[:128]!r} version {header.version}"
            if not check_header(
                header, tenant=js.tenant, prefix=js.prefix, job=js.job, use=js.use(header.block)
            ):  # its ranks do not use it (yet): nothing to serve
                await stream.skip(num_bytes, what)
                dropped += 1
                continue
            async with self._upload_hold(num_bytes, what, js.tenant):
                result = receiver.feed(frame)
                while result is None:
                    chunk = await stream.next_frame()
                    if chunk is None:
                        raise InvalidInputError(f"{what}: the stream ended inside the result")
                    result = receiver.feed(chunk)
            if not result.is_finite():
                raise InvalidInputError(f"{what}: it holds non-finite values")
            if js.received(peer, result, stream.frame_bytes - frames_before):
                kept += 1
            else:
                dropped += 1
        receiver.close()
        return ppb.PushResultsResponse(kept=kept, dropped=dropped)

    def _upload_hold(
        self, num_bytes: int, what: str, tenant: str
    ) -> AbstractAsyncContextManager[None]:
        if self.uploads is None:
            return contextlib.nullcontext()
        return self.uploads.hold(
            num_bytes, wait_s=self.push_timeouts.wait_s, what=what, tenant=tenant
        )

    def status(self, tenant: str) -> ppb.PeerStatusResponse:
        now = time.monotonic()
        return ppb.PeerStatusResponse(
            groups=[js.status(now) for (t, _), js in sorted(self.jobs.items()) if t == tenant]
        )

    def groups(self) -> list[tuple[str, ppb.PeerGroup]]:
        """Every tenant's peer groups (the metrics endpoint's view); call on the event loop."""
        now = time.monotonic()
        return [(tenant, js.status(now)) for (tenant, _), js in sorted(self.jobs.items())]


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait until each has ended (whatever it ended with)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def _close_channels(js: JobSync) -> None:
    for peer in js.peers.values():
        if peer.channel is not None:
            await peer.channel.close(grace=None)


def is_peer_error(exc: BaseException) -> bool:
    return isinstance(exc, AuthenticationError | LookupError | InvalidInputError)


class GatedEngine:
    """The engine as the Preconditioner servicer sees it: ``submit`` goes through the sync's
    gate (another daemon may own the block); everything else is the engine's own."""

    def __init__(self, engine: PreconditionerEngine, manager: SyncManager) -> None:
        self._engine = engine
        self._manager = manager

    def submit(self, task: SolveTask, *, job: str = "") -> SubmitOutcome:
        return self._manager.submit(task, job)

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)
