"""fusefs/daemon.py's Catalogue without a mount: seals keep a sandbox's
layer stack shallow (squashed past `squash_depth`, reads unchanged), and
removing a sandbox discards seals the store refused instead of failing
forever."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fusefs.cache import ChunkCache
from fusefs.daemon import Catalogue
from layerstore.errors import BackendUnavailable, NotFound
from layerstore.importer import import_image
from layerstore.squash import depth
from layerstore.store import open_store
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
