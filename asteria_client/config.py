"""The client's ``ASTERIA_*`` environment variables, read here and nowhere else.

- ``ASTERIA_ADDRESS``: the node daemon, ``unix:///path/asteria.sock`` or ``host:port``. When set,
  the optimizers default to ``mode="daemon"``.
- ``ASTERIA_TENANT`` / ``ASTERIA_TOKEN``: the tenant and its secret for the daemon's sessions
  (empty for a daemon without tokens, which serves the anonymous tenant ``local``).
- ``ASTERIA_JOB``: the job name a session reports (defaults to empty).
- ``ASTERIA_TRANSPORT``: ``auto`` (default: shared memory when the daemon is on this host and
  offers it, else gRPC) or ``grpc`` (never shared memory).
- ``ASTERIA_TLS_CA``: a PEM file of the certificate authority to trust for a TCP daemon that
  serves TLS; set, the client connects with TLS (``host:port`` addresses only).
- ``ASTERIA_DAEMON_UID``: the uid a ``unix://`` daemon must run as (checked with SO_PEERCRED
  before a token or a segment is sent); default: this process's own uid, or root.
- ``ASTERIA_NODE``: the name of this process's node in a ``torch.distributed`` job (default: the
  host name). Ranks with one name share a node and its daemon; a test or a container whose host
  name does not tell nodes apart sets it.

The launcher's run id is read here too: ``TORCHELASTIC_RUN_ID`` (set by ``torchrun``) names the
job when ``ASTERIA_JOB`` does not, so the data-parallel replicas of one job share their blocks
on a daemon without any setting (torchrun's placeholder ``none`` does not count).

Explicit arguments always win over the environment; :func:`client_env` only fills the gaps.
:func:`environ_without_asteria` is the environment for a child process (a daemon, a trainer) that
must not inherit this process's settings.
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
ENV_TRANSPORT = "ASTERIA_TRANSPORT"
ENV_TLS_CA = "ASTERIA_TLS_CA"
ENV_DAEMON_UID = "ASTERIA_DAEMON_UID"
ENV_NODE = "ASTERIA_NODE"
ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
TRANSPORTS = ("auto", "grpc")


@dataclass(frozen=True, kw_only=True)
class ClientEnv:
    """What the environment says about the daemon to use. ``token`` is never shown in a repr."""

    address: str | None = None
    tenant: str = ""
    token: str = field(default="", repr=False)
    job: str = ""
    transport: str = "auto"
    tls_ca: str | None = None
    run_id: str = ""  # the launcher's (torchrun) run id; "" when not launched by one
    daemon_uid: int | None = None  # the uid a unix:// daemon must run as (None: ours or root)
    node: str = ""  # this process's node name in a job ("": the host name)

    @property
    def job_name(self) -> str:
        """``ASTERIA_JOB``, else the launcher's run id, else ""."""
        return self.job or self.run_id


def client_env(environ: Mapping[str, str] | None = None) -> ClientEnv:
    """The ``ASTERIA_*`` client settings of ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ
    transport = env.get(ENV_TRANSPORT, "").strip().lower() or "auto"
    if transport not in TRANSPORTS:
        raise InvalidInputError(
            f"{ENV_TRANSPORT}={env.get(ENV_TRANSPORT)!r} is not valid: use one of {TRANSPORTS}"
        )
    return ClientEnv(
        address=env.get(ENV_ADDRESS) or None,
        tenant=env.get(ENV_TENANT, ""),
        token=env.get(ENV_TOKEN, ""),
        job=env.get(ENV_JOB, ""),
        transport=transport,
        tls_ca=env.get(ENV_TLS_CA) or None,
        run_id=_run_id(env.get(ENV_RUN_ID, "")),
        daemon_uid=_daemon_uid(env.get(ENV_DAEMON_UID, "")),
        node=env.get(ENV_NODE, "").strip(),
    )


def _daemon_uid(value: str) -> int | None:
    value = value.strip()
    if not value:
        return None
    if not value.isdigit():
        raise InvalidInputError(f"{ENV_DAEMON_UID}={value!r} is not valid: give a numeric uid")
    return int(value)


def _run_id(value: str) -> str:
    value = value.strip()
    return "" if value.lower() in ("", "none") else value


def environ_without_asteria(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default: ``os.environ``) without any ``ASTERIA_*`` variable: the
    base environment of a child process that gets its Asteria settings explicitly."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not k.startswith("ASTERIA_")}


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
