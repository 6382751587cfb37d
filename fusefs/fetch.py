"""Getting a chunk's bytes for a reader: cache first, else one verified fetch.

`ChunkFetcher.read` is what every lazy read goes through:

1. the local cache (`ChunkCache`), a pread of uncompressed bytes;
2. otherwise the store: `Store.read_chunk` fetches, decompresses and checks
   the blake3 digest (a corrupt object raises CorruptObject, never returns
   data), then the bytes go into the cache.

Concurrent readers of the same missing chunk share one fetch (single flight):
the first becomes the leader, the others wait for its result or its error.
Backend retries are bounded by the store's RetryingBackend, so a dead store
turns into an error in bounded time, never a hang.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

from layerstore.store import Store

from .cache import ChunkCache


class ChunkFetcher:
    """Read chunks through a cache, joining concurrent fetches of one chunk."""

    def __init__(self, store: Store, cache: ChunkCache, *, fetch: Callable[[str], bytes] | None = None) -> None:
        self.store = store
        self.cache = cache
        self._fetch = fetch or store.read_chunk
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[bytes]] = {}
        self.fetches = 0  # backend fetches actually issued (for tests and stats)

    def read(self, digest: str, offset: int = 0, length: int = -1) -> bytes:
        """Bytes [offset, offset+length) of chunk `digest` (whole chunk if length < 0)."""
        data = self.cache.read(digest, offset, length)
        if data is not None:
            return data
        whole = self.fetch(digest)
        return whole if length < 0 and offset == 0 else whole[offset : offset + length if length >= 0 else None]

    def fetch(self, digest: str) -> bytes:
        """The whole verified chunk, fetched once however many callers ask at once."""
        with self._lock:
            future = self._inflight.get(digest)
            leader = future is None
            if leader:
                future = self._inflight[digest] = Future()
        if not leader:
            return future.result()
        try:
            # a previous leader may have inserted it between our miss and now
            data = self.cache.read(digest) if self.cache.contains(digest) else None
            if data is None:
                self.fetches += 1
                data = self._fetch(digest)
                self.cache.put(digest, data)
            future.set_result(data)
            return data
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._inflight.pop(digest, None)

    def prefetch(self, digest: str) -> None:
        """Bring a chunk into the cache; errors are left for a real read to report."""
        if self.cache.contains(digest):
            return
        try:
            self.fetch(digest)
        except Exception:
            pass
