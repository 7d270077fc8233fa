"""How snapshots reach a preconditioner engine outside the training process.

- :mod:`asteria_client.transport.daemon`: the node's ``asteria-server`` over gRPC
  (:class:`DaemonSource`), a Unix socket or TCP.

The in-process engine lives in :mod:`asteria_client.runtime.embedded`.
"""

from asteria_client.transport.connection import DaemonClientConfig, DaemonConnection
from asteria_client.transport.daemon import DaemonSource

__all__ = ["DaemonClientConfig", "DaemonConnection", "DaemonSource"]
