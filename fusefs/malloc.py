"""Keep freed chunk-sized buffers in the heap instead of giving them back.

glibc serves an allocation above its mmap threshold (128 KiB to start)
with a fresh mapping and unmaps it on free, and it trims free memory at
the top of the heap past 128 KiB. The daemon allocates and frees 1 MiB
buffers all the time (a chunk decompressed, composed, sliced into a read
reply), so on its main thread every one of them page-faulted in again:
480 faults and 1.4 ms to copy 1 MiB twice, against 3 faults and 0.09 ms
with the thresholds raised (measured here, a PVM guest, where a fault
costs ~3 us). Worker threads are spared by their arenas; the event loop
that answers FUSE reads is not.

The cost: up to `trim` bytes of freed memory stay mapped to the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("strata.fusefs")

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3


def keep_freed_memory(*, mmap_threshold: int = 32 << 20, trim: int = 256 << 20) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (mallopt(3)).
    False, and nothing changed, where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no mallopt in the C library (%s): chunk buffers are allocated as it chooses", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
