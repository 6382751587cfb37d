"""Streaming reads of an image: reply buffers on huge pages, and read-ahead.

A buffered sequential read of an image (`cp`, `dd`, a backup tool) reaches
the daemon as one request per 1 MiB, a few at a time (the kernel's own
read-ahead). The reader's FUSE file keeps what it reads, so the daemon
reads the chunk cache's files around their page cache, straight into the
buffer it replies from (LayerView.read_into). Two things decide how fast:

- **Where the buffer lives.** A direct read into 4 KiB pages went at 1.8
  GB/s on this host; into a 2 MiB huge page at 3.6-4.6 GB/s (the disk's
  requests carry a few large segments, not 256 small ones). So replies come
  from `ReplyBuffers`, a fixed set of buffers on huge pages where the
  kernel gives them (transparent huge pages, madvise mode), reused.
- **Who reads.** Answered each on a worker thread, a request cost two
  cross-thread wake-ups, which cost the daemon more CPU than its copies did
  (perf); read on the event loop, a stream's disk reads went one at a time.
  So once a handle reads sequentially, its `ReadStream` reads the blocks it
  expects next on worker threads, and a request that finds its block read
  is answered on the event loop without a wake-up:

    request (off, n) ──> block (off, n) read ahead? ── done ──> answer from it
                              │                       └─ not yet ─> wait for it
                              └─ no ──> None: the caller reads it itself
    then blocks (off + n*i, n), i = 1..depth, are read ahead while buffers
    are free; blocks elsewhere (the reader moved) are dropped

Streams never fetch: a block whose chunks are neither cached nor in memory
is not read, and its request is read the ordinary way (which fetches: what
the store must send is the chunk read-ahead's job, fetch.py, and a cold
restore's working set's). Nor do they report errors: a block whose read
failed is dropped, and its request read again reports it. Only for images:
immutable, so a block read ahead cannot go stale.

When a reply buffer is free again: pyfuse3 (3.5, handlers.pxi) writes a
read's reply to /dev/fuse (fuse_reply_buf) as soon as the handler returns,
before the event loop runs anything else. So every buffer lent to a reply
is free the next time the daemon's code runs on the loop (`reclaim`, at
each read). Only the loop takes buffers, so none is read into while a
reply still holds it; tests/test_fusefs_stream.py's concurrent readers
would see a buffer given to two reads at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import trio

from layerstore.directio import aligned_buffer

from .view import LayerView

HUGE_PAGE = 2 << 20
PAGE = 4096


class ReplyBuffers:
    """`count` buffers of `size` bytes, page-aligned and on huge pages where
    the kernel gives them; a buffer is taken (`get`), then either handed to
    pyfuse3 as a reply (`lend`) or given back (`put`, from any thread)."""

    def __init__(self, *, size: int = 1 << 20, count: int = 16) -> None:
        self.size = size
        self._arena = mmap.mmap(-1, size * count + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError, AttributeError):  # no THP: 4 KiB pages, still correct
            self._arena.madvise(mmap.MADV_HUGEPAGE)
        base = -ctypes.addressof(ctypes.c_char.from_buffer(self._arena)) % HUGE_PAGE
        whole = memoryview(self._arena)
        # Faulted in now, at the daemon's start: a fresh daemon's first reads
        # (a cold restore's device state) otherwise wait for the faults.
        used = whole[base : base + size * count]
        used[::PAGE] = bytes(len(range(0, len(used), PAGE)))
        self._free = [whole[base + i * size : base + (i + 1) * size] for i in range(count)]
        self._lent: list[memoryview] = []
        self._lock = threading.Lock()

    def get(self) -> memoryview | None:
        """A free buffer of `size` bytes, or None if all are taken."""
        with self._lock:
            return self._free.pop() if self._free else None

    def put(self, buffer: memoryview) -> None:
        """Give back a buffer from `get` that no reply holds."""
        if buffer.obj is self._arena:
            with self._lock:
                self._free.append(buffer)

    def lend(self, buffer: memoryview) -> None:
        """`buffer` is about to be a reply: free again at the next `reclaim`."""
        if buffer.obj is self._arena:
            self._lent.append(buffer)

    def reclaim(self) -> None:
        """Free every buffer lent before (event loop only: see the module docstring)."""
        if self._lent:
            with self._lock:
                self._free += self._lent
            self._lent.clear()

    def any(self, n: int) -> memoryview:
        """A buffer of `n` bytes for one reply: a free one if `n` fits, else from the heap."""
        buffer = self.get() if n <= self.size else None
        return buffer if buffer is not None else aligned_buffer(n)


class ReadStreams:
    """The streams of one mount: their reply buffers, and the `threads` that
    read their blocks, at most `depth` ahead of each stream's last request."""

    def __init__(self, *, threads: int = 2, depth: int = 8, buffers: int = 16) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="strata-stream")
        self.buffers = ReplyBuffers(count=buffers)
        self.depth = depth

    def open(self, view: LayerView) -> ReadStream:
        return ReadStream(view, self)

    async def read(self, view: LayerView, off: int, size: int, *, stream: ReadStream | None) -> memoryview:
        """Bytes [off, off+size) of `view` in a reply buffer, read around the
        chunk cache's page cache: from `stream`'s blocks if it read them
        ahead, else on a worker thread (fetching if need be)."""
        self.buffers.reclaim()
        block = await stream.take(off, size) if stream is not None else None
        if block is None:
            buffer = self.buffers.any(size)
            try:
                n = await trio.to_thread.run_sync(view.read_into, off, buffer[:size])
            except BaseException:
                self.buffers.put(buffer)
                raise
            assert n is not None  # fetched if need be
            block = buffer, n
        buffer, n = block
        self.buffers.lend(buffer)
        return buffer[:n]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


