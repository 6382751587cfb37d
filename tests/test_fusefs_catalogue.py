"""fusefs/catalogue.py's Catalogue without a mount: seals keep a sandbox's
layer stack shallow (squashed past `squash_depth`, reads unchanged),
removing a sandbox discards seals the store refused instead of failing
forever, and a layer's working set is recorded on its first use, then
prefetched and merged by the next."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from fusefs.cache import ChunkCache
from fusefs.catalogue import Catalogue
from layerstore.errors import BackendUnavailable, NotFound
from layerstore.importer import import_image
from layerstore.refs import parse_ref
from layerstore.squash import depth
from layerstore.store import Store, open_store
from tests.images import MiB, write_image

CS = 64 * 1024


@pytest.fixture
def cat(tmp_path: Path) -> Catalogue:
    store = open_store(str(tmp_path / "store"))
    write_image(tmp_path / "base.img", "rzrprzrr", chunk=CS, tail=1000)
    import_image(store, tmp_path / "base.img", "base:v1", chunk_size=CS)
    catalogue = Catalogue(store, ChunkCache(tmp_path / "cache", capacity=64 * MiB), tmp_path / "uppers",
                          squash_depth=4)
    yield catalogue
    catalogue.close()


def test_many_seals_stay_shallow_and_read_every_write(cat: Catalogue) -> None:
    """200 seals of one sandbox with squash_depth 4: the stack never passes
    5 layers, and the last layer (and the live disk) read every write."""
    upper = cat.create_sandbox("sb1", image="base:v1")
    expected = bytearray(upper.read(0, upper.size))
    rng = random.Random(3)
    deepest = 0
    for n in range(200):
        offset = rng.randrange(upper.size - 16)
        data = f"write {n:05d}".encode()
        upper.write(offset, data)
        expected[offset:offset + len(data)] = data
        manifest = cat.seal("sb1", wait=True).manifest
        assert manifest is not None
        deepest = max(deepest, depth(cat.store, manifest))
    assert deepest <= 5
    assert bytes(cat.view_for_manifest(manifest).read(0, upper.size)) == bytes(expected)
    assert upper.read(0, upper.size) == bytes(expected)
    assert cat.store.get_layer(manifest).annotations.get("sandbox") == "sb1"


def test_a_seals_chunks_are_kept_for_the_next_seal_and_its_forks(cat: Catalogue) -> None:
    """What a seal stored stays in this node's memory (verified) without a
    fetch: the next seal completes its partial chunks, and restores read
    the snapshot, from there. Bytes that are not the digest's are refused."""
    upper = cat.create_sandbox("sb1", image="base:v1")
    upper.write(3 * CS + 4096, b"w" * 4096)  # a whole page: chunk 3 partial until the seal completes it
    upper.write(5 * CS + 7, b"unaligned")
    manifest = cat.seal("sb1", wait=True).manifest
    layer = cat.store.get_layer(manifest)
    assert sorted(layer.chunks) == [3, 5]
    digests = [layer.chunks[3], layer.chunks[5]]
    assert wait_for(lambda: all(cat.fetcher.read_ready(d, 0, CS) is not None for d in digests))
    fetches = cat.fetcher.fetches
    view = cat.view_for_manifest(manifest)
    assert view.read(3 * CS, CS) == upper.read(3 * CS, CS)
    assert cat.fetcher.fetches == fetches  # served from memory
    assert cat.fetcher.keep(digests[0], b"not these bytes") is False


