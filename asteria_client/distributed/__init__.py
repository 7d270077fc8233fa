"""Process-group awareness: which ranks a job has, where they run, what the job is called, and
how its data-parallel replicas share one computation per block."""

from asteria_client.distributed.layout import JobLayout, discover_layout, distributed_job
from asteria_client.distributed.replicas import (
    BlockOwners,
    ExchangeSource,
    NodeShareSource,
    PullChoosers,
    job_source,
    replica_agreement,
)

__all__ = [
    "BlockOwners",
    "ExchangeSource",
    "JobLayout",
    "NodeShareSource",
    "PullChoosers",
    "discover_layout",
    "distributed_job",
    "job_source",
    "replica_agreement",
]
