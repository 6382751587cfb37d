"""Import: chunking, holes, dedup, parents, and failure atomicity (all backends)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from layerstore.chunk import chunk_key
from layerstore.errors import BackendError, InvalidInput, NotFound
from layerstore.exporter import export_image
from layerstore.importer import import_image
from layerstore.manifest import manifest_key
from layerstore.store import Store, inspect_image
from tests.images import MiB, write_image


def test_import_export_roundtrip_bit_exact(store: Store, tmp_path: Path) -> None:
    content = write_image(tmp_path / "a.img", "rzpzdr", tail=12345)
    res = import_image(store, tmp_path / "a.img", "img:v1")
    assert res.size == len(content)
    assert res.data_chunks == 5 and res.hole_chunks == 2  # tail chunk counts as data
    assert res.unique_chunks == 4  # 'd' duplicates chunk 0
    assert res.new_chunks == 4
    out = tmp_path / "out.img"
    export_image(store, "img:v1", out)
    assert out.read_bytes() == content
    assert os.stat(out).st_blocks * 512 < len(content)  # holes stay holes


def test_holes_are_never_stored(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "z.img", "zzzz")
    res = import_image(store, tmp_path / "z.img", "zeros:v1")
    assert res.new_chunks == 0 and res.data_chunks == 0
    assert list(store.backend.list("chunks/")) == []
    # zeros written as real data (not holes) are detected too
    (tmp_path / "dense-zero.img").write_bytes(bytes(3 * MiB))
    assert import_image(store, tmp_path / "dense-zero.img", "zeros:v2").new_chunks == 0
    export_image(store, "zeros:v2", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == bytes(3 * MiB)


def test_reimport_unchanged_uploads_nothing(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "rrpp")
    first = import_image(store, tmp_path / "a.img", "img:v1")
    second = import_image(store, tmp_path / "a.img", "img:v2")
    assert second.new_chunks == 0 and second.new_stored_bytes == 0
    assert second.manifest_id == first.manifest_id


def test_one_changed_chunk_stores_one_chunk(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "rrrrrrrr", seed=1)
    import_image(store, tmp_path / "a.img", "img:v1")
    with open(tmp_path / "a.img", "r+b") as f:
        f.seek(3 * MiB + 10)
        f.write(b"changed")
    res = import_image(store, tmp_path / "a.img", "img:v2")
    assert res.new_chunks == 1


def test_parent_layer_holds_only_differences(store: Store, tmp_path: Path) -> None:
    base = write_image(tmp_path / "base.img", "rrrr", seed=2)
    import_image(store, tmp_path / "base.img", "img:base")
    parent_id = store.resolve("img:base")
    child = bytearray(base)
    child[MiB : MiB + 5] = b"HELLO"  # chunk 1 changes
    child[2 * MiB : 3 * MiB] = bytes(MiB)  # chunk 2 becomes a hole -> whiteout
    (tmp_path / "child.img").write_bytes(bytes(child))
    res = import_image(store, tmp_path / "child.img", "img:child", parent=parent_id)
    layer = store.get_layer(res.manifest_id)
    assert layer.parent == parent_id
    assert set(layer.chunks) == {1, 2} and layer.chunks[2] is None
    export_image(store, "img:child", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == bytes(child)
    info = inspect_image(store, "img:child")
    assert info.layers == 2 and info.data_chunks == 3


@pytest.mark.parametrize("chunk_size", [64 * 1024, 4 * MiB])
def test_chunk_size_option(store: Store, tmp_path: Path, chunk_size: int) -> None:
    content = write_image(tmp_path / "a.img", "rp", chunk=chunk_size, tail=1)
    res = import_image(store, tmp_path / "a.img", "img:cs", chunk_size=chunk_size)
    assert store.get_layer(res.manifest_id).chunk_size == chunk_size
    export_image(store, "img:cs", tmp_path / "o")
    assert (tmp_path / "o").read_bytes() == content


def test_bad_inputs_change_nothing(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "r")
    with pytest.raises(InvalidInput, match="no such file"):
        import_image(store, tmp_path / "missing.img", "img:v1")
    with pytest.raises(InvalidInput, match="directory"):
        import_image(store, tmp_path, "img:v1")
    with pytest.raises(InvalidInput):
        import_image(store, tmp_path / "a.img", "../evil:v1")
    with pytest.raises(InvalidInput):
        import_image(store, tmp_path / "a.img", "img:v1", chunk_size=3000)
    assert list(store.backend.list("")) == []


class FailingPuts:
    """Passes everything through but fails chunk puts after `allowed` of them."""

    def __init__(self, inner, allowed: int) -> None:
        self.inner, self.allowed = inner, allowed
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key: str, data: bytes) -> None:
        if key.startswith("chunks/"):
            with self.lock:
                if self.allowed <= 0:
                    raise BackendError("disk on fire")
                self.allowed -= 1
        self.inner.put(key, data)


def test_failed_upload_publishes_no_manifest_and_no_ref(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "rrrrrrrr", seed=5)
    broken = Store(FailingPuts(store.backend, allowed=3), store.catalog)
    with pytest.raises(BackendError, match="disk on fire"):
        import_image(broken, tmp_path / "a.img", "img:v1", workers=2, upload_concurrency=2)
    assert list(store.backend.list("manifests/")) == []
    assert list(store.backend.list("refs/")) == []
    assert len(list(store.backend.list("chunks/"))) == 3  # whole objects only, no partial ones
    with pytest.raises(NotFound):
        store.resolve("img:v1")
    # and a retry completes, reusing what was uploaded
    res = import_image(store, tmp_path / "a.img", "img:v1")
    assert res.new_chunks == 5
    export_image(store, "img:v1", tmp_path / "o")
    assert (tmp_path / "o").read_bytes() == (tmp_path / "a.img").read_bytes()


def test_manifest_naming_missing_chunk_is_refused(store: Store, tmp_path: Path) -> None:
    from layerstore.errors import MissingChunk
    from layerstore.manifest import Layer

    with pytest.raises(MissingChunk, match="missing"):
        store.put_layer(Layer(size=MiB, chunk_size=MiB, chunks={0: "ab" * 32}))
    assert list(store.backend.list("manifests/")) == []


def test_ref_to_missing_manifest_is_refused(store: Store) -> None:
    with pytest.raises(NotFound):
        store.set_ref("img:v1", "cd" * 32)
    assert list(store.backend.list("refs/")) == []


def test_keys_follow_documented_layout(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "r")
    res = import_image(store, tmp_path / "a.img", "img:v1")
    keys = {o.key for o in store.backend.list("")}
    digest = store.get_layer(res.manifest_id).chunks[0]
    assert keys == {chunk_key(digest), manifest_key(res.manifest_id), "refs/img/v1"}


def test_import_on_a_node_whose_remote_holds_the_chunks_still_stores_them_locally(tmp_path: Path) -> None:
    """Dedup is against the store the import's lease protects: a chunk only the remote holds is
    written here too, so no local manifest names a chunk the remote's GC could take away."""
    from layerstore.errors import MissingChunk
    from layerstore.localdir import LocalDirBackend
    from layerstore.manifest import Layer
    from tests.test_transfer import local_store

    data = write_image(tmp_path / "a.img", "rrp", seed=11)
    remote = local_store(tmp_path / "remote")
    first = import_image(remote, tmp_path / "a.img", "app:v1")
    node = local_store(tmp_path / "node", remote=LocalDirBackend(tmp_path / "remote" / "objects", create=False))
    assert node.missing_chunks(remote.chunk_map(first.manifest_id)[1].values()) == set()  # readable through
    res = import_image(node, tmp_path / "a.img", "app:v1")
    assert res.manifest_id == first.manifest_id and res.new_chunks == first.new_chunks == 3
    stored = {o.key for o in node.backend.list("chunks/")}
    assert stored == {chunk_key(d) for d in node.chunk_map(res.manifest_id)[1].values()}
    assert node.local_missing_chunks(node.chunk_map(res.manifest_id)[1].values()) == set()
    export_image(node, "app:v1", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == data and node.sources["remote"] == 0
    # publishing checks this store alone, unless a lazy pull asks for the read path
    layer = Layer(size=MiB, chunk_size=MiB, chunks={0: remote.chunk_map(first.manifest_id)[1][0]})
    for digest in set(remote.chunk_map(first.manifest_id)[1].values()):
        node.backend.delete(chunk_key(digest))
    with pytest.raises(MissingChunk):
        node.put_layer(layer)
    assert node.put_layer(layer, read_through=True) == layer.manifest_id()
    node.close()
    remote.close()
