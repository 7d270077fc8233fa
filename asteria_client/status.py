"""What a daemon is doing, read and shown: the data behind ``asteria status`` (cli/status.py).

:class:`StatusReader` holds one session as a tenant, so it sees that tenant's blocks, with the
daemon-wide numbers: incarnation, uptime, workers busy and idle, queue depth.
:func:`status_document` makes them one JSON document, :func:`format_table` a text table.
By default ``asteria status`` shows a summary instead (:meth:`StatusReader.read_summary`,
:func:`format_summary`, :func:`summary_document`): one RPC whatever the number of blocks, the
daemon adding them up, so 160,000 blocks cost a pass over their records, not 80 MB of JSON.
Every block's row is read in pages of columns (``BlockTable``) and shown with ``--blocks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import operator
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol, cast

from asteria_client.tables import text_table
from asteria_client.transport.connection import (
    DaemonClientConfig,
    DaemonConnection,
    RegisteredJob,
    StatusPage,
)
from asteria_server.errors import AsteriaError
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.types import (
    BlockState,
    BlockStatus,
    BlockSummary,
    BlockTable,
    EngineStats,
    TransportStats,
)

#: Deadline of each call status makes.
CALL_TIMEOUT_S = 5.0
_JOB = "asteria-status"


def status_document(
    address: str,
    stats: EngineStats,
    blocks: Sequence[BlockStatus],
    transport: TransportStats | None = None,
    jobs: list[RegisteredJob] | None = None,
) -> dict[str, Any]:
    """The JSON document of ``asteria status --json``."""
    if isinstance(blocks, BlockTable):  # a daemon's read: in name order, rows from columns
        rows = blocks.to_dicts()
    else:
        rows = [b.to_dict() for b in sorted(blocks, key=lambda b: (b.tenant, b.block))]
    for row in rows:
        row["staleness_s"] = row["age_s"]
    return {
        "address": address,
        "incarnation_id": stats.incarnation_id,
        "uptime_s": stats.uptime_s,
        "workers": {
            "total": stats.num_workers,
            "busy": stats.workers_busy,
            "idle": stats.workers_idle,
            "restarts": stats.worker_restarts,
            "each": [dataclasses.asdict(w) for w in stats.workers],
        },
        "result_cache": {
            "host_bytes": stats.cache_host_bytes,
            "budget_bytes": stats.cache_budget_bytes,
            "spilled": stats.results_spilled,
            "spill_bytes": stats.spill_bytes,
            "dropped": stats.results_dropped,
        },
        "queue_depth": stats.queue_depth,
        "solves_done": stats.solves_done,
        "solves_failed": stats.solves_failed,
        "results_discarded": stats.results_discarded,
        "closed": stats.closed,
        "broken_reason": stats.broken_reason,
        "transport": None if transport is None else transport.to_dict(),
        "jobs": [dataclasses.asdict(job) for job in jobs or ()],
        "blocks": rows,
    }


#: Rows ``write_status_json`` formats per pass: its strings for them are what it holds at once.
JSON_CHUNK_ROWS = 10_000
#: Stands for the rows in the document's text until they are written in its place.
_ROWS_MARK = "\u0000asteria-status-rows\u0000"
#: A row's fields, in :meth:`BlockStatus.to_dict` order, then ``staleness_s`` (its age).
_STATUS_FIELDS = tuple(field.name for field in dataclasses.fields(BlockStatus))
_ROW_FIELDS = (*_STATUS_FIELDS, "staleness_s")
#: The fields whose values are strings (or None); the others' are numbers (or None).
_TEXT_FIELDS = frozenset(("tenant", "block", "state", "last_error", "tier"))
#: The fields whose values are ints (never None): their text is ``int.__repr__``, as json's.
_INT_FIELDS = frozenset(
    (
        *("version", "submitted_version", "in_flight_version", "queued_version"),
        *("running_version", "delivered_version", "staleness_steps", "failures"),
        *("consecutive_failures", "duplicates", "stale_ignored", "superseded"),
    )
)
#: Each state's JSON text, by the state's ``_value_`` (an attribute, where ``value`` is a
#: property and an Enum's hash a Python call: looked up by the state, 160,000 rows took ~50 ms).
_STATE_JSON = {state.value: json.dumps(state.value) for state in BlockState}
_STATE_VALUE = operator.attrgetter("_value_")
#: What comes before each field's value in a row's text; the first field's also closes the
#: row before (the chunk's first row and last ``}`` are written apart).
_FIELD_PREFIXES = [f", {json.dumps(name)}: " for name in _ROW_FIELDS]
_FIELD_PREFIXES[0] = "}, {" + _FIELD_PREFIXES[0][2:]


class TextSink(Protocol):
    """Where :func:`write_status_json` writes: stdout, a file, or a byte counter."""

    def write(self, text: str, /) -> int: ...


def write_status_json(out: TextSink, document: dict[str, Any], table: BlockTable) -> None:
    """Write ``document`` as :func:`json.dumps` does, with ``table``'s rows as its ``blocks``:
    the text :func:`status_document`'s rows would give, formatted a column and a chunk of rows
    at a time, with no dict per block and no one string of the whole document (160,000 blocks
    are 85 MB of JSON; a dict per row and one ``json.dumps`` of it took 1.1 s of the 4 s that
    ``asteria status --json --blocks`` took)."""
    _write_rows(out, document, [table])


def write_status_pages(
    out: TextSink,
    address: str,
    pages: Iterator[StatusPage],
    jobs: list[RegisteredJob] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> int:
    """``asteria status --json --blocks`` written as its pages arrive: the document of the first
    page's numbers (:func:`status_document`, with ``jobs`` and then ``extra``'s keys), its
    ``blocks`` each page's rows as :func:`write_status_json` formats them. A page is written
    while the daemon builds the next (:meth:`DaemonConnection.status_pages` asks for it
    first), not after every page was read: 160,000 blocks read then written took the sum of
    both. Returns the number of rows written. An error of the first page's call is raised
    before anything is written; one of a later page's, after the rows so far (the document
    then stops there: the caller says so on stderr and fails)."""
    first = next(pages)
    document = status_document(address, first.stats, [], first.transport, jobs)
    document.update(extra or {})
    return _write_rows(out, document, itertools.chain([first.table], (p.table for p in pages)))


def _write_rows(out: TextSink, document: dict[str, Any], tables: Iterable[BlockTable]) -> int:
    """``document`` with ``tables``' rows, in order, as its ``blocks`` (see
    :func:`write_status_json`); the number of rows."""
    head, tail = json.dumps({**document, "blocks": _ROWS_MARK}).split(json.dumps(_ROWS_MARK))
    out.write(head + "[")
    rows = 0
    for table in tables:
        for start in range(0, len(table), JSON_CHUNK_ROWS):
            if rows:
                out.write(", ")
            out.write(_json_rows(table, start, start + JSON_CHUNK_ROWS))
            rows += min(JSON_CHUNK_ROWS, len(table) - start)
    out.write("]" + tail)
    return rows


def _json_rows(table: BlockTable, start: int, stop: int) -> str:
    """Rows ``start:stop`` of ``table`` as JSON objects joined by ", ": each column's values
    are encoded a column at a time, then laid between the fields' prefixes by slice
    assignment and joined once (no tuple or format call per row)."""
    c = {name: column[start:stop] for name, column in table.columns.items()}
    count = len(c["block"])
    if not count:
        return ""
    encoded = {
        "tenant": [json.dumps(table.tenant)] * count,
        "in_flight_version": _json_ints(
            [
                q if q >= 0 else r
                for q, r in zip(c["queued_version"], c["running_version"], strict=True)
            ]
        ),
        "staleness_steps": _json_ints(
            [s - v for s, v in zip(c["submitted_version"], c["version"], strict=True)]
        ),
        "state": list(map(_STATE_JSON.__getitem__, map(_STATE_VALUE, c["state"]))),
    }
    for name in _STATUS_FIELDS:
        if name in encoded:
            continue
        if name in _TEXT_FIELDS:
            encoded[name] = _json_strings(c[name])
        else:
            encoded[name] = _json_ints(c[name]) if name in _INT_FIELDS else _json_numbers(c[name])
    encoded["staleness_s"] = encoded["age_s"]
    width = 2 * len(_ROW_FIELDS)
    parts: list[str] = [""] * (count * width)
    for f, name in enumerate(_ROW_FIELDS):
        parts[2 * f :: width] = [_FIELD_PREFIXES[f]] * count
        parts[2 * f + 1 :: width] = encoded[name]
    parts[0] = _FIELD_PREFIXES[0][3:]  # the chunk's first row closes none before it
    return "".join(parts) + "}"


#: The text of the small ints most count columns hold (failures, duplicates, -1 for none): one
#: string each, looked up, where ``int.__repr__`` makes a new one per row.
_SMALL_INTS = {i: str(i) for i in range(-1, 1024)}


def _json_ints(values: list[Any]) -> list[str]:
    """Each of ``values`` as :func:`json.dumps` writes it: for a column of ints, the kept text
    of small ones or ``int.__repr__`` in C; the json module's text where any is not an int (a
    float equal to a small int must not read as one, nor a bool)."""
    if not set(map(type, values)) <= {int}:
        return _json_numbers(values)
    try:
        return list(map(_SMALL_INTS.__getitem__, values))
    except KeyError:
        return list(map(int.__repr__, values))


def _json_numbers(values: list[Any]) -> list[str]:
    """Each of ``values`` (numbers or None) as :func:`json.dumps` writes it, in one call: no
    number's or null's text holds the list's ", " separator."""
    return json.dumps(values)[1:-1].split(", ") if values else []


