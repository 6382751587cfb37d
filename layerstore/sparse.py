"""Sparse files: find the data in a file without reading its holes.

A 64 GiB disk image with 1 GiB written should cost 1 GiB of reading, so the
importer asks the filesystem where data lives (lseek SEEK_DATA / SEEK_HOLE)
and only visits chunks that overlap it. Filesystems without hole support
report the whole file as data, which is still correct, just slower.
"""

from __future__ import annotations

import errno
import os
from typing import Iterator


def data_ranges(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """Yield [start, end) byte ranges of `fd` that may hold data, in order."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past offset
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield offset, size
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        offset = end


def data_chunks(fd: int, size: int, chunk_size: int) -> Iterator[int]:
    """Yield, ascending and once each, the indices of chunks that overlap data."""
    last = -1
    for start, end in data_ranges(fd, size):
        first = max(start // chunk_size, last + 1)
        stop = -(-end // chunk_size)
        yield from range(first, stop)
        last = max(last, stop - 1)
