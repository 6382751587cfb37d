"""Volumes in the store (layerstore/volumes.py) on every backend: paths are
normalised and never escape, edits keep the tree whole (parents exist, a
directory is never replaced by a file), concurrent writers lose no update,
file bytes come back verified, and GC keeps what a volume names and refuses
to run past a volume it cannot read."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from layerstore import gc
from layerstore.errors import Conflict, CorruptObject, InvalidInput, NotFound
from layerstore.store import Store, open_store
from layerstore.volumes import (DIRECTORY, FILE, VOLUME_PREFIX, Entry, Volumes, check_path, check_volume_id,
                                make_dir, put_entry, read_bytes, remove, set_metadata, store_bytes)


def file_entry(store: Store, tmp_path: Path, data: bytes, *, now: float = 1.0) -> Entry:
    src = tmp_path / f"src-{os.urandom(4).hex()}"
    src.write_bytes(data)
    layer, size = store_bytes(store, src)
    return Entry(FILE, 0o644, 0, 0, now, now, size, layer)


@pytest.mark.parametrize(("given", "key"), [("/", ""), ("", ""), ("/a//b/", "a/b"), ("./a/./b", "a/b"),
                                            ("a/b.txt", "a/b.txt"), ("/ünï côde", "ünï côde")])
def test_paths_are_normalised(given: str, key: str) -> None:
    assert check_path(given) == key


@pytest.mark.parametrize("bad", ["../etc/passwd", "/a/../../b", "a/..", "a\0b", "x" * 4097, "/" + "y" * 256])
def test_paths_that_could_mean_elsewhere_are_refused(bad: str) -> None:
    with pytest.raises(InvalidInput):
        check_path(bad)


@pytest.mark.parametrize("bad", ["", "vol", "../volumes/x", "VOL0123456789abcdef", "vol0123456789abcde"])
def test_ids_that_cannot_exist_are_unknown(bad: str) -> None:
    with pytest.raises(NotFound):
        check_volume_id(bad)


def test_create_list_get_delete(store: Store) -> None:
    vols = Volumes(store.backend)
    a = vols.create("data", "alpha")
    b = vols.create("data", "beta")  # names are per team
    with pytest.raises(Conflict):
        vols.create("data", "alpha")
    with pytest.raises(InvalidInput):
        vols.create("../x", "alpha")
    assert {v.id for v in vols.list()} == {a.id, b.id} and vols.get(a.id).token == a.token != b.token
    assert len(a.token) == 64
    vols.delete(a.id)
    with pytest.raises(NotFound):
        vols.get(a.id)
    assert [v.id for v in vols.list()] == [b.id]


def test_edits_keep_the_tree_whole(store: Store, tmp_path: Path) -> None:
    vols = Volumes(store.backend)
    vid = vols.create("tree", "alpha").id
    f = file_entry(store, tmp_path, b"hello")
    d = Entry(DIRECTORY, 0o755)
    v = vols.change(vid, lambda v: put_entry(v, "a/b/c.txt", f, parents=True, replace_file=False))
    assert v.entry("a").type == v.entry("a/b").type == DIRECTORY and v.children("") == ["a"]
    assert v.children("a", depth=2) == ["a/b", "a/b/c.txt"]
    with pytest.raises(Conflict):  # no overwrite without force
        vols.change(vid, lambda v: put_entry(v, "a/b/c.txt", f, parents=True, replace_file=False))
    with pytest.raises(Conflict):  # a directory is never replaced by a file
        vols.change(vid, lambda v: put_entry(v, "a/b", f, parents=True, replace_file=True))
    with pytest.raises(InvalidInput):  # nor used as a file's parent when it is a file
        vols.change(vid, lambda v: put_entry(v, "a/b/c.txt/d", f, parents=True, replace_file=True))
    with pytest.raises(NotFound):  # a missing parent without force
        vols.change(vid, lambda v: make_dir(v, "x/y", d, parents=False))
    v = vols.change(vid, lambda v: make_dir(v, "x/y", d, parents=True))
    v = vols.change(vid, lambda v: make_dir(v, "x/y", d, parents=True))  # force: an existing one is fine
    with pytest.raises(Conflict):
        vols.change(vid, lambda v: make_dir(v, "x/y", d, parents=False))
    v = vols.change(vid, lambda v: set_metadata(v, "x", uid=1000, gid=None, mode=0o700, now=5.0))
    assert (v.entry("x").uid, v.entry("x").gid, v.entry("x").mode, v.entry("x").ctime) == (1000, 0, 0o700, 5.0)
    v = vols.change(vid, lambda v: remove(v, "a"))  # a directory goes with everything under it
    assert sorted(v.entries) == ["x", "x/y"]
    for bad in (lambda v: remove(v, ""), lambda v: remove(v, "nope")):
        with pytest.raises((InvalidInput, NotFound)):
            vols.change(vid, bad)
    assert sorted(vols.get(vid).entries) == ["x", "x/y"]  # refused edits changed nothing


def test_concurrent_writers_lose_no_update(store: Store, tmp_path: Path) -> None:
    if store.kind == "moto":  # type: ignore[attr-defined]
        pytest.skip("moto's in-process S3 model is not thread-safe for concurrent PUTs of one key; local and "
                    "SeaweedFS cover it")
    vols = Volumes(store.backend)
    vid = vols.create("busy", "alpha").id
    entry = Entry(FILE, 0o644)

    def write(i: int) -> None:
        vols.change(vid, lambda v: put_entry(v, f"d{i % 3}/f{i}", entry, parents=True, replace_file=False))

    def write_elsewhere(i: int) -> None:  # each with its own Volumes, as on separate nodes
        Volumes(store.backend).change(vid, lambda v: put_entry(v, f"n{i}", entry, parents=True, replace_file=False))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(24)))
        list(pool.map(write_elsewhere, range(8)))
    files = [p for p, e in vols.get(vid).entries.items() if e.type == FILE]
    assert len(files) == 24 + 8


def test_bytes_come_back_verified(store: Store, tmp_path: Path) -> None:
    data = os.urandom(3 << 20) + bytes(2 << 20) + b"tail"  # several chunks, a hole, a short last chunk
    entry = file_entry(store, tmp_path, data)
    assert entry.size == len(data) and b"".join(read_bytes(store, entry)) == data
    assert b"".join(read_bytes(store, file_entry(store, tmp_path, b""))) == b""
    with pytest.raises(CorruptObject):
        list(read_bytes(store, replace(entry, size=entry.size + 1)))  # the volume and the layer disagree


def test_gc_keeps_what_a_volume_names_and_what_a_garbled_one_may_name(store: Store, tmp_path: Path) -> None:
    vols = Volumes(store.backend)
    vid = vols.create("kept", "alpha").id
    data = os.urandom(1 << 20)
    entry = file_entry(store, tmp_path, data)
    vols.change(vid, lambda v: put_entry(v, "f", entry, parents=True, replace_file=False))
    gone = file_entry(store, tmp_path, os.urandom(1 << 20))  # stored, named by nothing
    for i in range(2):
        gc.collect(store, grace=0, now=time.time() + 10 + i)
    assert b"".join(read_bytes(store, vols.get(vid).entry("f"))) == data
    with pytest.raises(NotFound):
        list(read_bytes(store, gone))
    garbled = entry.layer.encode()  # the head of an index torn after naming the file's layer
    store.backend.put(VOLUME_PREFIX + "vol" + "0" * 16, b'{"entries":{"g":{"layer":"' + garbled)
    vols.change(vid, lambda v: replace(v, entries={}))  # only the garbled index names the layer now
    for i in range(2):
        report = gc.collect(store, grace=0, now=time.time() + 20 + i)
        assert report.quarantined[0].startswith(f"{VOLUME_PREFIX}vol{'0' * 16}: volume vol{'0' * 16} is malformed")
    assert b"".join(read_bytes(store, entry)) == data  # kept through GC: a garbled index only salvages
    assert [v.id for v in vols.list()] == [vid]  # a listing leaves it out


def test_a_volume_is_copied_with_its_files_and_kept_there(store: Store, tmp_path: Path) -> None:
    from layerstore.transfer import copy
    from tests.test_transfer import local_store

    vols = Volumes(store.backend)
    vid = vols.create("moving", "alpha").id
    data = os.urandom(2 << 20)
    entry = file_entry(store, tmp_path, data)
    vols.change(vid, lambda v: put_entry(v, "a/f", entry, parents=True, replace_file=False))
    other = local_store(tmp_path / "other")
    result = copy(store, other, vid)
    assert result.manifests_sent == 1 and result.chunks_sent >= 2
    moved = Volumes(other.backend).get(vid)
    assert moved == vols.get(vid) and b"".join(read_bytes(other, moved.entry("a/f"))) == data
    for i in range(2):
        gc.collect(other, grace=0, now=time.time() + 10 + i)
    assert b"".join(read_bytes(other, Volumes(other.backend).get(vid).entry("a/f"))) == data
    assert copy(store, other, vid).chunks_sent == 0  # again: nothing new to send
    other.close()


def test_a_snapshot_keeps_the_volume_as_it_was_and_gc_keeps_its_files(store: Store, tmp_path: Path) -> None:
    """A volume snapshot is unchanged by later edits, starts new volumes with
    its files (their layers shared), keeps those layers through GC after
    the volume is gone, and a garbled one is quarantined by GC, not fatal to it."""
    vols = Volumes(store.backend)
    vol = vols.create("data", "alpha")
    kept = file_entry(store, tmp_path, b"version one" * 1000)
    vols.change(vol.id, lambda v: put_entry(v, "f", kept, parents=True, replace_file=True))
    snap = vols.snapshot(vol.id)
    vols.change(vol.id, lambda v: put_entry(v, "f", file_entry(store, tmp_path, b"two"), parents=True,
                                            replace_file=True))
    assert vols.get_snapshot(snap.id).volume.entry("f") == kept
    assert [s.id for s in vols.snapshots()] == [snap.id] and snap.source == vol.id and snap.volume.token == ""
    copy = vols.create("copy", "alpha", entries=vols.get_snapshot(snap.id).volume.entries)
    assert copy.id != vol.id and copy.entry("f").layer == kept.layer and copy.token
    vols.delete(vol.id)
    vols.delete(copy.id)
    for i in range(2):
        gc.collect(store, grace=0, now=time.time() + 10 + i)
    assert b"".join(read_bytes(store, vols.get_snapshot(snap.id).volume.entry("f"))) == b"version one" * 1000
    with pytest.raises(NotFound):
        vols.get_snapshot("vs../../x")
    store.backend.put("volume-snapshots/vs0000000000000000", b"{not json")
    report = gc.collect(store, grace=0, now=time.time() + 20)
    assert [line.split(":")[0] for line in report.quarantined] == ["volume-snapshots/vs0000000000000000"]
    assert b"".join(read_bytes(store, vols.get_snapshot(snap.id).volume.entry("f"))) == b"version one" * 1000
    assert [s.id for s in vols.snapshots()] == [snap.id]  # the garbled one is left out of listings
    vols.delete_snapshot(snap.id)
    with pytest.raises(NotFound):
        vols.get_snapshot(snap.id)


def test_an_index_past_its_byte_cap_is_refused_and_one_in_the_store_is_not_parsed(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch
                                                                                    ) -> None:
    """Long paths fill an index long before MAX_ENTRIES: a change that would pass MAX_INDEX_BYTES
    is VolumeFull and writes nothing; an index that big in the store (an older writer) is refused
    unparsed by readers (listings, the content API), while GC still reads what it names."""
    from layerstore import volumes as module
    from layerstore.volumes import VolumeFull

    store = open_store(str(tmp_path / "store"))
    volumes = Volumes(store.backend)
    vol = volumes.create("deep", "alpha")
    monkeypatch.setattr(module, "MAX_INDEX_BYTES", 64 << 10)
    with pytest.raises(VolumeFull, match="index would pass"):
        for n in range(1000):
            path = f"{n:04d}{'d' * 250}"
            volumes.change(vol.id, lambda v, p=path: make_dir(v, p, Entry(DIRECTORY, 0o755), parents=True))
    written = store.backend.get(f"volumes/{vol.id}")
    assert len(written) <= 64 << 10 and volumes.get(vol.id).entries  # the last good index stays
    monkeypatch.setattr(module, "MAX_INDEX_BYTES", 1 << 10)
    with pytest.raises(CorruptObject, match="passes 1024"):
        volumes.get(vol.id)
    assert vol.id not in {v.id for v in volumes.list()}
    _roots, salvaged = volumes.gc_roots()
    assert salvaged == []


def test_a_token_is_checked_before_the_index_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The content API asks get_by_token of every request before it knows the caller: a wrong
    token costs one read of the index, never a parse of it."""
    from layerstore import volumes as module

    store = open_store(str(tmp_path / "store"))
    volumes = Volumes(store.backend)
    vol = volumes.create("data", "alpha")
    assert volumes.get_by_token(vol.id, vol.token) == vol
    parsed = []
    real = module.parse_volume
    monkeypatch.setattr(module, "parse_volume", lambda *a: parsed.append(a[0]) or real(*a))
    for wrong in ("0" * 64, vol.token[:-1] + "x", "", "é" * 64):
        assert volumes.get_by_token(vol.id, wrong) is None
    assert parsed == []
    assert volumes.get_by_token(vol.id, vol.token) == vol and parsed == [vol.id]