def _json_strings(values: list[str | None]) -> list[str]:
    """Each of ``values`` (strings or None) as :func:`json.dumps` writes it."""
    if None not in values:
        return list(map(encode_basestring_ascii, cast(list[str], values)))
    return ["null" if v is None else encode_basestring_ascii(v) for v in values]


def _version(v: int) -> str:
    return "-" if v < 0 else str(v)


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f}ms" if s < 1 else f"{s:.1f}s"


_COLUMNS = (
    "BLOCK",
    "SUBMITTED",
    "COMPUTED",
    "DELIVERED",
    "STALE_STEPS",
    "STALE_S",
    "QUEUE",
    "LAST_SOLVE",
    "FAILURES",
    "STATE",
    "TIER",
)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _header_lines(
    address: str,
    stats: EngineStats,
    transport: TransportStats | None,
    jobs: list[RegisteredJob] | None,
) -> list[str]:
    """The report's first lines: the daemon, its workers, cache, data path and the jobs."""
    lines = [
        f"daemon {address}  incarnation {stats.incarnation_id}  uptime {stats.uptime_s:.1f} s"
        + ("  (shutting down)" if stats.closed else ""),
        f"workers {stats.num_workers}: {stats.workers_busy} busy, {stats.workers_idle} idle, "
        f"{stats.worker_restarts} restarted; queue depth {stats.queue_depth}; "
        f"solves {stats.solves_done} done, {stats.solves_failed} failed",
    ]
    for w in stats.workers:
        if w.state in ("busy", "overdue", "stopped") and w.elapsed_s > 0:
            lines.append(
                f"  worker {w.index} (pid {w.pid}) {w.state}: {w.block or '(another tenant)'} "
                f"n={w.n}, {_seconds(w.elapsed_s)} of ~{_seconds(w.expected_s)} expected; "
                f"replaced after {_seconds(w.timeout_s)}"
            )
    budget = _mib(stats.cache_budget_bytes) if stats.cache_budget_bytes else "unbounded"
    lines.append(
        f"result cache: {_mib(stats.cache_host_bytes)} in memory of {budget}; "
        f"{stats.results_spilled} spilled ({_mib(stats.spill_bytes)}), "
        f"{stats.results_dropped} dropped"
    )
    if transport is not None:
        t = transport
        lines.append(
            f"shared memory: {t.shm_connections} clients, {t.shm_segments} segments "
            f"({_mib(t.shm_mapped_bytes)}); uploads: {_mib(t.upload_bytes_in_flight)} of "
            f"{_mib(t.upload_budget_bytes)} in flight, {t.uploads_waiting} waiting"
        )
    if stats.broken_reason:
        lines.append(f"BROKEN: {stats.broken_reason}")
    for job in jobs or ():
        here = job.nodes[job.node_rank] if job.node_rank < len(job.nodes) else None
        lines.append(
            f"job {job.job}: {job.world_size} ranks on {len(job.nodes)} node(s); this daemon "
            f"serves node {job.node_rank}"
            + (f" ({here.host}, ranks {_ranks(here.ranks)})" if here is not None else "")
            + f"; registered {_seconds(job.registered_age_s)} ago"
            + (f", {job.registrations} times" if job.registrations > 1 else "")
        )
    return lines


