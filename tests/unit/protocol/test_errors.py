"""protocol.errors: the one table between gRPC status codes and Asteria exceptions."""

from __future__ import annotations

import inspect
from concurrent import futures
from typing import Any

import grpc
import pytest

import asteria_server.errors as asteria_errors
from asteria_server.errors import (
    AsteriaError,
    AuthenticationError,
    BlockFailedError,
    EngineUnavailableError,
    InvalidInputError,
    NonFiniteGradientError,
    ResultTimeoutError,
    SolverError,
    UnknownSessionError,
    UnsupportedParameterError,
)
from asteria_server.protocol import errors
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2 as pb
from asteria_server.protocol.generated.asteria.v1 import preconditioner_pb2_grpc as pb_grpc

ROWS = [pytest.param(cls, code, id=cls.__name__) for cls, code in errors.STATUS_TABLE]


def test_table_is_one_to_one_and_covers_the_documented_pairs() -> None:
    table = dict(errors.STATUS_TABLE)
    assert len(table) == len(set(table.values())) == len(errors.STATUS_TABLE)
    assert table[InvalidInputError] is grpc.StatusCode.INVALID_ARGUMENT
    assert table[EngineUnavailableError] is grpc.StatusCode.UNAVAILABLE
    assert table[ResultTimeoutError] is grpc.StatusCode.DEADLINE_EXCEEDED
    assert table[AuthenticationError] is grpc.StatusCode.UNAUTHENTICATED
    assert table[UnknownSessionError] is grpc.StatusCode.NOT_FOUND
    assert grpc.StatusCode.OK not in table.values()
    assert grpc.StatusCode.INTERNAL not in table.values()


@pytest.mark.parametrize(("cls", "code"), ROWS)
def test_every_row_round_trips(cls: type[AsteriaError], code: grpc.StatusCode) -> None:
    exc = cls("block 'layers.0.L' version 7: what went wrong, and what to do")
    got_code, message = errors.to_status(exc)
    assert got_code is code and message == str(exc)
    back = errors.from_status(got_code, message)
    assert type(back) is cls and str(back) == str(exc)


def test_subclasses_travel_as_their_nearest_listed_base() -> None:
    for exc, code, cls in [
        (NonFiniteGradientError("grad of 'w' has NaN"), "INVALID_ARGUMENT", InvalidInputError),
        (UnsupportedParameterError("'w' is int8"), "INVALID_ARGUMENT", InvalidInputError),
    ]:
        got_code, message = errors.to_status(exc)
        assert got_code.name == code
        assert type(errors.from_status(got_code, message)) is cls


def test_every_asteria_exception_has_a_code() -> None:
    classes = [
        c
        for _, c in inspect.getmembers(asteria_errors, inspect.isclass)
        if issubclass(c, AsteriaError) and c is not AsteriaError
    ]
    assert {InvalidInputError, NonFiniteGradientError, UnknownSessionError} <= set(classes)
    listed = {code for _, code in errors.STATUS_TABLE}
    for cls in classes:
        assert errors.to_status(cls("x"))[0] in listed, cls.__name__


def test_standard_bases_survive_the_trip() -> None:
    timeout = errors.from_status(*errors.to_status(ResultTimeoutError("waited 2.0 s for 'b'")))
    assert isinstance(timeout, TimeoutError)
    bad = errors.from_status(*errors.to_status(InvalidInputError("n must be >= 1")))
    assert isinstance(bad, ValueError)
    session = errors.from_status(*errors.to_status(UnknownSessionError("session s-1 is gone")))
    assert isinstance(session, EngineUnavailableError)
    failed = errors.from_status(*errors.to_status(BlockFailedError("block 'b' failed 3 times")))
    assert isinstance(failed, SolverError)


def test_other_exceptions_become_internal_without_their_text() -> None:
    code, message = errors.to_status(KeyError("token=s3cr3t"))
    assert code is grpc.StatusCode.INTERNAL
    assert "s3cr3t" not in message and "KeyError" in message
    code, message = errors.to_status(AsteriaError("registry lost block 'b'"))
    assert code is grpc.StatusCode.INTERNAL and "registry lost block 'b'" in message


@pytest.mark.parametrize(
    "code",
    [
        c
        for c in grpc.StatusCode
        if c is not grpc.StatusCode.OK and c not in {code for _, code in errors.STATUS_TABLE}
    ],
    ids=lambda c: c.name,
)
def test_unlisted_codes_mean_unavailable(code: grpc.StatusCode) -> None:
    exc = errors.from_status(code, "details from the peer")
    assert type(exc) is EngineUnavailableError
    assert code.name in str(exc) and "details from the peer" in str(exc)


def test_ok_is_not_an_error_and_codes_must_be_status_codes() -> None:
    with pytest.raises(ValueError, match="OK is not an error"):
        errors.from_status(grpc.StatusCode.OK, "")
    with pytest.raises(TypeError, match=r"grpc\.StatusCode"):
        errors.from_status(14, "unavailable")  # an int, not a StatusCode


def test_long_messages_are_clipped() -> None:
    code, message = errors.to_status(InvalidInputError("x" * 10_000))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(message) == errors.MAX_MESSAGE_CHARS and message.endswith("…")


def test_empty_message_names_the_error() -> None:
    assert errors.to_status(AuthenticationError()) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "AuthenticationError",
    )


class _Raising(pb_grpc.PreconditionerServicer):
    """A servicer whose Status call fails with whatever the test sets, mapped by the table."""

    exc: BaseException = RuntimeError("unset")

    def Status(self, request: Any, context: Any) -> Any:
        code, message = errors.to_status(self.exc)
        context.abort(code, message)


def test_every_row_round_trips_over_a_real_call() -> None:
    servicer = _Raising()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pb_grpc.add_PreconditionerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PreconditionerStub(channel)
            for cls, _ in errors.STATUS_TABLE:
                servicer.exc = cls(f"block 'é/{cls.__name__}' version 3: details")
                with pytest.raises(grpc.RpcError) as info:
                    stub.Status(pb.StatusRequest(), timeout=30)
                back = errors.from_status(info.value.code(), info.value.details())
                assert type(back) is cls and str(back) == str(servicer.exc)
    finally:
        server.stop(None)
