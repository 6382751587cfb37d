"""A read-only byte view over a resolved layer stack.

Mounting reads only manifests: a `LayerView` holds the flattened
index -> digest map and fetches chunk bytes only when a read touches them.
Holes read as zeros without any fetch. Reads never go past the image size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from layerstore.errors import CorruptObject

from .fetch import ChunkFetcher


def chunk_spans(offset: int, end: int, chunk_size: int) -> Iterator[tuple[int, int, int, int]]:
    """Split [offset, end) at chunk boundaries: yields (index, offset in chunk, length, position)."""
    pos = offset
    while pos < end:
        index, inner = divmod(pos, chunk_size)
        n = min(chunk_size - inner, end - pos)
        yield index, inner, n, pos
        pos += n


@dataclass
class LayerView:
    """Lazily readable image: `size` bytes in `chunk_size` pieces, `chunks` maps index -> digest."""

    fetcher: ChunkFetcher
    manifest_id: str
    size: int
    chunk_size: int
    chunks: dict[int, str]
    _zero: bytes = field(init=False, repr=False)
    # chunk indices in first-read order: the working set recorded beside the layer (daemon.py)
    touched: dict[int, None] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._zero = bytes(self.chunk_size)

    @classmethod
    def of(cls, fetcher: ChunkFetcher, manifest_id: str) -> "LayerView":
        """The view of a layer stack in the fetcher's store (its packed
        chunks' whereabouts told to the fetcher)."""
        store = fetcher.store
        top, resolved = store.chunk_map(manifest_id)
        fetcher.learn(store.packed_map(manifest_id))
        return cls(fetcher, manifest_id, top.size, top.chunk_size, resolved)

    def chunk_range(self, offset: int, length: int) -> range:
        """Indices of chunks covering [offset, offset+length) within the image."""
        end = min(self.size, offset + length)
        if offset >= end:
            return range(0)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length), clamped to the image size."""
        end = min(self.size, offset + length)
        if offset < 0 or offset >= end:
            return b""
        parts: list[bytes] = []
        for index, inner, n, _pos in chunk_spans(offset, end, self.chunk_size):
            digest = self.chunks.get(index)
            if digest is None:
                parts.append(self._zero[:n])
            else:
                if index not in self.touched:
                    self.touched[index] = None
                parts.append(self.fetcher.read(digest, inner, n))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_into(self, offset: int, out: memoryview, *, fetch: bool = True) -> int | None:
        """`read` into `out` (the count, clamped to the image size), for a
        reader that keeps what it reads: chunk cache files are read around
        their page cache (ChunkFetcher.read_into). None if a chunk would have
        to be fetched and `fetch` is False."""
        end = min(self.size, offset + len(out))
        if offset < 0 or offset >= end:
            return 0
        for index, inner, n, pos in chunk_spans(offset, end, self.chunk_size):
            digest = self.chunks.get(index)
            part = out[pos - offset : pos - offset + n]
            if digest is None:
                part[:] = self._zero[:n]
                continue
            got = self.fetcher.read_into(digest, inner, part, fetch=fetch)
            if got is None:
                return None
            if index not in self.touched:
                self.touched[index] = None
            if got != n:  # never answer with what the reused buffer held before
                raise CorruptObject(f"chunk {digest} of {self.manifest_id} is shorter than its manifest says")
        return end - offset

    def chunk(self, index: int) -> bytes:
        """Chunk `index` whole (zeros for a hole, nothing past the end), for a
        seal composing it: not a guest's read (not recorded as touched), and
        kept in the fetcher's memory, where the seal reads it again as a base."""
        start = index * self.chunk_size
        n = max(0, min(self.chunk_size, self.size - start))
        digest = self.chunks.get(index)
        return self._zero[:n] if digest is None or n == 0 else self.fetcher.read(digest)

    def read_ready(self, offset: int, length: int, *, max_disk_read: int = 64 << 10) -> bytes | None:
        """A read within one chunk served without I/O waits (hole, memory or
        verified cache entry: a pread of at most `max_disk_read` bytes), or
        None when it needs the slow path."""
        end = min(self.size, offset + length)
        if offset < 0 or offset >= end:
            return b""
        index, inner = divmod(offset, self.chunk_size)
        if (end - 1) // self.chunk_size != index:
            return None
        digest = self.chunks.get(index)
        if digest is None:
            return self._zero[: end - offset] if end - offset < self.chunk_size else self._zero
        data = self.fetcher.read_ready(digest, inner, end - offset, max_disk_read=max_disk_read)
        if data is not None and index not in self.touched:  # served fast, still part of the working set
            self.touched[index] = None
        return data

    def zeros_if_hole(self, offset: int, length: int) -> bytes | None:
        """Zeros for a range that touches no stored chunk, else None (cheap: no I/O)."""
        chunks = self.chunks
        for index in self.chunk_range(offset, length):
            if index in chunks:
                return None
        end = min(self.size, offset + length)
        n = max(0, end - offset)
        return self._zero if n == self.chunk_size else bytes(n)

    def digests(self) -> set[str]:
        return set(self.chunks.values())
