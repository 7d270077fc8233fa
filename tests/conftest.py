"""Shared pytest setup: slow and GPU tests are opt-in."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = os.environ.get("ASTERIA_RUN_SLOW") == "1" or "slow" in (config.option.markexpr or "")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        has_cuda = False
    skip_slow = pytest.mark.skip(reason="slow: set ASTERIA_RUN_SLOW=1 or use -m slow")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _no_host_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process daemon configs (``--check-config`` called as a function) read no cgroup: the
    memory defaults and the cgroup check would otherwise follow whatever limit the machine
    running the tests has. Tests of the cgroup rules give a fake tree of their own, and daemon
    subprocesses get an environment without ``ASTERIA_*`` (their real cgroup)."""
    monkeypatch.setenv("ASTERIA_CGROUP_ROOT", "/nonexistent/asteria-tests-cgroup")
