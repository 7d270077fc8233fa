"""Hierarchical sync between the node daemons of a multi-node job (the ``Peer`` service).

- :mod:`asteria_server.owners`: the deterministic, cost-balanced owner map every daemon
  computes alike (the one owner rule, shared with the client);
- :mod:`.config`: the peer groups' timings (:class:`SyncConfig`);
- :mod:`.membership`: who is in a job's group, heartbeat state and liveness, agreement on the
  block lists, the owner maps that follow from them;
- :mod:`.decide`: the snapshot gate's decisions as pure functions that return actions (solve
  here, claim from the owner, wait for a member's push, ask again later);
- :mod:`.links`: the push link to each peer (what it has, what is queued for it, its channel);
- :mod:`.group`: one job's group (:class:`~.group.JobSync`), which carries out the decisions:
  the gate, claims, results and status;
- :mod:`.manager`: every group of the daemon and the loop around them (heartbeats, senders,
  claims, the calls peers make);
- :mod:`.push`, :mod:`.policy`: checks of incoming pushes, the operator's rules on peers;
- :mod:`.service`: the gRPC ``asteria.v1.Peer`` servicer over the manager.
"""

from asteria_server.owners import balance, block_cost, owner_map
from asteria_server.sync.config import SyncConfig
from asteria_server.sync.manager import SyncManager

__all__ = ["SyncConfig", "SyncManager", "balance", "block_cost", "owner_map"]
