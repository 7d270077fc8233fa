"""Asteria's training-side package: second-order optimizers whose matrix work runs off the step.

from asteria_client import SOAP
optimizer = SOAP(model.named_parameters(), lr=3e-3)
"""

from asteria_client.optim.base import Mode, NonFinitePolicy
from asteria_client.optim.blocking import LargeDimPolicy
from asteria_client.optim.kl_shampoo import KLShampoo
from asteria_client.optim.shampoo import Shampoo
from asteria_client.optim.soap import SOAP
from asteria_server.errors import (
    AsteriaError,
    NonFiniteGradientError,
    SolverError,
    UnsupportedParameterError,
)

__version__ = "0.1.0"

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
