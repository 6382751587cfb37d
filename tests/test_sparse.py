"""Sparse reading: only chunks overlapping data are visited."""

from __future__ import annotations

import os

from layerstore.sparse import data_chunks, data_ranges

MiB = 1 << 20


def test_sparse_file_visits_only_data_chunks(tmp_path) -> None:
    path = tmp_path / "sparse.img"
    with open(path, "wb") as f:
        f.truncate(64 << 30)  # 64 GiB, all hole
        for offset in (0, 5 * MiB + 100, (64 << 30) - 10):
            f.seek(offset)
            f.write(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        chunks = list(data_chunks(fd, size, MiB))
        ranges = list(data_ranges(fd, size))
    finally:
        os.close(fd)
    # ext4/xfs/tmpfs report data at block granularity: each write is one small range.
    assert len(ranges) == 3
    assert chunks == [0, 5, (64 << 30) // MiB - 1]


def test_all_hole_and_empty_files(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    hole = tmp_path / "hole"
    with open(hole, "wb") as f:
        f.truncate(10 * MiB)
    for path, size in ((empty, 0), (hole, 10 * MiB)):
        fd = os.open(path, os.O_RDONLY)
        try:
            assert list(data_chunks(fd, size, MiB)) == []
        finally:
            os.close(fd)


def test_chunks_spanning_ranges_are_yielded_once(tmp_path) -> None:
    path = tmp_path / "dense"
    path.write_bytes(os.urandom(3 * MiB + 5))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert list(data_chunks(fd, 3 * MiB + 5, MiB)) == [0, 1, 2, 3]
    finally:
        os.close(fd)
