"""Guest RAM mapped copy-on-write from its base layer, and the pages it changed.

A QEMU sandbox's RAM is a private mapping (memory-backend-file share=off)
of a read-only file on the mount: the layer its RAM upper layer sits on
(`layers/<id>/disk.img`: a snapshot's memory, or the all-holes layer of a
boot). Every sandbox started from one snapshot maps that same file, so the
pages none of them changed are held once, in the file's page cache; a page
a guest writes becomes its QEMU's own copy. At a snapshot, `write_back`
finds those copies and writes the ones whose bytes differ from the RAM
upper layer into it, which then holds the guest's RAM and seals as before.

Which pages are a process's own, the kernel says in /proc/PID/pagemap: one
64-bit little-endian entry per page of its address space, of which only
the top byte is read here:

    bit 63  present in RAM            top byte & 0x80
    bit 62  swapped out               top byte & 0x40
    bit 61  a page of the mapped file top byte & 0x20
    (bits 0-54: the frame number, hidden without CAP_SYS_ADMIN; unused)

    a page of the RAM mapping that is
      not present, not swapped   never touched: the base's bytes
      present, a file page       only read: the base's bytes
      present or swapped, and    written: the guest's own copy,
        not a file page          the only kind `write_back` reads

so the changed pages are runs of top bytes in [\\x40-\\x5f\\x80-\\x9f\\xc0-\\xdf],
found by one regular expression at C speed. They are read from
/proc/PID/mem a megabyte at a time, compared with the target's bytes, and
only pages that differ are written: a snapshot after a pre-copy rewrites
only what the guest changed in between. With no dirty page tracking that
reaches QEMU's memory from outside (soft-dirty bits are not in this
kernel; userfaultfd would have to be opened inside QEMU), every page the
guest owns is read at each write-back, so a `CowRam` keeps what its
pre-copy read until the capture that follows: the capture then compares
in memory instead of reading the target back through the mount.

Exact only while the process is paused (a snapshot's capture; a pre-copy
reads a running guest and the capture corrects it), and only while nothing
hands a written page back to the file: QEMU does that (MADV_DONTNEED) only
for a balloon, virtio-mem or a post-copy migration, none of which Strata's
VMs have. Reading another process's memory needs ptrace access to it: the
node's own VMs, as root.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .backend import VmmError

PAGE = mmap.PAGESIZE
ENTRY = 8  # bytes per pagemap entry
RUN_PAGES = 256  # pages read and compared at a time (1 MiB)
_OWN_COPY = re.compile(rb"[\x40-\x5f\x80-\x9f\xc0-\xdf]+")


@dataclass(frozen=True)
class WriteBack:
    """What one `write_back` did."""

    changed: int  # pages the guest holds its own copy of
    written: int  # of those, pages whose bytes the target did not have yet
    seconds: float


def mapping_address(pid: int, path: Path, size: int) -> int:
    """Where process `pid` maps `path` whole (`size` bytes from offset 0)."""
    wanted = os.path.realpath(path)
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and fields[5] == wanted and int(fields[2], 16) == 0:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    if end - start == size:
                        return start
    except OSError as exc:
        raise VmmError(f"reading the memory map of process {pid}: {exc.strerror}") from None
    raise VmmError(f"process {pid} does not map {wanted} ({size} bytes)")


def own_pages(pid: int, address: int, pages: int) -> list[tuple[int, int]]:
    """(first page, count) of each run of pages process `pid` holds its own
    copy of, in the `pages` pages mapped at `address`."""
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        try:
            entries = _pread_all(fd, pages * ENTRY, address // PAGE * ENTRY)
        finally:
            os.close(fd)
    except OSError as exc:
        raise VmmError(f"reading the page map of process {pid}: {exc.strerror}") from None
    tops = entries[ENTRY - 1::ENTRY]
    return [(m.start(), m.end() - m.start()) for m in _OWN_COPY.finditer(tops)]


class CowRam:
    """A VM's guest RAM: mapped copy-on-write from `base`, written back into
    `file` (`size` bytes each)."""

    def __init__(self, base: Path, file: Path, size: int) -> None:
        self.base, self.file, self.size = base, file, size
        self._seen: dict[int, memoryview] = {}  # page -> its bytes as the last pre-copy wrote them

    def write_back(self, pid: int, *, precopy: bool = False) -> WriteBack:
        """`write_back` of VM process `pid`. A pre-copy keeps the bytes it read
        (as much memory as the guest owns pages, until the next call); the
        next call compares with them."""
        seen, self._seen = self._seen, {}
        keep: dict[int, memoryview] = {}
        done = write_back(pid, self.base, self.file, self.size, known=seen, keep=keep if precopy else None)
        self._seen = keep  # only once all of it is in the file: a failure keeps nothing to trust
        return done

    def forget(self) -> None:
        """Drop what a pre-copy kept (its snapshot was given up)."""
        self._seen = {}


def write_back(pid: int, base: Path, target: Path, size: int, *, known: dict[int, memoryview] | None = None,
               keep: dict[int, memoryview] | None = None) -> WriteBack:
    """Write the pages process `pid` changed in its private mapping of `base`
    into `target` (a file over the same bytes as `base`), where they differ;
    then flush `target` and drop its pages from the page cache (the
    guest's copies are the ones in memory). Returns what it did.

    `known`: pages whose bytes in `target` are known (page -> bytes), not
    read back; `keep`: filled with the bytes of every page the guest owns."""
    started = time.monotonic()
    address = mapping_address(pid, base, size)
    runs = own_pages(pid, address, size // PAGE)
    changed = written = 0
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:
            out = os.open(target, os.O_RDWR | os.O_CLOEXEC)
            try:
                for first, count in runs:
                    changed += count
                    for page in range(first, first + count, RUN_PAGES):
                        n = min(RUN_PAGES, first + count - page)
                        written += _write_differing(mem, out, address, page, n, known or {}, keep)
                os.fsync(out)
                os.posix_fadvise(out, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(out)
        finally:
            os.close(mem)
    except OSError as exc:
        raise VmmError(f"writing the guest RAM of process {pid} to {target}: {exc.strerror or exc}") from None
    return WriteBack(changed, written, time.monotonic() - started)


def _write_differing(mem: int, out: int, address: int, page: int, n: int, known: dict[int, memoryview],
                     keep: dict[int, memoryview] | None) -> int:
    """Compare `n` pages from `page` in the guest with the target (as
    `known`, or read); write the runs of pages that differ. Returns the
    pages written."""
    offset = page * PAGE
    guest = _pread_all(mem, n * PAGE, address + offset)
    view = memoryview(guest)
    if keep is not None:
        for i in range(n):
            keep[page + i] = view[i * PAGE:(i + 1) * PAGE]
    if all(page + i in known for i in range(n)):
        have = b"".join(known[page + i] for i in range(n))
    else:
        have = _pread_all(out, n * PAGE, offset)
    if guest == have:
        return 0
    theirs = memoryview(have)
    written = 0
    i = 0
    while i < n:
        if view[i * PAGE:(i + 1) * PAGE] == theirs[i * PAGE:(i + 1) * PAGE]:
            i += 1
            continue
        j = i + 1
        while j < n and view[j * PAGE:(j + 1) * PAGE] != theirs[j * PAGE:(j + 1) * PAGE]:
            j += 1
        _pwrite_all(out, view[i * PAGE:j * PAGE], offset + i * PAGE)
        written += j - i
        i = j
    return written


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    """`size` bytes at `offset` (EIO if the file ends first: a RAM upper
    layer is as long as the RAM)."""
    parts = []
    done = 0
    while done < size:
        part = os.pread(fd, size - done, offset + done)
        if not part:
            raise OSError(errno.EIO, f"{size - done} bytes short at offset {offset + done}")
        parts.append(part)
        done += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done
