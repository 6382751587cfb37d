"""Tars whose headers attack the reader (layerstore/tarsafe.py), written
block by block so that a bomb of hundreds of MiB never sits in the test's
memory. Each shape ends with an ordinary member `after`, so a reader that
survived the headers still has something to hand out."""

from __future__ import annotations

import gzip
import tarfile
from collections.abc import Iterator
from pathlib import Path

BLOCK = 1 << 20


def record(key: str, value: bytes) -> bytes:
    """One pax record: "LEN KEY=VALUE\\n", LEN counting itself."""
    body = b" " + key.encode() + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def header(kind: bytes, size: int, name: str = "././@PaxHeader") -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def extended(kind: bytes, payload: bytes) -> bytes:
    """An extended header (pax 'x' or 'g', GNU 'L' or 'K') holding `payload`."""
    return header(kind, len(payload)) + payload + bytes(-len(payload) % 512)


def member(name: str = "after", data: bytes = b"x") -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info.tobuf(format=tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)


def shape(name: str, size: int = 256 << 20) -> Iterator[bytes]:
    """The blocks of one hostile shape; `size` is a bomb's declared size."""
    if name in ("pax-bomb", "longname-bomb"):
        yield header(tarfile.XHDTYPE if name == "pax-bomb" else tarfile.GNUTYPE_LONGNAME, size)
        for _ in range(size // BLOCK):
            yield bytes(BLOCK)
    elif name == "keyword-scan":  # records of length 2 whose keyword scan runs to the far end: quadratic
        yield extended(tarfile.XHDTYPE, b"2 " * 30_000 + b"=x\n")
    elif name == "digit-run":  # tarfile's hdrcharset search is quadratic in a run of digits
        yield extended(tarfile.XHDTYPE, record("comment", b"1" * 60_000))
    elif name == "header-chain":  # every header recurses into the next
        for _ in range(5_000):
            yield extended(tarfile.XHDTYPE, record("path", b"chained"))
    elif name == "global-flood":  # global headers accumulate, and each member gets a copy of them all
        for i in range(20_000):
            yield extended(tarfile.XGLTYPE, record(f"k{i:06d}", b"v"))
            yield member(f"m{i}")
    elif name == "long-name":
        yield extended(tarfile.GNUTYPE_LONGNAME, b"d/" * 40_000 + b"\0")
    elif name == "gnu-sparse":
        yield header(tarfile.GNUTYPE_SPARSE, 0, "sparse")
    elif name == "pax-sparse":
        yield extended(tarfile.XHDTYPE, record("GNU.sparse.size", b"1000") + record("GNU.sparse.numblocks", b"0"))
    else:
        raise ValueError(name)
    yield member()
    yield bytes(1024)


SHAPES = ("pax-bomb", "longname-bomb", "keyword-scan", "digit-run", "header-chain", "global-flood", "long-name",
          "gnu-sparse", "pax-sparse")


def write(path: Path, name: str, *, size: int = 256 << 20, compress: bool = True) -> Path:
    """Shape `name` at `path`, gzip-compressed (a bomb of 256 MiB is ~250 KiB) unless not `compress`."""
    with (gzip.open(path, "wb", compresslevel=9) if compress else open(path, "wb")) as out:
        for block in shape(name, size):
            out.write(block)
    return path
