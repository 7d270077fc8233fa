"""SolveTask / SolveResult value types: what is validated at construction and what is not."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from asteria_server.errors import InvalidInputError
from asteria_server.types import SolveKind, SolveResult, SolveTask, SubmitOutcome


def _task(**overrides: Any) -> SolveTask:
    kwargs: dict[str, Any] = {
        "block": "layer0.L",
        "version": 3,
        "kind": SolveKind.INVERSE_ROOT,
        "matrix": np.eye(4, dtype=np.float32),
    }
    kwargs.update(overrides)
    return SolveTask(**kwargs)


def test_valid_task_has_documented_defaults() -> None:
    task = _task()
    assert task.exponent == 0.25
    assert task.epsilon == 1e-12
    assert task.basis is None and task.base_version == -1
    assert task.deadline == math.inf and task.tenant == "local"
    assert task.n == 4 and task.key == ("local", "layer0.L") and not task.is_refresh


def test_refresh_task_accepts_matching_basis() -> None:
    task = _task(kind=SolveKind.EIGENBASIS, basis=np.eye(4), base_version=1)
    assert task.is_refresh


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"matrix": np.ones((3, 4), np.float32)}, "matrix"),
        ({"matrix": np.ones((2, 2, 2), np.float32)}, "matrix"),
        ({"matrix": np.ones((0, 0), np.float32)}, "matrix"),
        ({"matrix": np.eye(3, dtype=np.int64)}, "matrix"),
        ({"matrix": np.eye(3, dtype=np.float16)}, "matrix"),
        ({"matrix": [[1.0]]}, "matrix"),
        ({"version": -1}, "version"),
        ({"version": True}, "version"),
        ({"version": 1.0}, "version"),
        ({"exponent": 0.0}, "exponent"),
        ({"exponent": math.inf}, "exponent"),
        ({"epsilon": -1e-9}, "epsilon"),
        ({"epsilon": math.nan}, "epsilon"),
        ({"deadline": math.nan}, "deadline"),
        ({"base_version": -2}, "base_version"),
        ({"block": ""}, "block"),
        ({"tenant": ""}, "tenant"),
        ({"kind": "eigenbasis"}, "kind"),
        ({"basis": np.eye(4)}, "basis"),  # INVERSE_ROOT takes no basis
        ({"kind": SolveKind.EIGENBASIS, "basis": np.eye(5)}, "basis"),
        ({"kind": SolveKind.EIGENBASIS, "basis": np.eye(4, dtype=np.int32)}, "basis"),
    ],
)
def test_invalid_fields_raise_naming_block_and_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        _task(**overrides)
    assert isinstance(info.value, ValueError)
    assert field in str(info.value)
    if field != "block":
        assert "layer0.L" in str(info.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_and_asymmetric_matrices_are_the_solvers_business(bad: float) -> None:
    m = np.eye(4, dtype=np.float64)
    m[0, 1] = bad
    assert _task(matrix=m).matrix is m  # accepted, not copied
    asym = np.eye(4, dtype=np.float32)
    asym[0, 3] = 5.0
    _task(matrix=asym)


def test_submit_outcome_accepted() -> None:
    assert SubmitOutcome.QUEUED.accepted and SubmitOutcome.SUPERSEDED_QUEUED.accepted
    assert not SubmitOutcome.DUPLICATE.accepted and not SubmitOutcome.STALE_IGNORED.accepted


def test_result_is_finite() -> None:
    kwargs: dict[str, Any] = {
        "block": "b",
        "version": 1,
        "kind": SolveKind.EIGENBASIS,
        "permutation": None,
        "base_version": -1,
        "epsilon_used": 0.0,
        "solve_time_s": 0.0,
        "attempts": 1,
    }
    good = SolveResult(
        matrix=np.eye(2, dtype=np.float32), eigenvalues=np.ones(2, np.float32), **kwargs
    )
    assert good.is_finite()
    bad = SolveResult(
        matrix=np.eye(2, dtype=np.float32),
        eigenvalues=np.array([1.0, np.nan], np.float32),
        **kwargs,
    )
    assert not bad.is_finite()
