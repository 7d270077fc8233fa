"""Which daemons a peer group may contact, and how many: the operator's rules, not a tenant's.

A job's layout is written by a tenant's ranks, so the addresses in it are a tenant's words:
without bounds one RegisterJob of 4,096 nodes (closed ports) made the daemon heartbeat every
one 4 times a second, slowing every other tenant for minutes, and the daemon connected to any
host:port written there. So, before a job's peer group is formed:

- **Size.** A job spans at most ``max_job_daemons`` distinct daemons, and one tenant's peer
  groups together contact at most ``tenant_max_peers`` (RESOURCE_EXHAUSTED naming the limit).
- **Addresses.** Every peer address must match the operator's ``peer_allow`` patterns (IP
  networks such as ``10.0.0.0/8``, or host-name patterns such as ``node-*.cluster``); without
  patterns, a daemon on loopback or a Unix socket contacts loopback peers only (a daemon the
  operator put on another interface, which needs TLS there, may contact any: its TLS root
  refuses daemons without the job's certificate). INVALID_ARGUMENT names ``peer_allow``.

Rates (in :mod:`asteria_server.sync.manager`): a peer that has not yet proven itself (answered
a heartbeat, or called with the job token) is asked at most once a second, backing off to
``UNPROVEN_HEARTBEAT_MAX_S``; only proven peers get a heartbeat every ``heartbeat_s``. Those
bounds are per peer, so many tenants' many unproven peers add up: a :class:`RateLimit` shared by
every peer group of the daemon spaces all heartbeats to unproven peers to at most
``SyncConfig.unproven_heartbeats_per_s`` (16) together, first come first served across tenants.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from dataclasses import dataclass

from asteria_server.errors import DaemonBusyError, InvalidInputError

#: The longest wait between two heartbeats to a peer that never answered one.
UNPROVEN_HEARTBEAT_MAX_S = 16.0


class RateLimit:
    """At most ``per_s`` events a second after a burst of ``burst``, as slots handed out in
    order (a virtual clock, as GCRA): :meth:`reserve` books the next slot and says how long
    to wait for it, so waiters are served first come first served and none is starved."""

    def __init__(self, per_s: float, *, burst: int = 1) -> None:
        if not per_s > 0 or burst < 1:
            raise ValueError(f"RateLimit needs per_s > 0 and burst >= 1, got {per_s}, {burst}")
        self.per_s = per_s
        self.burst = burst
        self._next = -float("inf")  # when the next slot is free (the virtual clock)

    def reserve(self, now: float) -> float:
        """Book a slot; seconds to wait before using it (0: now)."""
        interval = 1.0 / self.per_s
        earliest = max(self._next, now - (self.burst - 1) * interval)
        self._next = earliest + interval
        return max(0.0, earliest - now)


def parse_patterns(text: str) -> tuple[str, ...]:
    """``peer_allow``'s comma-separated patterns; ValueError naming a malformed network."""
    patterns = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    for pattern in patterns:
        if "/" in pattern:
            try:
                ipaddress.ip_network(pattern, strict=False)
            except ValueError:
                raise ValueError(
                    f"peer_allow: {pattern!r} is neither an IP network (10.0.0.0/8) nor a host "
                    "pattern (node-*.cluster)"
                ) from None
    return patterns


def address_host(address: str) -> str | None:
    """The host of a daemon address (``host:port``, ``[v6]:port``, ``dns:host:port``); None for
    a Unix socket, which no other node can reach (never contacted)."""
    if address.startswith("unix:"):
        return None
    target = address.removeprefix("dns:").lstrip("/")
    if target.startswith("["):
        return target[1 : target.find("]")].lower() if "]" in target else target.lower()
    host, sep, port = target.rpartition(":")
    return (host if sep and port.isdigit() else target).lower()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True)
class PeerPolicy:
    """The operator's bounds on peer groups (see the module docstring)."""

    max_job_daemons: int = 64
    tenant_max_peers: int = 256
    allow: tuple[str, ...] = ()
    #: without ``allow``: contact loopback peers only (a daemon on loopback or a Unix socket)
    loopback_only: bool = True

    def allowed(self, address: str) -> bool:
        host = address_host(address)
        if host is None:
            return True  # a Unix socket: never contacted
        if not self.allow:
            return not self.loopback_only or _is_loopback(host)
        for pattern in self.allow:
            if "/" in pattern:
                try:
                    if ipaddress.ip_address(host) in ipaddress.ip_network(pattern, strict=False):
                        return True
                except ValueError:
                    continue
            elif fnmatch.fnmatchcase(host, pattern):
                return True
        return False

    def check(self, job: str, me: str, addresses: list[str], tenant_peers: int) -> None:
        """Raise for a job of these distinct daemon ``addresses`` (``me`` is this daemon's)
        when the operator's rules refuse it; ``tenant_peers``: peers the tenant's other
        groups contact already."""
        what = f"RegisterJob of job {job[:64]!r}"
        if len(addresses) > self.max_job_daemons:
            raise DaemonBusyError(
                f"{what}: its layout lists {len(addresses)} daemons, more than this daemon's "
                f"max_job_daemons ({self.max_job_daemons}); its daemons do not sync"
            )
        peers = len(addresses) - 1
        if tenant_peers + peers > self.tenant_max_peers:
            raise DaemonBusyError(
                f"{what}: the tenant's peer groups would contact {tenant_peers + peers} daemons, "
                f"more than tenant_max_peers ({self.tenant_max_peers}); its daemons do not sync"
            )
        for address in addresses:
            if address != me and not self.allowed(address):
                rule = (
                    f"the patterns {', '.join(self.allow)}"
                    if self.allow
                    else "loopback addresses only (this daemon listens on loopback or a socket)"
                )
                raise InvalidInputError(
                    f"{what}: daemon address {address[:128]!r} is not one this daemon may "
                    f"contact: peer_allow allows {rule}; ask the operator to add it"
                )
