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
