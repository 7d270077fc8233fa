"""The daemon's job registry: the layouts of the ``torch.distributed`` jobs it serves.

The lowest rank of each node registers its job's layout (every node, its ranks, the daemon that
serves them) once its session is open; ``asteria status`` lists the jobs, and the sync between
node daemons finds its peers here. A job is keyed by tenant and job id, so a tenant sees and
replaces only its own; a job registered again (a restarted job) replaces its layout.

Everything here is bounded: jobs per tenant, nodes per job, ranks per job and the length of
every string, each with a clear INVALID_ARGUMENT or RESOURCE_EXHAUSTED. A job leaves the
registry once no session of it has been open here for ``job_idle_s`` (looked at on every
RegisterJob and ListJobs), or at once when its blocks are forgotten (``asteria forget --job``,
CloseSession with ``forget_blocks``): a tenant's quota is never used up for the daemon's life.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from asteria_server.errors import DaemonBusyError, InvalidInputError, UnknownSessionError
from asteria_server.protocol.errors import abort_call
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2_grpc as jpb_grpc

logger = logging.getLogger(__name__)

#: Jobs a daemon keeps per tenant by default (``tenant_max_jobs``); registering one more
#: evicts nothing that is in use and is refused.
MAX_JOBS_PER_TENANT = 64
#: Seconds a job stays registered with no session of it open (``job_idle_s``).
JOB_IDLE_S = 120.0
#: Nodes and ranks one job may list.
MAX_JOB_NODES = 4096
MAX_JOB_RANKS = 1 << 20
#: Longest job id, host name or daemon address accepted.
MAX_NAME_CHARS = 256


@dataclass
class _Job:
    layout: jpb.JobLayout
    node_rank: int
    registered_at: float
    registrations: int
    #: when a session of the job was last seen open (or it was registered)
    active_at: float


def check_layout(layout: jpb.JobLayout, node_rank: int) -> None:
    """Raise InvalidInputError naming what is wrong with a layout."""
    what = f"RegisterJob of job {layout.job[:MAX_NAME_CHARS]!r}"
    if not layout.job or len(layout.job) > MAX_NAME_CHARS:
        raise InvalidInputError(f"{what}: the job id must have 1 to {MAX_NAME_CHARS} characters")
    if len(layout.run_nonce) > MAX_NAME_CHARS:
        raise InvalidInputError(
            f"{what}: run_nonce must have at most {MAX_NAME_CHARS} characters, got "
            f"{len(layout.run_nonce)}"
        )
    if not 1 <= layout.world_size <= MAX_JOB_RANKS:
        raise InvalidInputError(
            f"{what}: world_size must be between 1 and {MAX_JOB_RANKS}, got {layout.world_size}"
        )
    if not 1 <= len(layout.nodes) <= MAX_JOB_NODES:
        raise InvalidInputError(
            f"{what}: a job lists 1 to {MAX_JOB_NODES} nodes, got {len(layout.nodes)}"
        )
    if not 0 <= node_rank < len(layout.nodes):
        raise InvalidInputError(
            f"{what}: node_rank {node_rank} is not one of its {len(layout.nodes)} nodes"
        )
    seen: set[int] = set()
    for index, node in enumerate(layout.nodes):
        for field in (node.host, node.daemon_address, node.daemon_incarnation):
            if len(field) > MAX_NAME_CHARS:
                raise InvalidInputError(
                    f"{what}: node {index} has a name longer than {MAX_NAME_CHARS} characters"
                )
        if not node.host or not node.ranks:
            raise InvalidInputError(f"{what}: node {index} needs a host and at least one rank")
        for rank in node.ranks:
            if not 0 <= rank < layout.world_size or rank in seen:
                raise InvalidInputError(
                    f"{what}: rank {rank} of node {index} is outside the world of "
                    f"{layout.world_size} or listed twice"
                )
            seen.add(rank)
    if len(seen) != layout.world_size:
        raise InvalidInputError(
            f"{what}: the nodes list {len(seen)} ranks, the world has {layout.world_size}"
        )


class JobsServicer(jpb_grpc.JobsServicer):
    """The ``Jobs`` service. ``tenant_of`` maps a session id to its tenant (or raises
    UnknownSessionError), so this registry shares the Preconditioner service's sessions."""

    def __init__(
        self,
        tenant_of: Callable[[str], str],
        incarnation_id: str,
        on_register: Callable[[str, jpb.JobLayout, int], None] | None = None,
        *,
        check_register: Callable[[str, jpb.JobLayout, int], None] | None = None,
        job_sessions: Callable[[str, str], int] | None = None,
        max_jobs_per_tenant: int = MAX_JOBS_PER_TENANT,
        job_idle_s: float = JOB_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tenant_of = tenant_of
        self._incarnation_id = incarnation_id
        #: told (tenant, layout, node_rank) of every registration (the sync between daemons)
        self._on_register = on_register
        #: raises InvalidInputError or DaemonBusyError for a layout the sync refuses
        self._check_register = check_register
        #: open sessions of (tenant, job) here; None: jobs never expire
        self._job_sessions = job_sessions
        self.max_jobs_per_tenant = max_jobs_per_tenant
        self.job_idle_s = job_idle_s
        self._clock = clock
        self._jobs: dict[str, dict[str, _Job]] = {}
        self.expired = 0
        #: told (tenant, error) of a registration refused for a quota (counted and logged)
        self.on_busy: Callable[[str, BaseException], None] | None = None

    def jobs(self, tenant: str) -> list[tuple[jpb.JobLayout, int, float, int]]:
        """A tenant's jobs, newest first: (layout, node_rank, registered_at, registrations)."""
        self._expire(self._clock())
        found = sorted(self._jobs.get(tenant, {}).values(), key=lambda j: -j.registered_at)
        return [(j.layout, j.node_rank, j.registered_at, j.registrations) for j in found]

    def forget(self, tenant: str, job: str) -> bool:
        """Drop ``job`` from the registry (its blocks were forgotten); whether it was there."""
        jobs = self._jobs.get(tenant, {})
        found = jobs.pop(job, None) is not None
        if not jobs:
            self._jobs.pop(tenant, None)
        return found

    def _expire(self, now: float) -> None:
        """Drop every job of any tenant with no open session for ``job_idle_s``."""
        if self._job_sessions is None:
            return
        for tenant, jobs in list(self._jobs.items()):
            for job_id, job in list(jobs.items()):
                if self._job_sessions(tenant, job_id) > 0:
                    job.active_at = now
                elif now - job.active_at >= self.job_idle_s:
                    del jobs[job_id]
                    self.expired += 1
                    logger.info(
                        "job %r left the job registry: no session of it for %g s (job_idle_s)",
                        job_id,
                        self.job_idle_s,
                        extra={"tenant": tenant, "job": job_id},
                    )
            if not jobs:
                del self._jobs[tenant]

    async def RegisterJob(
        self, request: jpb.RegisterJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> jpb.RegisterJobResponse:
        tenant = ""
        try:
            tenant = self._tenant_of(request.session_id)
            check_layout(request.layout, request.node_rank)
            now = self._clock()
            self._expire(now)
            jobs = self._jobs.setdefault(tenant, {})
            old = jobs.get(request.layout.job)
            if old is None and len(jobs) >= self.max_jobs_per_tenant:
                raise DaemonBusyError(
                    f"RegisterJob of job {request.layout.job[:MAX_NAME_CHARS]!r}: tenant "
                    f"{tenant!r} already has {len(jobs)} jobs registered on this daemon, its "
                    f"quota (tenant_max_jobs = {self.max_jobs_per_tenant}); a job leaves once no "
                    f"session of it has been open for job_idle_s ({self.job_idle_s:g} s), or "
                    "at once with `asteria forget --job JOB`; until then this job's daemons "
                    "do not sync"
                )
            if self._check_register is not None:
                self._check_register(tenant, request.layout, request.node_rank)
            layout = jpb.JobLayout()
            layout.CopyFrom(request.layout)
            jobs[layout.job] = _Job(
                layout,
                request.node_rank,
                now,
                1 if old is None else old.registrations + 1,
                now,
            )
        except (UnknownSessionError, InvalidInputError, DaemonBusyError) as exc:
            if tenant and isinstance(exc, DaemonBusyError) and self.on_busy is not None:
                self.on_busy(tenant, exc)
            await abort_call(context, exc)
        if self._on_register is not None:
            try:
                self._on_register(tenant, layout, request.node_rank)
            except Exception:  # the sync's bug costs the sync, never the registration
                logger.exception("the job sync could not take job %r", layout.job)
        return jpb.RegisterJobResponse(
            incarnation_id=self._incarnation_id, replaced=old is not None
        )

    async def ListJobs(
        self, request: jpb.ListJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> jpb.ListJobsResponse:
        try:
            tenant = self._tenant_of(request.session_id)
        except UnknownSessionError as exc:
            await abort_call(context, exc)
        now = self._clock()
        return jpb.ListJobsResponse(
            jobs=[
                jpb.RegisteredJob(
                    layout=layout,
                    node_rank=node_rank,
                    registered_age_s=now - at,
                    registrations=count,
                )
                for layout, node_rank, at, count in self.jobs(tenant)
            ]
        )
