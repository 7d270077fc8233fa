"""protocol.handover: every request and reply round-trips, and anything else is refused by name."""

from __future__ import annotations

import json

import pytest

from asteria_server.errors import InvalidInputError
from asteria_server.protocol.handover import (
    HANDOVER_VERSION,
    Attach,
    Detach,
    Hello,
    Reply,
    SegmentRole,
    Ticket,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)


@pytest.mark.parametrize(
    "request_",
    [
        Hello("s1"),
        Attach("seg", 8192, SegmentRole.SNAPSHOT),
        Attach("seg", 8192, SegmentRole.RESULT, "block/0"),
        Detach("seg"),
        Ticket(),
    ],
)
def test_requests_round_trip_and_carry_the_version(request_: object) -> None:
    data = encode_request(request_)  # type: ignore[arg-type]
    assert json.loads(data)["v"] == HANDOVER_VERSION
    assert decode_request(data) == request_


def test_replies_round_trip_and_an_empty_reply_is_a_refusal() -> None:
    assert decode_reply(encode_reply(Reply(True))) == Reply(True)
    assert decode_reply(encode_reply(Reply(True, ticket="t-1"))) == Reply(True, ticket="t-1")
    assert decode_reply(encode_reply(Reply(False, "no"))) == Reply(False, "no")
    assert not decode_reply(b"").ok


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (b"not json", "JSON object"),
        (b"[1]", "JSON object"),
        (b'{"op": "hello", "session_id": "s"}', "version None"),
        (b'{"v": 2, "op": "hello", "session_id": "s"}', "version 2"),
        (b'{"v": 1, "op": "map"}', "unknown handover op"),
        (b'{"v": 1, "op": "hello"}', "session_id"),
        (
            b'{"v": 1, "op": "attach", "segment_id": "x", "size_bytes": 0, "role": "snapshot"}',
            "size_bytes",
        ),
        (b'{"v": 1, "op": "attach", "segment_id": "x", "size_bytes": 8, "role": "both"}', "role"),
        (
            b'{"v": 1, "op": "attach", "segment_id": "x", "size_bytes": 8, "role": "result"}',
            "block",
        ),
    ],
)
def test_malformed_requests_are_refused_saying_why(message: bytes, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        decode_request(message)