Block = tuple[memoryview, int]  # a buffer from ReplyBuffers, and how many of its bytes were read


class ReadStream:
    """One handle's read-ahead over `view`. Used from the event loop only."""

    def __init__(self, view: LayerView, streams: ReadStreams) -> None:
        self.view = view
        self.streams = streams
        self._blocks: dict[tuple[int, int], tuple[Future[int | None], memoryview]] = {}

    async def take(self, off: int, size: int) -> Block | None:
        """The block (off, size) if it was read ahead (waiting for it if need
        be), else None; the blocks after it are read ahead either way. The
        caller lends the block's buffer to its reply."""
        found = self._blocks.pop((off, size), None)
        self._read_ahead(off + size, size)
        if found is None:
            return None
        future, buffer = found
        if not future.done():
            try:
                await _done(future)
            except BaseException:  # cancelled (the mount stops): the buffer comes back when the read ends
                self._drop(future, buffer)
                raise
        n = None if future.exception() is not None else future.result()
        if n is None:
            self.streams.buffers.put(buffer)
            return None
        return buffer, n

    def close(self) -> None:
        """Drop every block (the handle is released)."""
        self._keep(set())

    def _read_ahead(self, start: int, size: int) -> None:
        buffers = self.streams.buffers
        wanted = [(start + size * i, size) for i in range(self.streams.depth) if start + size * i < self.view.size]
        self._keep(set(wanted))
        if size > buffers.size:
            return
        for key in wanted:
            if key in self._blocks:
                continue
            buffer = buffers.get()
            if buffer is None:  # every buffer busy: the cap on what streams hold
                break
            self._blocks[key] = (self.streams.pool.submit(self._read, key[0], buffer[:size]), buffer)

    def _keep(self, wanted: set[tuple[int, int]]) -> None:
        for key in [k for k in self._blocks if k not in wanted]:
            self._drop(*self._blocks.pop(key))

    def _drop(self, future: Future[int | None], buffer: memoryview) -> None:
        if future.cancel():
            self.streams.buffers.put(buffer)
        else:  # still reading: its buffer comes back when it is done
            future.add_done_callback(lambda _f: self.streams.buffers.put(buffer))

    def _read(self, off: int, out: memoryview) -> int | None:
        return self.view.read_into(off, out, fetch=False)


async def _done(future: Future[int | None]) -> None:
    """Wait on the event loop until a worker's `future` is done."""
    token = trio.lowlevel.current_trio_token()
    event = trio.Event()

    def wake(_future: Future[int | None]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(event.set)

    future.add_done_callback(wake)
    await event.wait()
