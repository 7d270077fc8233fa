"""The claim protocol's decisions in one JobSync of a 2-member job, without daemons: a fake
engine says what is computed, queued or running here, and the peer's heartbeats and silence
are set by hand (no sleeps). Member 0 is this daemon, member 1 its peer."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.sync.config import SyncConfig
from asteria_server.sync.group import JobSync, _BlockStats
from asteria_server.sync.membership import blocks_digest
from asteria_server.types import SolveKind, SolveTask, SubmitOutcome

TENANT = "t"
#: two blocks of one size: the owner rule gives one to each member
BLOCKS = {"j:a": 8, "j:b": 8}


class FakeEngine:
    def __init__(self) -> None:
        self.computed: dict[str, int] = {}
        self.submitted: list[tuple[str, int]] = []

    def computed_version(self, block: str, tenant: str) -> int:
        return self.computed.get(block, -1)

    def withdraw(self, block: str, tenant: str, max_version: int) -> SolveTask | None:
        return None  # nothing queued here

    def in_flight_version(self, block: str, tenant: str) -> int | None:
        return None  # nothing running here

    def peek_result(self, block: str, tenant: str) -> None:
        return None

    def note_elsewhere(self, task: SolveTask, *, job: str = "") -> None:
        pass

    def submit(self, task: SolveTask, *, job: str = "") -> SubmitOutcome:
        self.submitted.append((task.block, task.version))
        return SubmitOutcome.QUEUED


class FakeManager:
    def __init__(self) -> None:
        self.config = SyncConfig(settle_s=1e-6)
        self.engine = FakeEngine()
        self.claims: list[tuple[str, int, int]] = []

    def wake_ticker(self) -> None:
        pass

    def start_claim(self, js: JobSync, held: Any, owner: int) -> None:
        held.claiming = True
        self.claims.append((held.task.block, held.task.version, owner))


def _agreed_pair() -> tuple[JobSync, FakeManager]:
    """Member 0's JobSync; both members use BLOCKS and have agreed on them."""
    manager = FakeManager()
    layout = jpb.JobLayout(
        job="j", nodes=[jpb.JobNode(daemon_address="a"), jpb.JobNode(daemon_address="b")]
    )
    js = JobSync(manager, TENANT, layout, 0)  # type: ignore[arg-type]
    js.view.known = dict(BLOCKS)  # what this member's ranks registered (as submit records them)
    js.view.digest = blocks_digest(js.view.known)
    js.stats = {b: _BlockStats(n) for b, n in BLOCKS.items()}
    peer = js.peers[1]
    state = ppb.PeerState(
        node=1,
        incarnation_id="inc-1",
        blocks_digest=js.view.digest,
        blocks=[ppb.BlockUse(block=b, n=n) for b, n in BLOCKS.items()],
        blocks_included=True,
    )
    js.heard(peer, state)
    state.view_digest = js.view.view_digest()  # it holds the same lists as this member
    js.heard(peer, state)
    js.view.agreed(time.monotonic())  # starts settle_s (a microsecond)
    assert peer.state == "alive" and js.view.owner_of("j:a", time.monotonic()) is not None
    return js, manager


def _owned_by(js: JobSync, member: int) -> str:
    (block,) = [b for b, m in js.view.owners().items() if m == member]
    return block


def _quiet(js: JobSync, seconds: float) -> None:
    """Peer 1 last heard ``seconds`` ago (this daemon itself ran all along)."""
    now = time.monotonic()
    js.peers[1].last_heard = now - seconds
    js.refresh_states(now)


def _task(block: str, version: int) -> SolveTask:
    return SolveTask(
        block=block,
        version=version,
        kind=SolveKind.EIGENBASIS,
        matrix=np.eye(BLOCKS[block], dtype=np.float32),
        deadline=version + 2,
        tenant=TENANT,
    )


