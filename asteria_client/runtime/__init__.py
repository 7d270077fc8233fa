"""The client runtime: where preconditioner results come from, their versions and staleness.

The optimizers (``asteria_client.optim``) use only the names exported here; the sources behind
them (native, embedded engine, daemon) and the transfer layer are this package's business.
"""

from asteria_client.runtime.freshness import (
    FreshnessRuntime,
    Mode,
    TileBlocks,
    make_source,
    parse_enum,
    resolve_mode,
)
from asteria_client.runtime.source import (
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
)
from asteria_client.runtime.staleness import DEFAULT_REFRESH_OVERHEAD, Refresh, StalenessPolicy

__all__ = [
    "DEFAULT_REFRESH_OVERHEAD",
    "FreshnessRuntime",
    "Mode",
    "PreconditionerRequest",
    "PreconditionerResult",
    "PreconditionerSource",
    "Refresh",
    "StalenessPolicy",
    "TileBlocks",
    "make_source",
    "parse_enum",
    "resolve_mode",
]
