"""Multi-rank tests start from a clean client environment, like the integration tests: spawned
ranks inherit it, and a user's ``ASTERIA_*`` variables must not change what a test exercises."""

from tests.integration.conftest import _no_asteria_env

__all__ = ["_no_asteria_env"]
