"""Tiles grouped by shape: one batched operation per group and step, not one per tile.

On a GPU an optimizer step of a model with hundreds of weight matrices is bound by kernel
launches and Python, not by flops: the per-tile code dispatched about 21 operations per
parameter per step (SOAP on the ``asteria train`` GPT), and a model twice as deep dispatched
twice as many. Here the tiles that share a shape, dtype, device, parameter group, set of
preconditioned dims and step count form a :class:`TileGroup`, whose state is *stacked*: one
``[k, *shape]`` tensor per moment and one ``[k, n, n]`` tensor per factor dim, so the rotation into
the eigenbasis is one ``bmm`` for all k tiles, the moments one elementwise op each. A model with
more layers of the same shapes dispatches the same number of operations.

Each tile keeps its own dataclass (its freshness bookkeeping, checkpoints by name and tile): its
tensor fields become *views* of a row of the group's stacks. So the rest of Asteria — requests,
installs, checkpoints, resharding — keeps reading tiles, and an install writes through the view
with :func:`set_tensor` / :func:`set_entry` instead of rebinding the field. A basis or root that a
tile does not have yet (``None``, the identity) is stored as the identity in its row: a product
with the identity is exact, so a group mixes tiles with and without one on the same code path;
the tile's field stays ``None`` until :func:`set_entry` puts a matrix into the row.

A group is built (the tiles' tensors copied into fresh stacks) when the tiles stepping together
change — the first regular step, a loaded checkpoint, a parameter that got no gradient — and
reused otherwise; :meth:`TileGroup.still_backs` checks on every step that each tile's fields
still are the group's views, so state rebound by any other code can never be silently ignored.
Where a group has one tile the code is the same.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: Where a tile keeps the views it was bound to (not a dataclass field: never checkpointed).
_SLOTS = "_group_slots"


@dataclass(frozen=True)
class StorageSpec:
    """Which fields of an optimizer's tile dataclass a group stacks.

    ``tensors``: tensor fields shaped like the tile (moments). ``lists``: per-dim lists whose
    entries are all tensors or all ``None`` across a group (factors, eigenvalues). ``optional``:
    per-dim lists of square matrices that a tile may not have yet (bases, roots), kept for the
    preconditioned dims: stored as the identity until set.
    """

    tensors: tuple[str, ...]
    lists: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()


def _slots(tile: Any) -> dict[Any, Any]:
    slots = tile.__dict__.get(_SLOTS)
    if slots is None:
        slots = tile.__dict__[_SLOTS] = {}
    return slots


def set_tensor(tile: Any, name: str, value: torch.Tensor) -> None:
    """``tile.<name> = value``, written into the group's storage where a group backs the field."""
    row = _slots(tile).get(name)
    if row is not None and getattr(tile, name) is row:
        row.copy_(value)
    else:
        setattr(tile, name, value)


def set_entry(tile: Any, name: str, dim: int, value: torch.Tensor) -> None:
    """``tile.<name>[dim] = value`` (a basis, root or eigenvalue vector), written into the group's
    storage where a group backs it; the entry then is that row's view."""
    slots = _slots(tile)
    row = slots.get((name, dim))
    entries = getattr(tile, name)
    if row is None or (entries[dim] is not None and entries[dim] is not row):
        entries[dim] = value
        return
    row.copy_(value)
    entries[dim] = row
    group = slots.get("group")
    if group is not None:
        group.present[(name, dim)] = True
        mask = group.masks.get(name)
        if mask is not None:
            mask[slots["index"]] = True


def backing_group(tile: Any, tensors: Sequence[str], entry: tuple[str, int]) -> TileGroup | None:
    """The group whose storage backs ``tile``'s ``tensors`` fields and its ``entry``
    (``(field, dim)``: a basis or root, which may still be None), or None where any of them
    is not a view of the group's (a tile outside a group, or state rebound elsewhere)."""
    slots = tile.__dict__.get(_SLOTS)
    if not slots:
        return None
    group = slots.get("group")
    if group is None or any(getattr(tile, name) is not slots.get(name) for name in tensors):
        return None
    row = slots.get(entry)
    value = getattr(tile, entry[0])[entry[1]]
    if row is None or not (value is None or value is row):
        return None
    return group


