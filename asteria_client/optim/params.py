"""Every idiom users pass to an optimizer, turned into param groups of ``(name, tensor)`` pairs.

Asteria keys optimizer state by parameter *name* (checkpoints survive regrouping and, later,
another world size), so every parameter needs one. Users write any of::

    SOAP(model.named_parameters())                       # names given
    SOAP(dict(model.named_parameters()))                 # a name -> tensor mapping
    SOAP(model.parameters())                             # no names
    SOAP([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])   # AdamW's idiom

``torch.optim.Optimizer`` refuses to mix named and unnamed groups, and reads a mapping's keys as
parameters. This module normalizes all of them *before* torch sees them: names come from the
pairs or mapping when given, else from ``model`` (``model=`` at construction or
``optimizer.attach(model)`` before the first step), else from position (``param0``, ``param1``,
...) — the last one with a ``UserWarning``, because a checkpoint keyed by position breaks when
the parameter order changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from asteria_server.errors import InvalidInputError

#: Prefix of the positional names given to parameters passed without one.
POSITIONAL_PREFIX = "param"


def model_names(model: torch.nn.Module | None) -> dict[int, str]:
    """``id(tensor) -> name`` for every parameter of ``model`` (empty without a model)."""
    if model is None:
        return {}
    return {id(p): name for name, p in model.named_parameters()}


class ParamNamer:
    """Gives every parameter a name; counts the positional ones (``param<i>``)."""

    def __init__(self, names_by_id: dict[int, str]) -> None:
        self.names_by_id = names_by_id
        self.num_positional = 0
        self.positional_ids: set[int] = set()  # parameters named by position

    def name(self, tensor: torch.Tensor) -> str:
        known = self.names_by_id.get(id(tensor))
        if known is not None:
            return known
        name = f"{POSITIONAL_PREFIX}{self.num_positional}"
        self.num_positional += 1
        self.positional_ids.add(id(tensor))
        return name

    def named_group(self, group: Mapping[str, Any], where: str) -> dict[str, Any]:
        """A copy of ``group`` whose ``"params"`` are ``(name, tensor)`` pairs."""
        if "params" not in group:
            raise InvalidInputError(f"{where} has no 'params' key")
        out = dict(group)
        out["params"] = self.named_params(group["params"], where)
        return out

    def named_params(self, params: Any, where: str) -> list[tuple[str, torch.Tensor]]:
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, Mapping):
            params = list(params.items())
        elif isinstance(params, set):
            raise InvalidInputError(
                f"{where}: parameters must be an ordered collection (a list), not a set"
            )
        pairs = []
        for index, item in enumerate(params):
            if isinstance(item, torch.Tensor):
                pairs.append((self.name(item), item))
            elif (
                isinstance(item, tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)
            ):
                pairs.append((item[0], item[1]))
            else:
                raise InvalidInputError(
                    f"{where}, item {index}: expected a tensor or a (name, tensor) pair, got "
                    f"{type(item).__name__}; pass model.named_parameters(), "
                    "dict(model.named_parameters()), model.parameters(), or param groups "
                    "{'params': [...], ...} of those"
                )
        return pairs


def named_param_groups(params: Any, namer: ParamNamer) -> list[dict[str, Any]]:
    """Normalize every accepted form of ``params`` to groups of ``(name, tensor)`` pairs."""
    if isinstance(params, torch.Tensor):
        raise InvalidInputError(
            "params must be an iterable of tensors, (name, tensor) pairs or param groups, "
            "not a single tensor; pass model.named_parameters()"
        )
    if isinstance(params, Mapping):
        if "params" in params:  # one group given as a dict
            return [namer.named_group(params, "the param group")]
        return [{"params": namer.named_params(params, "the parameter mapping")}]
    if not isinstance(params, Iterable):
        raise InvalidInputError(
            f"params must be an iterable, got {type(params).__name__}; "
            "pass model.named_parameters()"
        )
    items = list(params)
    if not items:
        raise InvalidInputError("the optimizer got an empty parameter list")
    if all(isinstance(item, Mapping) for item in items):
        return [namer.named_group(g, f"param group {i}") for i, g in enumerate(items)]
    if any(isinstance(item, Mapping) for item in items):
        raise InvalidInputError(
            "params mixes param groups (dicts) with parameters; put every parameter in a group"
        )
    return [{"params": namer.named_params(items, "params")}]
