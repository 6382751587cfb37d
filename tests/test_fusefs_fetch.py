"""ChunkFetcher: one fetch per missing chunk however many readers, errors shared, never cached."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fusefs.cache import ChunkCache
from fusefs.fetch import ChunkFetcher
from fusefs.view import LayerView
from layerstore.digest import digest_bytes
from layerstore.errors import CorruptObject
from layerstore.store import open_store
from tests.test_fusefs_catalogue import wait_for

DATA = b"chunk-bytes" * 1000
DIGEST = digest_bytes(DATA)


def make(tmp_path: Path, fetch) -> ChunkFetcher:  # noqa: ANN001
    store = open_store(str(tmp_path / "store"))
    return ChunkFetcher(store, ChunkCache(tmp_path / "cache", capacity=1 << 20), fetch=fetch, memory=0)


def test_concurrent_readers_share_one_fetch(tmp_path: Path) -> None:
    calls = []
    gate = threading.Event()

    def slow_fetch(digest: str) -> bytes:
        calls.append(digest)
        gate.wait(5)
        return DATA

    fetcher = make(tmp_path, slow_fetch)
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(fetcher.read(DIGEST, 11, 22))) for _ in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join()
    assert calls == [DIGEST] and fetcher.fetches == 1
    assert results == [DATA[11:33]] * 16
    assert fetcher.read(DIGEST) == DATA and fetcher.fetches == 1  # now from the cache


def test_cache_writes_go_behind_the_reader_within_a_bound(tmp_path: Path) -> None:
    """A fetch returns before its cache file is written; a read meanwhile
    is served from the bytes waiting (no second fetch); flush waits for the
    write; past the bound the write is the reader's own, as without."""
    store = open_store(str(tmp_path / "store"))
    cache = ChunkCache(tmp_path / "cache", capacity=1 << 20)
    fetcher = ChunkFetcher(store, cache, fetch=lambda digest: DATA, memory=0, write_behind=len(DATA))
    gate = threading.Event()
    real_put = cache.put
    cache.put = lambda digest, data: gate.wait(5) and real_put(digest, data)  # type: ignore[method-assign]
    assert fetcher.read(DIGEST) == DATA and not cache.contains(DIGEST)  # not waiting for the write
    assert fetcher.read(DIGEST, 3, 4) == DATA[3:7] and fetcher.fetches == 1
    other = b"other chunk" * 100
    other_digest = digest_bytes(other)
    fetcher._fetch = lambda digest: other  # no room behind: this reader writes its own
    writer = threading.Thread(target=fetcher.read, args=(other_digest,))
    writer.start()
    writer.join(0.3)
    assert writer.is_alive()  # blocked in its own cache write
    gate.set()
    writer.join(5)
    fetcher.flush()
    assert cache.contains(DIGEST) and cache.contains(other_digest)
    fetcher.close()


def test_a_sets_cache_writes_wait_while_fetching_is_busy_unless_half_the_bound_waits(tmp_path: Path) -> None:
    """A restore's burst of working-set prefetches is not slowed by their own cache
    writes: they start once fetching has settled, or at once when half the
    bytes allowed to wait already do, or when a flush asks. A read's own
    fetch, or read-ahead's, is written at once (unless queued behind those)."""
    store = open_store(str(tmp_path / "store"))
    cache = ChunkCache(tmp_path / "cache", capacity=1 << 20)
    chunks = {digest_bytes(c): c for c in (b"a" * 1000, b"b" * 1000, b"c" * 3000, b"d" * 10, b"e" * 10)}
    fetcher = ChunkFetcher(store, cache, fetch=chunks.__getitem__, memory=0, write_behind=6000, write_settle=2.0)
    first, second, big, read, last = chunks
    fetcher.read(read)  # a read's fetch: written behind it at once
    assert wait_for(lambda: cache.contains(read), timeout=1.0)
    ahead = b"f" * 10  # and read-ahead's
    chunks[digest_bytes(ahead)] = ahead
    fetcher.prefetch(digest_bytes(ahead))
    assert wait_for(lambda: cache.contains(digest_bytes(ahead)), timeout=1.0)
    fetcher.prefetch(first, settle=True)
    time.sleep(0.2)
    fetcher.prefetch(second, settle=True)  # fetching goes on: the first write still waits
    time.sleep(0.3)
    assert not cache.contains(first)
    assert wait_for(lambda: cache.contains(first) and cache.contains(second))  # settled
    fetcher.prefetch(big, settle=True)  # half the bound waits: written without settling
    assert wait_for(lambda: cache.contains(big), timeout=1.0)
    fetcher.prefetch(last, settle=True)
    fetcher.flush()  # asked: written now
    assert cache.contains(last)
    fetcher.close()


def test_errors_reach_every_waiter_and_are_not_cached(tmp_path: Path) -> None:
    attempts = []

    def broken(digest: str) -> bytes:
        attempts.append(digest)
        time.sleep(0.1)
        raise CorruptObject(f"chunk {digest}: bad")

    fetcher = make(tmp_path, broken)
    errors: list[Exception] = []

    def reader() -> None:
        try:
            fetcher.read(DIGEST)
        except CorruptObject as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 8 and len(attempts) == 1
    assert not fetcher.cache.contains(DIGEST)
    with pytest.raises(CorruptObject):
        fetcher.read(DIGEST)
    assert len(attempts) == 2  # a later read tries again (the object may have been repaired)