def row_of(tile: Any) -> int:
    """The tile's row in its group's stacks."""
    return int(_slots(tile)["index"])


def set_rows(
    group: TileGroup,
    name: str,
    dim: int,
    index: torch.Tensor,
    values: torch.Tensor,
    tiles: Sequence[Any],
) -> None:
    """:func:`set_entry` of the ``tiles`` at rows ``index``, in one indexed copy."""
    group.entries[(name, dim)].index_copy_(0, index, values)
    for tile in tiles:
        getattr(tile, name)[dim] = _slots(tile)[(name, dim)]
    group.present[(name, dim)] = True
    mask = group.masks.get(name)
    if mask is not None:
        mask.index_fill_(0, index, True)


class TileGroup:
    """The stacked state of tiles of one shape; see the module docstring."""

    def __init__(
        self,
        tiles: Sequence[Any],
        spec: StorageSpec,
        shape: tuple[int, ...],
        preconditioned: tuple[bool, ...] = (),
    ) -> None:
        self.tiles = list(tiles)
        self.spec = spec
        self.shape = shape
        #: per dim, whether the tiles' factors precondition it (the same for every tile)
        self.preconditioned = preconditioned
        #: whether the tiles have blocks at all: tiles with none have no freshness to keep
        self.has_blocks = any(preconditioned)
        #: field -> [k, *shape]
        self.tensors: dict[str, torch.Tensor] = {}
        #: (field, dim) -> [k, ...]: the stacked entries of per-dim lists
        self.entries: dict[tuple[str, int], torch.Tensor] = {}
        #: (optional field, dim) -> whether any tile has a matrix there (else: skip the product)
        self.present: dict[tuple[str, int], bool] = {}
        #: optional field -> [k] bool on the device: which tiles have one in any dim
        self.masks: dict[str, torch.Tensor] = {}
        #: this group's compiled math (:class:`GroupKernels`), by the function compiled
        self.kernels: dict[Callable[..., Any], Callable[..., Any]] = {}
        #: per tile, its parameter's position among the optimizer's (FSDP2's finite check)
        self.positions: torch.Tensor | None = None
        for index, tile in enumerate(self.tiles):
            slots = _slots(tile)
            slots.clear()
            slots["group"], slots["index"] = self, index
        for name in spec.tensors:
            stack = torch.stack([getattr(t, name) for t in self.tiles])
            self.tensors[name] = stack
            for tile, row in zip(self.tiles, stack.unbind(0), strict=True):
                setattr(tile, name, row)
                _slots(tile)[name] = row
        for name in spec.lists:
            for dim in range(len(shape)):
                values = [getattr(t, name)[dim] for t in self.tiles]
                if all(v is None for v in values):
                    continue
                if any(v is None for v in values):
                    raise ValueError(f"tiles of one group disagree on {name}[{dim}]")
                self._bind_entries(name, dim, torch.stack(values))
        like = next(iter(self.tensors.values()))  # the state's dtype and device
        for name in spec.optional:
            any_set = [False] * len(self.tiles)
            for dim, size in enumerate(shape):
                if not (dim < len(preconditioned) and preconditioned[dim]):
                    continue  # an unpreconditioned dim has no basis or root to keep
                values = [getattr(t, name)[dim] for t in self.tiles]
                eye = torch.eye(size, dtype=like.dtype, device=like.device)
                stack = torch.stack([eye if v is None else v.to(like.dtype) for v in values])
                self._bind_entries(name, dim, stack, keep_none=True)
                self.present[(name, dim)] = any(v is not None for v in values)
                any_set = [a or v is not None for a, v in zip(any_set, values, strict=True)]
            if self.has_blocks:
                self.masks[name] = torch.tensor(any_set, device=like.device)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def __len__(self) -> int:
        return len(self.tiles)

    def _bind_entries(
        self, name: str, dim: int, stack: torch.Tensor, *, keep_none: bool = False
    ) -> None:
        self.entries[(name, dim)] = stack
        for tile, row in zip(self.tiles, stack.unbind(0), strict=True):
            entries = getattr(tile, name)
            if not (keep_none and entries[dim] is None):
                entries[dim] = row
            _slots(tile)[(name, dim)] = row

    def stacked(self, name: str, dim: int) -> torch.Tensor | None:
        """The stacked entries of ``name[dim]``; None where no tile has one (the identity)."""
        if name in self.spec.optional and not self.present.get((name, dim), False):
            return None
        return self.entries.get((name, dim))

    def stacked_all(self, name: str) -> list[torch.Tensor | None]:
        return [self.stacked(name, dim) for dim in range(len(self.shape))]

    def still_backs(self, tiles: Sequence[Any]) -> bool:
        """Whether these are this group's tiles, in order, with every field still its view."""
        if len(tiles) != len(self.tiles):
            return False
        for mine, tile in zip(self.tiles, tiles, strict=True):
            if mine is not tile:
                return False
            slots = tile.__dict__.get(_SLOTS)
            if slots is None or slots.get("group") is not self:
                return False
            for name in self.spec.tensors:
                if getattr(tile, name) is not slots[name]:
                    return False
            for (name, dim), _ in self.entries.items():
                entry = getattr(tile, name)[dim]
                if entry is not slots[(name, dim)] and not (
                    entry is None and name in self.spec.optional
                ):
                    return False
        return True


