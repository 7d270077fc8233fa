"""The full Status read of ``DaemonConnection.status_report`` and ``status_pages`` (issue 27):
every page, in order, with the next page's call sent before the current page is converted (and,
for ``asteria status --json --blocks``, written), against a fake stub."""

from __future__ import annotations

import json

import grpc
import pytest

from asteria_client.cli import status as cli_status
from asteria_client.status import StatusReader, status_document, write_status_pages
from asteria_client.transport import connection as connection_module
from asteria_client.transport.connection import STATUS_BULK_PAGE_BLOCKS, DaemonConnection
from asteria_server.errors import AsteriaError
from asteria_server.protocol import convert
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.types import BlockState, BlockStatus, BlockTable, EngineStats

TENANT = "t0"


def _block(i: int) -> BlockStatus:
    return BlockStatus(
        tenant=TENANT,
        block=f"layer{i:04d}.weight",
        version=i,
        submitted_version=i,
        in_flight_version=-1,
        queued_version=-1,
        running_version=-1,
        delivered_version=i,
        staleness_steps=0,
        age_s=0.5,
        submitted_age_s=None,
        delivered_age_s=None,
        last_solve_s=None,
        failures=0,
        consecutive_failures=0,
        duplicates=0,
        stale_ignored=0,
        superseded=0,
        state=BlockState.IDLE,
        last_error=None,
        queue_position=None,
        tier="",
    )


def _stats() -> EngineStats:
    return EngineStats(
        incarnation_id="abc",
        uptime_s=1.0,
        num_workers=1,
        workers_busy=0,
        workers_idle=1,
        worker_restarts=0,
        queue_depth=0,
        blocks=0,
        solves_done=0,
        solves_failed=0,
        results_discarded=0,
        seconds_per_n3=1e-10,
        closed=False,
        broken_reason=None,
    )


class _Done:
    """A finished call, as ``stub.Status.future`` gives it."""

    def __init__(self, log: list[str], reply: pb.StatusResponse | None, error: Exception | None):
        self._log, self._reply, self._error = log, reply, error

    def result(self) -> pb.StatusResponse:
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply

    def cancel(self) -> bool:
        self._log.append("cancel")
        return True


class _FakeRpcError(grpc.RpcError, grpc.Call):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "daemon gone"


class _FakeStatus:
    """A daemon's Status that pages ``blocks`` by ``page`` blocks (whatever ``max_blocks``
    asks, as an older daemon does), as columns or, with ``columns=False``, a message per block;
    ``fail_at``: the call of that number fails. Every call is logged."""

    def __init__(self, count: int, page: int, *, columns: bool = True, fail_at: int = -1):
        self.blocks = [_block(i) for i in range(count)]
        self.page, self.columns, self.fail_at = page, columns, fail_at
        self.log: list[str] = []
        self.requests: list[pb.StatusRequest] = []

    def future(self, request: pb.StatusRequest, timeout: float) -> _Done:
        self.requests.append(request)
        self.log.append(f"call {request.after_block or '-'}")
        if len(self.requests) - 1 == self.fail_at:
            return _Done(self.log, None, _FakeRpcError())
        after = [b for b in self.blocks if b.block > request.after_block]
        shown = after[: self.page]
        if self.columns:
            reply = convert.status_to_proto(_stats(), [])
            reply.columns.CopyFrom(convert.block_table_to_proto(BlockTable.of(TENANT, shown)))
        else:
            reply = convert.status_to_proto(_stats(), shown)
        if len(after) > len(shown):
            reply.next_after_block = shown[-1].block
        return _Done(self.log, reply, None)

    def __call__(self, request: pb.StatusRequest, timeout: float) -> pb.StatusResponse:
        return self.future(request, timeout).result()  # a blocking call, as one's reply


class _FakeStub:
    def __init__(self, status: _FakeStatus) -> None:
        self.Status = status


def _connection(status: _FakeStatus) -> DaemonConnection:
    conn = DaemonConnection("unix:/nonexistent/asteria.sock", tenant=TENANT)
    conn._stub = _FakeStub(status)  # type: ignore[assignment]
    return conn


def test_the_next_page_is_asked_for_before_this_one_is_converted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = _FakeStatus(7, page=3)
    real = convert.block_table_from_proto

    def logged(message: pb.BlockColumns) -> BlockTable:
        table = real(message)
        status.log.append(f"convert {table.columns['block'][0]}")  # into the calls' log
        return table

    monkeypatch.setattr(connection_module.convert, "block_table_from_proto", logged)
    conn = _connection(status)
    try:
        _, table, _ = conn.status_report("s")
    finally:
        conn.close()
    assert table.columns["block"] == [b.block for b in status.blocks]
    assert status.log == [
        "call -",
        "call layer0002.weight",
        "convert layer0000.weight",
        "call layer0005.weight",
        "convert layer0003.weight",
        "convert layer0006.weight",
    ]


