"""Tars from strangers, read with bounded memory and time.

Python's tarfile trusts an archive's headers. Before it hands out a member
it reads the member's extended headers whole:

    [pax 'x' / global 'g' header: size S] [S bytes: "LEN KEY=VALUE\\n"...]
    [GNU 'L' longname / 'K' longlink: size S] [S bytes: a name]
    [the member's own 512-byte header] [its data]

so one header declaring 16 GiB (a few hundred KiB gzip-compressed) is read
into memory, its record parser is quadratic on crafted input (a keyword
scan that runs past its record; a search over long digit runs), the headers
chain by recursion without end, global headers accumulate, and every member
read is kept in `TarFile.members` until the archive is closed.

`HostileTar` (a TarFile) reads the same archives with these bounds, each
refused with a `TarRefused` (a TarError, so callers' existing handlers name
the archive):

    an extended header        at most MAX_HEADER bytes, its pax records
                              checked in one linear pass before tarfile
                              parses them (no digit run past MAX_DIGITS)
    headers before a member   at most MAX_CHAIN
    global pax headers        at most MAX_GLOBALS keys and MAX_HEADER bytes
                              in all (every member copies them)
    a member's name or link   at most MAX_NAME bytes
    GNU sparse members        refused (no image or COPY tar needs them;
                              their maps are read unbounded)
    members kept              none: iterate once, use each as it comes

`IndexedTar` keeps up to MAX_INDEXED members, for archives read by name
(an image archive: `docker save`, an OCI layout in a tar).
"""

from __future__ import annotations

import re
import tarfile
from typing import Any

MAX_HEADER = 1 << 20  # bytes in one pax or GNU extended header (real ones: a path, a few xattrs)
MAX_CHAIN = 16  # extended headers in a row before a member
MAX_NAME = 4096  # bytes in a member's name or link target (PATH_MAX)
MAX_GLOBALS = 64  # keys set by global pax headers (each member gets a copy of them all)
MAX_DIGITS = 64  # ASCII digits in a row in a pax header (tarfile's hdrcharset search is quadratic in them)
MAX_INDEXED = 100_000  # members an IndexedTar keeps

_DIGIT_RUN = re.compile(rb"\d{%d}" % (MAX_DIGITS + 1))


class TarRefused(tarfile.TarError):
    """The archive passes a bound of this module: its message names the bound."""


def check_pax_records(data: bytes) -> None:
    """TarRefused unless `data` is a run of well-formed pax records
    ("LEN KEY=VALUE\\n", LEN counting the whole record), read in one pass."""
    if _DIGIT_RUN.search(data):
        raise TarRefused(f"a pax header holds more than {MAX_DIGITS} digits in a row")
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        if space <= pos or not data[pos:space].isdigit():
            raise TarRefused(f"a pax header record at byte {pos} has no length")
        end = pos + int(data[pos:space])
        equals = data.find(b"=", space + 1, end)
        if end > len(data) or data[end - 1:end] != b"\n" or equals <= space + 1:
            raise TarRefused(f"a pax header record at byte {pos} is malformed")
        pos = end


class _Replay:
    """The file object tarfile reads, with `head` already read from it: the
    next read returns `head`, the rest goes to the file."""

    def __init__(self, head: bytes, rest: Any) -> None:
        self.head: bytes | None = head
        self.rest = rest

    def read(self, size: int = -1) -> bytes:
        if self.head is not None:
            head, self.head = self.head, None
            return head
        return bytes(self.rest.read(size))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rest, name)


class _Header(tarfile.TarInfo):
    """TarInfo whose extended-header steps check their bounds first."""

    def _proc_gnulong(self, tar: Any) -> tarfile.TarInfo:
        _extended(tar, self)
        return super()._proc_gnulong(tar)  # type: ignore[misc]

    def _proc_pax(self, tar: Any) -> tarfile.TarInfo:
        _extended(tar, self)
        head = tar.fileobj.read(self._block(self.size))  # type: ignore[attr-defined]
        check_pax_records(head[:self.size])
        real = tar.fileobj
        tar.fileobj = _Replay(head, real)  # tarfile reads the header again, from here
        try:
            member = super()._proc_pax(tar)  # type: ignore[misc]
        finally:
            tar.fileobj = real
        globals_ = tar.pax_headers
        if len(globals_) > MAX_GLOBALS or sum(len(k) + len(v) for k, v in globals_.items()) > MAX_HEADER:
            raise TarRefused(f"global pax headers pass {MAX_GLOBALS} keys or {MAX_HEADER} bytes")
        return member  # type: ignore[no-any-return]

    def _proc_sparse(self, tar: Any) -> tarfile.TarInfo:
        raise TarRefused(f"{self.name[:200]!r} is a GNU sparse member, which is not supported")

    def _refuse_sparse(self, next: tarfile.TarInfo, *args: object) -> None:
        raise TarRefused(f"{next.name[:200]!r} is a GNU sparse member, which is not supported")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


def _extended(tar: Any, header: tarfile.TarInfo) -> None:
    tar.extended = getattr(tar, "extended", 0) + 1
    if tar.extended > MAX_CHAIN:
        raise TarRefused(f"more than {MAX_CHAIN} extended headers before one member")
    if header.size > MAX_HEADER:
        raise TarRefused(f"an extended header of {header.size} bytes (at most {MAX_HEADER})")


class HostileTar(tarfile.TarFile):
    """A TarFile within this module's bounds that forgets each member once
    it is handed out: iterate it once (`for member in tar`)."""

    tarinfo = _Header

    def next(self) -> tarfile.TarInfo | None:
        self.extended = 0
        member = super().next()
        if member is not None and max(len(member.name), len(member.linkname)) > MAX_NAME:
            raise TarRefused(f"a member's name or link passes {MAX_NAME} bytes: {member.name[:200]!r}...")
        self._keep()
        return member

    def _keep(self) -> None:
        self.members.clear()


class IndexedTar(HostileTar):
    """A HostileTar that keeps its members (at most MAX_INDEXED), for
    `getmember` by name."""

    def _keep(self) -> None:
        if len(self.members) > MAX_INDEXED:
            raise TarRefused(f"more than {MAX_INDEXED} members")