def format_table(
    address: str,
    stats: EngineStats,
    blocks: Sequence[BlockStatus],
    transport: TransportStats | None = None,
    jobs: list[RegisteredJob] | None = None,
) -> str:
    """The human-readable report: the summary lines, the tenant's jobs, then one row per
    block."""
    lines = _header_lines(address, stats, transport, jobs)
    if not blocks:
        lines.append("no blocks for this tenant")
        return "\n".join(lines)
    table = blocks if isinstance(blocks, BlockTable) else BlockTable.of("", _by_name(blocks))
    lines.append("")
    lines += text_table([list(_COLUMNS), *_table_rows(table)])
    return "\n".join(lines)


def _by_name(blocks: Sequence[BlockStatus]) -> list[BlockStatus]:
    return sorted(blocks, key=lambda b: (b.tenant, b.block))


def _table_rows(table: BlockTable) -> list[list[str]]:
    """The table's rows of cells, formatted a column at a time."""
    c = table.columns
    cells = [
        c["block"],
        [_version(v) for v in c["submitted_version"]],
        [_version(v) for v in c["version"]],
        [_version(v) for v in c["delivered_version"]],
        [str(s - v) for s, v in zip(c["submitted_version"], c["version"], strict=True)],
        [_seconds(a) for a in c["age_s"]],
        ["-" if p is None else str(p) for p in c["queue_position"]],
        [_seconds(t) for t in c["last_solve_s"]],
        [str(f) for f in c["failures"]],
        [s.value for s in c["state"]],
        [t or "-" for t in c["tier"]],
    ]
    return [list(row) for row in zip(*cells, strict=True)]


