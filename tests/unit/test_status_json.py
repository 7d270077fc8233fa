"""`asteria status --json --blocks` writes its rows from the table's columns: the same document,
text for text, as one ``json.dumps`` of :func:`status_document` (a dict per row) gives."""

from __future__ import annotations

import io
import json
import math

import pytest

from asteria_client import status as status_module
from asteria_client.status import status_document, write_status_json
from asteria_server.types import BlockState, BlockStatus, BlockTable, EngineStats, TransportStats


def _block(i: int) -> BlockStatus:
    queued = i if i % 3 == 0 else -1
    running = i - 1 if i % 3 == 1 else -1
    return BlockStatus(
        tenant='t "quoted", tenant',
        block=f'layer{i}.w, "é\\"' if i % 4 == 0 else f"layer{i}.weight",
        version=i - 2,
        submitted_version=i,
        in_flight_version=queued if queued >= 0 else running,
        queued_version=queued,
        running_version=running,
        delivered_version=-1 if i % 5 == 0 else i - 3,
        staleness_steps=2,
        age_s=None if i % 5 == 0 else 0.1 * i,
        submitted_age_s=[1e-7, 12345.678, 0.0, math.inf][i % 4],
        delivered_age_s=None,
        last_solve_s=1.0 / 3.0 if i % 2 else None,
        failures=i % 3,
        consecutive_failures=i % 2,
        duplicates=i,
        stale_ignored=0,
        superseded=7,
        state=list(BlockState)[i % len(BlockState)],
        last_error="bad: nan, inf\n" if i % 6 == 0 else None,
        queue_position=i if queued >= 0 else None,
        tier=["", "host", "shm", "spill"][i % 4],
    )


def _stats() -> EngineStats:
    return EngineStats(
        incarnation_id="abc",
        uptime_s=1.5,
        num_workers=2,
        workers_busy=1,
        workers_idle=1,
        worker_restarts=0,
        queue_depth=3,
        blocks=25,
        solves_done=9,
        solves_failed=1,
        results_discarded=0,
        seconds_per_n3=1.2e-10,
        closed=False,
        broken_reason=None,
    )


@pytest.mark.parametrize("count", [0, 1, 7, 25])
def test_the_json_writer_gives_the_document_of_a_dict_per_row(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(status_module, "JSON_CHUNK_ROWS", 4)  # several chunks, one partial
    table = BlockTable.of('t "quoted", tenant', [_block(i) for i in range(count)])
    stats, transport = _stats(), TransportStats()
    old = status_document("unix:///x.sock", stats, table, transport, [])
    old["peer_groups"] = []

    head = status_document("unix:///x.sock", stats, [], transport, [])
    head["peer_groups"] = []
    out = io.StringIO()
    write_status_json(out, head, table)

    assert out.getvalue() == json.dumps(old)  # the same text, key order and number formats
    assert json.loads(out.getvalue()) == json.loads(json.dumps(old))


@pytest.mark.parametrize(
    "values",
    [[0, 7, -1, 1023], [1024, -2, 10**12], [1, 2.0], [True, 0], [None, 3], [1.5, math.inf], []],
)
def test_a_column_of_numbers_reads_as_json_dumps_writes_it(values: list[object]) -> None:
    """The writer's int columns: the kept text of small ints must not stand for a float or a
    bool that equals one (1.0 is "1.0" in JSON, True is "true")."""
    expected = json.dumps(values)[1:-1].split(", ") if values else []
    assert status_module._json_ints(values) == expected
