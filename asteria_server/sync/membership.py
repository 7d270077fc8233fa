"""Who is in a job's peer group, how each member is doing, and whether they agree on the blocks.

The membership half of a peer group (see :mod:`asteria_server.sync.manager` for the protocol):
each peer's heartbeat state, its liveness (alive, suspect, dead, gone, judged on this daemon's
clock with its own pauses not counted against its peers), the block lists every member uses and
the digests that show when they all hold the same ones (``agreed``), and the owner maps those
lists give by :func:`asteria_server.owners.owner_map`. It holds no push queue and no snapshot,
and calls nothing: the decisions (:mod:`.decide`) read it, the group's I/O feeds it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from asteria_server.owners import owner_map
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.sync.config import SyncConfig

logger = logging.getLogger(__name__)


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
class Peer:
    """Another member of a job, as this daemon hears it (its push link: :mod:`.links`)."""

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
    suspected: int = 0
    died: int = 0
    rejoined: int = 0
    #: it answered a heartbeat or called with the job token: a daemon of the job, heartbeated
    #: every heartbeat_s; until then asked at most once a second, backing off (misses)
    proven: bool = False
    misses: int = 0


class Membership:
    """One job's members as this daemon sees them: liveness and agreement on the blocks."""

    def __init__(
        self,
        tenant: str,
        layout: jpb.JobLayout,
        node_rank: int,
        config: SyncConfig,
        *,
        now: float,
    ) -> None:
        self.tenant = tenant
        self.job = layout.job
        self.prefix = f"{layout.job}:"
        self.config = config
        self.registered_at = now
        addresses: list[str] = []
        self.member_of_node: list[int] = []
        for node in layout.nodes:
            if node.daemon_address not in addresses:
                addresses.append(node.daemon_address)
            self.member_of_node.append(addresses.index(node.daemon_address))
        self.addresses = addresses
        self.me = self.member_of_node[node_rank]
        self.members = list(range(len(addresses)))
        self.peers: dict[int, Peer] = {
            m: Peer(m, a) for m, a in enumerate(addresses) if m != self.me
        }
        self.known: dict[str, int] = {}  # replicated blocks the local ranks use
        self.digest = ""
        self._agreed_key: tuple[str, tuple[int, ...]] | None = None
        self._agreed_since = 0.0
        self._owners_key: tuple[str, tuple[int, ...]] | None = None
        self._owners: dict[str, int] = {}
        #: the owner map among the members not gone (see buried_owner), and its key
        self._home_key: tuple[str, tuple[int, ...]] | None = None
        self._home: dict[str, int] = {}
        #: when the peers' states were last judged, and the seconds this daemon did not run
        #: (SIGSTOP, a stalled host) that were not counted against its peers
        self._judged_at = self.registered_at
        self.own_pauses = 0
        self.own_pause_s = 0.0

    @property
    def syncing(self) -> bool:
        return len(self.addresses) > 1

    def node_of(self, member: int) -> int:
        return self.member_of_node.index(member)

    def learn(self, block: str, n: int) -> bool:
        """The local ranks use ``block`` (of size ``n``); True when it is new to its list."""
        if block in self.known:
            return False
        self.known[block] = n
        self.digest = blocks_digest(self.known)
        return True

    # ------------------------------------------------------------------ liveness

    def peer_state(self, peer: Peer, now: float) -> str:
        config = self.config
        if peer.last_heard is None:
            return "unknown" if now - self.registered_at < config.dead_s else "dead"
        quiet = now - peer.last_heard
        if quiet < config.suspect_s:
            return "alive"
        return "suspect" if quiet < config.dead_s else "dead"

    def refresh_states(self, now: float) -> list[Peer]:
        """Judge every peer's state at ``now``; the peers that died since (their links hold
        nothing that counts any more: they may come back with nothing)."""
        gap = now - self._judged_at
        if gap > self.config.suspect_s:
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
        died = []
        for peer in self.peers.values():
            state = self.peer_state(peer, now)
            if state != peer.state:
                if state == "suspect":
                    peer.suspected += 1
                elif state == "dead":
                    peer.died += 1
                    died.append(peer)
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
        return died

    def gone(self, peer: Peer, now: float) -> bool:
        """Whether ``peer`` has been dead for ``takeover_grace_s``: only then are versions it
        may hold (queued or on a worker) solved elsewhere."""
        if peer.state != "dead":
            return False
        config = self.config
        quiet_since = peer.last_heard if peer.last_heard is not None else self.registered_at
        return now - quiet_since >= config.dead_s + config.takeover_grace_s

    def living(self) -> list[int]:
        """Members not dead (alive, suspect or not yet heard), this one included."""
        return [self.me] + [m for m, p in self.peers.items() if p.state != "dead"]

    def heard(self, peer: Peer, state: ppb.PeerState, now: float) -> tuple[bool, list[Peer]]:
        """A heartbeat of ``peer`` arrived (its call or its answer): whether it came back as a
        new incarnation (it holds nothing yet), and the peers that died meanwhile."""
        reborn = bool(peer.incarnation) and state.incarnation_id != peer.incarnation
        if reborn:
            peer.rejoined += 1
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
        return reborn, self.refresh_states(now)

    def my_state(
        self,
        known_digest: str,
        *,
        incarnation_id: str,
        workers_busy: int,
        workers: int,
        queue_depth: int,
    ) -> ppb.PeerState:
        """This member's heartbeat state, its block list included when the peer's
        ``known_digest`` says it lacks the current one."""
        include = known_digest != self.digest
        return ppb.PeerState(
            node=self.me,
            incarnation_id=incarnation_id,
            workers_busy=workers_busy,
            workers=workers,
            queue_depth=queue_depth,
            blocks_digest=self.digest,
            blocks=[ppb.BlockUse(block=b, n=n) for b, n in sorted(self.known.items())]
            if include
            else [],
            blocks_included=include,
            alive_members=self.living(),
            view_digest=self.view_digest(),
        )

    # ------------------------------------------------------------------ agreement and owners

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
        return now - self._agreed_since >= self.config.settle_s

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

    def decided_owners(self) -> dict[str, int]:
        """The owner map last decided (empty before the first): the owners a result is
        pushed by, without waiting for agreement again."""
        return self.owners() if self._owners_key is not None else {}

    def owner_of(self, block: str, now: float) -> int | None:
        """The block's owner, or None while the members do not agree on the blocks."""
        if not self.agreed(now):
            return None
        return self.owners().get(block)

    def buried_owner(self, block: str, now: float) -> int | None:
        """The member that owns ``block`` while it is quiet (suspect, or dead but not yet
        :meth:`gone`), or None. Its ranks send it the versions they send here, so it may hold
        (or, stopped, be solving) any version that arrives here meanwhile: such a version is
        held for its push, like one it had when it went quiet (``Held.had_by``), and solved
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

    def owner_without(self, block: str, member: int, now: float) -> int | None:
        """The block's owner among the members not gone, ``member`` left out (the owner it
        had while ``member`` was dead)."""
        staying = [
            m
            for m in self.members
            if m != member and (m == self.me or not self.gone(self.peers[m], now))
        ]
        blocks, users = self.all_blocks()
        return owner_map(blocks, self.members, staying, users=users).get(block)