def format_summary(
    address: str,
    stats: EngineStats,
    summary: BlockSummary,
    transport: TransportStats | None = None,
    jobs: list[RegisteredJob] | None = None,
) -> str:
    """The default report: the daemon's lines, what the tenant's blocks add up to, and its
    worst blocks (failed first, then the most stale) as rows; ``--blocks`` shows every one."""
    s = summary
    lines = _header_lines(address, stats, transport, jobs)
    if not s.blocks:
        lines.append("no blocks for this tenant")
        return "\n".join(lines)
    lines += [
        f"blocks {s.blocks}: {s.idle} idle, {s.queued} queued, {s.running} running, "
        f"{s.failed} failed; {s.never_computed} never computed; {s.failures} failed solves",
        f"staleness (steps): median {s.staleness_steps_p50}, p99 {s.staleness_steps_p99}, "
        f"max {s.staleness_steps_max}; oldest result {_seconds(s.oldest_result_age_s)} old",
        f"results held: {s.tier_host} in daemon memory, {s.tier_shm} in shared memory, "
        f"{s.tier_spill} spilled, {s.tier_none} none",
    ]
    if len(s.worst):
        lines += ["", f"the {len(s.worst)} blocks most behind (every block: --blocks):"]
        lines += text_table([list(_COLUMNS), *_table_rows(s.worst)])
    return "\n".join(lines)


