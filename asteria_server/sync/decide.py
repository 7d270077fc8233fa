"""What a peer group does with the snapshots it holds for another member's push: the decisions.

Pure: each function reads the membership (:class:`.membership.Membership`), the held snapshots
and ``now``, and returns actions (solve here, claim from the owner, wait for a member, ask again
later) for :class:`asteria_server.sync.group.JobSync` to carry out. Nothing here submits,
sends or changes a record, so every rule can be tested with plain calls on a membership whose
peers' heartbeats and silence are set by hand. (The membership's owner maps and agreement clock
are memoised inside it; reading them at one ``now`` gives one answer.)

The rules are those of the module docstring of :mod:`asteria_server.sync.manager` ("The gate").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set
from dataclasses import dataclass

from asteria_server.sync.membership import Membership
from asteria_server.types import SolveTask


@dataclass
class Held:
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
    #: :func:`lost`), never merely because it went quiet.
    had_by: tuple[int, str] | None = None


# ---------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Drop:
    """A push brought the held version (or a newer one) already: forget the snapshot."""

    held: Held


@dataclass(frozen=True)
class SolveHere:
    """Solve the held version on this daemon. ``fallback``: without its owner's grant (it may
    duplicate the owner's work), for ``reason`` (a ``fallback_reasons`` key) because ``why``;
    ``taken``: this member stands in for the owner, so its result goes to every peer."""

    held: Held
    fallback: bool
    reason: str = ""
    why: str = ""
    taken: bool = False


@dataclass(frozen=True)
class WaitFor:
    """Wait for ``member``'s push (of incarnation ``incarnation``) until ``due``."""

    held: Held
    member: int
    incarnation: str
    due: float


@dataclass(frozen=True)
class Postpone:
    """Look at it again at ``due`` (claim again, or give a claim's winner more time)."""

    held: Held
    due: float


@dataclass(frozen=True)
class Restart:
    """Count its patience from ``since`` (the members agree again only once a quiet one is
    declared dead or is back)."""

    held: Held
    since: float


@dataclass(frozen=True)
class StartClaim:
    """Ask ``owner`` for the held version (Peer.Claim)."""

    held: Held
    owner: int


@dataclass(frozen=True)
class TakeOver:
    """The owner granted the held version: solve it here, and push it to every peer."""

    held: Held


@dataclass(frozen=True)
class Disowned:
    """Its owner answered that it does not own the block, first at ``since`` (None: it
    answers as the owner again)."""

    held: Held
    since: float | None


@dataclass(frozen=True)
class NoteBehind:
    """Whether ``owner``'s ranks are behind (its last grant: a version not arrived there):
    its next snapshots are claimed from it at once."""

    owner: int
    behind: bool


@dataclass(frozen=True)
class QueuePush:
    """Queue the block's newest result for ``member``."""

    member: int
    block: str


Action = (
    Drop
    | SolveHere
    | WaitFor
    | Postpone
    | Restart
    | StartClaim
    | TakeOver
    | Disowned
    | NoteBehind
    | QueuePush
)


@dataclass(frozen=True)
class Submit:
    """A new snapshot goes to this daemon's engine (``fallback``: without its owner, for
    ``reason``)."""

    fallback: bool
    reason: str = ""


@dataclass(frozen=True)
class Hold:
    """A new snapshot is held for a push, as ``held``."""

    held: Held


# ---------------------------------------------------------------------- rules


def lost(view: Membership, held: Held, now: float) -> bool:
    """Whether the member that had ``held``'s version may no longer deliver it: it came back
    as a new incarnation (a restart holds nothing), or it has been dead for
    ``takeover_grace_s``. A member merely quiet (suspect, or dead for a shorter while: a
    SIGSTOPped daemon whose worker may be solving that very version) is waited for, so the
    version is not solved twice in the cluster; the ranks meanwhile keep their budget with
    the barrier and, past it, a local solve."""
    if held.had_by is None or held.had_by[0] == view.me:
        return True
    member, incarnation = held.had_by
    peer = view.peers[member]
    if peer.incarnation != incarnation:
        return True
    return view.gone(peer, now)


