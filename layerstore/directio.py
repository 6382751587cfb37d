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

Reads go around the page cache too (`pread_into`), for a reader that keeps
what it reads itself: the mount's buffered readers, whose FUSE file caches
the bytes, so the chunk cache file's page cache would be a second copy.
"""

from __future__ import annotations

import ctypes
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


def aligned_buffer(size: int) -> memoryview:
    """`size` writable bytes at a page-aligned address, for a direct read.

    From the heap, not a fresh mapping: a freed buffer's memory is reused
    without faulting it in again (layerstore/malloc.py). It lives as long
    as the view (or a slice of it) does.
    """
    raw = bytearray(size + ALIGN)
    skip = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % ALIGN
    return memoryview(raw)[skip : skip + size]


def pread_into(path: str | os.PathLike[str], out: memoryview, offset: int, *, direct: bool = True) -> int:
    """Read `path` at `offset` into `out` (fewer bytes at its end); the count.

    Around the page cache (O_DIRECT) when `direct` and the memory, offset
    and length are aligned and the filesystem allows; else through it. A
    direct read of a range with dirty pages waits for their writeback, so
    it is for files written whole before (the chunk cache's). Memory that is
    not page-aligned is refused by the kernel (EINVAL) and read buffered.
    """
    aligned = len(out) >= SMALL and offset % ALIGN == 0 and len(out) % ALIGN == 0
    if direct and aligned:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        else:
            try:
                return _preadv_all(fd, out, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            finally:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _preadv_all(fd, out, offset)
    finally:
        os.close(fd)


def _preadv_all(fd: int, out: memoryview, offset: int) -> int:
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


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