def test_a_claim_of_a_version_solved_here_is_refused_before_the_listener_tells_the_group() -> None:
    js, manager = _agreed_pair()
    block = _owned_by(js, 0)
    # The worker's result is in the engine (neither queued nor running any more), but the
    # result listener's local_result has not run on the loop yet: the group's stats lag.
    manager.engine.computed[block] = 5
    assert js.stats[block].version == -1
    reply = js.claim(js.peers[1], block, 5)
    assert not reply.granted and reply.reason == "solved", reply
    assert block not in js.handed and js.claims_handed_over == 0
    # A version not computed here yet (not arrived) is still handed over.
    reply = js.claim(js.peers[1], block, 7)
    assert reply.granted and reply.reason == "not_arrived", reply


def test_a_suspect_owners_version_is_held_when_its_claim_gets_no_answer() -> None:
    js, manager = _agreed_pair()
    block = _owned_by(js, 1)
    _quiet(js, manager.config.suspect_s + 0.1)
    assert js.peers[1].state == "suspect"
    assert js.submit(_task(block, 3), "job") == SubmitOutcome.QUEUED
    js.tick(time.monotonic())
    assert manager.claims == [(block, 3, 1)]  # claimed from it at once
    held = js.held[block]
    # A stopped owner does not answer. Its ranks sent it this version too, so it is waited
    # for (until it is gone) rather than solved here: it would be solved twice.
    js.claim_failed(held, 1, TimeoutError("no answer"))
    assert manager.engine.submitted == [] and js.held[block] is held
    assert held.had_by == (1, "inc-1")


@pytest.mark.parametrize("held_before", [False, True])
def test_a_buried_owners_versions_are_held_until_it_is_gone(held_before: bool) -> None:
    js, manager = _agreed_pair()
    config = manager.config
    block = _owned_by(js, 1)
    if held_before:  # arrived while it was alive: it had this version
        js.submit(_task(block, 3), "job")
    _quiet(js, config.dead_s + 0.1)
    assert js.peers[1].state == "dead"
    js.view.agreed(time.monotonic())  # the living changed: settle again
    assert js.view.owner_of(block, time.monotonic()) == 0  # the owner rule moved it here
    if not held_before:  # arrived after it was declared dead: its ranks sent it there too
        assert js.submit(_task(block, 3), "job") == SubmitOutcome.QUEUED
    js.tick(time.monotonic())
    assert manager.engine.submitted == [] and block in js.held
    # A newer one waits for it too.
    js.submit(_task(block, 5), "job")
    js.tick(time.monotonic())
    assert manager.engine.submitted == [] and js.held[block].task.version == 5
    assert js.view.buried_owner(block, time.monotonic()) == 1
    # Gone (dead for takeover_grace_s): taken over, solved here.
    _quiet(js, config.dead_s + config.takeover_grace_s + 0.1)
    assert js.view.buried_owner(block, time.monotonic()) is None
    js.tick(time.monotonic())
    assert manager.engine.submitted == [(block, 5)]


def test_a_returning_owner_is_pushed_the_versions_taken_over_from_it() -> None:
    js, _ = _agreed_pair()
    block = _owned_by(js, 1)
    # Solved here while its owner was gone; it comes back (heard again).
    js.stats[block].version, js.stats[block].origin = 9, "local"
    js.queue_missing(js.peers[1])
    assert block in js.links[1].queued


def test_versions_held_for_an_owner_that_restarted_are_solved_by_its_stand_in() -> None:
    js, manager = _agreed_pair()
    block = _owned_by(js, 1)
    _quiet(js, manager.config.dead_s + 0.1)
    js.submit(_task(block, 3), "job")
    js.tick(time.monotonic())
    assert manager.engine.submitted == []  # held for it
    # It comes back as a new incarnation (a restart holds nothing): the members do not agree
    # on the blocks yet, and this member, its block's owner while it was dead, solves the
    # version (and pushes it to every peer: taken) instead of waiting out patience_s.
    js.heard(js.peers[1], ppb.PeerState(node=1, incarnation_id="inc-2", blocks_digest="x"))
    js.tick(time.monotonic())
    assert manager.engine.submitted == [(block, 3)] and js.taken[block] == 3