def stand_in(view: Membership, held: Held, now: float) -> int | None:
    """The member that solves ``held``'s version, held for an owner that came back as a
    new incarnation (a restart holds nothing): the block's owner while that owner was
    dead. One member, so the members that held the version do not all solve it."""
    if held.had_by is None or held.had_by[0] == view.me or held.wait_for is not None:
        return None
    member, incarnation = held.had_by
    if view.peers[member].incarnation == incarnation:
        return None
    return view.owner_without(held.task.block, member, now)


def waits_for_quiet(view: Membership, held: Held, now: float) -> bool:
    """Whether ``held`` waits for the member that had its version, quiet now and not yet
    lost (see :func:`lost`): solving it here would solve it twice in the cluster."""
    if held.had_by is None or held.had_by[0] == view.me:
        return False
    return view.peers[held.had_by[0]].state != "alive" and not lost(view, held, now)


def tick(
    view: Membership,
    held: list[Held],
    solved_version: Callable[[str], int],
    now: float,
) -> list[Action]:
    """The held snapshots looked at again (``view``'s states judged at ``now`` already): solve
    here those whose owner is this member now or is dead (or whose claim's winner is down or
    never pushed); claim from its owner each one whose push would come too late.
    ``solved_version``: the newest version of a block this member has (solved or pushed)."""
    actions: list[Action] = []
    for h in held:
        action = _tick_one(view, h, solved_version(h.task.block), now)
        if action is not None:
            actions.append(action)
    return actions


def _tick_one(view: Membership, held: Held, solved: int, now: float) -> Action | None:
    config = view.config
    block = held.task.block
    if solved >= held.task.version:
        return Drop(held)
    member = stand_in(view, held, now)
    if member == view.me:  # solved here, pushed to every peer (its owner included)
        return SolveHere(held, fallback=False, taken=True)
    if member is not None:  # that member solves it: its push
        return WaitFor(held, member, view.peers[member].incarnation, now + config.push_timeout_s)
    owner = view.owner_of(block, now)
    if held.wait_for is not None:  # this member, as owner, let another one claim it
        state = view.peers[held.wait_for].state
        if state in ("suspect", "dead"):
            if not lost(view, held, now):
                return None  # the winner has it queued or on a worker: not solved twice
            why = f"member {held.wait_for}, whose push it waits for, is {state}"
            return SolveHere(held, fallback=True, reason="owner_down", why=why)
        if now < held.due:
            return None
        winner = view.peers[held.wait_for]
        if winner.queue_depth > 0 or winner.workers_busy > 0:
            return Postpone(held, now + config.patience_s)  # still at work
        why = f"member {held.wait_for} won its claim, is idle and did not push it"
        return SolveHere(held, fallback=True, reason="claim_lapsed", why=why)
    if owner == view.me:
        if waits_for_quiet(view, held, now):
            return None  # its old owner, quiet now, has this version: not solved twice
        return SolveHere(held, fallback=False)
    if owner is None:
        if waits_for_quiet(view, held, now):
            # The members agree again once a quiet one is declared dead or is back;
            # patience_s counts from then, or every member that held this version for
            # a returning owner would solve it at once as a fallback.
            return Restart(held, now)
        if now < held.since + config.patience_s:
            return None
        why = "the daemons did not agree on the job's blocks in time"
        return SolveHere(held, fallback=True, reason="not_agreed", why=why)
    if view.peers[owner].state == "dead":
        if not lost(view, held, now):
            return None
        why = f"its owner (member {owner}) is dead"
        return SolveHere(held, fallback=True, reason="owner_down", why=why)
    if not held.claiming and (now >= held.due or view.peers[owner].state == "suspect"):
        return StartClaim(held, owner)
    return None


#: Claim failures that asking again does not mend: the owner cannot take claims from here.
HOPELESS_CLAIM_CODES = frozenset({"UNIMPLEMENTED", "UNAUTHENTICATED", "PERMISSION_DENIED"})


def claim_failed(
    view: Membership, held: Held, owner: int, code: str | None, detail: str, now: float
) -> Action:
    """A claim of ``held`` from ``owner`` got no answer (``code``: the gRPC status code's name,
    None for another failure; ``detail``: what went wrong): ask again soon, or solve here when
    the owner, quiet, no longer holds the version, or cannot take claims."""
    state = view.peers[owner].state
    hopeless = code in HOPELESS_CLAIM_CODES
    if not hopeless and (state == "alive" or not lost(view, held, now)):
        # Asked again soon. A quiet owner that had this version is waited for (it may be
        # stopped with the version on a worker): solving it here would solve it twice.
        return Postpone(held, now + view.config.heartbeat_s)
    return SolveHere(
        held,
        fallback=True,
        reason="owner_down" if not hopeless else "claim_failed",
        why=f"its owner (member {owner}, {state}) did not answer a claim: {detail}",
    )


