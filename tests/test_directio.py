"""layerstore/directio.py: large writes around the page cache, the same bytes either way."""

from __future__ import annotations

import os
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from layerstore.directio import ALIGN, PIECE, SMALL, AlignedBuffers, DirectFile, aligned_buffer, pread_into

MiB = 1 << 20


def _accepts_direct(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def _cached_pages(path: Path) -> int:
    """Pages of `path` in the page cache, by util-linux's fincore (mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip()) // 4096


def _pieces(seed: int) -> list[tuple[int, bytes]]:
    """Writes of every shape: aligned and not, small and large, with a short tail."""
    rng = random.Random(seed)
    shapes = [(0, MiB), (MiB, MiB + 1000), (3 * MiB, 100), (3 * MiB + 4096, SMALL), (4 * MiB + 17, 2 * MiB),
              (7 * MiB, 3 * MiB - 5)]
    return [(offset, rng.randbytes(length)) for offset, length in shapes]


@pytest.mark.parametrize("direct", [True, False])
def test_writes_of_every_shape_from_many_threads_land_exactly(tmp_path: Path, direct: bool) -> None:
    pieces = _pieces(1)
    path = tmp_path / "out"
    with DirectFile(path, os.O_CREAT | os.O_EXCL, buffers=AlignedBuffers(), direct=direct) as f:
        assert f.direct is (direct and _accepts_direct(tmp_path))
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda piece: f.pwrite(piece[1], piece[0]), pieces))
        f.fsync()
    expected = bytearray(max(offset + len(data) for offset, data in pieces))
    for offset, data in pieces:
        expected[offset:offset + len(data)] = data
    assert path.read_bytes() == expected


def test_a_direct_write_leaves_only_its_unaligned_tail_in_the_page_cache(tmp_path: Path) -> None:
    if not _accepts_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT: nothing goes around its page cache")
    data = os.urandom(8 * MiB + 100)
    cached = {}
    buffers = AlignedBuffers()
    for direct in (True, False):
        path = tmp_path / f"direct-{direct}"
        with DirectFile(path, os.O_CREAT | os.O_EXCL, buffers=buffers, direct=direct) as f:
            f.pwrite(data, 0)
            f.fsync()
        cached[direct] = _cached_pages(path)
        assert path.read_bytes() == data
    assert cached[True] <= 1  # the 100-byte tail went buffered
    assert cached[False] >= 8 * MiB // 4096
    assert buffers.buffer is not None and len(buffers.buffer) == PIECE  # copied a piece at a time


def test_a_thread_buffer_grows_to_the_largest_block_and_is_page_aligned() -> None:
    buffers = AlignedBuffers()
    small = buffers.holding(b"x" * 10)
    assert bytes(small) == b"x" * 10
    big = buffers.holding(b"y" * (3 * MiB + 1))
    assert len(big) == 3 * MiB + 1 and bytes(big[-1:]) == b"y"
    assert len(buffers.buffer) % ALIGN == 0 and len(buffers.buffer) >= 3 * MiB + 1
    assert bytes(small) == b"x" * 10  # a view of the old buffer stays valid


def test_an_existing_file_is_refused_with_o_excl_and_nothing_is_left_open(tmp_path: Path) -> None:
    path = tmp_path / "there"
    path.write_bytes(b"keep")
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(FileExistsError):
        DirectFile(path, os.O_CREAT | os.O_EXCL, buffers=AlignedBuffers())
    assert len(os.listdir("/proc/self/fd")) == before
    assert path.read_bytes() == b"keep"


@pytest.mark.parametrize("bulk", [True, False])
def test_a_store_opened_for_bulk_writes_leaves_its_chunks_out_of_the_page_cache(tmp_path: Path, bulk: bool) -> None:
    from layerstore.chunk import chunk_key
    from layerstore.digest import digest_bytes
    from layerstore.store import open_store

    if not _accepts_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT: nothing goes around its page cache")
    data = os.urandom(2 * MiB)  # incompressible: the chunk object is as large
    digest = digest_bytes(data)
    with open_store(str(tmp_path / "store"), direct_writes=bulk) as store:
        store.write_chunk(digest, data)
        path = tmp_path / "store" / "objects" / chunk_key(digest)
        cached = _cached_pages(path)
        assert store.read_chunk(digest) == data
    assert (cached <= 1) if bulk else (cached >= 2 * MiB // 4096)


def test_a_writer_opens_small_objects_and_an_unwilling_writer_buffered_only(tmp_path: Path) -> None:
    from layerstore.directio import DirectWriter

    writer = DirectWriter()
    with writer.open(tmp_path / "small", os.O_CREAT | os.O_EXCL, large=False) as f:
        assert not f.direct
        f.pwrite(b"manifest", 0)
    with writer.open(tmp_path / "large", os.O_CREAT | os.O_EXCL) as f:
        assert f.direct is _accepts_direct(tmp_path)
        f.pwrite(b"z" * MiB, 0)
    assert writer.direct is _accepts_direct(tmp_path)  # still asked for the next large file
    with DirectWriter(direct=False).open(tmp_path / "off", os.O_CREAT | os.O_EXCL) as f:
        assert not f.direct
    assert (tmp_path / "small").read_bytes() == b"manifest" and (tmp_path / "large").read_bytes() == b"z" * MiB


def test_a_read_into_a_buffer_returns_exactly_what_a_buffered_read_does(tmp_path: Path) -> None:
    """Direct where aligned (memory, offset, length), buffered where not; short at the end."""
    data = os.urandom(3 * MiB + 777)
    path = tmp_path / "f"
    path.write_bytes(data)
    os.sync()
    for offset, length, shift in ((0, MiB, 0), (MiB, 2 * MiB + 4096, 0), (2 * MiB, 4 * MiB, 0), (4096 + 1, MiB, 0),
                                  (0, 100, 0), (4096, MiB, 1), (len(data), MiB, 0)):
        out = aligned_buffer(length + shift)[shift:]  # shift: memory a direct read refuses
        n = pread_into(path, out, offset)
        assert bytes(out[:n]) == data[offset:offset + length]
    if _accepts_direct(tmp_path):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        out = aligned_buffer(2 * MiB)
        assert pread_into(path, out, 0) == 2 * MiB and bytes(out) == data[:2 * MiB]
        assert _cached_pages(path) == 0  # aligned and large: read around the page cache
        assert pread_into(path, out, 0, direct=False) == 2 * MiB
        assert _cached_pages(path) >= 2 * MiB // 4096  # asked buffered: through it (and read-ahead)


def test_an_aligned_buffer_is_page_aligned_and_lives_with_its_view() -> None:
    import ctypes
    views = [aligned_buffer(n) for n in (1, 4096, MiB + 3)]
    assert [len(v) for v in views] == [1, 4096, MiB + 3]
    assert all(ctypes.addressof(ctypes.c_char.from_buffer(v)) % ALIGN == 0 for v in views)
    part = views[2][4096:8192]
    del views
    part[:] = b"x" * 4096  # the memory stays while a slice holds it
    assert bytes(part) == b"x" * 4096
