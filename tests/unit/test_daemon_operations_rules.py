"""The pure decisions behind the daemon's operations (issue 29), with plain calls: the cgroup's
memory limit, the memory defaults, what a SIGHUP reloads, when a finished job expires, how
refusals are named and rate-limited in the log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asteria_server.config import (
    DaemonConfig,
    cgroup_memory_limit,
    default_max_memory_bytes,
    physical_memory_bytes,
)
from asteria_server.service.expiry import JobExpiry
from asteria_server.service.limits import QuotaRefusals, limit_named
from asteria_server.service.reload import plan_reload

SOCK = "unix:///tmp/asteria-test/asteria.sock"
TOKEN = "t" * 16


def _proc(tmp_path: Path, text: str) -> Path:
    proc = tmp_path / "cgroup-of-self"
    proc.write_text(text)
    return proc


def test_the_smallest_limit_of_the_cgroup_and_its_ancestors_wins(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    leaf = root / "system.slice" / "asteria.service"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")  # no limit of its own
    (root / "system.slice" / "memory.max").write_text(f"{3 << 30}\n")
    (root / "memory.max").write_text(f"{8 << 30}\n")
    proc = _proc(tmp_path, "0::/system.slice/asteria.service\n")
    assert cgroup_memory_limit(root, proc) == (3 << 30, root / "system.slice" / "memory.max")
    (leaf / "memory.max").write_text(f"{1 << 30}\n")
    assert cgroup_memory_limit(root, proc) == (1 << 30, leaf / "memory.max")
    # v1: the memory controller's line, memory.limit_in_bytes; the "unlimited" value is none.
    v1 = root / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    proc_v1 = _proc(tmp_path, "4:memory:/job\n1:cpu:/job\n")
    assert cgroup_memory_limit(root, proc_v1) is None
    (v1 / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    assert cgroup_memory_limit(root, proc_v1) == (2 << 30, v1 / "memory.limit_in_bytes")
    assert cgroup_memory_limit(root, tmp_path / "missing") is None


def test_memory_defaults_take_the_smaller_of_ram_and_the_cgroup() -> None:
    ram = physical_memory_bytes()
    assert ram is not None
    assert default_max_memory_bytes(None) == ram // 4
    assert default_max_memory_bytes(2 << 30) == min(ram // 4, 1 << 30)
    assert default_max_memory_bytes(1 << 50) == ram // 4


def test_sighup_plan_applies_limits_and_tokens_and_keeps_the_rest() -> None:
    old = DaemonConfig(listen=SOCK, tokens={"a": TOKEN}, tenant_max_blocks=10, workers=1)
    new = DaemonConfig(
        listen=SOCK,
        tokens={"a": "u" * 16, "b": TOKEN},
        tenant_max_blocks=5,
        workers=3,
        log_level="DEBUG",
    )
    plan = plan_reload(old, new)
    assert set(plan.changed) == {"tokens", "tenant_max_blocks", "log_level"}
    assert set(plan.restart) == {"workers"}
    applied = plan.applied_config(old, new)
    assert applied.workers == 1 and applied.tenant_max_blocks == 5
    assert dict(applied.tokens) == {"a": "u" * 16, "b": TOKEN}
    line = plan.describe()
    assert "added 'b'" in line and "new token for 'a'" in line and "workers 1 -> 3" in line
    assert TOKEN not in line and "u" * 16 not in line
    # From no tokens (anonymous) to tokens: who the tenants are changes, so a restart.
    anonymous = DaemonConfig(listen=SOCK)
    assert set(plan_reload(anonymous, old).restart) == {"tokens"}
    assert plan_reload(old, old).describe().endswith("nothing changed")


def test_a_job_expires_ttl_after_its_last_session_unless_it_comes_back() -> None:
    expiry = JobExpiry(ttl_s=10.0)
    expiry.idle(("t", "a"), now=0.0)
    expiry.idle(("t", "b"), now=5.0)
    assert expiry.next_due() == 10.0
    assert expiry.due(9.9) == []
    expiry.active(("t", "a"))  # a session of it opened again
    assert expiry.next_due() == 15.0
    assert expiry.due(15.0) == [("t", "b")] and len(expiry) == 0
    off = JobExpiry(ttl_s=0.0)
    off.idle(("t", "a"), now=0.0)
    assert off.next_due() is None and off.due(1e9) == []


@pytest.mark.parametrize(
    ("message", "limit"),
    [
        ("tenant 'a' has 2 blocks, its quota (tenant_max_blocks = 2)", "tenant_max_blocks"),
        (
            "... (max_upload_bytes), 0 of them this tenant's ... (tenant_upload_share)",
            "max_upload_bytes",
        ),
        ("too many failed authentications from unix: at most 10 in a row", "auth_throttle"),
        ("something new", "other"),
    ],
)
def test_a_refusal_is_counted_under_the_limit_it_names(message: str, limit: str) -> None:
    assert limit_named(message) == limit


def test_refusals_are_logged_once_per_tenant_and_minute_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    refusals = QuotaRefusals(logging.getLogger("test.refusals"), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(5):
            refusals.refused("a", "its quota (tenant_max_blocks = 2)")
        refusals.refused("b", "its quota (tenant_cached_bytes)")
        now[0] = 61.0
        refusals.refused("a", "its quota (tenant_max_blocks = 2)")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "and 4 more refusals since the last line" in lines[2]
    assert refusals.counts() == {("a", "tenant_max_blocks"): 6, ("b", "tenant_cached_bytes"): 1}
