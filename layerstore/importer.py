"""Import a raw image (disk image, memory file) into the store as a layer.

Pipeline, per window of chunks (a window bounds memory):

    pread (holes skipped via SEEK_DATA) -> zero check -> blake3      hash pool
    one batched existence check for the window's new digests          own store
    zstd + put for the chunks the store lacks                         upload pool

pread, blake3 and zstd all release the GIL, so the pools use every core.
The next window hashes while one is checked and its uploads queued
(layerstore/windows.py; without that, the hash pool idled at each window's
end: a 1 GiB import took 1.4 s, against 1.2-1.3 s), and uploads overlap with
both; in-flight uploads are capped so memory stays near (2 windows + 2 x
upload concurrency) chunks. Chunks already
stored are neither compressed nor uploaded, so re-importing an unchanged image
uploads nothing. The manifest is published only after every upload finished
and then the ref, so a failed import leaves no ref and no manifest.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import blake3
import zstandard

from .chunk import DEFAULT_CHUNK_SIZE
from .lease import Lease
from .errors import InvalidInput
from .manifest import Layer, check_chunk_size
from .refs import Ref, parse_ref
from .sparse import data_chunks
from .store import Store
from .windows import one_ahead

Progress = Callable[[int], None]


@dataclass
class ImportResult:
    """What an import did; `as_dict` is the CLI's --json output."""

    manifest_id: str
    ref: str | None
    size: int
    chunk_size: int
    data_chunks: int = 0
    hole_chunks: int = 0
    unique_chunks: int = 0
    new_chunks: int = 0
    new_raw_bytes: int = 0
    new_stored_bytes: int = 0
    read_bytes: int = 0
    seconds: float = 0.0
    parent: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "manifest": self.manifest_id,
            "ref": self.ref,
            "size": self.size,
            "chunk_size": self.chunk_size,
            "parent": self.parent,
            "data_chunks": self.data_chunks,
            "hole_chunks": self.hole_chunks,
            "unique_chunks": self.unique_chunks,
            "new_chunks": self.new_chunks,
            "new_raw_bytes": self.new_raw_bytes,
            "new_stored_bytes": self.new_stored_bytes,
            "read_bytes": self.read_bytes,
            "seconds": round(self.seconds, 4),
            "throughput_mb_s": round(self.size / self.seconds / 1e6, 1) if self.seconds else None,
        }


