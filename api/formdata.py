"""A multipart/form-data body read as it arrives, for envd's `/files` upload.

Starlette's `request.form()` spools every file to the node's temp dir
before the handler sees a byte, so a client could fill the node's disk
with one upload whatever its sandbox's disk. Here python-multipart's
push parser turns each block of the body into events, in order:

    ("file", name)   a part with a filename begins (name: that filename)
    ("data", bytes)  some of its content
    ("end", None)    it ended

and the caller sends each block on before it reads the next. Parts
without a filename (plain fields) are skipped; a part's headers are
capped at MAX_HEADERS, the parts at MAX_PARTS.
"""

from __future__ import annotations

from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

MAX_HEADERS = 16 << 10  # bytes of one part's header lines
MAX_PARTS = 1000  # parts in one body, as starlette's own default


class FormError(ValueError):
    """The body is not the multipart/form-data its Content-Type says."""


def boundary_of(content_type: str) -> bytes:
    """The boundary a multipart/form-data Content-Type names, or FormError."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary", b"")
    if kind != b"multipart/form-data" or not 0 < len(boundary) <= 200:
        raise FormError("a multipart/form-data Content-Type with a boundary (1 to 200 bytes) is required")
    return boundary


class FormReader:
    """Feed the body's blocks; each feed returns the events they completed."""

    def __init__(self, boundary: bytes) -> None:
        self._events: list[tuple[str, Any]] = []
        self._field, self._value, self._header_bytes = bytearray(), bytearray(), 0
        self._filename: str | None = None
        self._parts, self._ended = 0, False
        self._parser = MultipartParser(boundary, {
            "on_part_begin": self._begin, "on_header_field": self._add(self._field),
            "on_header_value": self._add(self._value), "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._data,
            "on_part_end": self._part_end, "on_end": self._end})

    def feed(self, block: bytes) -> list[tuple[str, Any]]:
        try:
            self._parser.write(block)
        except MultipartParseError as exc:
            raise FormError(f"the multipart body is malformed: {exc}") from None
        events, self._events = self._events, []
        return events

    def finish(self) -> None:
        """Raises FormError unless the body ended with its closing boundary."""
        if not self._ended:
            raise FormError("the multipart body ended before its closing boundary")

    def _begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise FormError(f"the form has more than {MAX_PARTS} parts")
        self._filename, self._header_bytes = None, 0

    def _add(self, into: bytearray) -> Any:
        def add(data: bytes, start: int, end: int) -> None:
            self._header_bytes += end - start
            if self._header_bytes > MAX_HEADERS:
                raise FormError(f"a part's headers are longer than {MAX_HEADERS} bytes")
            into.extend(data[start:end])
        return add

    def _header_end(self) -> None:
        if bytes(self._field).strip().lower() == b"content-disposition":
            _, options = parse_options_header(bytes(self._value))
            if b"filename" in options:
                self._filename = options[b"filename"].decode("utf-8", "replace")
        self._field.clear()
        self._value.clear()

    def _headers_finished(self) -> None:
        if self._filename is not None:
            self._events.append(("file", self._filename))

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._filename is not None and end > start:
            self._events.append(("data", data[start:end]))

    def _part_end(self) -> None:
        if self._filename is not None:
            self._events.append(("end", None))
        self._filename = None

    def _end(self) -> None:
        self._ended = True
