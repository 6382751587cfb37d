"""Verify and read paths: corrupt, truncated and missing objects are found, never served."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerstore.chunk import chunk_key
from layerstore.errors import CorruptObject, MissingChunk
from layerstore.exporter import export_image
from layerstore.importer import import_image
from layerstore.store import Store
from layerstore.verify import verify_store
from tests.images import write_image


def _first_digest(store: Store, ref: str) -> str:
    _top, resolved = store.chunk_map(store.resolve(ref))
    return resolved[min(resolved)]


def test_clean_store_verifies(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "rpzr")
    import_image(store, tmp_path / "a.img", "img:v1")
    report = verify_store(store)
    assert report.ok, report.errors
    assert report.refs == 1 and report.manifests == 1 and report.chunks_checked == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_corrupt_chunk_detected_and_not_exported(store: Store, tmp_path: Path, damage: str) -> None:
    write_image(tmp_path / "a.img", "rpr", seed=3)
    import_image(store, tmp_path / "a.img", "img:v1")
    digest = _first_digest(store, "img:v1")
    key = chunk_key(digest)
    blob = store.backend.get(key)
    if damage == "flip":
        bad = blob[:100] + bytes([blob[100] ^ 1]) + blob[101:]
    elif damage == "truncate":
        bad = blob[: len(blob) // 2]
    else:  # a valid frame of other content
        bad = store.backend.get(chunk_key(store.chunk_map(store.resolve("img:v1"))[1][1]))
    store.backend.put(key, bad)
    report = verify_store(store)
    assert not report.ok and report.corrupt_chunks == [digest]
    out = tmp_path / "out.img"
    with pytest.raises(CorruptObject, match=digest):
        export_image(store, "img:v1", out)
    assert not out.exists() and not any(p.name.startswith(".out.img") for p in tmp_path.iterdir())
    # repair: the same bytes put back make everything whole again
    store.backend.put(key, blob)
    assert verify_store(store).ok
    export_image(store, "img:v1", out)
    assert out.read_bytes() == (tmp_path / "a.img").read_bytes()


def test_missing_chunk_reported_with_manifest(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "rr", seed=4)
    res = import_image(store, tmp_path / "a.img", "img:v1")
    digest = _first_digest(store, "img:v1")
    store.backend.delete(chunk_key(digest))
    report = verify_store(store)
    assert report.missing_chunks == [(digest, res.manifest_id)]
    with pytest.raises(MissingChunk, match=digest):
        export_image(store, "img:v1", tmp_path / "out.img")


def test_dangling_ref_and_corrupt_manifest_reported(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "r")
    res = import_image(store, tmp_path / "a.img", "img:v1")
    store.backend.put(f"manifests/{res.manifest_id}", b'{"v":1}')
    store.forget_layer(res.manifest_id)
    report = verify_store(store)
    assert not report.ok
    assert any(res.manifest_id in m for m in report.bad_manifests)
    assert any("img:v1" in m for m in report.bad_refs)
    with pytest.raises(CorruptObject):
        export_image(store, "img:v1", tmp_path / "out.img")
