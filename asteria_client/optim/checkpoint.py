"""Saving and loading Asteria's optimizer state with ``torch.distributed.checkpoint`` (DCP).

**Saving needs nothing special**::

    state = {"model": get_model_state_dict(model), "optim": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=path)

``optimizer.state_dict()`` is already keyed by parameter name (what torch's
``get_optimizer_state_dict`` produces for its own optimizers), and a sharded (FSDP2) parameter's
state by its shard's global rows (``fc.weight@rows0:12``). Under DDP every rank's entries are
equal, so DCP writes each once; under FSDP2 every rank writes its own shards' entries.

**Loading needs the entry's layout up front**: ``dcp.load`` fills a state dict of the right
shape in place, but a fresh optimizer has no state yet, and at another world size its shards are
not the saved ones. :class:`OptimizerLoadPlanner` builds that part of the state dict from the
checkpoint's own metadata — the entries this rank needs (its shard's, or the saved shards that
overlap its rows) and the hyperparameters — then ``optimizer.load_state_dict`` restores them,
rebuilding tiles whose shard geometry changed (:mod:`~asteria_client.optim.reshard`)::

    state = {"model": get_model_state_dict(model), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=OptimizerLoadPlanner(optimizer))
    set_model_state_dict(model, state["model"])
    optimizer.load_state_dict(state["optim"])

Why not ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``: they expect torch's layout
(state keyed by parameter *index*, groups listing ``"params"``), create missing state by running
a step with zero gradients, and reshard only state tensors shaped like the parameter. Asteria's
state is keyed by name already, and most of it (factors, roots, bases) is not shaped like the
parameter: a shard's factors are blocks of their own, which no resharding of a DTensor produces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from asteria_client.optim.base import AsteriaOptimizer
from asteria_server.errors import InvalidInputError


class OptimizerLoadPlanner(DefaultLoadPlanner):
    """A DCP load planner that builds ``state_dict[key]`` (an Asteria optimizer's entry) from
    the checkpoint's metadata; the rest of the state dict loads as with DCP's default planner.

    Args:
        optimizer: the optimizer whose state is loaded (it chooses the entries it needs).
        key: the optimizer's key in the state dict passed to ``dcp.save`` / ``dcp.load``.
    """

    def __init__(self, optimizer: AsteriaOptimizer, key: str = "optim", **kwargs: Any) -> None:
        if not kwargs.get("flatten_state_dict", True):
            raise InvalidInputError(
                "OptimizerLoadPlanner needs flatten_state_dict=True (DCP's default)"
            )
        super().__init__(**kwargs)
        self.optimizer = optimizer
        self.key = key

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is None or not metadata.planner_data:
            raise InvalidInputError(
                "the checkpoint has no flattening metadata (saved with flatten_state_dict="
                "False?); save the optimizer's state_dict() with DCP's default planner"
            )
        paths = {
            fqn: path for fqn, path in metadata.planner_data.items() if path and path[0] == self.key
        }
        if not paths:
            raise InvalidInputError(
                f"the checkpoint holds no {self.key!r} entry; pass the key the optimizer's "
                "state_dict() was saved under (OptimizerLoadPlanner(optimizer, key=...))"
            )
        saved = {str(path[2]) for path in paths.values() if len(path) > 2 and path[1] == "state"}
        wanted = self.optimizer.checkpoint_entries(saved)
        built: dict[str, Any] = {}
        for fqn, path in paths.items():
            if len(path) > 2 and path[1] == "state" and str(path[2]) not in wanted:
                continue
            stored = metadata.state_dict_metadata[fqn]
            value: Any = None  # a pickled object: DCP replaces it whole
            if isinstance(stored, TensorStorageMetadata):
                value = torch.empty(stored.size, dtype=stored.properties.dtype)
            set_element(built, path, value)
        entry = built[self.key]
        entry.setdefault("state", {})  # an empty mapping leaves no key behind
        state_dict[self.key] = entry
        super().set_up_planner(state_dict, metadata, is_coordinator)
