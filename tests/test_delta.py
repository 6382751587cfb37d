"""Delta layers (layerstore/delta.py): a seal's changed chunks published as
changed pages in one pack over their parent, read back byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layerstore import delta
from layerstore.exporter import export_image
from layerstore.importer import import_image
from layerstore.pack import PAGE
from layerstore.store import Store
from layerstore.transfer import copy
from layerstore.verify import verify_store
from tests.images import MiB, write_image
from tests.test_transfer import keys, local_store


def rewrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def seal(store: Store, path: Path, parent: str, slots: list[int], ref: str) -> str:
    """Publish chunks `slots` of the file at `path` over `parent` (as a sandbox's seal does its upper layer's)."""
    data = path.read_bytes()
    result = delta.publish_delta(store, lambda i: data[i * MiB:(i + 1) * MiB], len(data), parent=parent, slots=slots,
                                 read_base=store.read_chunk)
    store.set_ref(ref, result.manifest_id)
    return result.manifest_id


def test_changed_pages_are_packed_over_the_chunk_below_and_read_back(store: Store, tmp_path: Path) -> None:
    image = tmp_path / "a.img"
    write_image(image, "rrrrzz")  # chunks 0-3 data, 4-5 holes
    parent = import_image(store, image, "a:v1").manifest_id
    below = store.chunk_map(parent)[1]
    rewrite(image, 0 * MiB + 5 * PAGE, os.urandom(2 * PAGE))  # chunk 0: two pages
    rewrite(image, 1 * MiB, os.urandom(MiB))  # chunk 1: all of it
    rewrite(image, 2 * MiB, bytes(MiB))  # chunk 2: zeros now
    rewrite(image, 5 * MiB + 7 * PAGE, b"x" * 10)  # chunk 5: a page over a hole
    top = seal(store, image, parent, [0, 1, 2, 3, 5], "a:v2")  # 3 is dirty but unchanged
    layer = store.get_layer(top)
    assert sorted(layer.chunks) == [0, 1, 2, 5] and layer.chunks[2] is None  # 3 stays the parent's
    assert set(layer.packed) == {0, 5}
    assert layer.packed[0].base == below[0] and layer.packed[5].base is None
    assert len(keys(store, "packs/")) == 1
    export_image(store, "a:v2", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == image.read_bytes()

    # a second seal over the first: chunk 0's entry is over the same whole base (one step deep)
    rewrite(image, 0 * MiB + 100 * PAGE, os.urandom(PAGE))
    again = store.get_layer(seal(store, image, top, [0, 5], "a:v3"))
    assert set(again.chunks) == {0} and again.packed[0].base == below[0]
    export_image(store, "a:v3", tmp_path / "out3.img")
    assert (tmp_path / "out3.img").read_bytes() == image.read_bytes()
    assert verify_store(store).ok


def test_a_base_only_the_read_path_has_is_not_named(tmp_path: Path) -> None:
    src = local_store(tmp_path / "src")
    image = tmp_path / "a.img"
    write_image(image, "rr")
    parent = import_image(src, image, "a:v1").manifest_id
    lazy = local_store(tmp_path / "lazy", remote=src.backend)
    copy(src, lazy, "a:v1", chunks=False)  # chunks stay remote
    rewrite(image, PAGE, os.urandom(PAGE))
    layer = lazy.get_layer(seal(lazy, image, parent, [0], "a:v2"))
    assert layer.packed == {} and keys(lazy, "packs/") == set()  # stored whole
    export_image(lazy, "a:v2", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == image.read_bytes()


def test_past_the_pack_budget_chunks_are_stored_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = local_store(tmp_path / "s")
    image = tmp_path / "a.img"
    write_image(image, "rrrr")
    parent = import_image(store, image, "a:v1").manifest_id
    for i in range(4):
        rewrite(image, i * MiB, os.urandom(8 * PAGE))
    monkeypatch.setattr(delta, "PACK_BUDGET", 20 * PAGE)  # room for two of the four entries
    layer = store.get_layer(seal(store, image, parent, [0, 1, 2, 3], "a:v2"))
    assert len(layer.packed) == 2 and len(layer.chunks) == 4
    export_image(store, "a:v2", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == image.read_bytes()


def test_a_lease_is_taken_only_when_a_chunk_goes_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Changed pages alone need no lease (a new pack; bases the parent
    names); a whole chunk may be one the store already holds, which GC must
    not take before the manifest names it."""
    taken: list[str] = []

    class Counted(delta.Lease):
        def __enter__(self) -> delta.Lease:
            taken.append(self.what)
            return super().__enter__()

    monkeypatch.setattr(delta, "Lease", Counted)
    store = local_store(tmp_path / "s")
    image = tmp_path / "a.img"
    write_image(image, "rr")
    parent = import_image(store, image, "a:v1").manifest_id
    rewrite(image, PAGE, os.urandom(PAGE))
    v2 = seal(store, image, parent, [0], "a:v2")
    assert taken == [] and keys(store, "leases/") == set()
    rewrite(image, MiB, os.urandom(MiB))
    seal(store, image, v2, [1], "a:v3")
    assert len(taken) == 1 and keys(store, "leases/") == set()  # released once published


def test_a_chunk_back_to_its_base_is_named_whole_not_packed_over_itself(tmp_path: Path) -> None:
    store = local_store(tmp_path / "s")
    image = tmp_path / "a.img"
    original = write_image(image, "r")
    parent = import_image(store, image, "a:v1").manifest_id
    rewrite(image, PAGE, os.urandom(PAGE))
    v2 = seal(store, image, parent, [0], "a:v2")
    assert set(store.get_layer(v2).packed) == {0}
    image.write_bytes(original)  # the page changes back
    v3 = store.get_layer(seal(store, image, v2, [0], "a:v3"))
    assert v3.chunks[0] == store.get_layer(parent).chunks[0] and v3.packed == {}
    export_image(store, "a:v3", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == original
