"""Hierarchical sync between the node daemons of a multi-node job (the ``Peer`` service).

- :mod:`.owners`: the deterministic, cost-balanced owner map every daemon computes alike;
- :mod:`.manager`: the peer groups (heartbeats, failure detection, the snapshot gate that leaves
  a block to its owner, pushes of results, status);
- :mod:`.service`: the gRPC ``asteria.v1.Peer`` servicer over the manager.
"""

from asteria_server.owners import balance, block_cost, owner_map
from asteria_server.sync.manager import SyncConfig, SyncManager

__all__ = ["SyncConfig", "SyncManager", "balance", "block_cost", "owner_map"]
