"""Import a raw image (disk image, memory file) into the store as a layer.

Pipeline, per window of chunks (a window bounds memory):

    pread (holes skipped via SEEK_DATA) -> zero check -> blake3      hash pool
    one batched existence check for the window's new digests          own store
    zstd + put for the chunks the store lacks                         upload pool

pread, blake3 and zstd all release the GIL, so the pools use every core.
Uploads overlap with hashing of the next window; in-flight uploads are capped
so memory stays near (window + 2 x upload concurrency) chunks. Chunks already
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
    parent_map: dict[int, str] = {}
    if parent is not None:
        parent_top, parent_map = store.chunk_map(parent)
        if parent_top.chunk_size != chunk_size:
            raise InvalidInput(f"parent layer uses {parent_top.chunk_size}-byte chunks, this import {chunk_size}")
    path = Path(path)
    fd, size = _open_image(path)
    workers = workers or max(2, os.cpu_count() or 2)
    upload_concurrency = upload_concurrency or max(4, workers * 2)
    window = window or max(32, workers * 8)
    result = ImportResult(manifest_id="", ref=str(target) if target else None, size=size, chunk_size=chunk_size, parent=parent)
    # The lease keeps a concurrent GC from deleting a chunk this import finds
    # already stored (and so does not upload) before the manifest names it.
    lease = Lease(store.backend, f"import {path.name}")
    try:
        lease.__enter__()
    except BaseException:
        os.close(fd)
        raise
    try:
        if slots is not None:
            if parent is None:
                raise InvalidInput("slots need a parent layer")
            count = -(-size // chunk_size)
            indices = sorted({i for i in slots if 0 <= i < count})
        else:
            indices = list(data_chunks(fd, size, chunk_size))
        if on_total:
            on_total(sum(min(chunk_size, size - i * chunk_size) for i in indices))
        level = store.level if level is None else level
        zero = bytes(chunk_size)
        local = threading.local()
        chunk_digests: dict[int, str] = {}
        seen: set[str] = set()
        errors: list[BaseException] = []
        stats_lock = threading.Lock()
        inflight = threading.BoundedSemaphore(upload_concurrency * 2)
        uploaded: list[tuple[str, int, int]] = []

        def compressor() -> zstandard.ZstdCompressor:
            cctx = getattr(local, "cctx", None)
            if cctx is None:
                cctx = local.cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
            return cctx

        def read(index: int, buf: bytearray) -> memoryview:
            try:
                n = os.preadv(fd, [buf], index * chunk_size)
            except OSError as exc:
                raise InvalidInput(f"{path}: read error at offset {index * chunk_size} ({exc.strerror})") from None
            expected = min(chunk_size, size - index * chunk_size)
            if n != expected:
                raise InvalidInput(f"{path}: changed while importing (short read at offset {index * chunk_size})")
            return memoryview(buf)[:n]

        def read_hash(index: int) -> tuple[int, str | None, bytes | None, int]:
            # Reads into a per-thread buffer (no 1 MiB allocation per chunk) and
            # compresses right away unless this node already stored the chunk:
            # then only the (smaller) compressed object waits for the batch check.
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(chunk_size)
            view = read(index, buf)
            n = len(view)
            if (buf == zero) if n == chunk_size else (bytes(view) == zero[:n]):
                return index, None, None, n
            digest = blake3.blake3(view).hexdigest()
            blob = None if store.catalog.has_chunk(digest) else compressor().compress(view)
            return index, digest, blob, n

        def upload(digest: str, index: int, blob: bytes | None, raw: int) -> None:
            try:
                if blob is None:  # the catalog thought the store had it; it does not
                    blob = compressor().compress(read(index, bytearray(chunk_size)))
                store.put_chunk_object(digest, blob)
                with stats_lock:
                    result.new_chunks += 1
                    result.new_raw_bytes += raw
                    result.new_stored_bytes += len(blob)
                    uploaded.append((digest, len(blob), raw))
            except BaseException as exc:  # surfaced after the pool drains
                errors.append(exc)
            finally:
                inflight.release()

        with ThreadPoolExecutor(workers, thread_name_prefix="strata-hash") as hash_pool, ThreadPoolExecutor(
            upload_concurrency, thread_name_prefix="strata-put"
        ) as put_pool:
            for start in range(0, len(indices), window):
                if errors:
                    break
                batch = list(hash_pool.map(read_hash, indices[start : start + window]))
                fresh: dict[str, tuple[int, bytes | None, int]] = {}
                for index, digest, blob, n in batch:
                    result.read_bytes += n
                    if digest is None:
                        continue
                    chunk_digests[index] = digest
                    if digest not in seen:
                        seen.add(digest)
                        fresh[digest] = (index, blob, n)
                # local only: under this import's lease, a chunk some other store holds is not stored
                missing = store.local_missing_chunks(fresh) if fresh else set()
                for digest in missing:
                    inflight.acquire()
                    put_pool.submit(upload, digest, *fresh[digest])
                del fresh, batch
                if progress:
                    progress(sum(min(chunk_size, size - i * chunk_size) for i in indices[start : start + window]))
        if errors:
            raise errors[0]
        store.catalog.add_chunks(uploaded)
        result.data_chunks = len(chunk_digests)
        result.hole_chunks = -(-size // chunk_size) - len(chunk_digests)
        result.unique_chunks = len(seen)
        layer_chunks: dict[int, str | None]
        if parent is None:
            layer_chunks = dict(chunk_digests)
        elif slots is not None:
            layer_chunks = {i: chunk_digests.get(i) for i in indices}
            layer_chunks = {i: d for i, d in layer_chunks.items() if d is not None or i in parent_map}
        else:
            count = -(-size // chunk_size)
            layer_chunks = {i: d for i, d in chunk_digests.items() if parent_map.get(i) != d}
            layer_chunks.update({i: None for i in parent_map if i < count and i not in chunk_digests})
        layer = Layer(size=size, chunk_size=chunk_size, chunks=layer_chunks, parent=parent, annotations=annotations or {})
        result.manifest_id = store.put_layer(layer)
        if target is not None:
            store.set_ref(target, result.manifest_id)
    finally:
        os.close(fd)
        lease.__exit__(None, None, None)
    result.seconds = time.monotonic() - started
    return result

