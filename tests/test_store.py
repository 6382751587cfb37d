"""layerstore/store.py: what the API asks of a store beyond reading images
(the rest is covered by the modules that build on it: test_manifest,
test_snapshot, test_layering, test_gc, test_refs...)."""

from __future__ import annotations

import pytest

from layerstore.chunk import decode_chunk
from layerstore.digest import digest_bytes
from layerstore.errors import NotFound
from layerstore.store import Store


def test_a_chunk_object_is_served_as_stored_and_only_from_the_store_itself(store: Store) -> None:
    data = b"strata chunk " * 1000
    digest = digest_bytes(data)
    store.write_chunk(digest, data)
    assert decode_chunk(digest, store.chunk_object(digest)) == data
    for unknown in (digest_bytes(b"absent"), "../../etc/passwd", "A" * 64, ""):
        with pytest.raises(NotFound):
            store.chunk_object(unknown)


def test_an_image_without_an_oci_config_has_an_empty_runtime(store: Store) -> None:
    from layerstore.manifest import Layer

    block = b"x" * (64 << 10)
    ids = [digest_bytes(block)]
    store.write_chunk(ids[0], block)
    manifest_id = store.put_layer(Layer(size=len(block), chunk_size=len(block), chunks={0: ids[0]}))
    store.set_ref("disk:v1", manifest_id)
    runtime = store.runtime("disk:v1")
    assert (runtime.env, runtime.cwd, runtime.user) == ({}, "", "")
    with pytest.raises(NotFound):
        store.runtime("absent:v1")
