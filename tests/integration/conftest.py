"""Integration tests start from a clean client environment: a user's ``ASTERIA_*`` variables
(a daemon address, a forced transport, a job name) must not change what a test exercises."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_asteria_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ASTERIA_"):
            monkeypatch.delenv(name)
