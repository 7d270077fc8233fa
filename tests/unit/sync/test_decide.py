"""The gate's decisions (:mod:`asteria_server.sync.decide`) as plain calls: a real membership
of a 2- or 3-member job, its peers' heartbeats fed by hand on a made-up clock, held snapshots,
and the actions the decisions return. Member 0 is this daemon."""

from __future__ import annotations

import numpy as np

from asteria_server.owners import owner_map
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.sync import decide
from asteria_server.sync.config import SyncConfig
from asteria_server.sync.decide import Held
from asteria_server.sync.membership import Membership, blocks_digest
from asteria_server.types import SolveKind, SolveTask

CONFIG = SyncConfig(settle_s=1e-3)
#: blocks of one size, used by every member: the owner rule spreads them over the members
BLOCKS = {f"j:w{i}": 8 for i in range(12)}
T0 = 1000.0


class Cluster:
    """Member 0's membership and a clock; ``run`` moves the clock in heartbeat-sized steps,
    the given peers heard at each (the others silent), as the daemon's loop would."""

    def __init__(self, num_members: int) -> None:
        layout = jpb.JobLayout(
            job="j", nodes=[jpb.JobNode(daemon_address=f"d{m}") for m in range(num_members)]
        )
        self.view = Membership("t", layout, 0, CONFIG, now=T0)
        self.view.known = dict(BLOCKS)
        self.view.digest = blocks_digest(BLOCKS)
        self.incarnation = {m: f"inc-{m}-1" for m in self.view.peers}
        self.busy = dict.fromkeys(self.view.peers, 0)
        self.now = T0
        self.run(T0 + 1.0, hear=list(self.view.peers))
        assert self.view.owner_of("j:w0", self.now) is not None  # agreed

    def hear(self, member: int) -> None:
        state = ppb.PeerState(
            node=member,
            incarnation_id=self.incarnation[member],
            queue_depth=self.busy[member],
            blocks_digest=self.view.digest,
            blocks=[ppb.BlockUse(block=b, n=n) for b, n in BLOCKS.items()],
            blocks_included=True,
            view_digest=self.view.view_digest(),  # it holds the same lists as member 0
        )
        self.view.heard(self.view.peers[member], state, self.now)

    def run(self, until: float, *, hear: list[int]) -> None:
        while self.now < until:
            self.now = min(until, self.now + CONFIG.heartbeat_s)
            for member in hear:
                self.hear(member)
            self.view.refresh_states(self.now)
            self.view.agreed(self.now)  # (the tick asks at every step: it starts settle_s)

    def owned_by(self, member: int) -> str:
        return next(b for b, m in sorted(self.view.owners().items()) if m == member)

    def held(self, block: str, version: int, **fields: object) -> Held:
        task = SolveTask(
            block=block,
            version=version,
            kind=SolveKind.EIGENBASIS,
            matrix=np.eye(BLOCKS[block], dtype=np.float32),
            deadline=version + 2,
            tenant="t",
        )
        return Held(task, "job", self.now, self.now, **fields)


def nothing_solved(block: str) -> int:
    return -1


def test_a_version_a_push_brought_is_dropped() -> None:
    c = Cluster(2)
    held = c.held(c.owned_by(1), 3)
    assert decide.tick(c.view, [held], lambda block: 3, c.now) == [decide.Drop(held)]


def test_a_claim_that_times_out_on_a_quiet_owner_is_solved_here_unless_that_owner_had_it() -> None:
    c = Cluster(2)
    block = c.owned_by(1)
    c.run(c.now + CONFIG.suspect_s + 0.1, hear=[])  # member 1 stopped answering
    assert c.view.peers[1].state == "suspect"
    # Arrived here while it was quiet (it never had this version from us): claimed at once.
    fresh = c.held(block, 3, had_by=None)
    assert decide.tick(c.view, [fresh], nothing_solved, c.now) == [decide.StartClaim(fresh, 1)]
    # The claim times out: solved here, a fallback.
    action = decide.claim_failed(c.view, fresh, 1, "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", c.now)
    assert isinstance(action, decide.SolveHere) and action.held is fresh
    assert action.fallback and action.reason == "owner_down" and not action.taken
    # One it had (its ranks sent it the same version) may be on its worker: asked again soon.
    had = c.held(block, 3, had_by=(1, c.incarnation[1]))
    action = decide.claim_failed(c.view, had, 1, "DEADLINE_EXCEEDED", "x", c.now)
    assert action == decide.Postpone(had, c.now + CONFIG.heartbeat_s)
    # An owner that cannot take claims at all is not asked again, whatever it holds.
    action = decide.claim_failed(c.view, had, 1, "UNIMPLEMENTED", "x", c.now)
    assert isinstance(action, decide.SolveHere) and action.reason == "claim_failed"


def test_a_claim_whose_winner_never_pushes_is_solved_here_once_it_is_idle() -> None:
    c = Cluster(2)
    block = c.owned_by(0)  # this member owns it and let member 1 claim version 3
    held = c.held(block, 3, wait_for=1, had_by=(1, c.incarnation[1]))
    held.due = c.now + CONFIG.push_timeout_s
    assert decide.tick(c.view, [held], nothing_solved, c.now) == []  # its push may come
    c.busy[1] = 1  # still at work when the push is due: more time
    c.run(held.due, hear=[1])
    assert decide.tick(c.view, [held], nothing_solved, c.now) == [
        decide.Postpone(held, c.now + CONFIG.patience_s)
    ]
    c.busy[1] = 0
    c.run(c.now + CONFIG.heartbeat_s, hear=[1])
    (action,) = decide.tick(c.view, [held], nothing_solved, c.now)
    assert isinstance(action, decide.SolveHere) and action.reason == "claim_lapsed"