def summary_document(
    address: str,
    stats: EngineStats,
    summary: BlockSummary,
    transport: TransportStats | None = None,
    jobs: list[RegisteredJob] | None = None,
) -> dict[str, Any]:
    """The JSON document of ``asteria status --json``: :func:`status_document`'s keys, with
    ``summary`` (the numbers and the ``worst`` blocks' rows) in place of ``blocks``."""
    document = status_document(address, stats, [], transport, jobs)
    del document["blocks"]
    numbers = summary.to_dict()
    for row in numbers["worst"]:
        row["staleness_s"] = row["age_s"]
    document["summary"] = numbers
    return document


def _ranks(ranks: tuple[int, ...]) -> str:
    """``0-3`` for a contiguous run, else the list."""
    if ranks and list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


class StatusReader:
    """One connection and session, reopened when the daemon restarts."""

    def __init__(self, address: str, tenant: str, token: str) -> None:
        config = DaemonClientConfig(call_timeout_s=CALL_TIMEOUT_S, status_timeout_s=CALL_TIMEOUT_S)
        self.address = address
        self._conn = DaemonConnection(address, tenant=tenant, token=token, job=_JOB, config=config)
        self._session_id: str | None = None

    def read(self) -> tuple[EngineStats, BlockTable, TransportStats | None]:
        """Raises an AsteriaError when the daemon cannot be reached or refuses the tenant."""
        for attempt in range(2):
            if self._session_id is None:
                self._session_id = self._conn.open_session().session_id
            try:
                return self._conn.status_report(self._session_id)
            except AsteriaError:
                self._session_id = None  # e.g. the daemon restarted: one new session, once
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def read_pages(self) -> Generator[StatusPage, None, None]:
        """:meth:`read` page by page, as :meth:`DaemonConnection.status_pages` gives them. A
        failure before the first page reopens the session once, as :meth:`read` does; one
        after it is raised (the pages before it were handed on already)."""
        for attempt in range(2):
            if self._session_id is None:
                self._session_id = self._conn.open_session().session_id
            pages = self._conn.status_pages(self._session_id)
            try:
                first = next(pages)
            except AsteriaError:
                self._session_id = None
                if attempt == 1:
                    raise
                continue
            yield first
            yield from pages
            return

    def read_summary(self) -> tuple[EngineStats, BlockSummary | None, TransportStats | None]:
        """:meth:`read` as a summary: one RPC however many blocks (None from a daemon that
        predates summaries). Raises an AsteriaError as :meth:`read` does."""
        for attempt in range(2):
            if self._session_id is None:
                self._session_id = self._conn.open_session().session_id
            try:
                return self._conn.status_summary(self._session_id)
            except AsteriaError:
                self._session_id = None
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def jobs(self) -> list[RegisteredJob]:
        """The tenant's registered jobs ([] when the daemon cannot say)."""
        if self._session_id is None:
            return []
        try:
            return self._conn.list_jobs(self._session_id)
        except AsteriaError:
            return []

    def peers(self) -> ppb.PeerStatusResponse | None:
        """The tenant's multi-node peer groups on this daemon (None when it cannot say)."""
        if self._session_id is None:
            return None
        try:
            return self._conn.peer_status(self._session_id)
        except AsteriaError:
            return None

    def close(self) -> None:
        if self._session_id is not None:
            with contextlib.suppress(AsteriaError):
                self._conn.close_session(self._session_id)
        self._conn.close()