def _open_image(path: Path) -> tuple[int, int]:
    """Open an image read-only; return (fd, size). Clear errors for the usual mistakes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InvalidInput(f"{path}: is a directory, not an image file") from None
    except PermissionError:
        raise InvalidInput(f"{path}: permission denied") from None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot open ({exc.strerror})") from None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise InvalidInput(f"{path}: is a directory, not an image file")
    if stat.S_ISREG(st.st_mode):
        return fd, st.st_size
    if stat.S_ISBLK(st.st_mode):
        return fd, os.lseek(fd, 0, os.SEEK_END)
    os.close(fd)
    raise InvalidInput(f"{path}: not a regular file or block device")


def import_image(
    store: Store,
    path: str | os.PathLike[str],
    ref: Ref | str | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    level: int | None = None,
    parent: str | None = None,
    annotations: dict[str, str] | None = None,
    workers: int | None = None,
    upload_concurrency: int | None = None,
    window: int | None = None,
    slots: Iterable[int] | None = None,
    progress: Progress | None = None,
    on_total: Callable[[int], None] | None = None,
) -> ImportResult:
    """Chunk, hash, compress and store `path`; publish a manifest and (optionally) a ref.

    `parent` (a manifest id) makes the new layer hold only the chunks that
    differ from the parent stack, with whiteouts where the parent had data and
    the image now has zeros. `slots` (with `parent`) instead names exactly
    the chunk indices the new layer holds, e.g. the dirty chunks of a sealed
    sandbox layer: each is stored (or whited out if all zeros) and every
    other index inherits from the parent. `progress` is called with bytes advanced;
    `on_total` once with the total number of bytes that will be read.
    """
    started = time.monotonic()
    check_chunk_size(chunk_size)
    target = parse_ref(ref) if isinstance(ref, str) else ref
    if slots is not None and parent is None:
        raise InvalidInput("slots need a parent layer")
    parent_map = _parent_map(store, parent, chunk_size)
    path = Path(path)
    fd, size = _open_image(path)
    workers = workers or max(2, os.cpu_count() or 2)
    result = ImportResult(manifest_id="", ref=str(target) if target else None, size=size, chunk_size=chunk_size,
                          parent=parent)
    try:
        # The lease keeps a concurrent GC from deleting a chunk this import finds
        # already stored (and so does not upload) before the manifest names it.
        with Lease(store.backend, f"import {path.name}") as lease:
            indices = _indices(fd, size, chunk_size, slots)
            if on_total:
                on_total(_span_bytes(indices, size, chunk_size))
            chunker = _Chunker(store, fd, path, size, chunk_size, level=store.level if level is None else level,
                               result=result, upload_concurrency=upload_concurrency or max(4, workers * 2))
            digests = chunker.run(indices, workers=workers, window=window or max(32, workers * 8),
                                  progress=progress)
            layer = Layer(size=size, chunk_size=chunk_size, parent=parent, annotations=annotations or {},
                          chunks=_layer_chunks(digests, parent_map, indices if slots is not None else None,
                                               -(-size // chunk_size)))
            lease.check()
            result.manifest_id = store.put_layer(layer)
            if target is not None:
                store.set_ref(target, result.manifest_id)
    finally:
        os.close(fd)
    result.seconds = time.monotonic() - started
    return result


def _parent_map(store: Store, parent: str | None, chunk_size: int) -> dict[int, str]:
    """The parent stack's resolved chunk map (empty without a parent)."""
    if parent is None:
        return {}
    parent_top, parent_map = store.chunk_map(parent)
    if parent_top.chunk_size != chunk_size:
        raise InvalidInput(f"parent layer uses {parent_top.chunk_size}-byte chunks, this import {chunk_size}")
    return parent_map


