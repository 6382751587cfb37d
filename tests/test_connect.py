"""api/connect.py: the Connect framing envd's clients speak, on its own."""

from __future__ import annotations

import struct

import pytest

from api.connect import (HTTP_STATUS, STREAM_TYPE, UNARY_TYPE, ConnectError, end_of_stream, envelope,
                         parse_envelopes, request_message)


def test_envelopes_round_trip() -> None:
    body = envelope({"a": 1}) + envelope({"b": [2]})
    assert parse_envelopes(body) == [{"a": 1}, {"b": [2]}]
    assert body[0] == 0 and struct.unpack(">I", body[1:5])[0] == len(b'{"a":1}')
    end = end_of_stream(ConnectError("not_found", "gone"))
    assert end[0] == 0x02 and parse_envelopes(b"\x00" + end[1:]) == [{"error": {"code": "not_found",
                                                                                  "message": "gone"}}]
    assert parse_envelopes(b"\x00" + end_of_stream()[1:]) == [{}]


@pytest.mark.parametrize("body", [
    b"\x00\x00\x00",  # shorter than a prefix
    b"\x00\x00\x00\x00\x10{}",  # length past the body
    b"\x00\xff\xff\xff\xff{}",  # length past the limit
    b"\x01\x00\x00\x00\x02{}",  # compressed
    b"\x00\x00\x00\x00\x05[1,2]",  # not an object
    b"\x00\x00\x00\x00\x04{no}",  # not JSON
])
def test_bad_envelopes_are_clear_errors(body: bytes) -> None:
    with pytest.raises(ConnectError) as err:
        parse_envelopes(body)
    assert err.value.code in ("invalid_argument", "unimplemented")


def test_request_message_by_content_type() -> None:
    assert request_message(UNARY_TYPE, b'{"path": "/x"}') == {"path": "/x"}
    assert request_message(f"{STREAM_TYPE}; charset=utf-8", envelope({"pid": 3})) == {"pid": 3}
    assert request_message(UNARY_TYPE, b"") == {}
    with pytest.raises(ConnectError, match="one request message"):
        request_message(STREAM_TYPE, envelope({}) + envelope({}))
    with pytest.raises(ConnectError) as err:
        request_message("application/proto", b"\x0a\x01x")
    assert err.value.code == "unimplemented" and HTTP_STATUS[err.value.code] == 501