@dataclass
class GroupStep:
    """One group's work in one step: its tiles' gradients stacked, and where each tile's update
    goes (``owners[i]``: the parameter entry and the tile's index in its plan)."""

    group: TileGroup
    grads: torch.Tensor
    owners: list[tuple[Any, int]]
    hyper: dict[str, Any]
    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    #: whether this step's gradients are all finite, on the device (None: known on the host to
    #: be): every state update of the step is masked by it, so a bad step changes nothing
    mask: StepMask | None = None

    @property
    def tiles(self) -> list[Any]:
        return self.group.tiles


# ---------------------------------------------------------------------- masked updates
class StepMask:
    """A step's "all gradients finite" flag on the device, as the coefficients that mask its
    updates: with ``keep`` = 1 an EMA is the usual one, with 0 it leaves its state as it was,
    and nothing reads the flag on the host (no sync). Coefficients are made once per step."""

    def __init__(self, keep: torch.Tensor) -> None:
        self.keep = keep  # 0-d, 1.0 or 0.0, in the state's dtype and on its device
        self._discard: torch.Tensor | None = None  # 1 - keep
        self._retain: dict[float, torch.Tensor] = {}  # beta -> beta or 1
        self._scaled: dict[float, torch.Tensor] = {}  # value -> value or 0

    def ema(self, beta: float, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b, c)`` such that ``x * b + new * c`` is ``beta x + (1 - beta) scale new`` where
        the step counts, and ``x`` where it does not."""
        b = self._retain.get(beta)
        if b is None:
            if self._discard is None:
                self._discard = 1 - self.keep
            b = self._retain[beta] = self.keep * beta + self._discard  # exactly beta, or 1
        return b, self.scaled((1 - beta) * scale)

    def scaled(self, value: float) -> torch.Tensor:
        """``value`` where the step counts, else 0."""
        c = self._scaled.get(value)
        if c is None:
            c = self._scaled[value] = self.keep * value
        return c


Coefficients = tuple[torch.Tensor, torch.Tensor]


def coefficients(mask: StepMask | None, beta: float, scale: float = 1.0) -> Coefficients | None:
    """``mask.ema(beta, scale)``, or None (plain arithmetic) without a mask."""
    return None if mask is None else mask.ema(beta, scale)


def weight(mask: StepMask | None, value: float) -> float | torch.Tensor:
    """``value`` as an interpolation weight: 0 where a masked step does not count."""
    return value if mask is None else mask.scaled(value)


def ema_(
    state: torch.Tensor,
    new: torch.Tensor,
    beta: float,
    coef: Coefficients | None,
    *,
    scale: float = 1.0,
) -> torch.Tensor:
    """``state <- beta * state + (1 - beta) * scale * new``, in place; with ``coef`` (from
    :meth:`StepMask.ema`) the same where the step counts and no change where it does not."""
    if coef is None:
        return state.mul_(beta).add_(new, alpha=(1 - beta) * scale)
    b, c = coef
    return state.mul_(b).addcmul_(new, c)


def ema_square_(
    state: torch.Tensor, new: torch.Tensor, beta: float, coef: Coefficients | None
) -> torch.Tensor:
    """``state <- beta * state + (1 - beta) * new**2``, in place (masked as :func:`ema_`)."""
    if coef is None:
        return state.mul_(beta).addcmul_(new, new, value=1 - beta)
    b, c = coef
    return state.mul_(b).addcmul_(new, new * c)


# ---------------------------------------------------------------------- batched tensor ops
def mode_product(tensor: torch.Tensor, matrix: torch.Tensor, dim: int) -> torch.Tensor:
    """For each of the k tiles, multiply along tile dim ``dim``: ``tensor`` is ``[k, *shape]``,
    ``matrix`` ``[k, a, b]``; ``out[t, .., i, ..] = sum_j M[t, i, j] T[t, .., j, ..]``."""
    if tensor.dim() == 3:
        return torch.bmm(matrix, tensor) if dim == 0 else torch.bmm(tensor, matrix.transpose(1, 2))
    moved = tensor.movedim(dim + 1, -1)
    rest = moved.shape[1:-1]
    flat = moved.reshape(moved.shape[0], math.prod(rest), moved.shape[-1])
    out = torch.bmm(flat, matrix.transpose(1, 2)).reshape(moved.shape[0], *rest, -1)
    return out.movedim(-1, dim + 1)


def permute_along(tensor: torch.Tensor, perms: torch.Tensor, dim: int) -> torch.Tensor:
    """For each of the k 2-D tiles of ``tensor`` (``[k, a, b]``), its entries reordered along
    tile dim ``dim`` by its row of ``perms`` (``[k, n]``): ``index_select(dim, perm)`` each."""
    k, a, b = tensor.shape
    if dim == 0:
        return tensor.gather(1, perms[:, :, None].expand(k, a, b))
    return tensor.gather(2, perms[:, None, :].expand(k, a, b))


def project(
    tensor: torch.Tensor, bases: Sequence[torch.Tensor | None], *, back: bool = False
) -> torch.Tensor:
    """Rotate each tile into its product basis (``Q_i^T`` on each dim), or back (``Q_i``);
    ``None`` leaves a dim as it is."""
    out = tensor
    for dim, basis in enumerate(bases):
        if basis is not None:
            out = mode_product(out, basis if back else basis.transpose(1, 2), dim)
    return out


def apply_on_dims(tensor: torch.Tensor, matrices: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Apply ``matrices[i]`` (stacked) along tile dim i; ``None`` is the identity."""
    out = tensor
    for dim, matrix in enumerate(matrices):
        if matrix is not None:
            out = mode_product(out, matrix, dim)
    return out


