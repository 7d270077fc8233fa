"""The one exception tree shared by the engine, the daemon and the client.

Every error Asteria raises derives from :class:`AsteriaError`. Errors caused by bad input also
derive from :class:`ValueError`, timeouts from :class:`TimeoutError`, so callers can catch either
the Asteria-specific or the standard type. Messages name the block or field and say what to do;
they never contain a matrix or a token.
"""

from __future__ import annotations


class AsteriaError(Exception):
    """Base of every error Asteria raises."""


class InvalidInputError(AsteriaError, ValueError):
    """A caller passed something Asteria cannot accept (shape, dtype, value)."""


class NonFiniteGradientError(InvalidInputError):
    """A gradient holds NaN or Inf; the optimizer refused to step so the weights stay finite."""


class UnsupportedParameterError(InvalidInputError, TypeError):
    """A parameter's dtype or layout is not supported by the optimizer."""


class SolverError(AsteriaError):
    """A root or eigenbasis computation failed even after its retries."""


class BlockFailedError(SolverError):
    """A block failed more consecutive times than allowed and is marked failed."""


class EngineUnavailableError(AsteriaError):
    """The preconditioner engine (embedded or daemon) cannot take or return work."""


class ResultTimeoutError(AsteriaError, TimeoutError):
    """A bounded wait for a fresher result ran out."""


class DaemonBusyError(AsteriaError):
    """The daemon has no room for this snapshot now (its upload budget is full).

    Nothing is wrong with the snapshot: skip it and send the block's next one.
    """


class AuthenticationError(AsteriaError):
    """A daemon refused the caller's credentials (unknown tenant or wrong token)."""


class UnknownSessionError(EngineUnavailableError):
    """The daemon does not know the session: it restarted or the session ended.

    Open a new session, re-register the blocks and resubmit. It is an EngineUnavailableError so a
    caller that only degrades on unavailability still does the right thing.
    """
