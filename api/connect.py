"""The Connect protocol's JSON flavour, as far as envd's clients use it.

connectrpc.com/docs/protocol, in short:

    unary          POST /pkg.Service/Method, Content-Type: application/json,
                   body = the request message as proto3 JSON; the reply is
                   the response message (200) or an error:
                   HTTP status + {"code": "not_found", "message": "..."}
    server stream  Content-Type: application/connect+json; request and
                   reply bodies are envelopes:

        +-------+-----------------+-----------------------------+
        | flags | length (uint32, | message (JSON)              |
        | 1 B   | big-endian) 4 B |                             |
        +-------+-----------------+-----------------------------+

                   flags 0x02 marks the last envelope, the end of stream:
                   {} or {"error": {"code": ..., "message": ...}}, always
                   sent with status 200 once the stream has started.

proto3 JSON: field names in lowerCamelCase, bytes as base64, 64-bit integers
as strings (numbers accepted), enums by name, Timestamps as RFC 3339.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from layerstore.errors import StrataError

STREAM_TYPE = "application/connect+json"
UNARY_TYPE = "application/json"
END_STREAM = 0x02
MAX_MESSAGE = 16 << 20  # a request envelope longer than this is refused

# Connect code -> HTTP status of a unary error response.
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


class ConnectError(StrataError):
    """An RPC that fails with a Connect code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        assert code in HTTP_STATUS, code
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "message": str(self)}


def envelope(message: dict[str, Any], *, flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_of_stream(error: ConnectError | None = None) -> bytes:
    return envelope({"error": error.body()} if error is not None else {}, flags=END_STREAM)


def parse_envelopes(body: bytes) -> list[dict[str, Any]]:
    """The messages of an enveloped request body (a server-streaming call has one)."""
    out, i = [], 0
    while i < len(body):
        if len(body) - i < 5:
            raise ConnectError("invalid_argument", "truncated envelope")
        flags, size = struct.unpack(">BI", body[i:i + 5])
        if size > MAX_MESSAGE or i + 5 + size > len(body):
            raise ConnectError("invalid_argument", "envelope length past the body or the limit")
        if flags & 0x01:
            raise ConnectError("unimplemented", "compressed messages are not supported")
        out.append(parse_json(body[i + 5:i + 5 + size]))
        i += 5 + size
    return out


def parse_json(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data or b"{}")
    except ValueError:
        raise ConnectError("invalid_argument", "the request is not JSON") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the request is not a JSON object")
    return message


def request_message(content_type: str, body: bytes) -> dict[str, Any]:
    """The one request message of a unary or server-streaming call."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == STREAM_TYPE:
        messages = parse_envelopes(body)
        if len(messages) != 1:
            raise ConnectError("invalid_argument", f"expected one request message, got {len(messages)}")
        return messages[0]
    if kind == UNARY_TYPE:
        return parse_json(body)
    raise ConnectError("unimplemented", f"content type {kind or 'none'} is not supported (use JSON)")
