"""The chunk cache: hard cap, LRU with watermarks, pins, restart, torn entries."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lmdb
import pytest

from fusefs.cache import ChunkCache
from layerstore.digest import digest_bytes

KiB = 1024


def chunk(i: int, size: int = 64 * KiB) -> tuple[str, bytes]:
    data = i.to_bytes(4, "little") * (size // 4)
    return digest_bytes(data), data


def test_cap_is_never_exceeded_and_lru_keeps_recent(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=1024 * KiB)
    hot_digest, hot = chunk(0)
    assert cache.put(hot_digest, hot)
    for i in range(1, 100):
        d, data = chunk(i)
        assert cache.put(d, data)
        assert cache.stats.size <= cache.capacity
        assert sum(f.stat().st_size for f in (tmp_path / "chunks").rglob("*") if f.is_file()) <= cache.capacity
        assert cache.read(hot_digest) == hot  # keep it recently used
    stats = cache.snapshot_stats()
    assert stats["evictions"] > 0 and stats["hits"] == 99
    assert cache.read(chunk(1)[0]) is None  # an old one is gone


def test_watermarks_evict_in_batches(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=1000 * KiB, high_watermark=0.9, low_watermark=0.5)
    sizes = []
    for i in range(40):
        d, data = chunk(i)
        cache.put(d, data)
        sizes.append(cache.stats.size)
    assert max(sizes) <= 900 * KiB
    assert min(sizes[15:]) <= 500 * KiB  # dropped to the low watermark at least once


def test_pinned_chunks_are_evicted_last(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=640 * KiB, high_watermark=1.0, low_watermark=1.0)
    pinned = [chunk(i) for i in range(5)]
    for d, data in pinned:
        cache.put(d, data)
    cache.pin("vm-1", [d for d, _ in pinned])
    for i in range(5, 50):
        d, data = chunk(i)
        cache.put(d, data)
    assert all(cache.contains(d) for d, _ in pinned)
    # everything pinned and full: pinned chunks go as a last resort, cap holds
    cache.pin("vm-2", [chunk(i)[0] for i in range(5, 50)])
    for i in range(50, 70):
        d, data = chunk(i)
        assert cache.put(d, data)
        assert cache.stats.size <= cache.capacity
    cache.unpin("vm-1")
    cache.unpin("vm-2")
    assert cache.snapshot_stats()["pinned"] == 0


def test_oversized_insert_is_skipped_not_an_overrun(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=100 * KiB)
    d, data = chunk(1, 128 * KiB)
    assert cache.put(d, data) is False
    assert cache.stats.size == 0 and cache.stats.skipped_inserts == 1


def test_index_survives_restart_in_lru_order(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=10 * 64 * KiB, high_watermark=1.0, low_watermark=1.0)
    items = [chunk(i) for i in range(10)]
    for d, data in items:
        cache.put(d, data)
    cache.read(items[0][0])  # 0 becomes most recent
    cache.close()
    again = ChunkCache(tmp_path, capacity=10 * 64 * KiB, high_watermark=1.0, low_watermark=1.0)
    assert again.stats.entries == 10 and again.stats.size == 10 * 64 * KiB
    assert again.read(items[5][0], 4, 8) == items[5][1][4:12]
    again.put(*chunk(100))  # evicts the least recent: item 1, not item 0
    assert again.contains(items[0][0]) and not again.contains(items[1][0])
    again.close()


def test_torn_entry_is_detected_and_never_served(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=1 << 20)
    d, data = chunk(7)
    cache.put(d, data)
    cache.close()
    path = tmp_path / "chunks" / d[:2] / d
    with open(path, "r+b") as f:  # same size, different bytes: a torn write
        f.seek(100)
        f.write(b"\xff" * 100)
    again = ChunkCache(tmp_path, capacity=1 << 20)
    assert again.read(d) is None
    assert again.stats.torn_entries == 1 and not path.exists()
    assert again.put(d, data) and again.read(d) == data


def test_restart_reconciles_missing_and_stray_files(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=1 << 20)
    (d1, a), (d2, b) = chunk(1), chunk(2)
    cache.put(d1, a)
    cache.put(d2, b)
    cache.close()
    (tmp_path / "chunks" / d1[:2] / d1).unlink()
    stray = tmp_path / "chunks" / "ab" / ("ab" * 32)
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"junk")
    junk = tmp_path / "chunks" / "ab" / "not-a-chunk"
    junk.write_bytes(b"junk")
    again = ChunkCache(tmp_path, capacity=1 << 20)
    assert not again.contains(d1) and again.contains(d2) and not junk.exists()
    # a chunk file the index does not name is adopted, and re-hashed before it is served
    assert again.contains("ab" * 32) and again.stats.size == len(b) + 4
    assert again.read("ab" * 32) is None and not stray.exists() and again.stats.torn_entries == 1
    assert again.read(d2) == b


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete", "garbage-values"])
def test_a_torn_index_is_rebuilt_from_the_chunk_files(tmp_path: Path, damage: str) -> None:
    """The index torn, garbled or gone while the daemon is down: the cache
    opens, knows its chunks again, serves them exactly (each re-hashed
    first), never serves a damaged file, and keeps its cap."""
    cache = ChunkCache(tmp_path, capacity=1 << 20)
    items = [chunk(i) for i in range(12)]
    for d, data in items:
        cache.put(d, data)
    cache.close()
    data_mdb = tmp_path / "index" / "data.mdb"
    if damage == "truncate":
        os.truncate(data_mdb, data_mdb.stat().st_size // 3)
    elif damage == "garbage":
        data_mdb.write_bytes(os.urandom(data_mdb.stat().st_size))
    elif damage == "delete":
        shutil.rmtree(tmp_path / "index")
    else:  # a sound LMDB whose values are not entries
        env = lmdb.open(str(tmp_path / "index"), max_dbs=4, subdir=True)
        with env.begin(write=True, db=env.open_db(b"entries")) as txn:
            txn.put(bytes.fromhex(items[0][0]), b"short")
        env.close()
    flipped = tmp_path / "chunks" / items[3][0][:2] / items[3][0]
    with open(flipped, "r+b") as f:
        f.write(b"\xff" * 64)
    again = ChunkCache(tmp_path, capacity=256 * KiB)
    assert again.stats.index_rebuilds == (0 if damage == "delete" else 1)
    assert again.stats.size <= 256 * KiB  # the cap holds over adopted files
    served = 0
    for d, data in items:
        got = again.read(d)
        assert got is None or got == data, f"chunk {d[:12]} served wrong bytes"
        served += got is not None
    assert served >= 2 and again.read(items[3][0]) is None
    again.put(*items[3])
    assert again.read(items[3][0]) == items[3][1]
    again.close()
    assert ChunkCache(tmp_path, capacity=256 * KiB).stats.index_rebuilds == 0  # sound again


def test_capacity_lowered_between_runs(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=1 << 20)
    for i in range(10):
        cache.put(*chunk(i))
    cache.close()
    again = ChunkCache(tmp_path, capacity=256 * KiB)
    assert again.stats.size <= 256 * KiB


def test_drop_unpinned(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, capacity=1 << 20)
    keep = chunk(1)
    cache.put(*keep)
    cache.put(*chunk(2))
    cache.pin("x", [keep[0]])
    assert cache.drop() == 64 * KiB
    assert cache.contains(keep[0]) and cache.stats.entries == 1
    assert not any(p.name.startswith(".") for p in (tmp_path / "tmp").iterdir())
    assert os.path.isdir(tmp_path / "index")


def test_bad_settings_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ChunkCache(tmp_path, capacity=0)
    with pytest.raises(ValueError):
        ChunkCache(tmp_path, capacity=1, high_watermark=0.5, low_watermark=0.9)


def test_read_into_and_will_need_hit_count_and_miss_cleanly(tmp_path: Path) -> None:
    """read_into reads a cached chunk's bytes into a buffer (a hit), a
    missing one is None (a miss); will_need of a chunk gone is no error."""
    from layerstore.directio import aligned_buffer

    cache = ChunkCache(tmp_path, capacity=1024 * KiB)
    digest, data = chunk(1)
    assert cache.put(digest, data)
    out = aligned_buffer(64 * KiB)
    assert cache.read_into(digest, 0, out) == len(data) and bytes(out) == data
    assert cache.read_into(digest, 4096, out[:8192]) == 8192 and bytes(out[:8192]) == data[4096:12288]
    assert cache.read_into(chunk(2)[0], 0, out) is None
    stats = cache.snapshot_stats()
    assert (stats["hits"], stats["misses"]) == (2, 1)
    cache.will_need(digest)
    cache.will_need(chunk(2)[0])  # not cached: nothing to page in, and no error
