"""The client's ``ASTERIA_*`` environment variables, read here and nowhere else.

- ``ASTERIA_ADDRESS``: the node daemon, ``unix:///path/asteria.sock`` or ``host:port``. When set,
  the optimizers default to ``mode="daemon"``.
- ``ASTERIA_TENANT`` / ``ASTERIA_TOKEN``: the tenant and its secret for the daemon's sessions
  (empty for a daemon without tokens, which serves the anonymous tenant ``local``).
- ``ASTERIA_JOB``: the job name a session reports (defaults to empty).

Explicit arguments always win over the environment; :func:`client_env` only fills the gaps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from asteria_server.errors import InvalidInputError

ENV_ADDRESS = "ASTERIA_ADDRESS"
ENV_TENANT = "ASTERIA_TENANT"
ENV_TOKEN = "ASTERIA_TOKEN"
ENV_JOB = "ASTERIA_JOB"


@dataclass(frozen=True, kw_only=True)
class ClientEnv:
    """What the environment says about the daemon to use. ``token`` is never shown in a repr."""

    address: str | None = None
    tenant: str = ""
    token: str = field(default="", repr=False)
    job: str = ""


def client_env(environ: Mapping[str, str] | None = None) -> ClientEnv:
    """The ``ASTERIA_*`` client settings of ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ
    return ClientEnv(
        address=env.get(ENV_ADDRESS) or None,
        tenant=env.get(ENV_TENANT, ""),
        token=env.get(ENV_TOKEN, ""),
        job=env.get(ENV_JOB, ""),
    )


def resolve_address(address: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``address`` or ``ASTERIA_ADDRESS``; InvalidInputError (a ValueError) naming both when
    neither is set."""
    resolved = address or client_env(environ).address
    if not resolved:
        raise InvalidInputError(
            "no daemon address: pass address='unix:///path/asteria.sock' (or 'host:port') or "
            f"set {ENV_ADDRESS}; or use mode='embedded' to run without a daemon"
        )
    return resolved