def _indices(fd: int, size: int, chunk_size: int, slots: Iterable[int] | None) -> list[int]:
    """The chunk indices to read: `slots` (in range), else every index that holds data."""
    if slots is not None:
        count = -(-size // chunk_size)
        return sorted({i for i in slots if 0 <= i < count})
    return list(data_chunks(fd, size, chunk_size))


def _span_bytes(indices: list[int], size: int, chunk_size: int) -> int:
    return sum(min(chunk_size, size - i * chunk_size) for i in indices)


def _layer_chunks(digests: dict[int, str], parent_map: dict[int, str], slots: list[int] | None,
                  count: int) -> dict[int, str | None]:
    """The new layer's sparse map: everything read (no parent); the slots
    (with whiteouts only where the parent had data); or what differs from
    the parent, with whiteouts where the parent had data and the image now
    has zeros."""
    if not parent_map and slots is None:
        return dict(digests)
    if slots is not None:
        chosen = {i: digests.get(i) for i in slots}
        return {i: d for i, d in chosen.items() if d is not None or i in parent_map}
    layer: dict[int, str | None] = {i: d for i, d in digests.items() if parent_map.get(i) != d}
    layer.update({i: None for i in parent_map if i < count and i not in digests})
    return layer


class _Chunker:
    """One import's read -> zero check -> blake3 -> batched existence check
    -> zstd + put pipeline (see the module docstring), filling `result`."""

    def __init__(self, store: Store, fd: int, path: Path, size: int, chunk_size: int, *, level: int,
                 result: ImportResult, upload_concurrency: int) -> None:
        self.store, self.fd, self.path, self.size, self.chunk_size = store, fd, path, size, chunk_size
        self.level = level
        self.result = result
        self.upload_concurrency = upload_concurrency
        self.zero = bytes(chunk_size)
        self.local = threading.local()
        self.errors: list[BaseException] = []
        self.stats_lock = threading.Lock()
        self.inflight = threading.BoundedSemaphore(upload_concurrency * 2)
        self.uploaded: list[tuple[str, int, int]] = []

    def run(self, indices: list[int], *, workers: int, window: int, progress: Progress | None) -> dict[int, str]:
        """Store every chunk of `indices` the store lacks; returns index -> digest of the non-zero ones."""
        digests: dict[int, str] = {}
        seen: set[str] = set()
        with ThreadPoolExecutor(workers, thread_name_prefix="strata-hash") as hash_pool, ThreadPoolExecutor(
            self.upload_concurrency, thread_name_prefix="strata-put"
        ) as put_pool:
            parts = (indices[start : start + window] for start in range(0, len(indices), window))
            for part, futures in one_ahead(parts, lambda part: [hash_pool.submit(self.read_hash, i) for i in part]):
                if self.errors:
                    break
                fresh = self._hash_window((f.result() for f in futures), digests, seen)
                # local only: under this import's lease, a chunk some other store holds is not stored
                for digest in self.store.local_missing_chunks(fresh) if fresh else set():
                    self.inflight.acquire()
                    put_pool.submit(self.upload, digest, *fresh[digest])
                del fresh, futures  # the uploads hold what they need: no window keeps the last alive
                if progress:
                    progress(_span_bytes(part, self.size, self.chunk_size))
        if self.errors:
            raise self.errors[0]
        self.store.catalog.add_chunks(self.uploaded)
        r = self.result
        r.data_chunks, r.unique_chunks = len(digests), len(seen)
        r.hole_chunks = -(-self.size // self.chunk_size) - len(digests)
        return digests

    def _hash_window(self, batch: Iterable[tuple[int, str | None, bytes | None, int]], digests: dict[int, str],
                     seen: set[str]) -> dict[str, tuple[int, bytes | None, int]]:
        """Record a window's digests; return the digests first seen in it (to check and upload)."""
        fresh: dict[str, tuple[int, bytes | None, int]] = {}
        for index, digest, blob, n in batch:
            self.result.read_bytes += n
            if digest is None:
                continue
            digests[index] = digest
            if digest not in seen:
                seen.add(digest)
                fresh[digest] = (index, blob, n)
        return fresh

    def compressor(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self.local, "cctx", None)
        if cctx is None:
            cctx = self.local.cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return cctx

    def read(self, index: int, buf: bytearray) -> memoryview:
        offset = index * self.chunk_size
        try:
            n = os.preadv(self.fd, [buf], offset)
        except OSError as exc:
            raise InvalidInput(f"{self.path}: read error at offset {offset} ({exc.strerror})") from None
        if n != min(self.chunk_size, self.size - offset):
            raise InvalidInput(f"{self.path}: changed while importing (short read at offset {offset})")
        return memoryview(buf)[:n]

    def read_hash(self, index: int) -> tuple[int, str | None, bytes | None, int]:
        # Reads into a per-thread buffer (no 1 MiB allocation per chunk) and
        # compresses right away unless this node already stored the chunk:
        # then only the (smaller) compressed object waits for the batch check.
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = bytearray(self.chunk_size)
        view = self.read(index, buf)
        n = len(view)
        if (buf == self.zero) if n == self.chunk_size else (bytes(view) == self.zero[:n]):
            return index, None, None, n
        digest = blake3.blake3(view).hexdigest()
        blob = None if self.store.catalog.has_chunk(digest) else self.compressor().compress(view)
        return index, digest, blob, n

    def upload(self, digest: str, index: int, blob: bytes | None, raw: int) -> None:
        try:
            if blob is None:  # the catalog thought the store had it; it does not
                blob = self.compressor().compress(self.read(index, bytearray(self.chunk_size)))
            self.store.put_chunk_object(digest, blob)
            with self.stats_lock:
                self.result.new_chunks += 1
                self.result.new_raw_bytes += raw
                self.result.new_stored_bytes += len(blob)
                self.uploaded.append((digest, len(blob), raw))
        except BaseException as exc:  # surfaced after the pool drains
            self.errors.append(exc)
        finally:
            self.inflight.release()
