"""api/uploads.py: a streamed upload is staged within its size limit and within the disk's room
(the filesystem's free space less a reserve), refused before a byte when Content-Length says so,
and its file is gone whatever happens."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from api.exceptions import Capacity, TooLarge
from api.uploads import staged


async def body(size: int) -> AsyncIterator[bytes]:
    for _ in range(size >> 20):
        yield b"x" * (1 << 20)


def stage(directory: Path, size: int, *, declared: bool, limit: int = 1 << 40, room: int = 1 << 20) -> int:
    """Stage `size` bytes with `room` bytes of the disk left to uploads; the staged file's size."""
    reserve = shutil.disk_usage(directory).free - room

    async def run() -> int:
        async with staged(body(size), directory=directory, limit=limit, declared=str(size) if declared else None,
                          reserve=reserve) as path:
            return path.stat().st_size
    return asyncio.run(run())


@pytest.mark.parametrize("declared", [True, False])
def test_an_upload_past_the_disks_room_is_capacity_and_leaves_nothing(tmp_path: Path, declared: bool) -> None:
    with pytest.raises(Capacity, match="room"):
        stage(tmp_path, 64 << 20, declared=declared)
    assert list(tmp_path.iterdir()) == []


def test_an_upload_within_the_room_and_the_limit_is_staged(tmp_path: Path) -> None:
    assert stage(tmp_path, 4 << 20, declared=False, room=1 << 30) == 4 << 20
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TooLarge):
        stage(tmp_path, 4 << 20, declared=True, limit=1 << 20, room=1 << 30)
