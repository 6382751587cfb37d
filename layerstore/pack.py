"""Packs: many chunks stored as one object, each as the pages it changes.

A VM snapshot changes a few pages in each of many chunks. Stored as whole
chunk objects, that is one object per chunk: on the local store two fsyncs
each, and a whole MiB written for a few KiB of change. A pack holds the
seal's chunks in one object, each as the pages that differ from a *base*:

    packs/<blake3 of the object>      entries, one after another
      entry = one zstd frame (content size in its header) of
          <u32 little-endian: the chunk's length>
          <bitmap: one bit per PAGE of the chunk, LSB first; 1 = page present>
          <the present pages, in order (a chunk's short last page is short)>

A layer's recorded working set (store.py, `prefetch/`) may have its
packed chunks stored again beside it, each as one entry over no base,
so that a restore on another node reads them without their bases:

    prefetch-chunks/<layer id>
        <u32 little-endian: n> <JSON {"<digest>": [offset, length], ...}: n bytes>
        <the entries, one after another (offsets count from the end of the JSON)>

It names no object and nothing names it; it is kept and deleted with its
layer, and every chunk rebuilt from it is checked against the digest the
layer names, like any entry.

A chunk stored this way keeps its digest: the layer manifest still names the
chunk's full content `D` and says where to rebuild it (manifest.py,
`packed`: base chunk, pack, offset, length). Rebuilding takes the base's
bytes (zeros if the base is null), lays the present pages over them, and
is accepted only if the result hashes to `D`, so a corrupt pack, a wrong
base or a lying manifest yields CorruptObject, never data. A base is always
a whole chunk object (chains are one step deep): garbage collection keeps
it, and a push copies it, for as long as a layer names the packed chunk.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import zstandard

from .chunk import DEFAULT_LEVEL, MAX_CHUNK_SIZE
from .digest import check_digest, digest_bytes
from .errors import CorruptObject, InvalidInput

PACK_PREFIX = "packs/"
PAGE = 4096
_HEADER = struct.Struct("<I")
_ZEROS = bytes(1 << 20)  # what a chunk of the usual size is rebuilt over when it has no base
MAX_ENTRY = _HEADER.size + MAX_CHUNK_SIZE // PAGE // 8 + MAX_CHUNK_SIZE  # the largest decoded entry


def pack_key(pack_id: str) -> str:
    """The object key of the pack with this id (validated)."""
    check_digest(pack_id, what="pack id")
    return f"{PACK_PREFIX}{pack_id}"


def _pages(length: int) -> int:
    return -(-length // PAGE)


def changed_pages(data: bytes, base: bytes | None) -> list[int]:
    """Indices of the pages where `data` differs from `base` (all-zero pages when base is None)."""
    zero = bytes(PAGE)
    out = []
    for page in range(_pages(len(data))):
        start = page * PAGE
        piece = data[start:start + PAGE]
        if piece != (base[start:start + PAGE] if base is not None else zero[:len(piece)]):
            out.append(page)
    return out


def encode_entry(data: bytes, base: bytes | None, *, level: int = DEFAULT_LEVEL,
                 pages: list[int] | None = None) -> bytes:
    """One entry: `data` as the pages that differ from `base` (same length, or
    None for zeros); `pages` is `changed_pages(data, base)` if the caller has it."""
    if base is not None and len(base) != len(data):
        raise ValueError(f"base is {len(base)} bytes, the chunk {len(data)}")
    if pages is None:
        pages = changed_pages(data, base)
    bitmap = bytearray((_pages(len(data)) + 7) // 8)
    for page in pages:
        bitmap[page >> 3] |= 1 << (page & 7)
    body = b"".join([_HEADER.pack(len(data)), bytes(bitmap), *(data[p * PAGE:(p + 1) * PAGE] for p in pages)])
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(body)


def _runs(bitmap: bytes, count: int) -> list[tuple[int, int]]:
    """The present pages of a `count`-page bitmap as [start, end) runs: a
    chunk is rebuilt one run at a time, not page by page."""
    runs: list[tuple[int, int]] = []
    start = None
    for page in range(count):
        if bitmap[page >> 3] >> (page & 7) & 1:
            if start is None:
                start = page
        elif start is not None:
            runs.append((start, page))
            start = None
    if start is not None:
        runs.append((start, count))
    return runs


def _lay_over(base: bytes | None, length: int, pages: memoryview, runs: list[tuple[int, int]]) -> bytes:
    """The chunk: `base` (None: zeros) with each run of `pages` laid over
    it, in order, built in one pass (no zero-filled copy to patch)."""
    if base is not None:
        under = memoryview(base)
    else:
        under = memoryview(_ZEROS if length <= len(_ZEROS) else bytes(length))
    parts = []
    at = pos = 0  # in `pages`, in the chunk
    for start, end in runs:
        first, stop = start * PAGE, min(end * PAGE, length)
        parts += [under[pos:first], pages[at:at + stop - first]]
        at += stop - first
        pos = stop
    parts.append(under[pos:length])
    return b"".join(parts)


def decode_entry(digest: str, frame: bytes | memoryview, base: bytes | None) -> bytes:
    """The chunk `digest` rebuilt from its entry and its base's bytes, verified."""
    what = f"packed chunk {digest}"
    try:
        params = zstandard.get_frame_parameters(frame)
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN or params.content_size > MAX_ENTRY:
            raise CorruptObject(f"{what}: entry frame has no content size or one above {MAX_ENTRY}")
        body = zstandard.ZstdDecompressor().decompress(frame, max_output_size=MAX_ENTRY)
    except zstandard.ZstdError as exc:
        raise CorruptObject(f"{what}: entry is not a valid zstd frame ({exc})") from None
    if len(body) < _HEADER.size:
        raise CorruptObject(f"{what}: entry too short")
    (length,) = _HEADER.unpack_from(body)
    if length > MAX_CHUNK_SIZE or (base is not None and len(base) != length):
        raise CorruptObject(f"{what}: entry of {length} bytes does not fit its base")
    count = _pages(length)
    at = _HEADER.size + (count + 7) // 8
    bitmap = body[_HEADER.size:at]
    runs = _runs(bitmap, count)
    present = sum(min(end * PAGE, length) - start * PAGE for start, end in runs)
    if at + present != len(body):
        raise CorruptObject(f"{what}: entry holds {len(body) - at - present} bytes more or less than its bitmap says")
    if base is None and runs == [(0, count)]:
        data = body[at:]  # every page present (a full chunk of RAM, say): one copy, no rebuild
    else:
        data = _lay_over(base, length, memoryview(body)[at:], runs)
    actual = digest_bytes(data)
    if actual != digest:
        raise CorruptObject(f"{what}: rebuilt content hashes to {actual} (corrupt pack or base)")
    return data


