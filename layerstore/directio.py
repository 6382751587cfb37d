"""Large writes that go around the page cache (O_DIRECT), where the filesystem allows.

Why: a buffered write copies every byte into page-cache pages, and on this
host (a PVM guest, where the host faults fresh guest pages in) that copy was
most of an export's CPU: 768 MiB exported in 2.1-2.4 s with 3 s of system
time, against 0.6-0.7 s and 0.3 s written direct (bench/ingest.py's image).
Written direct, the disk reads each block from a buffer this process reuses.

O_DIRECT wants the memory, the file offset and the length aligned to the
device's block size. So a block is copied into a page-aligned buffer of the
calling thread (a warm copy, a few ms per 100 MiB); its aligned head is
written direct, and the tail past the last 4 KiB boundary through a second,
buffered descriptor of the same file. Writes at unaligned offsets go buffered
whole. A filesystem that refuses O_DIRECT (at open, or at the first write:
a device with blocks above 4 KiB) gets buffered writes throughout.

Durability is unchanged: a direct write may still sit in the device's cache,
and the caller's fsync flushes both descriptors' data (fsync is per file).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

ALIGN = 4096  # the largest logical block size we align for (memory, offsets, lengths)
SMALL = 64 * 1024  # below this a write is all page cache's: nothing to gain direct
PIECE = 4 << 20  # the most a direct write copies at once: each thread's buffer stays this small


class AlignedBuffers(threading.local):
    """One page-aligned scratch buffer per thread, grown to the largest block it held."""

    def __init__(self) -> None:
        self.buffer: mmap.mmap | None = None

    def holding(self, data: bytes | memoryview) -> memoryview:
        """`data` copied into this thread's buffer (a view of exactly its length)."""
        n = len(data)
        if self.buffer is None or len(self.buffer) < n:  # the old one unmaps once no view holds it
            self.buffer = mmap.mmap(-1, max(n + ALIGN - 1, 1 << 20) // ALIGN * ALIGN)
        view = memoryview(self.buffer)[:n]
        view[:] = data
        return view


class DirectFile:
    """A file written in large blocks at their offsets, from any number of threads.

    `flags` are os.open's (O_WRONLY is implied); `direct=False` opens it
    buffered only. Close it (or use it as a context manager) to release both
    descriptors; `fsync` before that for durability.
    """

    def __init__(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644, *,
                 buffers: AlignedBuffers, direct: bool = True) -> None:
        self.buffers = buffers
        self.fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | flags, mode)
        self.direct_fd = -1
        self._refused = False  # the device refused a direct write: buffered from then on
        if direct:
            try:  # the same inode again, not the name: nobody can swap the file in between
                self.direct_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    os.close(self.fd)
                    raise

    @property
    def direct(self) -> bool:
        """Whether large aligned blocks still go around the page cache."""
        return self.direct_fd >= 0 and not self._refused

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        """Write all of `data` at `offset`."""
        view = memoryview(data).cast("B")
        head = len(view) // ALIGN * ALIGN
        if self.direct and offset % ALIGN == 0 and head >= SMALL and self._write_direct(view[:head], offset):
            view, offset = view[head:], offset + head
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def _write_direct(self, view: memoryview, offset: int) -> bool:
        """The aligned `view` written direct, PIECE by PIECE; False (nothing
        written) where the device refuses it."""
        for start in range(0, len(view), PIECE):
            aligned = self.buffers.holding(view[start:start + PIECE])
            at = offset + start
            try:
                while aligned:
                    written = os.pwrite(self.direct_fd, aligned, at)
                    aligned, at = aligned[written:], at + written
            except OSError as exc:
                if exc.errno != errno.EINVAL or start or at != offset:
                    raise
                self._refused = True  # blocks above ALIGN (the descriptor stays open: other threads may hold it)
                return False
        return True

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        for name in ("direct_fd", "fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirectWriter:
    """Opens the files of one long-lived writer (a store, a cache): the
    threads' buffers, and whether the filesystem still takes O_DIRECT (a
    refusal is remembered, not asked for again at every file)."""

    def __init__(self, *, direct: bool = True) -> None:
        self.buffers = AlignedBuffers()
        self.direct = direct

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644, *, large: bool = True) -> DirectFile:
        """A DirectFile for `path`; `large=False` (a small object) opens it buffered only."""
        tried = self.direct and large
        opened = DirectFile(path, flags, mode, buffers=self.buffers, direct=tried)
        if tried and not opened.direct:
            self.direct = False
        return opened
