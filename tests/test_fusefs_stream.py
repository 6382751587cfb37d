"""fusefs/stream.py: reply buffers (aligned, reused, capped) and read-ahead
streams over a real store and chunk cache; exact bytes, blocks dropped when
the reader moves or a read fails, every buffer back after. Through a real
mount: many buffered readers at once each get exactly their image's bytes,
which a reply buffer reused before its reply was sent would break."""

from __future__ import annotations

import ctypes
import hashlib
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import trio

from fusefs.cache import ChunkCache
from fusefs.fetch import ChunkFetcher
from fusefs.stream import ReadStreams, ReplyBuffers
from fusefs.view import LayerView
from layerstore.importer import import_image
from layerstore.store import open_store
from tests.images import MiB, write_image
from tests.test_fusefs_mount import Mount, _drop_pages, mount  # noqa: F401  (mount: the fixture)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_reply_buffers_are_aligned_reused_and_capped() -> None:
    buffers = ReplyBuffers(size=MiB, count=3)
    taken = [buffers.get() for _ in range(3)]
    assert all(b is not None and len(b) == MiB and _address(b) % 4096 == 0 for b in taken)
    assert len({_address(b) for b in taken}) == 3
    assert buffers.get() is None  # the cap
    spare = buffers.any(5000)  # none free: one from the heap, still aligned for a direct read
    assert len(spare) == 5000 and _address(spare) % 4096 == 0
    buffers.put(spare)  # not one of the set: ignored
    assert buffers.get() is None
    buffers.lend(taken[0])
    assert buffers.get() is None  # lent to a reply: not free until reclaimed
    buffers.reclaim()
    assert buffers.get() is taken[0]
    buffers.put(taken[1])
    assert buffers.get() is taken[1]
    assert buffers.any(2 * MiB).obj is not taken[0].obj  # larger than a buffer: from the heap