def encode_entries(entries: Mapping[str, bytes]) -> bytes:
    """Entries (`encode_entry` frames) by chunk digest, as one object with its index."""
    index: dict[str, list[int]] = {}
    at = 0
    for digest, frame in entries.items():
        check_digest(digest, what="chunk digest")
        index[digest] = [at, len(frame)]
        at += len(frame)
    head = json.dumps(index, separators=(",", ":")).encode()
    return b"".join([_HEADER.pack(len(head)), head, *entries.values()])


def decode_entries(blob: bytes) -> dict[str, memoryview]:
    """The entries `encode_entries` stored, by digest (views of `blob`, not
    copies); CorruptObject if the index does not describe the object (each
    entry is verified when used)."""
    view = memoryview(blob)
    try:
        (n,) = _HEADER.unpack_from(blob)
        index = json.loads(blob[_HEADER.size:_HEADER.size + n])
        body = _HEADER.size + n
        out = {}
        for digest, (offset, length) in index.items():
            check_digest(digest, what="chunk digest")
            if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset
                    and 0 < length <= MAX_ENTRY and body + offset + length <= len(blob)):
                raise ValueError(f"entry of {digest} out of range")
            out[digest] = view[body + offset:body + offset + length]
        return out
    except (struct.error, ValueError, TypeError, AttributeError, InvalidInput) as exc:
        raise CorruptObject(f"working-set entries: malformed object ({exc})") from None


class PackWriter:
    """Builds one pack: `add` each chunk, then store `blob()` under its digest."""

    def __init__(self, *, level: int = DEFAULT_LEVEL) -> None:
        self.level = level
        self._entries: list[bytes] = []
        self._size = 0

    def add(self, data: bytes, base: bytes | None) -> tuple[int, int]:
        """Append `data` as its difference from `base`; its (offset, length) in the pack."""
        return self.add_entry(encode_entry(data, base, level=self.level))

    def add_entry(self, entry: bytes) -> tuple[int, int]:
        """Append an entry `encode_entry` made; its (offset, length) in the pack."""
        offset = self._size
        self._entries.append(entry)
        self._size += len(entry)
        return offset, len(entry)

    def __len__(self) -> int:
        return self._size

    def blob(self) -> bytes:
        return b"".join(self._entries)

    def pack_id(self) -> str:
        return digest_bytes(self.blob())