def test_a_dead_owners_versions_wait_until_it_is_gone() -> None:
    c = Cluster(2)
    block = c.owned_by(1)
    held = c.held(block, 3, had_by=(1, c.incarnation[1]))  # arrived while it was alive
    c.run(c.now + CONFIG.dead_s + 0.1, hear=[])
    assert c.view.peers[1].state == "dead"
    assert decide.tick(c.view, [held], nothing_solved, c.now) == []  # it may be solving it
    assert c.view.owner_of(block, c.now) == 0  # the owner rule moved it here meanwhile
    c.run(c.now + CONFIG.takeover_grace_s, hear=[])
    # Gone: solved here, as its owner now (no fallback).
    assert decide.tick(c.view, [held], nothing_solved, c.now) == [
        decide.SolveHere(held, fallback=False)
    ]


def test_a_restarted_owners_versions_go_to_its_stand_in_only() -> None:
    c = Cluster(3)
    blocks, users = c.view.all_blocks()
    # The owners while member 1 was dead (members 0 and 2): one of its blocks each.
    while_dead = owner_map(blocks, c.view.members, [0, 2], users=users)
    of_1 = [b for b, m in sorted(c.view.owners().items()) if m == 1]
    mine = next(b for b in of_1 if while_dead[b] == 0)
    theirs = next(b for b in of_1 if while_dead[b] == 2)
    held_mine = c.held(mine, 3, had_by=(1, c.incarnation[1]))
    held_theirs = c.held(theirs, 3, had_by=(1, c.incarnation[1]))
    c.run(c.now + CONFIG.dead_s + 0.1, hear=[2])
    assert c.view.peers[1].state == "dead" and c.view.peers[2].state == "alive"
    # Held for it (it may be solving it), though this member owns the block now.
    assert c.view.owner_of(mine, c.now) == 0
    assert decide.tick(c.view, [held_mine], nothing_solved, c.now) == []
    c.incarnation[1] = "inc-1-2"  # it comes back from a restart, holding nothing
    c.hear(1)
    actions = decide.tick(c.view, [held_mine, held_theirs], nothing_solved, c.now)
    assert actions == [
        decide.SolveHere(held_mine, fallback=False, taken=True),
        decide.WaitFor(held_theirs, 2, c.incarnation[2], c.now + CONFIG.push_timeout_s),
    ]


def task(block: str, version: int) -> SolveTask:
    return SolveTask(
        block=block,
        version=version,
        kind=SolveKind.EIGENBASIS,
        matrix=np.eye(BLOCKS[block], dtype=np.float32),
        deadline=version + 2,
        tenant="t",
    )


def route(c: Cluster, block: str, version: int, **kw: object) -> decide.Submit | decide.Hold:
    fields: dict[str, object] = {"handed": None, "behind": set(), "step_s": None, "now": c.now}
    fields.update(kw)
    return decide.route(c.view, task(block, version), "job", **fields)


def test_a_new_snapshot_is_solved_by_its_owner_and_held_elsewhere() -> None:
    c = Cluster(2)
    assert route(c, c.owned_by(0), 3) == decide.Submit(fallback=False)
    # Claimed by member 1 (this member, its owner, let it): member 1's push.
    held = route(c, c.owned_by(0), 3, handed=(1, 3))
    assert isinstance(held, decide.Hold) and held.held.wait_for == 1
    # Another's block: held for its push, claimed once patience_s has passed.
    other = route(c, c.owned_by(1), 3)
    assert isinstance(other, decide.Hold) and other.held.due == c.now + CONFIG.patience_s
    assert other.held.had_by == (1, c.incarnation[1])
    # ... at once when its ranks are behind.
    behind = route(c, c.owned_by(1), 3, behind={1})
    assert isinstance(behind, decide.Hold) and behind.held.due == c.now


def test_a_claim_refused_by_an_owner_that_disowns_it_is_solved_here_after_patience() -> None:
    c = Cluster(2)
    held = c.held(c.owned_by(1), 3)

    def refused(now: float) -> list[decide.Action]:
        return decide.claim_answered(
            c.view, held, 1, granted=False, reason="not_owner", current=True, now=now
        )

    assert refused(c.now) == [
        decide.Disowned(held, c.now),
        decide.Postpone(held, c.now + CONFIG.heartbeat_s),
    ]
    held.disowned_since = c.now  # (as the group carries it out)
    actions = refused(c.now + CONFIG.patience_s)
    assert isinstance(actions[-1], decide.SolveHere) and actions[-1].reason == "not_agreed"
    granted = decide.claim_answered(
        c.view, held, 1, granted=True, reason="not_arrived", current=True, now=c.now
    )
    assert granted == [decide.NoteBehind(1, True), decide.TakeOver(held)]


def test_a_result_goes_to_the_peers_only_from_its_owner_or_a_claims_winner() -> None:
    c = Cluster(2)
    mine, theirs = c.owned_by(0), c.owned_by(1)
    assert decide.result_pushes(c.view, mine, 3, taken=-1) == [decide.QueuePush(1, mine)]
    assert decide.result_pushes(c.view, theirs, 3, taken=-1) == []  # its owner pushes it
    assert decide.result_pushes(c.view, theirs, 3, taken=3) == [decide.QueuePush(1, theirs)]
