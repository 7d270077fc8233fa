"""The one table between gRPC status codes and Asteria exceptions, used by both sides of the wire.

The daemon's servicers turn an exception into a status with :func:`to_status`; the client's gRPC
transport turns a failed call's status back into an exception with :func:`from_status`. Each row
of :data:`STATUS_TABLE` round-trips: ``from_status(*to_status(exc))`` has the class of the row.

- An exception maps through its nearest class in the table (``NonFiniteGradientError`` travels
  as ``INVALID_ARGUMENT`` and comes back as ``InvalidInputError``).
- Anything else, a bug included, becomes ``INTERNAL``. Only Asteria errors carry their message
  (those are written to be safe to show); any other exception's text stays in the server's log.
- A code not in the table (``INTERNAL``, ``UNKNOWN``, ``CANCELLED``, ...,
  also those gRPC raises itself) comes back as :class:`EngineUnavailableError`, so a client that
  degrades on unavailability keeps training.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc

from asteria_server.errors import (
    AsteriaError,
    AuthenticationError,
    BlockFailedError,
    DaemonBusyError,
    EngineUnavailableError,
    InvalidInputError,
    ResultTimeoutError,
    SolverError,
    UnknownSessionError,
)

#: Asteria exception ⇄ gRPC status code, one to one. A subclass precedes its base.
STATUS_TABLE: tuple[tuple[type[AsteriaError], grpc.StatusCode], ...] = (
    # Bad input: a shape, dtype, value or stream that cannot be accepted. Do not retry as is.
    (InvalidInputError, grpc.StatusCode.INVALID_ARGUMENT),
    # Wrong token or unknown tenant.
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    # The daemon restarted or the session ended: open a new session, re-register, resubmit.
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    # The engine cannot take or return work now (closed, broken, shutting down). Degrade.
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
    # A bounded wait ran out (also what a call's own gRPC deadline produces).
    (ResultTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    # The block is marked failed until a solve of it succeeds.
    (BlockFailedError, grpc.StatusCode.FAILED_PRECONDITION),
    # A solve failed after its retries; the last good result stays in use.
    (SolverError, grpc.StatusCode.ABORTED),
    # No room for this upload now (the daemon's upload budget is full): send the next snapshot.
    (DaemonBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)

_CODE_OF: dict[type, grpc.StatusCode] = dict(STATUS_TABLE)
_ERROR_OF: dict[grpc.StatusCode, type[AsteriaError]] = {code: cls for cls, code in STATUS_TABLE}
assert len(_CODE_OF) == len(_ERROR_OF) == len(STATUS_TABLE), "STATUS_TABLE must be one to one"
assert grpc.StatusCode.OK not in _ERROR_OF and grpc.StatusCode.INTERNAL not in _ERROR_OF

#: gRPC carries the message in a header; longer ones are cut (Asteria's are far shorter).
MAX_MESSAGE_CHARS = 2000


def _clip(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 1] + "…"


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a server answers ``exc`` with."""
    for cls in type(exc).__mro__:
        code = _CODE_OF.get(cls)
        if code is not None:
            return code, _clip(str(exc) or cls.__name__)
    if isinstance(exc, AsteriaError):
        return grpc.StatusCode.INTERNAL, _clip(f"{type(exc).__name__}: {exc}")
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error in the server ({type(exc).__name__}); see the server's log",
    )


def from_status(code: grpc.StatusCode, message: str) -> AsteriaError:
    """The exception a client raises for a call that failed with ``code`` and ``message``."""
    if not isinstance(code, grpc.StatusCode):
        raise TypeError(f"from_status() takes a grpc.StatusCode, got {code!r}")
    if code is grpc.StatusCode.OK:
        raise ValueError("from_status(): StatusCode.OK is not an error")
    cls = _ERROR_OF.get(code)
    if cls is not None:
        return cls(message)
    return EngineUnavailableError(
        f"the call to the daemon failed with {code.name}: {message or 'no details'}"
    )


async def abort_call(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    """End a servicer's call with the status of ``exc`` (:func:`to_status`); an INTERNAL one, a
    bug, is logged with its traceback, since its text never reaches the caller."""
    code, message = to_status(exc)
    if code is grpc.StatusCode.INTERNAL:
        logging.getLogger(__name__).error("internal error in a call", exc_info=exc)
    await context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises
