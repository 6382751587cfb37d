"""Staging a streamed upload in a file, within the node's size limit.

An image upload can be far bigger than memory, so the body goes to a file
under the node's state directory (the same filesystem the import reads
from) in large blocks written off the event loop, and the file is removed
whatever happens. The limit is checked from Content-Length before a byte is
read, and again as bytes arrive, for clients that stream without one. So
is the disk: an upload may take the filesystem's free space less RESERVE
(what the node's sandboxes, caches and records still need), else it is
Capacity (429, node full) rather than a disk filled for everyone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import BinaryIO

import anyio

from layerstore.errors import InvalidInput

from .exceptions import Capacity, TooLarge

BLOCK = 1 << 20
RESERVE = 2 << 30  # bytes of the state filesystem no upload may take


def reap(directory: Path) -> int:
    """Remove upload files a killed server left behind (called at start,
    when no upload of this node is in flight). Returns how many."""
    removed = 0
    for leftover in directory.glob(".upload-*") if directory.is_dir() else ():
        leftover.unlink(missing_ok=True)
        removed += 1
    return removed


@asynccontextmanager
async def staged(chunks: AsyncIterator[bytes], *, directory: Path, limit: int,
                 declared: str | None = None, allow_empty: bool = False,
                 reserve: int = RESERVE) -> AsyncIterator[Path]:
    """The body `chunks` as a file in `directory` for the duration of the
    block; `declared` is the request's Content-Length, if it sent one. An
    empty body is refused unless `allow_empty` (an empty file is a file;
    an empty image is a mistake)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"upload of {declared} bytes exceeds the {limit}-byte limit")
    directory.mkdir(parents=True, exist_ok=True)
    room = shutil.disk_usage(directory).free - reserve
    if declared is not None and declared.isdigit() and int(declared) > room:
        raise Capacity(f"upload of {declared} bytes: this node has room for {max(room, 0)} more")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as f:
            received = await _receive(chunks, f, limit=limit, room=room)
        if received == 0 and not allow_empty:
            raise InvalidInput("empty upload: send the content as the request body")
        yield Path(tmp)
    finally:
        os.unlink(tmp)


async def _receive(chunks: AsyncIterator[bytes], f: BinaryIO, *, limit: int, room: int) -> int:
    """Copy `chunks` into the open file `f`; returns the bytes received."""
    received = 0
    pending = bytearray()
    async for part in chunks:
        received += len(part)
        if received > limit:
            raise TooLarge(f"upload exceeds the {limit}-byte limit")
        if received > room:
            raise Capacity(f"upload stopped at {received} bytes: this node has no room for more")
        pending += part
        if len(pending) >= BLOCK:  # write in large blocks, off the event loop
            await anyio.to_thread.run_sync(f.write, bytes(pending))
            pending.clear()
    await anyio.to_thread.run_sync(f.write, bytes(pending))
    return received