def route(
    view: Membership,
    task: SolveTask,
    job: str,
    *,
    handed: tuple[int, int] | None,
    behind: Set[int],
    step_s: float | None,
    now: float,
) -> Submit | Hold:
    """Where a new snapshot of a block of the job goes (one not solved or held here already):
    solved here when this member owns the block (unless it let another member claim this
    version: that one's push) or its owner is dead, else held for its owner's push, claimed
    at once from an owner suspect or behind, otherwise once the push would come too late
    (``max(patience_s, (deadline - version) * step_s)``). ``handed``: the (member, version)
    this member, as owner, last let another member solve; ``behind``: the owners whose ranks
    are behind; ``step_s``: the job's seconds per step."""
    config = view.config
    peers = view.peers
    owner = view.owner_of(task.block, now)
    buried = view.buried_owner(task.block, now)
    wait_for = None
    if owner == view.me and buried is None:
        if handed is None or handed[1] < task.version or peers[handed[0]].state == "dead":
            return Submit(fallback=False)
        wait_for = handed[0]  # this version was claimed by another member: its push
    elif owner is not None and buried is None and peers[owner].state == "dead":
        return Submit(fallback=True, reason="owner_down")
    if wait_for is not None:
        due = now + config.push_timeout_s
    elif owner not in (None, view.me) and (peers[owner].state == "suspect" or owner in behind):
        # Claimed from it at once: a stopped owner does not answer, and one whose ranks
        # are behind (its last grant: not arrived there yet) would only make it wait.
        due = now
    else:
        budget = max(0.0, task.deadline - task.version) if math.isfinite(task.deadline) else 0
        due = now + max(config.patience_s, budget * (step_s or 0.0))
    had_by = wait_for if wait_for is not None else buried if buried is not None else owner
    had = (
        (had_by, peers[had_by].incarnation)
        if had_by is not None and (had_by == buried or peers[had_by].state == "alive")
        else None
    )
    return Hold(Held(task, job, now, due, wait_for=wait_for, had_by=had))


def claim_answered(
    view: Membership,
    held: Held,
    owner: int,
    *,
    granted: bool,
    reason: str,
    current: bool,
    now: float,
) -> list[Action]:
    """The owner's answer to a claim of ``held`` (``current``: it is still held here, no push
    or newer snapshot came meanwhile). Granted: solved here (a version not arrived there
    marks the owner's ranks as behind). Refused by an owner that does not see itself as the
    owner (the maps differ for a moment): asked again soon, solved here after patience_s.
    Refused otherwise (solved or running there, or won by another member): its push is on
    its way; asked again after patience_s should it not come."""
    config = view.config
    if granted:
        actions: list[Action] = [NoteBehind(owner, reason == "not_arrived")]
        # Not current: the owner, which waits for this version, solves it after push_timeout_s.
        return [*actions, TakeOver(held)] if current else actions
    if not current:
        return []
    if reason == "not_owner":
        since = held.disowned_since if held.disowned_since is not None else now
        if now - since < config.patience_s:
            return [Disowned(held, since), Postpone(held, now + config.heartbeat_s)]
        why = f"its owner (member {owner}) does not see itself as its owner"
        return [
            Disowned(held, since),
            SolveHere(held, fallback=True, reason="not_agreed", why=why),
        ]
    return [NoteBehind(owner, False), Disowned(held, None), Postpone(held, now + config.patience_s)]


def result_pushes(view: Membership, block: str, version: int, taken: int) -> list[QueuePush]:
    """The peers a result solved here (``version`` of ``block``) goes to: those that use the
    block and are not dead, when it is the owner's result, one whose claim this member won
    (``taken``: the version it won), or one solved here because the owner could not (not
    decided, suspect or dead). The owner gets it too once it answers: its own queued solve
    of that version is then dropped."""
    owner = view.decided_owners().get(block)
    if taken >= version or owner is None or owner == view.me or view.peers[owner].state != "alive":
        return [
            QueuePush(m, block)
            for m, peer in view.peers.items()
            if block in peer.blocks and peer.state != "dead"
        ]
    return []
