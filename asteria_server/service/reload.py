"""What a SIGHUP may change in a running daemon, decided apart from applying it.

:func:`plan_reload` compares the configuration in force with the one read again and sorts every
difference into what can change while serving (tenant tokens, the log level, the limits and
quotas the servicer checks per call, the job registry's and the job expiry's times) and what
needs a restart (addresses, TLS, workers, the engine's and the transport's sizes). The daemon
applies the first kind and keeps the old value of the second, and one log line
(:meth:`ReloadPlan.describe`) says both, so an operator who edited the file knows what took.

Sessions already open stay open when their tenant's token changes or goes; their next
OpenSession needs the new token. Switching between no tokens (the anonymous tenant) and tenant
tokens needs a restart: it changes who the daemon's tenants are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from asteria_server.config import DaemonConfig

#: Settings a SIGHUP applies (the rest need a restart).
RELOADABLE = frozenset(
    {
        "tokens",
        "log_level",
        "max_memory_bytes",
        "tenant_queued_bytes",
        "tenant_cached_bytes",
        "tenant_max_blocks",
        "max_block_name_bytes",
        "max_sessions",
        "tenant_max_sessions",
        "session_ttl_s",
        "tenant_max_streams",
        "stream_stall_s",
        "max_upload_bytes",
        "upload_wait_s",
        "tenant_upload_share",
        "upload_idle_s",
        "upload_max_s",
        "tenant_max_jobs",
        "job_idle_s",
        "job_ttl_s",
    }
)
#: Fields that are never compared: derived (not settable) or what the daemon was started with.
_IGNORED = frozenset({"cgroup_memory_limit_bytes", "ready_file", "stop_with_pid"})


@dataclass(frozen=True)
class ReloadPlan:
    """The differences between two configurations: ``changed`` are applied, ``restart`` are
    not (each maps a field to its (old, new) values)."""

    changed: dict[str, tuple[object, object]]
    restart: dict[str, tuple[object, object]]

    def applied_config(self, old: DaemonConfig, new: DaemonConfig) -> DaemonConfig:
        """``old`` with the changes applied: the configuration in force after the reload."""
        values = {name: getattr(new, name) for name in self.changed}
        if not values:
            return old
        fields = {f.name: getattr(old, f.name) for f in dataclasses.fields(old) if f.init}
        fields.update(values)
        return DaemonConfig(**fields)

    def describe(self) -> str:
        """One line: what the reload changed, and what needs a restart."""
        if not self.changed and not self.restart:
            return "SIGHUP: reloaded the configuration: nothing changed"
        parts = [_show(name, old, new) for name, (old, new) in sorted(self.changed.items())]
        line = "SIGHUP: reloaded " + (", ".join(parts) if parts else "nothing")
        if self.restart:
            kept = [_show(name, old, new) for name, (old, new) in sorted(self.restart.items())]
            line += "; not reloaded (restart the daemon to apply): " + ", ".join(kept)
        return line


def plan_reload(old: DaemonConfig, new: DaemonConfig) -> ReloadPlan:
    """Sort the differences between ``old`` (in force) and ``new`` (read again)."""
    changed: dict[str, tuple[object, object]] = {}
    restart: dict[str, tuple[object, object]] = {}
    for f in dataclasses.fields(old):
        if f.name in _IGNORED:
            continue
        before, after = getattr(old, f.name), getattr(new, f.name)
        if f.name == "tokens":
            before, after = dict(before), dict(after)
        if before == after:
            continue
        if f.name == "tokens" and old.allows_anonymous() != new.allows_anonymous():
            restart[f.name] = (before, after)
        elif f.name in RELOADABLE:
            changed[f.name] = (before, after)
        else:
            restart[f.name] = (before, after)
    return ReloadPlan(changed, restart)


def _show(name: str, old: object, new: object) -> str:
    if name == "tokens":  # tenants only: a token is never logged
        assert isinstance(old, dict) and isinstance(new, dict)
        added = sorted(set(new) - set(old))
        removed = sorted(set(old) - set(new))
        replaced = sorted(t for t in set(old) & set(new) if old[t] != new[t])
        said = [
            f"{what} {', '.join(map(repr, tenants))}"
            for what, tenants in (
                ("added", added),
                ("removed", removed),
                ("new token for", replaced),
            )
            if tenants
        ]
        return "tokens (" + "; ".join(said) + ")"
    return f"{name} {_value(old)} -> {_value(new)}"


def _value(value: object) -> str:
    if hasattr(value, "value"):  # an enum
        return str(value.value)
    return repr(value)