class Views:
    """A store with a 9 MiB image (and its 5000-byte tail), a cache, and a view of it."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = open_store(str(tmp_path / "store"))
        self.content = write_image(tmp_path / "a.img", "rrzrrrrrr", seed=7, tail=5000)
        self.manifest = import_image(self.store, tmp_path / "a.img", "a:v1").manifest_id
        self.fetcher = ChunkFetcher(self.store, ChunkCache(tmp_path / "cache", capacity=64 * MiB), memory=0)
        self.view = LayerView.of(self.fetcher, self.manifest)
        assert self.view.read(0, self.view.size) == self.content  # every chunk cached
        self.streams = ReadStreams(threads=2, depth=4, buffers=6)

    def close(self) -> None:
        self.streams.close()
        self.fetcher.close()
        self.store.close()

    def free(self) -> int:
        """Buffers free once every read still running is done (the streams stop)."""
        self.streams.pool.shutdown(wait=True)  # a dropped block's buffer comes back as its read ends
        count = 0
        while self.streams.buffers.get() is not None:
            count += 1
        return count


@pytest.fixture
def views(tmp_path: Path) -> Iterator[Views]:
    v = Views(tmp_path)
    yield v
    v.close()


def test_a_stream_answers_from_blocks_read_ahead_exactly(views: Views) -> None:
    async def main() -> list[bytes | None]:
        stream = views.streams.open(views.view)
        got: list[bytes | None] = []
        for off in range(0, len(views.content), MiB):
            block = await stream.take(off, MiB)
            got.append(None if block is None else bytes(block[0][: block[1]]))
            if block is not None:
                views.streams.buffers.put(block[0])
        stream.close()
        return got

    got = trio.run(main)
    assert got[0] is None  # nothing was read ahead of the first request
    expect = [views.content[off : off + MiB] for off in range(0, len(views.content), MiB)]
    assert got[1:] == expect[1:]  # the hole and the short tail included
    assert views.free() == 6


def test_a_read_answers_from_a_reply_buffer_lent_until_the_next_read(views: Views) -> None:
    async def main() -> None:
        stream = views.streams.open(views.view)
        for off in (0, MiB, 2 * MiB, 9 * MiB):  # the first and the tail read on a worker, the rest ahead
            got = await views.streams.read(views.view, off, MiB, stream=stream)
            assert bytes(got) == views.content[off : off + MiB]
        tail = await views.streams.read(views.view, 8 * MiB + 4096, MiB, stream=None)
        assert bytes(tail) == views.content[8 * MiB + 4096 : 9 * MiB + 4096]
        stream.close()
        views.streams.buffers.reclaim()  # the last reply's buffer, lent until now

    trio.run(main)
    assert views.free() == 6


def test_blocks_the_reader_skips_are_dropped_and_their_buffers_come_back(views: Views) -> None:
    async def main() -> None:
        stream = views.streams.open(views.view)
        assert await stream.take(0, MiB) is None  # blocks 1..4 read ahead
        assert await stream.take(6 * MiB, MiB) is None  # moved: 1..4 dropped, 7..8 read ahead
        block = await stream.take(7 * MiB, MiB)
        assert block is not None and bytes(block[0][: block[1]]) == views.content[7 * MiB : 8 * MiB]
        views.streams.buffers.put(block[0])
        assert await stream.take(3 * MiB, 4096) is None  # another size: another block
        stream.close()

    trio.run(main)
    assert views.free() == 6


def test_a_stream_never_fetches_and_drops_a_block_whose_read_fails(views: Views) -> None:
    """A chunk the cache lost is not fetched by the stream (the caller's own
    read does that); a cache file cut short fails its block, not the stream."""
    views.fetcher.cache._path(views.view.chunks[4]).unlink()
    views.fetcher.cache._path(views.view.chunks[1]).write_bytes(b"short")
    fetches = views.fetcher.fetches

    async def main() -> None:
        stream = views.streams.open(views.view)
        assert await stream.take(0, MiB) is None
        assert await stream.take(MiB, MiB) is None  # its read failed: the caller's own read reports it
        block = await stream.take(3 * MiB, MiB)  # the others are fine
        assert await stream.take(4 * MiB, MiB) is None  # not cached: the caller's own read fetches it
        assert block is not None and bytes(block[0][: block[1]]) == views.content[3 * MiB : 4 * MiB]
        views.streams.buffers.put(block[0])
        stream.close()

    trio.run(main)
    assert views.free() == 6
    assert views.fetcher.fetches == fetches


def test_a_request_cancelled_while_its_block_reads_gives_the_buffer_back(views: Views) -> None:
    gate = threading.Event()
    cache = views.fetcher.cache
    slow_read = cache.read_into
    cache.read_into = lambda *args: gate.wait(5) and slow_read(*args)  # type: ignore[method-assign]
    view = views.view

    async def main() -> None:
        stream = views.streams.open(view)
        with trio.move_on_after(5):
            assert await stream.take(0, MiB) is None  # blocks 1..4 start reading, held at the gate
        with trio.move_on_after(0.2) as scope:
            await stream.take(MiB, MiB)
        assert scope.cancelled_caught
        gate.set()
        stream.close()

    trio.run(main)
    assert views.free() == 6


def test_many_buffered_readers_at_once_each_get_their_images_bytes(mount: Mount) -> None:
    """Eight readers of four images, reads of mixed sizes and seeks, the FUSE
    files' page cache dropped between rounds so every round asks the daemon:
    a reply buffer reused before its reply went out would show here."""
    expect = {}
    for i in range(4):
        content = write_image(mount.tmp / f"{i}.img", "rrrrrr", seed=20 + i, tail=777 * i)
        mount.strata("image", "import", str(mount.tmp / f"{i}.img"), f"img{i}:v1")
        expect[i] = content
    mount.start()

    def reader(n: int) -> None:
        i, rng = n % 4, random.Random(n)
        path = mount.image(f"img{i}:v1")
        for _round in range(3):
            _drop_pages([path])
            with open(path, "rb", buffering=0) as f:
                start = rng.choice([0, 0, MiB, 2 * MiB + 4096])
                f.seek(start)
                got = bytearray()
                while chunk := f.read(rng.choice([4096, 200_000, MiB, 3 * MiB])):
                    got += chunk
            assert hashlib.sha256(got).digest() == hashlib.sha256(expect[i][start:]).digest(), (n, start)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(reader, range(8)))
