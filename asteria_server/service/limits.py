"""What keeps one tenant, or one unlucky client, from breaking the daemon for the others.

- :class:`SessionTable`: sessions are leases. Every call naming a session renews it, and so does
  an open result stream (whose connection gRPC keepalive pings, so a dead or stopped client's
  stream ends); a session with neither for ``ttl_s`` expires. Sessions are capped per tenant and
  in total, and a new session is refused (RESOURCE_EXHAUSTED) rather than another one dropped,
  so no tenant can evict another's. A session that ended is remembered (boundedly) with why, so
  a late call hears "expired" or "closed", not a guess.
- :class:`AuthThrottle`: failed authentications from one peer are limited to a small burst and
  a steady rate; beyond it OpenSession fails RESOURCE_EXHAUSTED before a token is compared.
- :class:`FdBudget`: the descriptors the segment handover keeps (one per segment, one per
  connection), bounded per tenant and in total below the process's limit, so that running out
  is a refused segment, never a dispatcher or a worker that cannot get a descriptor.
- :func:`raise_nofile_limit`: the soft descriptor limit raised to the hard one at start.

Everything here but :class:`FdBudget` is used from the event loop only.
"""

from __future__ import annotations

import logging
import math
import resource
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from asteria_server.errors import DaemonBusyError, UnknownSessionError
from asteria_server.ratelog import RefusalLog

__all__ = ["RefusalLog"]  # it lived here first: importers of it from here keep working

#: Ended sessions remembered with the reason they ended (for an accurate NOT_FOUND).
ENDED_SESSIONS_KEPT = 4096
#: Peers whose failed authentications are tracked at once (the oldest are forgotten).
AUTH_PEERS_KEPT = 4096


@dataclass(frozen=True)
class Session:
    """One training process's session."""

    session_id: str
    tenant: str
    job: str
    rank: int
    opened_at: float


@dataclass
class _Lease:
    last_seen: float
    streams: int = 0