def factor_statistic(
    grad: torch.Tensor, dim: int, other: torch.Tensor | None = None
) -> torch.Tensor:
    """Per tile, ``G_(dim) H_(dim)^T`` contracted over the tile's other dims: ``[k, n, n]``."""
    other = grad if other is None else other
    if grad.dim() == 3:
        if dim == 0:
            return torch.bmm(grad, other.transpose(1, 2))
        return torch.bmm(grad.transpose(1, 2), other)
    k, n = grad.shape[0], grad.shape[dim + 1]
    left = grad.movedim(dim + 1, 1).reshape(k, n, -1)
    right = other.movedim(dim + 1, 1).reshape(k, n, -1)
    return torch.bmm(left, right.transpose(1, 2))


def along(vector: torch.Tensor, dim: int, order: int) -> torch.Tensor:
    """A ``[k, n]`` per-tile vector shaped to broadcast along tile dim ``dim`` of an order-
    ``order`` tile stack."""
    shape = [vector.shape[0]] + [1] * order
    shape[dim + 1] = -1
    return vector.reshape(shape)


def tile_dims(stack: torch.Tensor) -> tuple[int, ...]:
    """The dims of a ``[k, *shape]`` stack that belong to one tile."""
    return tuple(range(1, stack.dim()))


# ---------------------------------------------------------------------- compiled math
class GroupKernels:
    """The per-group math, as written (``backend=None``) or compiled with ``torch.compile``.

    Each group gets its own compiled copy of a function (a fresh code object, so that one
    group's shapes never count against another's recompile limit) with ``fullgraph=True`` and
    static shapes: a group's shapes and constants (betas, eps) never change, so it compiles
    once, and again only when its set of installed bases first changes (``None`` -> a basis).
    The arguments that change every step (bias corrections, step sizes) stay outside."""

    def __init__(self, backend: str | None) -> None:
        self.backend = backend

    def __call__(self, group: TileGroup, fn: Callable[..., Any]) -> Callable[..., Any]:
        if self.backend is None:
            return fn
        compiled = group.kernels.get(fn)
        if compiled is None:
            own = types.FunctionType(
                fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
            )
            compiled = torch.compile(own, backend=self.backend, fullgraph=True, dynamic=False)
            group.kernels[fn] = compiled
        return compiled


