"""How snapshots reach a preconditioner engine outside the training process.

- :mod:`asteria_client.transport.connection`: one gRPC session with a daemon
  (:class:`DaemonConnection`), without torch: ``asteria status`` and ``asteria forget`` use it;
- :mod:`asteria_client.transport.daemon`: the node's ``asteria-server`` as a training run's
  source of results (:class:`DaemonSource`), a Unix socket or TCP; it imports torch, so it is
  imported when first named here, not with the package.

The in-process engine lives in :mod:`asteria_client.runtime.embedded`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asteria_client.transport.connection import DaemonClientConfig, DaemonConnection

if TYPE_CHECKING:
    from asteria_client.transport.daemon import DaemonSource


def __getattr__(name: str) -> Any:
    """``DaemonSource``, imported on first use (PEP 562)."""
    if name != "DaemonSource":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module("asteria_client.transport.daemon").DaemonSource
    globals()[name] = value
    return value


__all__ = ["DaemonClientConfig", "DaemonConnection", "DaemonSource"]
