"""The preconditioner engine: pure Python + NumPy/SciPy, no transport.

It runs embedded in a training process and, unchanged, inside the node daemon (its value types
live in :mod:`asteria_server.types`). Modules: ``solvers`` (the math), ``registry`` (versions
per block), ``scheduler`` (what runs next), ``coordinator`` (registry + scheduler in step), ``shm``,
``workers`` and ``worker_process`` (the process pool, both sides), ``faults`` (test-only fault
injection), ``engine`` (the thread-safe facade).
"""

from asteria_server.engine.engine import EngineConfig, PreconditionerEngine
from asteria_server.engine.registry import CoherenceRegistry
from asteria_server.engine.scheduler import CostModel, Scheduler
from asteria_server.engine.solvers import EighSolver, SolverConfig, solve
from asteria_server.types import (
    BlockState,
    BlockStatus,
    EngineStats,
    SolveKind,
    SolveResult,
    SolveTask,
    SubmitOutcome,
)

__all__ = [
    "BlockState",
    "BlockStatus",
    "CoherenceRegistry",
    "CostModel",
    "EighSolver",
    "EngineConfig",
    "EngineStats",
    "PreconditionerEngine",
    "Scheduler",
    "SolveKind",
    "SolveResult",
    "SolveTask",
    "SolverConfig",
    "SubmitOutcome",
    "solve",
]
