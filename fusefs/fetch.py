"""Getting a chunk's bytes for a reader: cache first, else one verified fetch.

`ChunkFetcher.read` is what every lazy read goes through:

1. the local cache (`ChunkCache`), a pread of uncompressed bytes;
2. otherwise the store: `Store.read_chunk` fetches, decompresses and checks
   the blake3 digest (a corrupt object raises CorruptObject, never returns
   data), then the bytes go into the cache. A chunk stored in a pack is
   rebuilt from its entry and base, as the views told the fetcher (`learn`),
   or, if its layer's working set stored it again whole (`learn_whole`),
   from that entry alone: no base to fetch.

Concurrent readers of the same missing chunk share one fetch (single flight):
the first becomes the leader, the others wait for its result or its error.
Backend retries are bounded by the store's RetryingBackend, so a dead store
turns into an error in bounded time, never a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping

from layerstore.digest import digest_bytes
from layerstore.errors import CorruptObject, MissingChunk
from layerstore.lru import Lru
from layerstore.manifest import Packed
from layerstore.pack import decode_entry
from layerstore.store import Store

from .cache import ChunkCache

log = logging.getLogger("strata.fusefs")


class ChunkFetcher:
    """Read chunks through a cache, joining concurrent fetches of one chunk."""

    def __init__(
        self,
        store: Store,
        cache: ChunkCache,
        *,
        fetch: Callable[[str], bytes] | None = None,
        memory: int = 64 << 20,
        write_behind: int = 0,
        write_settle: float = 0.0,
    ) -> None:
        self.store = store
        self.cache = cache
        self._fetch = fetch or self._from_store
        self._lock = threading.Lock()
        self._packed: dict[str, Packed] = {}  # where packed chunks are (digest -> pack entry)
        self._bases: set[str] = set()  # digests some entry is stored over: whole objects
        self._whole: dict[str, bytes | memoryview] = {}  # working-set chunks as entries over no base, until read once
        self._inflight: dict[str, Future[bytes]] = {}
        # Chunks fetched recently, kept whole in memory: the kernel reads a
        # 1 MiB chunk in 128 KiB requests, and all but the first are served
        # from here instead of re-reading the cache file just written.
        self._memory: Lru[bytes] = Lru(memory, len)
        # Cache files written behind the read that fetched them, by one
        # thread: the reader goes on at once instead of waiting for a 1 MiB
        # O_DIRECT write (~3 ms here). At most `write_behind` bytes wait, held
        # in `_unwritten` so that a read in between finds them (0: inline).
        # A working set's chunk (prefetched with `settle`) is written once
        # no chunk has been fetched for `write_settle` seconds, or at once
        # if half the bound waits: those writes, made during a cold
        # restore, slowed it by ~20 ms (the guest's reads are served from
        # memory meanwhile). Not a read's own fetch, nor read-ahead's:
        # deferred, those landed in the next snapshot's seal.
        self._write_behind = write_behind
        self._write_settle = write_settle
        self._last_fetch = 0.0
        self._hurry = threading.Event()  # a flush or close: write now
        self._unwritten: dict[str, bytes] = {}
        self._unwritten_size = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="strata-cache-write") if write_behind else None
        self.fetches = 0  # backend fetches actually issued (for tests and stats)
        self.memory_hits = 0  # reads served from the in-memory recent set

    def learn(self, packed: Mapping[str, Packed]) -> None:
        """Where the packed chunks of a layer being served are (Store.packed_map)."""
        with self._lock:
            self._packed.update(packed)
            self._bases.update(p.base for p in packed.values() if p.base is not None)

    def learn_whole(self, entries: Mapping[str, bytes | memoryview]) -> None:
        """Entries over no base for chunks a working set is about to prefetch
        (Store.get_set_chunks); each is used once, by the fetch of its chunk."""
        with self._lock:
            self._whole.update(entries)

    def packed_base(self, digest: str) -> str | None:
        """The base a served layer's packed chunk is rebuilt on (None: whole, or over zeros)."""
        with self._lock:
            where = self._packed.get(digest)
        return where.base if where is not None and where.base != digest else None

    def _from_store(self, digest: str) -> bytes:
        """A base is always a whole object (pack.py): it is read as one even
        if some layer also packs the same content, so a rebuild never waits
        on another rebuild (single flight would deadlock on a cycle). Only if
        that object is gone (the layer it was a base for was collected) is
        it rebuilt from its own entry, by the store alone (its base read
        whole, outside this fetcher)."""
        with self._lock:
            where = self._packed.get(digest)
            is_base = digest in self._bases
            whole = self._whole.pop(digest, None)
        if whole is not None:
            try:
                return decode_entry(digest, whole, None)  # verified like any entry
            except CorruptObject as exc:
                log.warning("working-set copy of chunk %s unusable, reading it as its layer says: %s", digest, exc)
        if not is_base:
            return self.store.read_chunk(digest, where, read_base=self.read)  # the base through the cache
        try:
            return self.store.read_chunk(digest)
        except MissingChunk:
            if where is None:
                raise
        return self.store.read_chunk(digest, where)

    def _remember(self, digest: str, data: bytes) -> None:
        self._memory.put(digest, data)

    def _recall(self, digest: str) -> bytes | None:
        data = self._memory.get(digest)
        with self._lock:
            if data is not None:
                self.memory_hits += 1
                return data
            return self._unwritten.get(digest)

    def _cache_put(self, digest: str, data: bytes, *, settle: bool = False) -> None:
        """Write a fetched chunk's cache file: behind the reader when there is room."""
        with self._lock:
            behind = (self._writer is not None and digest not in self._unwritten
                      and self._unwritten_size + len(data) <= self._write_behind)
            if behind:
                self._unwritten[digest] = data
                self._unwritten_size += len(data)
        if behind:
            try:
                self._writer.submit(self._write_unwritten, digest, data, settle)  # type: ignore[union-attr]
                return
            except RuntimeError:  # shutting down: write it here
                self._written(digest, data)
        self._put(digest, data)

    def _settle(self) -> None:
        """On the writer: wait while fetching is busy (see __init__), unless hurried."""
        while not self._hurry.is_set():
            with self._lock:
                half_full = self._unwritten_size >= self._write_behind // 2
            wait = self._write_settle - (time.monotonic() - self._last_fetch)
            if wait <= 0 or half_full:
                return
            self._hurry.wait(min(wait, 0.05))

    def _write_unwritten(self, digest: str, data: bytes, settle: bool) -> None:
        try:
            if settle:
                self._settle()
            self._put(digest, data)
        finally:
            self._written(digest, data)

    def _written(self, digest: str, data: bytes) -> None:
        with self._lock:
            if self._unwritten.pop(digest, None) is not None:
                self._unwritten_size -= len(data)

    def _put(self, digest: str, data: bytes) -> None:
        try:
            self.cache.put(digest, data)
        except Exception as exc:  # noqa: BLE001 - served from memory; the next read fetches again
            log.error("caching chunk %s: %s", digest, exc)

    def flush(self) -> None:
        """Wait until every cache write behind a read is done (before a pin
        counts what is cached, or a drop empties the cache)."""
        if self._writer is not None:
            self._hurry.set()
            try:
                self._writer.submit(lambda: None).result()
            finally:
                self._hurry.clear()

    def close(self) -> None:
        """Finish the cache writes still behind."""
        if self._writer is not None:
            self._hurry.set()
            self._writer.shutdown(wait=True)

    def forget_all(self) -> None:
        """Empty the in-memory set (the cache was dropped: a read after it
        must not be served from a copy the node was asked to let go of)."""
        self._memory.clear()
        with self._lock:
            self._whole.clear()

    def read(self, digest: str, offset: int = 0, length: int = -1, *, remember: bool = True) -> bytes:
        """Bytes [offset, offset+length) of chunk `digest` (whole chunk if
        length < 0); one read from the cache is kept in memory only if
        `remember` (a caller reading many chunks once passes False)."""
        whole = self._recall(digest)
        if whole is None:
            data = self.cache.read(digest, offset, length)
            if data is not None:
                if remember and offset == 0 and length < 0:  # asked for whole (a seal's base): likely read again soon
                    self._remember(digest, data)
                return data
            whole = self.fetch(digest)
        if offset == 0 and (length < 0 or length >= len(whole)):
            return whole
        return whole[offset : offset + length if length >= 0 else None]

    def read_into(self, digest: str, offset: int, out: memoryview, *, fetch: bool = True) -> int | None:
        """`read` into `out`: bytes [offset, offset+len(out)) of chunk
        `digest` (fewer at its end); a cache file is read around the page
        cache (ChunkCache.read_into), and nothing is kept in memory. None if
        the chunk is neither in memory nor cached and `fetch` is False."""
        whole = self._recall(digest)
        if whole is None:
            n = self.cache.read_into(digest, offset, out)
            if n is not None:
                return n
            if not fetch:
                return None
            whole = self.fetch(digest)
        part = memoryview(whole)[offset : offset + len(out)]
        out[: len(part)] = part
        return len(part)

    def read_ready(self, digest: str, offset: int, length: int, *, max_disk_read: int = 64 << 10) -> bytes | None:
        """The bytes if they can be had without fetching or hashing, else None.

        Reads from the cache file only up to `max_disk_read` bytes: the caller
        runs on the event loop, and a large pread that misses the page cache
        would hold up every other request.
        """
        whole = self._recall(digest)
        if whole is not None:
            return whole[offset : offset + length]
        if length > max_disk_read:
            return None
        return self.cache.read_verified(digest, offset, length)

    def fetch(self, digest: str, *, settle: bool = False) -> bytes:
        """The whole verified chunk, fetched once however many callers ask at
        once; its cache write may wait for fetching to settle if `settle` (a
        working set's chunk: see __init__)."""
        with self._lock:
            future = self._inflight.get(digest)
            leader = future is None
            if leader:
                future = self._inflight[digest] = Future()
        if not leader:
            return future.result()
        try:
            # a previous leader may have inserted it between our miss and now
            with self._lock:
                data = self._unwritten.get(digest)
            if data is None and self.cache.contains(digest):
                data = self.cache.read(digest)
            fetched = data is None
            if fetched:
                self._last_fetch = time.monotonic()
                self.fetches += 1
                data = self._fetch(digest)  # verified
            self._remember(digest, data)
            future.set_result(data)  # waiting readers go on while the cache file is written
            if fetched:
                self._cache_put(digest, data, settle=settle)
            return data
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._inflight.pop(digest, None)

    def keep(self, digest: str, data: bytes, *, hashed: bool = False) -> bool:
        """Hold chunk bytes this node just stored (a seal) in memory: the
        next seal composes its chunks from them, and forks of the snapshot
        read them, without a fetch and a decode. Not written to the cache:
        that write slowed the snapshot being published (~100 ms of ~450
        here). Hashed first, as everything served is verified, unless the
        caller just computed `digest` from these very bytes (`hashed`);
        False if `data` is not `digest`'s."""
        if not hashed and digest_bytes(data) != digest:
            log.error("not keeping chunk %s: the bytes hash to something else", digest)
            return False
        self._remember(digest, data)
        return True

    def prefetch(self, digest: str, *, settle: bool = False) -> None:
        """Bring a chunk into the cache; errors are left for a real read to
        report. Its cache write waits for fetching to settle if `settle`
        (a working set's chunk: see __init__).

        Not one held in memory: reads are served from there, and those are
        mostly the chunks a seal just kept (read-ahead past QEMU's reads of
        a sandbox's disk and RAM named them): fetching them again, a
        rebuild from their pack and a cache write each, was most of the
        mount's fetches during a VM snapshot (187 of 265 in 9 snapshots)."""
        if digest in self._memory or self.cache.contains(digest) or digest in self._unwritten:
            with self._lock:
                self._whole.pop(digest, None)  # not needed: not kept either
            return
        try:
            self.fetch(digest, settle=settle)
        except Exception:
            pass