def test_view_reads_holes_without_fetching(tmp_path: Path) -> None:
    fetched = []
    fetcher = make(tmp_path, lambda d: fetched.append(d) or DATA)
    cs = 64 * 1024
    view = LayerView(fetcher, "00" * 32, 3 * cs, cs, {1: DIGEST})
    assert view.read(0, cs) == bytes(cs) and fetched == []
    assert view.zeros_if_hole(0, cs) == bytes(cs) and view.zeros_if_hole(cs, 10) is None
    assert view.read(cs, 5) == DATA[:5] and fetched == [DIGEST]
    assert view.read(3 * cs, 10) == b"" and view.read(-1, 10) == b""
    assert list(view.touched) == [1]


def test_a_base_is_read_whole_so_rebuilds_never_wait_on_each_other(tmp_path: Path) -> None:
    """Two whole chunks, each also packed over the other in some layer (a
    RAM page that changed and changed back): reading either must not chase
    the recipes in a circle (single flight would wait on itself)."""
    from layerstore.manifest import Packed
    from layerstore.pack import PackWriter

    store = open_store(str(tmp_path / "store"))
    a, b = b"a" * 65536, b"a" * 4096 + b"b" * 61440
    for data in (a, b):
        store.write_chunk(digest_bytes(data), data)
    writer = PackWriter()
    b_over_a, a_over_b = writer.add(b, a), writer.add(a, b)
    pack = store.put_pack(writer)
    fetcher = ChunkFetcher(store, ChunkCache(tmp_path / "cache", capacity=1 << 20))
    fetcher.learn({digest_bytes(b): Packed(digest_bytes(a), pack, *b_over_a),
                   digest_bytes(a): Packed(digest_bytes(b), pack, *a_over_b)})
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend([fetcher.read(digest_bytes(a)), fetcher.read(digest_bytes(b))]),
                              daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert got == [a, b]


def test_a_base_whose_object_was_collected_is_rebuilt_from_its_own_entry(tmp_path: Path) -> None:
    """A digest one (collected) layer used as a base and a live layer packs:
    once its whole object is gone, the live layer's entry still serves it."""
    from layerstore.manifest import Packed
    from layerstore.pack import PackWriter

    store = open_store(str(tmp_path / "store"))
    b, d = b"b" * 65536, b"b" * 4096 + b"d" * 61440
    store.write_chunk(digest_bytes(b), b)
    writer = PackWriter()
    d_over_b = writer.add(d, b)
    pack = store.put_pack(writer)
    fetcher = ChunkFetcher(store, ChunkCache(tmp_path / "cache", capacity=1 << 20))
    other = digest_bytes(b"x" * 65536)
    fetcher.learn({other: Packed(digest_bytes(d), pack, 0, 1),  # d was a base there: no object of its own now
                   digest_bytes(d): Packed(digest_bytes(b), pack, *d_over_b)})
    assert fetcher.read(digest_bytes(d)) == d


def test_prefetch_leaves_a_chunk_held_in_memory_alone(tmp_path: Path) -> None:
    """A seal's kept chunk is served from memory: read-ahead naming it
    fetches nothing and writes no cache file; one not held is fetched."""
    calls: list[str] = []
    store = open_store(str(tmp_path / "store"))
    cache = ChunkCache(tmp_path / "cache", capacity=1 << 20)
    other = b"other" * 1000
    fetcher = ChunkFetcher(store, cache, fetch=lambda d: calls.append(d) or (DATA if d == DIGEST else other),
                           memory=1 << 20)
    assert fetcher.keep(DIGEST, DATA)
    fetcher.prefetch(DIGEST)
    assert calls == [] and fetcher.fetches == 0 and not cache.contains(DIGEST)
    assert fetcher.read(DIGEST) == DATA and calls == []
    fetcher.prefetch(digest_bytes(other))
    assert calls == [digest_bytes(other)] and cache.contains(digest_bytes(other))


def test_a_whole_read_from_the_cache_is_remembered_unless_asked_not_to(tmp_path: Path) -> None:
    """A seal's base read whole is kept in memory for the next read; a
    caller reading many chunks once (a set's whole copies being written)
    leaves the memory to the chunks in use."""
    store = open_store(str(tmp_path / "store"))
    cache = ChunkCache(tmp_path / "cache", capacity=1 << 20)
    fetcher = ChunkFetcher(store, cache, fetch=lambda d: pytest.fail("fetched"), memory=1 << 20)
    other = b"other" * 1000
    assert cache.put(DIGEST, DATA) and cache.put(digest_bytes(other), other)
    assert fetcher.read(DIGEST, remember=False) == DATA and fetcher.read(DIGEST) == DATA
    assert fetcher.memory_hits == 0  # both from the cache file
    assert fetcher.read(digest_bytes(other)) == other and fetcher.read(digest_bytes(other)) == other
    assert fetcher.memory_hits == 1
