"""The engine's value types now live in the leaf :mod:`asteria_server.types`; this module keeps
the old import path working for code outside the project."""

from asteria_server.types import (
    ACCEPTED_DTYPES,
    DEFAULT_TENANT,
    SolveKind,
    SolveResult,
    SolveTask,
    SubmitOutcome,
)

__all__ = [
    "ACCEPTED_DTYPES",
    "DEFAULT_TENANT",
    "SolveKind",
    "SolveResult",
    "SolveTask",
    "SubmitOutcome",
]
