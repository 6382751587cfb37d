"""Keep freed chunk-sized buffers in the heap instead of giving them back.

glibc serves an allocation above its mmap threshold (128 KiB to start)
with a fresh mapping and unmaps it on free, and it trims free memory at
the top of the heap past 128 KiB. Whatever moves chunks allocates and
frees 1 MiB buffers all the time: the mount daemon (a chunk decompressed,
composed, sliced into a read reply) and the bulk commands (`strata image
import|export`, `push`, `pull`: a chunk read, compressed, decompressed).
On the daemon's main thread every one of them page-faulted in again:
480 faults and 1.4 ms to copy 1 MiB twice, against 3 faults and 0.09 ms
with the thresholds raised (measured here, a PVM guest, where a fault
costs ~3 us); a 1 GiB import took 71,600 faults, against 14,500.

The cost: up to `trim` bytes of freed memory stay mapped to the process.

Threads share one arena (M_ARENA_MAX 1): glibc otherwise gives each
thread its own, and a chunk a prefetch thread freed was of no use to the
thread fetching the next one. And the daemon faults in, at start, the
heap its recent chunks will live in (`warm_heap`, the fetcher's RECENT
bytes): a fresh daemon's first cold restore took ~23,000 page faults
(the chunks it keeps, each in fresh pages), ~60 ms of its CPU on this
host, against ~420 with the heap warm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("strata.malloc")

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
PAGE = 4096


def keep_freed_memory(*, mmap_threshold: int = 32 << 20, trim: int = 256 << 20, arenas: int = 1) -> bool:
    """Raise glibc's mmap and trim thresholds and share `arenas` among all
    threads, for this process (mallopt(3)); before threads start. False,
    and nothing changed, where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no mallopt in the C library (%s): chunk buffers are allocated as it chooses", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return (bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
            and bool(mallopt(M_ARENA_MAX, arenas)))


def warm_heap(size: int, *, block: int = 1 << 20) -> None:
    """Fault in `size` bytes of heap in `block`-sized buffers and free them:
    with freed memory kept (`keep_freed_memory`), later buffers reuse
    these pages instead of faulting in fresh ones."""
    buffers = []
    for _ in range(size // block):
        buffer = bytearray(block)
        buffer[::PAGE] = bytes(len(range(0, block, PAGE)))  # write every page: allocating maps none
        buffers.append(buffer)
    del buffers
