"""Count the calls that make the host wait for a CUDA device, on CPU as on a GPU.

A GPU training step stays fast only while the CPU runs ahead of the device: any call that
reads device memory into Python (``.item()``, ``bool(t)``, ``.tolist()``), copies it to the
host with a blocking copy (``.cpu()``, ``.to("cpu")``), or needs a result's size before it
can go on (``nonzero``, ``masked_select``, boolean-mask indexing), or checks a solver's
error code on the host (``torch.linalg.eigh``, below) makes the host wait for every kernel
queued before it. :class:`HostSyncAudit` is a :class:`TorchFunctionMode` that
counts such calls made on the thread that enters it (the training thread: the sources' own
threads may wait, the step may not), by function, with the first line of client code that
made each.

How it decides whether a call *would* sync:

- **on a CUDA device** (``device="cuda"``): the call involves a CUDA tensor. A copy to the
  host counts unless it is ``non_blocking`` into pinned memory (the transfer layer's copies).
- **on CPU** (``device="cpu"``, where nothing ever waits) every CPU tensor stands for a device
  tensor, *except host memory the runtime made*: the transfer layer's staging buffers and the
  shared-memory views, which it marks (:func:`~asteria_client.runtime.transfer.mark_host`).
  Reading those is the host reading host memory, free on a GPU too. A copy to the host counts
  unless it is ``non_blocking``: the transfer layer asks for that, and on a GPU it issues the
  copy on a side stream into pinned memory; a plain ``.to("cpu")`` or ``.cpu()`` of an
  unmarked tensor is a blocking device read on a GPU, so it counts. A ``.to`` counts only
  when the host is named by the string ``"cpu"`` (``.to("cpu")``, ``.to(device="cpu")``): a
  ``torch.device`` target is taken to be the tensor's own device (``.to(param.device)``),
  which on a GPU it is. ``.numpy()`` of an unmarked tensor counts (on a GPU it needs a host
  copy first).

``torch.linalg.eigh`` (and ``eigvalsh``, ``torch._linalg_eigh``) counts too: after every
call ATen reads the solver's info on the host, ``at::_linalg_check_errors`` →
``infos.any().item<bool>()`` (aten/src/ATen/native/BatchLinearAlgebra.cpp,
``TORCH_IMPL_FUNC(_linalg_eigh_out)``, which all three reach), so on a GPU each call waits for
the device, once per call whatever its batch, and torch has no eigh without that check.
``torch.linalg.qr`` does not count: cuSOLVER's geqrf info is read only in debug builds.

It sees torch calls only (NumPy's and the CUDA runtime's own waits are not torch functions);
``torch.cuda.set_sync_debug_mode("error")`` catches those on a real device
(scripts/device_check.sh runs both).
"""

from __future__ import annotations

import collections
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from asteria_client.runtime.transfer import is_marked_host

#: Reads of a tensor's values into Python: always a sync for a device tensor.
_READS = frozenset(
    {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
)
#: Ops whose result size depends on the values: the host waits to learn it.
_DATA_SHAPED = frozenset(
    {
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "equal",
        "allclose",
        "bincount",
    }
)
#: Solvers that read their error code (LAPACK / cuSOLVER info) on the host after each call.
SOLVER_CHECKS = frozenset({"linalg_eigh", "linalg_eigvalsh", "_linalg_eigh"})
#: Indexing ops that sync when an index is a boolean mask.
_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put", "index_put_", "index"})

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", str(func))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []


def _to_host_device(args: tuple[Any, ...], kwargs: dict[str, Any], *, literal: bool) -> bool:
    """Whether a ``Tensor.to`` call targets the CPU; with ``literal``, only when it is named
    by the string ``"cpu"`` (on a CPU run a ``torch.device`` target is the tensor's own
    device, e.g. ``.to(param.device)``, which on a GPU is the GPU)."""
    target = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, str | torch.device):
            target = arg
    if target is None:
        return False
    if literal:
        return isinstance(target, str) and torch.device(target).type == "cpu"
    return torch.device(target).type == "cpu"


class HostSyncAudit(TorchFunctionMode):
    """Counts host-syncing torch calls on this thread; see the module docstring.

    ``device``: the device training runs on (default: CUDA when available, else the CPU).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self.enabled = True

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()
        self.sites.clear()

    def _on_device(self, tensor: torch.Tensor) -> bool:
        if self.device.type == "cpu":
            return tensor.device.type == "cpu" and not is_marked_host(tensor)
        return tensor.device.type == self.device.type

    def _pinned_or_marked(self, tensor: torch.Tensor) -> bool:
        if self.device.type == "cpu":
            return is_marked_host(tensor)
        return tensor.is_pinned()

    def would_sync(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        name = _name(func)
        tensors = _tensors(args) + _tensors(list(kwargs.values()))
        on_device = [t for t in tensors if self._on_device(t)]
        if not on_device:
            return False
        if name in _READS or name in _DATA_SHAPED or name in SOLVER_CHECKS:
            return True
        if name == "cpu":
            return True
        if name == "where" and len(args) == 1 and not kwargs:
            return True
        if name == "repeat_interleave":
            return "output_size" not in kwargs and any(
                isinstance(a, torch.Tensor) for a in args[1:]
            )
        if name in _INDEXING:
            return any(t.dtype in (torch.bool, torch.uint8) for t in tensors[1:])
        non_blocking = bool(kwargs.get("non_blocking", False))
        if name == "to":
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            literal = self.device.type == "cpu"
            if source is None or not self._on_device(source):
                return False
            if not _to_host_device(args, kwargs, literal=literal):
                return False
            return not non_blocking
        if name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
                return False
            if self.device.type == "cpu":
                host_dst = is_marked_host(dst)
            else:
                host_dst = dst.device.type == "cpu"
            if not host_dst or not self._on_device(src):
                return False
            return not (non_blocking and self._pinned_or_marked(dst))
        return False

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.enabled and self.would_sync(func, args, kwargs):
            name = _name(func)
            self.counts[name] += 1
            self.sites[f"{name} at {_caller()}"] += 1
        return func(*args, **kwargs)

    def report(self) -> str:
        """One line per call site, most frequent first."""
        return "\n".join(f"{n} x {site}" for site, n in self.sites.most_common())


def _caller() -> str:
    """The innermost frame outside torch and this module: who made the call."""
    for frame in reversed(traceback.extract_stack(limit=30)):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH) or path.startswith(os.path.join(_HERE, "sync_audit")):
            continue
        return f"{os.path.relpath(path)}:{frame.lineno}"
    return "?"
