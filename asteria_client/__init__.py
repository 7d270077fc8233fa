"""Asteria's training-side package: second-order optimizers whose matrix work runs off the step.

from asteria_client import SOAP
optimizer = SOAP(model.named_parameters(), lr=3e-3)

The optimizers (and torch with them) are imported when first named, not when the package is:
``asteria status`` and ``asteria forget`` import ``asteria_client.cli`` and talk to a daemon
with gRPC alone, and importing torch cost them ~3 s of a 2-core host before the first call.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asteria_server.errors import (
    AsteriaError,
    NonFiniteGradientError,
    SolverError,
    UnsupportedParameterError,
)

if TYPE_CHECKING:
    from asteria_client.optim.base import Mode, NonFinitePolicy
    from asteria_client.optim.blocking import LargeDimPolicy
    from asteria_client.optim.kl_shampoo import KLShampoo
    from asteria_client.optim.shampoo import Shampoo
    from asteria_client.optim.soap import SOAP

__version__ = "0.1.0"

#: The names that import torch, by the module that defines each.
_LAZY = {
    "Mode": "asteria_client.optim.base",
    "NonFinitePolicy": "asteria_client.optim.base",
    "LargeDimPolicy": "asteria_client.optim.blocking",
    "KLShampoo": "asteria_client.optim.kl_shampoo",
    "Shampoo": "asteria_client.optim.shampoo",
    "SOAP": "asteria_client.optim.soap",
}


def __getattr__(name: str) -> Any:
    """The optimizers' names, imported on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "SOAP",
    "AsteriaError",
    "KLShampoo",
    "LargeDimPolicy",
    "Mode",
    "NonFiniteGradientError",
    "NonFinitePolicy",
    "Shampoo",
    "SolverError",
    "UnsupportedParameterError",
]
