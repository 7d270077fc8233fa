"""Who is the daemon on the other end of a Unix socket? ``SO_PEERCRED`` says.

A client hands a daemon its tenant token (``OpenSession``) and its shared-memory segments (the
handover socket). If another local user could put their own process behind the socket path (a
swapped directory, a stale path in a world-writable place), they would receive both. So before a
session is opened, and on every handover connection, the client asks the kernel which user owns
the process that accepted it and refuses anyone but the expected one: by default this client's
own user or root (root can read any process's memory anyway), or exactly the uid that
``ASTERIA_DAEMON_UID`` names (a system daemon run as its own user).

A refusal leaves training to compute every block locally, so it is never quiet: the first one
in a process is logged at WARNING with the uid seen, the uids expected and the fix
(``ASTERIA_DAEMON_UID``), and every one is counted (:func:`refusals`, shown in the daemon source's
``stats()`` and by the local fallbacks it causes in ``runtime_stats()``).

gRPC does not expose its socket, so for the gRPC socket the check is made on a connection of our
own to the same path just before the session opens; the handover socket is checked on the very
connection that carries the segments.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading

from asteria_client.config import client_env
from asteria_server.errors import AuthenticationError, InvalidInputError
from asteria_server.protocol.handover import (
    MAX_MESSAGE_BYTES,
    Ticket,
    decode_reply,
    encode_request,
)

logger = logging.getLogger(__name__)

#: ``struct ucred`` as Linux returns it for SO_PEERCRED: pid, uid, gid.
_UCRED = struct.Struct("3i")

_lock = threading.Lock()
#: Refusals in this process (every check that found an unexpected uid), and whether the one
#: WARNING has been logged.
_refusals = 0
_warned = False


class UntrustedDaemonError(AuthenticationError):
    """The process behind the daemon's socket belongs to a user this client does not trust."""


def expected_uids() -> frozenset[int]:
    """The users a daemon may run as: ``ASTERIA_DAEMON_UID`` if set, else ours and root."""
    configured = client_env().daemon_uid
    if configured is not None:
        return frozenset({configured})
    return frozenset({os.getuid(), 0})


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of the connected Unix socket ``sock``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, _ = _UCRED.unpack(raw)
    return pid, uid


def refusals() -> int:
    """How many times this process refused a daemon for its uid (every check counts)."""
    with _lock:
        return _refusals


def _refused(path: str, pid: int, uid: int, allowed: frozenset[int]) -> UntrustedDaemonError:
    """Count a refusal, log the first of the process at WARNING, and build its error."""
    global _refusals, _warned
    configured = client_env().daemon_uid is not None
    fix = (
        f"ASTERIA_DAEMON_UID is {min(allowed)}: correct it to {uid} if that daemon is the node's"
        if configured
        else f"Set ASTERIA_DAEMON_UID={uid} in the job's environment if that daemon is the node's"
    )
    error = UntrustedDaemonError(
        f"the daemon socket {path} is served by pid {pid} of uid {uid}, not by an expected "
        f"user (uid(s) {', '.join(map(str, sorted(allowed)))}): refusing to send it a token or "
        f"memory, so its blocks are computed locally. {fix}"
    )
    with _lock:
        _refusals += 1
        first, _warned = not _warned, True
    if first:
        logger.warning("%s (logged once per process; refusals are counted)", error)
    return error


def check_peer(sock: socket.socket, path: str) -> None:
    """Raise :class:`UntrustedDaemonError` unless the peer of ``sock`` runs as an expected user."""
    pid, uid = peer_uid(sock)
    allowed = expected_uids()
    if uid not in allowed:
        raise _refused(path, pid, uid, allowed)


def check_socket_owner(address: str, *, timeout_s: float = 5.0) -> None:
    """For a ``unix://`` daemon address, connect once and check who serves it (see the module
    docstring); other addresses are left to TLS. An unreachable socket is not an error here:
    the call that follows reports it."""
    path = _unix_path(address)
    if path is None:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError:
            return
        check_peer(sock, path)


def _unix_path(address: str) -> str | None:
    if not address.startswith("unix:"):
        return None
    path = address.removeprefix("unix:")
    return path[2:] if path.startswith("//") else path


def caller_ticket(address: str, *, timeout_s: float = 5.0) -> str:
    """For a ``unix://`` daemon address: a caller ticket from its handover socket (``<socket>.shm``:
    see :mod:`asteria_server.protocol.handover`), which OpenSession and CloseSession name so that
    the daemon throttles this process's failed authentications apart from every other local
    process's. "" where there is none to have (TCP, no handover socket, a daemon that predates
    tickets, or one served by an unexpected user): the calls then go without."""
    path = _unix_path(address)
    if path is None:
        return ""
    shm = path + ".shm"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(shm)
            check_peer(sock, shm)
            sock.send(encode_request(Ticket()))
            reply = decode_reply(sock.recv(MAX_MESSAGE_BYTES))
        except (OSError, InvalidInputError, UntrustedDaemonError) as exc:
            logger.debug("no caller ticket from %s: %s", shm, exc)
            return ""
    return reply.ticket if reply.ok else ""