def test_removing_a_sandbox_discards_a_seal_the_store_refused(cat: Catalogue,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    upper = cat.create_sandbox("sb1", image="base:v1")
    upper.write(0, b"never published")

    def refuse(*_a: object, **_k: object) -> str:
        raise BackendUnavailable("the object store did not answer")

    monkeypatch.setattr(cat, "_publish", refuse)
    with pytest.raises(BackendUnavailable):
        cat.seal("sb1", wait=True)
    assert upper.sealing  # queued for a retry that will never come
    root = upper.root
    cat.remove_sandbox("sb1")  # was: "sealed layer(s) still being published" forever
    assert "sb1" not in cat.sandboxes and not root.exists()
    with pytest.raises(NotFound):
        cat.remove_sandbox("sb1")


def wait_for(check, timeout: float = 10.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    return check()


def recording_node(store: Store, tmp_path: Path, name: str, *, record_share: float) -> Catalogue:
    """A node of its own (cache, uppers) over `store`, recording sets after 0.3 s."""
    return Catalogue(store, ChunkCache(tmp_path / name, capacity=64 * MiB), tmp_path / f"uppers-{name}",
                     record_window=0.3, record_share=record_share)


def test_a_layers_working_set_is_recorded_on_first_use_and_prefetched_and_merged_after(tmp_path: Path) -> None:
    """The first sandbox over a layer records what it read (fast path too) in
    first-read order; the next node's sandbox prefetches exactly that before
    a read, and adds what it read that was new; a set stays under its share."""
    store = open_store(str(tmp_path / "store"))
    write_image(tmp_path / "base.img", "rrrrrrrr", chunk=CS)
    manifest = import_image(store, tmp_path / "base.img", "base:v1", chunk_size=CS).manifest_id

    first = recording_node(store, tmp_path, "a", record_share=0.5)
    try:
        upper = first.create_sandbox("sb1", image="base:v1")
        for index in (5, 2, 5):
            upper.read(index * CS, 100)
        view = first.view_for_manifest(manifest)
        assert view.read_ready(3 * CS, 10) is None  # not cached: the slow path, which records it
        view.read(3 * CS, 10)
        assert view.read_ready(3 * CS, 10) is not None
        assert wait_for(lambda: store.get_prefetch(manifest)) == [5, 2, 3]
    finally:
        first.close()

    second = recording_node(store, tmp_path, "b", record_share=0.5)  # another node, an empty cache
    try:
        upper = second.create_sandbox("sb2", image="base:v1")  # prefetch starts before any read
        digests = store.chunk_map(manifest)[1]
        assert wait_for(lambda: all(second.cache.contains(digests[i]) for i in (5, 2, 3)))
        assert not second.cache.contains(digests[7])
        for index in (7, 0, 1, 6):  # past half of the layer's 8 chunks
            upper.read(index * CS, 10)
        assert wait_for(lambda: store.get_prefetch(manifest) != [5, 2, 3]) and \
            store.get_prefetch(manifest) == [5, 2, 3, 7]  # merged, capped at half the layer
    finally:
        second.close()


def test_a_working_set_is_capped_by_the_layers_size_not_by_what_it_stores(tmp_path: Path) -> None:
    """A guest's RAM layer stores little beyond what the guest used, and a
    restore reads most of that: capped at half of its stored chunks, the
    rest were fetched one by one, each as the guest faulted on it."""
    store = open_store(str(tmp_path / "store"))
    write_image(tmp_path / "ram.img", "rrrzzzzz", chunk=CS)  # 3 of 8 slots stored
    manifest = import_image(store, tmp_path / "ram.img", "ram:v1", chunk_size=CS).manifest_id
    cat = Catalogue(store, ChunkCache(tmp_path / "cache", capacity=64 * MiB), tmp_path / "uppers",
                    record_window=0.3, record_share=0.5)
    try:
        upper = cat.create_sandbox("sb1", image="ram:v1")
        for index in (1, 0, 2):
            upper.read(index * CS, 10)
        assert wait_for(lambda: store.get_prefetch(manifest)) == [1, 0, 2]  # was [1]: half of 3
    finally:
        cat.close()


def test_opening_a_layer_leaves_the_store_read_of_its_set_to_a_prefetch_thread(cat: Catalogue,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The FUSE event loop opens files: a store read there (a round trip on
    S3) would hold up every request of the mount until it answered."""
    readers: list[str] = []
    get_prefetch = cat.store.get_prefetch

    def recording(manifest_id: str) -> list[int] | None:
        readers.append(threading.current_thread().name)
        return get_prefetch(manifest_id)

    monkeypatch.setattr(cat.store, "get_prefetch", recording)
    cat.start_prefetch(cat.view_for_ref(parse_ref("base:v1")))
    assert wait_for(lambda: readers) and readers[0].startswith("strata-prefetch")


def test_a_working_sets_packed_chunks_are_stored_whole_and_restored_without_their_bases(tmp_path: Path) -> None:
    """A snapshot's RAM packs what a restore reads over older versions: the
    first node to record the set stores those chunks again whole, and the
    next node's prefetch reads them without fetching a base. A broken copy
    only costs the bases again: what is served is verified either way."""
    store = open_store(str(tmp_path / "store"))
    write_image(tmp_path / "base.img", "rrrr", chunk=CS)
    import_image(store, tmp_path / "base.img", "base:v1", chunk_size=CS)

    first = recording_node(store, tmp_path, "a", record_share=1.0)
    try:
        upper = first.create_sandbox("src", image="base:v1")
        for index in (1, 2):
            upper.write(index * CS + 4096, b"changed" * 100)  # a page each: packed over the image's chunk
        manifest = first.seal("src", wait=True).manifest
        layer = store.get_layer(manifest)
        assert sorted(layer.packed) and all(p.base is not None for p in layer.packed.values())
        restored = first.create_sandbox("restored", manifest=manifest)
        expected = {i: restored.read(i * CS, CS) for i in (2, 1, 0)}
        assert wait_for(lambda: store.get_prefetch(manifest)) == [2, 1, 0]
        assert wait_for(lambda: store.get_set_chunks(manifest))
    finally:
        first.close()
    whole = store.get_set_chunks(manifest)
    digests = store.chunk_map(manifest)[1]
    assert set(whole) == {digests[1], digests[2]}  # the packed ones; chunk 0 is the image's own
    bases = {layer.packed[i].base for i in (1, 2)}

    second = recording_node(store, tmp_path, "b", record_share=1.0)
    try:
        second.create_sandbox("sb", manifest=manifest)
        assert wait_for(lambda: all(second.cache.contains(digests[i]) for i in (0, 1, 2)))
        second.fetcher.flush()
        assert not any(second.cache.contains(b) for b in bases)  # no base fetched
        assert second.fetcher.fetches == 3
        assert all(second.view_for_manifest(manifest).read(i * CS, CS) == expected[i] for i in (0, 1, 2))
    finally:
        second.close()

    broken = {d: e[:-8] for d, e in whole.items()}  # torn entries: refused, then read as the layer says
    store.put_set_chunks(manifest, broken)
    third = recording_node(store, tmp_path, "c", record_share=1.0)
    try:
        third.create_sandbox("sb", manifest=manifest)
        assert wait_for(lambda: all(third.cache.contains(digests[i]) for i in (0, 1, 2)))
        assert all(third.view_for_manifest(manifest).read(i * CS, CS) == expected[i] for i in (0, 1, 2))
        third.fetcher.flush()
        assert all(third.cache.contains(b) for b in bases)
    finally:
        third.close()

    store.backend.put(f"prefetch-chunks/{manifest}", b"not an index")  # unreadable: counts as none...
    fourth = recording_node(store, tmp_path, "d", record_share=1.0)
    try:
        fourth.create_sandbox("sb", manifest=manifest)
        assert wait_for(lambda: all(fourth.cache.contains(digests[i]) for i in (0, 1, 2)))
        assert wait_for(lambda: store.get_set_chunks(manifest)) == whole  # ...and the set's reader stores it again
    finally:
        fourth.close()

    store.backend.delete(f"prefetch-chunks/{manifest}")  # a set recorded by hand (`image record-prefetch`)
    store.set_ref("restored:v1", manifest)
    fifth = Catalogue(store, ChunkCache(tmp_path / "e", capacity=64 * MiB), tmp_path / "uppers-e", record_window=0)
    try:
        view = fifth.view_for_manifest(manifest)
        assert all(view.read(i * CS, CS) == expected[i] for i in (1, 2))
        assert fifth.record_prefetch(parse_ref("restored:v1")).chunks == 2
        assert store.get_set_chunks(manifest) == whole  # stores the packed chunks whole too
    finally:
        fifth.close()