class SessionTable:
    """Open sessions with their leases (see the module docstring)."""

    def __init__(
        self,
        *,
        max_sessions: int,
        tenant_max_sessions: int,
        ttl_s: float,
        incarnation_id: str,
        clock: Callable[[], float] = time.monotonic,
        on_job_idle: Callable[[str, str], None] | None = None,
        on_job_active: Callable[[str, str], None] | None = None,
    ) -> None:
        #: told (tenant, job) when the last open session of a job ends, and when a job that had
        #: none gets one (the expiry of a finished job's blocks)
        self.on_job_idle = on_job_idle
        self.on_job_active = on_job_active
        self.max_sessions = max_sessions
        self.tenant_max_sessions = tenant_max_sessions
        self.ttl_s = ttl_s
        self._incarnation = incarnation_id
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._leases: dict[str, _Lease] = {}
        self._by_tenant: dict[str, int] = {}
        self._by_job: dict[tuple[str, str], int] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def values(self) -> tuple[Session, ...]:
        return tuple(self._sessions.values())  # one C-level copy: safe from other threads

    def peek(self, session_id: str) -> Session | None:
        """The open session, its lease untouched (safe from other threads)."""
        return self._sessions.get(session_id)

    def tenant_sessions(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def job_sessions(self, tenant: str, job: str) -> int:
        """Open sessions of ``tenant`` that named ``job`` (a multi-node job's peer group ends
        some time after its last one here)."""
        return self._by_job.get((tenant, job), 0)

    def open(self, session: Session) -> None:
        """Add ``session`` (:meth:`reap` first, so expired sessions make room). DaemonBusyError
        when a cap is reached: nothing is dropped for it."""
        held = self._by_tenant.get(session.tenant, 0)
        if held >= self.tenant_max_sessions:
            raise DaemonBusyError(
                f"tenant {session.tenant!r} already holds {held} open sessions "
                f"(tenant_max_sessions = {self.tenant_max_sessions}); close unused sessions "
                f"(CloseSession) or wait for idle ones to expire (session_ttl_s = "
                f"{self.ttl_s:g} s)"
            )
        if len(self._sessions) >= self.max_sessions:
            raise DaemonBusyError(
                f"the daemon holds {len(self._sessions)} open sessions (max_sessions = "
                f"{self.max_sessions}); try again later"
            )
        self._sessions[session.session_id] = session
        self._leases[session.session_id] = _Lease(self._clock())
        self._by_tenant[session.tenant] = held + 1
        key = (session.tenant, session.job)
        self._by_job[key] = self._by_job.get(key, 0) + 1
        if self._by_job[key] == 1 and self.on_job_active is not None:
            self.on_job_active(*key)

    def get(self, session_id: str) -> Session:
        """The open session (its lease renewed), or UnknownSessionError saying why not."""
        session = self._sessions.get(session_id)
        if session is not None:
            lease = self._leases[session_id]
            now = self._clock()
            if lease.streams or now - lease.last_seen <= self.ttl_s:
                lease.last_seen = now
                return session
            self.end(session_id, self._expired_reason())
        why = self._ended.get(session_id)
        if why is not None:
            raise UnknownSessionError(
                f"session {session_id!r} {why}; open a new session, re-register the blocks "
                "and resubmit"
            )
        raise UnknownSessionError(
            f"unknown session {session_id!r}: this daemon (incarnation {self._incarnation}) "
            "never opened it, so it was opened by an earlier run of the daemon (it restarted) "
            "or the id is wrong; open a new session, re-register the blocks and resubmit"
        )

    def touch(self, session_id: str) -> None:
        """Renew a lease (a handover message of the session)."""
        lease = self._leases.get(session_id)
        if lease is not None:
            lease.last_seen = self._clock()

    def stream_started(self, session_id: str) -> None:
        lease = self._leases.get(session_id)
        if lease is not None:
            lease.streams += 1

    def stream_ended(self, session_id: str) -> None:
        lease = self._leases.get(session_id)
        if lease is not None:
            lease.streams = max(0, lease.streams - 1)
            lease.last_seen = self._clock()

    def end(self, session_id: str, why: str) -> Session | None:
        """Forget a session, remembering ``why`` (e.g. "was closed by CloseSession")."""
        session = self._sessions.pop(session_id, None)
        self._leases.pop(session_id, None)
        if session is None:
            return None
        left = self._by_tenant[session.tenant] - 1
        if left:
            self._by_tenant[session.tenant] = left
        else:
            del self._by_tenant[session.tenant]
        key = (session.tenant, session.job)
        if self._by_job[key] > 1:
            self._by_job[key] -= 1
        else:
            del self._by_job[key]
            if self.on_job_idle is not None:
                self.on_job_idle(*key)
        self._ended[session_id] = why
        while len(self._ended) > ENDED_SESSIONS_KEPT:
            self._ended.popitem(last=False)
        return session

    def _expired_reason(self) -> str:
        return (
            f"expired: no call and no open result stream for more than {self.ttl_s:g} s "
            "(session_ttl_s)"
        )

    def reap(self) -> list[Session]:
        """End every session whose lease ran out; returns them."""
        deadline = self._clock() - self.ttl_s
        gone = [
            sid
            for sid, lease in self._leases.items()
            if not lease.streams and lease.last_seen < deadline
        ]
        ended = [self.end(sid, self._expired_reason()) for sid in gone]
        return [s for s in ended if s is not None]

    def next_expiry(self) -> float | None:
        """When the earliest lease runs out (the table's clock), or None when none can."""
        idle = [lease.last_seen for lease in self._leases.values() if not lease.streams]
        return None if not idle else min(idle) + self.ttl_s


class AuthThrottle:
    """Failed authentications per peer: a burst of ``burst``, then ``per_s`` a second."""

    def __init__(
        self, *, burst: int = 10, per_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.per_s = per_s
        self._clock = clock
        #: peer -> (failures still allowed, when that was counted)
        self._peers: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _allowance(self, peer: str) -> float:
        left, at = self._peers.get(peer, (float(self.burst), self._clock()))
        return min(float(self.burst), left + (self._clock() - at) * self.per_s)

    def check(self, peer: str) -> None:
        """DaemonBusyError while ``peer`` has used up its failed authentications."""
        if self._allowance(peer) < 1.0:
            raise DaemonBusyError(
                f"too many failed authentications from {peer}: at most {self.burst} in a row, "
                f"then {self.per_s:g} a second; wait and check the tenant's token"
            )

    def failed(self, peer: str) -> None:
        self._peers[peer] = (self._allowance(peer) - 1.0, self._clock())
        self._peers.move_to_end(peer)
        while len(self._peers) > AUTH_PEERS_KEPT:
            self._peers.popitem(last=False)


#: The settings a refusal names, as they appear in its message (the ``limit`` label of
#: ``asteria_limit_refusals``); a refusal that names none is ``other``.
LIMIT_NAMES = (
    "tenant_max_blocks",
    "tenant_queued_bytes",
    "tenant_cached_bytes",
    "max_memory_bytes",
    "tenant_upload_share",
    "max_upload_bytes",
    "upload_idle_s",
    "upload_max_s",
    "tenant_max_sessions",
    "max_sessions",
    "tenant_max_streams",
    "stream_stall_s",
    "tenant_max_jobs",
    "max_job_daemons",
    "tenant_max_peers",
    "tenant_shm_segments",
    "failed authentications",
)


def limit_named(message: str) -> str:
    """The limit a refusal's message names first (one of :data:`LIMIT_NAMES`), else
    ``other``."""
    found = [(message.find(name), name) for name in LIMIT_NAMES if name in message]
    if not found:
        return "other"
    name = min(found)[1]
    return "auth_throttle" if name == "failed authentications" else name


class QuotaRefusals:
    """Requests refused for a limit or quota: counted per (tenant, limit) for the metrics, and
    logged at most once per tenant and ``every_s`` at WARNING (the first at once; later ones
    counted and summed up in the next line), so a tenant at its quota is seen in the log without
    a line per refused snapshot. ``tenant`` must be a bounded label (a configured tenant, or
    ``unknown``)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self.every_s = every_s
        self._clock = clock
        self._counts: dict[tuple[str, str], int] = {}
        #: tenant -> (when last logged, refusals not logged since)
        self._logged: dict[str, tuple[float, int]] = {}

    def counts(self) -> dict[tuple[str, str], int]:
        """(tenant, limit) -> refusals so far (a copy; read from the metrics thread)."""
        return dict(self._counts)

    def refused(self, tenant: str, message: str) -> str:
        """Count and maybe log one refusal; returns the limit it was counted under."""
        limit = limit_named(message)
        key = (tenant, limit)
        self._counts[key] = self._counts.get(key, 0) + 1
        now = self._clock()
        logged_at, quiet = self._logged.get(tenant, (-math.inf, 0))
        if now - logged_at < self.every_s:
            self._logged[tenant] = (logged_at, quiet + 1)
            return limit
        more = f" (and {quiet} more refusals since the last line)" if quiet else ""
        self._logger.warning(
            "refused a request of tenant %r (limit %s): %s%s",
            tenant,
            limit,
            message,
            more,
            extra={"tenant": tenant},
        )
        self._logged[tenant] = (now, 0)
        return limit


class CallerTickets:
    """Who a Unix-socket caller is, for the authentication throttle (thread-safe).

    gRPC tells the daemon nothing of a Unix-socket caller (its peer is ``unix:``), so the throttle
    would count every local process's failures together, and one tenant's wrong guesses would
    lock the other tenants out. The handover socket sees the connecting process's credentials
    (``SO_PEERCRED``): it issues a random ticket for them (:meth:`issue`), the client names the
    ticket in OpenSession and CloseSession, and the throttle counts per calling process
    (:meth:`caller`). A ticket lives ``ttl_s``; at most ``max_kept`` are kept (the oldest go)."""

    def __init__(
        self,
        *,
        ttl_s: float = 300.0,
        max_kept: int = AUTH_PEERS_KEPT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_kept = max_kept
        self._clock = clock
        self._lock = threading.Lock()
        #: ticket -> (who, when it expires), oldest first
        self._tickets: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._by_caller: dict[str, str] = {}  # who -> the ticket issued to it last

    def issue(self, uid: int, pid: int) -> str:
        """A ticket for process ``pid`` of user ``uid``: the one it holds while that is valid
        (so one process asking again and again cannot push the others' tickets out)."""
        who = f"uid={uid} pid={pid}"
        with self._lock:
            held = self._by_caller.get(who)
            if held is not None and self._tickets.get(held, ("", 0.0))[1] > self._clock():
                self._tickets[held] = (who, self._clock() + self.ttl_s)
                self._tickets.move_to_end(held)
                return held
            ticket = secrets.token_urlsafe(18)
            self._tickets[ticket] = (who, self._clock() + self.ttl_s)
            self._by_caller[who] = ticket
            while len(self._tickets) > self.max_kept:
                old, (gone, _) = self._tickets.popitem(last=False)
                if self._by_caller.get(gone) == old:
                    del self._by_caller[gone]
        return ticket

    def caller(self, ticket: str) -> str | None:
        """``uid=U pid=P`` of the process ``ticket`` was issued to; None: unknown or expired."""
        if not ticket:
            return None
        with self._lock:
            entry = self._tickets.get(ticket)
            if entry is None:
                return None
            if entry[1] < self._clock():
                del self._tickets[ticket]
                return None
            return entry[0]


def throttle_key(peer: str, ticket: str, tickets: CallerTickets | None) -> str:
    """The authentication throttle's key for a caller: its host over TCP; over the Unix socket
    the process its ticket names (``unix uid=U pid=P``), or ``unix (no ticket)`` for every
    caller without a valid one (throttled together, apart from the ticketed ones)."""
    host = peer_host(peer)
    if host != "unix":
        return host
    who = None if tickets is None else tickets.caller(ticket)
    return f"unix {who}" if who is not None else "unix (no ticket)"


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string (``ipv4:1.2.3.4:567`` -> ``ipv4:1.2.3.4``); a Unix
    socket's peers are one."""
    if peer.startswith("unix"):
        return "unix"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class FdBudget:
    """Descriptors held for clients (handover segments and connections), per tenant and in
    total; thread-safe."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = max(1, total)
        self.per_tenant = max(1, min(per_tenant, self.total))
        self._lock = threading.Lock()
        self._used = 0
        self._by_tenant: dict[str, int] = {}

    @property
    def used(self) -> int:
        return self._used

    def acquire(self, tenant: str | None, count: int = 1) -> str | None:
        """Take ``count`` descriptors for ``tenant`` (None: not yet known, the total only);
        None when granted, else why not."""
        with self._lock:
            if self._used + count > self.total:
                return (
                    f"the daemon holds {self._used} descriptors for clients, its limit (the "
                    "process's descriptor limit less a reserve for its own work); send further "
                    "blocks in chunks"
                )
            if tenant is not None:
                held = self._by_tenant.get(tenant, 0)
                if held + count > self.per_tenant:
                    return (
                        f"tenant {tenant!r} holds {held} handed-over descriptors, its share "
                        f"({self.per_tenant}: two per segment, tenant_shm_segments); send "
                        "further blocks in chunks"
                    )
                self._by_tenant[tenant] = held + count
            self._used += count
            return None

    def charge(self, tenant: str) -> str | None:
        """Charge a descriptor already counted in the total to ``tenant`` (a connection that
        said hello); None when granted, else why not (it stays counted in the total)."""
        with self._lock:
            held = self._by_tenant.get(tenant, 0)
            if held >= self.per_tenant:
                return (
                    f"tenant {tenant!r} holds {held} handed-over descriptors "
                    f"(tenant_shm_segments = {self.per_tenant}); close some connections"
                )
            self._by_tenant[tenant] = held + 1
            return None

    def release(self, tenant: str | None, count: int = 1) -> None:
        if count <= 0:
            return
        with self._lock:
            self._used -= count
            if tenant is not None:
                left = self._by_tenant.get(tenant, 0) - count
                if left > 0:
                    self._by_tenant[tenant] = left
                else:
                    self._by_tenant.pop(tenant, None)


def raise_nofile_limit() -> int:
    """Raise the soft descriptor limit to the hard one (where the hard one is finite); returns
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def fd_budget_for(soft_limit: int) -> int:
    """Descriptors the handover may keep for clients under ``soft_limit``: a quarter (at
    least 64) is kept back for the daemon's own sockets, pipes, workers and gRPC connections."""
    return max(1, soft_limit - max(64, soft_limit // 4))