def test_a_daemon_that_ignores_max_blocks_is_read_to_the_end() -> None:
    status = _FakeStatus(25, page=4)
    conn = _connection(status)
    try:
        stats, table, _ = conn.status_report("s")
    finally:
        conn.close()
    assert stats.incarnation_id == "abc"
    assert table.columns["block"] == [b.block for b in status.blocks]
    assert len(status.requests) == 7
    assert all(r.columns and r.max_blocks == STATUS_BULK_PAGE_BLOCKS for r in status.requests)


def test_a_daemon_that_predates_columns_is_read_to_the_end() -> None:
    status = _FakeStatus(10, page=4, columns=False)
    conn = _connection(status)
    try:
        _, table, _ = conn.status_report("s")
    finally:
        conn.close()
    assert table.columns["block"] == [b.block for b in status.blocks]
    assert table.tenant == TENANT


def test_a_failed_page_raises_an_asteria_error() -> None:
    status = _FakeStatus(10, page=4, fail_at=1)
    conn = _connection(status)
    try:
        with pytest.raises(AsteriaError, match="daemon gone"):
            conn.status_report("s")
    finally:
        conn.close()
    assert len(status.requests) == 2


def test_a_page_that_fails_to_convert_cancels_the_call_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = _FakeStatus(10, page=4)

    def broken(message: pb.BlockColumns) -> BlockTable:
        raise AsteriaError("bad page")

    monkeypatch.setattr(connection_module.convert, "block_table_from_proto", broken)
    conn = _connection(status)
    try:
        with pytest.raises(AsteriaError, match="bad page"):
            conn.status_report("s")
    finally:
        conn.close()
    assert status.log == ["call -", "call layer0003.weight", "cancel"]


class _LoggedSink:
    """A text sink that logs, into the calls' log, each chunk of rows it is given."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        if '"block": "' in text:
            self.log.append("write " + text.split('"block": "', 1)[1].split('"', 1)[0])
        return len(text)


def test_json_pages_are_written_while_the_daemon_builds_the_next() -> None:
    """``asteria status --json --blocks`` writes page k before it waits for page k+1's reply
    (whose call is already out), and the text is the one document of every row."""
    status = _FakeStatus(7, page=3)
    conn = _connection(status)
    sink = _LoggedSink(status.log)
    try:
        rows = write_status_pages(
            sink, "unix:/x", conn.status_pages("s"), extra={"peer_groups": []}
        )
    finally:
        conn.close()
    assert rows == 7
    assert status.log == [
        "call -",
        "call layer0002.weight",
        "write layer0000.weight",
        "call layer0005.weight",
        "write layer0003.weight",
        "write layer0006.weight",
    ]
    whole = status_document("unix:/x", _stats(), BlockTable.of(TENANT, status.blocks))
    whole["peer_groups"] = []
    assert json.loads("".join(sink.parts)) == json.loads(json.dumps(whole))


def test_a_page_that_fails_mid_document_raises_after_the_rows_before_it() -> None:
    status = _FakeStatus(10, page=4, fail_at=1)
    conn = _connection(status)
    sink = _LoggedSink(status.log)
    try:
        with pytest.raises(AsteriaError, match="daemon gone"):
            write_status_pages(sink, "unix:/x", conn.status_pages("s"))
    finally:
        conn.close()
    # the failed call is cancelled as well (harmless: it is done)
    assert status.log == ["call -", "call layer0003.weight", "write layer0000.weight", "cancel"]


def test_a_first_page_that_fails_writes_nothing() -> None:
    status = _FakeStatus(10, page=4, fail_at=0)
    conn = _connection(status)
    sink = _LoggedSink(status.log)
    try:
        with pytest.raises(AsteriaError, match="daemon gone"):
            write_status_pages(sink, "unix:/x", conn.status_pages("s"))
    finally:
        conn.close()
    assert sink.parts == []


def test_the_cli_says_on_stderr_when_the_document_is_cut_short(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = _FakeStatus(10, page=4, fail_at=1)
    reader = StatusReader("unix:/nonexistent/asteria.sock", TENANT, "")
    reader._conn._stub = _FakeStub(status)  # type: ignore[assignment]
    reader._session_id = "s"  # as if opened: the fake serves Status only
    try:
        assert cli_status._stream_json(reader, "unix:/x") is False
    finally:
        reader._session_id = None
        reader.close()
    out, err = capsys.readouterr()
    assert out.startswith('{"address": "unix:/x"') and out.endswith("\n")
    assert '"block": "layer0003.weight"' in out and "layer0004" not in out
    assert "cut short" in err and "daemon gone" in err