# ---------------------------------------------------------------------- grouping a step
@dataclass
class ParamStep:
    """One parameter in one step: its gradient cut into ``grads`` (one per tile, in the state's
    dtype), its state and param group, how it is blocked, and the step it takes."""

    name: str
    param: torch.Tensor
    grads: list[torch.Tensor]
    state: dict[str, Any]
    group: dict[str, Any]
    plan: Any
    #: the step this parameter takes now (its ``state["step"]`` once the step is applied)
    step: int
    #: where the parameter comes in the optimizer's parameters (all ranks agree on it)
    position: int = -1

    @property
    def direct(self) -> bool:
        """Whether the parameter is one tile of its own shape: its update needs no assembly."""
        return self.plan.whole


def _pattern(tile: Any) -> tuple[bool, ...]:
    factors = getattr(tile, "factors", None)
    return () if factors is None else tuple(f is not None for f in factors)


class GroupCache:
    """The tile groups of the last step, reused while the same tiles step together.

    The layout (which tile of which parameter goes where) is kept too: while the same
    parameters, with the same tile lists, step together (so their step counts move together), a
    step only gathers the gradients and checks that each group still backs its tiles."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], TileGroup] = {}
        #: the last step's signature and, per group, (group, [(param, tile)] places, step)
        self._signature: tuple[tuple[int, int], ...] | None = None
        self._layout: list[tuple[TileGroup, list[tuple[int, int]]]] = []
        self.builds = 0  # groups (re)built: the tests' and benchmarks' view of the cache

    def clear(self) -> None:
        self._groups.clear()
        self._signature, self._layout = None, []

    def steps(self, params: Sequence[ParamStep], specs: dict[type, StorageSpec]) -> list[GroupStep]:
        """Bucket the tiles of ``params`` into groups (param group, tile type, shape, dtype,
        device, preconditioned dims, step) and stack each group's gradients."""
        signature = tuple([(id(e.param), id(e.state["tiles"])) for e in params])
        if signature == self._signature:
            reused = self._reuse(params)
            if reused is not None:
                return reused
        buckets: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
        for position, entry in enumerate(params):
            step = entry.step
            for index, (tile, grad) in enumerate(
                zip(entry.state["tiles"], entry.grads, strict=True)
            ):
                key = (
                    id(entry.group),
                    type(tile),
                    tuple(grad.shape),
                    grad.dtype,
                    grad.device,
                    _pattern(tile),
                    step,
                )
                buckets.setdefault(key, []).append((position, index))
        groups: dict[tuple[int, ...], TileGroup] = {}
        layout = []
        for key, places in buckets.items():
            tiles = [params[p].state["tiles"][t] for p, t in places]
            ids = tuple(map(id, tiles))
            group = self._groups.get(ids)
            if group is None or not group.still_backs(tiles):
                group = TileGroup(tiles, specs[key[1]], key[2], key[5])
                self.builds += 1
            groups[ids] = group
            layout.append((group, places))
        self._groups, self._signature, self._layout = groups, signature, layout
        reused = self._reuse(params)
        assert reused is not None  # the groups were just built from these tiles
        return reused

    def _reuse(self, params: Sequence[ParamStep]) -> list[GroupStep] | None:
        """The last layout's group steps for ``params``; None when a group no longer backs its
        tiles (state rebound elsewhere: the caller regroups)."""
        steps = []
        for group, places in self._layout:
            tiles = [params[p].state["tiles"][t] for p, t in places]
            if not group.still_backs(tiles):
                return None
            grads = torch.stack([params[p].grads[t] for p, t in places])
            owners = [(params[p], t) for p, t in places]
            first = params[places[0][0]]
            steps.append(GroupStep(group, grads, owners, first.group, first.step))
        return steps
