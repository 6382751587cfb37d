"""Packs (layerstore/pack.py): chunks stored as the pages they change, in
one object, named by the layer manifest. The format round-trips and refuses
anything that does not rebuild to the chunk's digest; every part that needs
a layer's objects (publication, reads, export, GC, push, verify, squash, a
restore's completeness check) sees the pack and the base."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from layerstore import gc
from layerstore.chunk import encode_chunk
from layerstore.digest import digest_bytes
from layerstore.errors import CorruptObject, MissingChunk
from layerstore.exporter import export_image
from layerstore.manifest import Layer, Packed, canonical_json, parse_manifest
from layerstore.pack import (PAGE, PackWriter, changed_pages, decode_entries, decode_entry, encode_entries, encode_entry,
                             pack_key)
from layerstore.squash import squash
from layerstore.store import Store, inspect_image
from layerstore.transfer import copy
from layerstore.verify import verify_store
from tests.test_transfer import keys, local_store

MIB = 1 << 20
HOUR = 3600.0


def changed(base: bytes, pages: list[int], seed: int) -> bytes:
    out = bytearray(base)
    for page in pages:
        out[page * PAGE:(page + 1) * PAGE] = os.urandom(PAGE) if seed else bytes(PAGE)
    return bytes(out)


def test_an_entry_holds_only_the_changed_pages_and_rebuilds_exactly() -> None:
    base = os.urandom(MIB)
    data = changed(base, [0, 7, 255], seed=1)
    entry = encode_entry(data, base)
    assert changed_pages(data, base) == [0, 7, 255]
    assert len(entry) < 4 * PAGE  # three random pages and a bitmap, not a MiB
    assert decode_entry(digest_bytes(data), entry, base) == data
    # over zeros (a RAM chunk first written), and a chunk's short last page
    sparse = changed(bytes(MIB - 100), [3], seed=1)
    assert changed_pages(sparse, None) == [3]
    assert decode_entry(digest_bytes(sparse), encode_entry(sparse, None), None) == sparse
    tail = bytes(PAGE) + b"x" * 100
    assert decode_entry(digest_bytes(tail), encode_entry(tail, None), None) == tail
    # runs of pages (each laid over the base in one copy), and every page present
    runs = changed(base, [0, 1, 2, 9, 10, 254, 255], seed=1)
    assert decode_entry(digest_bytes(runs), encode_entry(runs, base), base) == runs
    full = os.urandom(MIB - 100)
    for over in (None, os.urandom(MIB - 100)):
        assert decode_entry(digest_bytes(full), encode_entry(full, over), over) == full


def test_an_entry_that_does_not_rebuild_to_its_digest_is_refused() -> None:
    base = os.urandom(MIB)
    data = changed(base, [5], seed=1)
    digest, entry = digest_bytes(data), encode_entry(data, base)
    with pytest.raises(CorruptObject, match="hashes to"):
        decode_entry(digest, entry, os.urandom(MIB))  # the wrong base
    with pytest.raises(CorruptObject, match="does not fit its base"):
        decode_entry(digest, entry, base[:-PAGE])
    with pytest.raises(CorruptObject, match="not a valid zstd frame"):
        decode_entry(digest, entry[:-3], base)
    with pytest.raises(CorruptObject):
        decode_entry(digest, encode_chunk(b"\x00" * 4 + b"\xff" * 32 + b"short"), base)  # bitmap says more pages
    one_page = (MIB).to_bytes(4, "little") + b"\x01" + bytes(31)
    for body in (one_page + bytes(PAGE - 1), one_page + bytes(PAGE + 1)):  # a byte short, a byte over
        with pytest.raises(CorruptObject, match="more or less than its bitmap says"):
            decode_entry(digest, encode_chunk(body), base)
    with pytest.raises(CorruptObject, match="hashes to"):
        decode_entry(digest_bytes(base), entry, base)  # someone else's digest


def test_entries_stored_together_come_back_by_digest_and_a_malformed_object_is_refused() -> None:
    """A working set's packed chunks stored again whole (store.py,
    `prefetch-chunks/`): one object, an index, entries over no base."""
    chunks = [changed(bytes(MIB), [1, 9], seed=1), os.urandom(MIB)]
    entries = {digest_bytes(c): encode_entry(c, None) for c in chunks}
    blob = encode_entries(entries)
    assert decode_entries(blob) == entries
    assert [decode_entry(d, e, None) for d, e in decode_entries(blob).items()] == chunks
    assert decode_entries(encode_entries({})) == {}
    head = json.dumps({digest_bytes(chunks[0]): [0, len(blob)]}).encode()
    for bad in (b"", blob[:2], blob[:-1],  # torn: the last entry runs past the end
                len(head).to_bytes(4, "little") + head + b"short",  # an entry past the end
                (5).to_bytes(4, "little") + b"[1,2]",  # not an index
                (11).to_bytes(4, "little") + b'{"x":[0,1]}',  # not a digest
                len(blob).to_bytes(4, "little") + blob):  # an index that is not JSON
        with pytest.raises(CorruptObject, match="working-set entries"):
            decode_entries(bad)


def test_a_manifest_names_packed_chunks_and_refuses_malformed_entries() -> None:
    d, b, p = digest_bytes(b"d"), digest_bytes(b"b"), digest_bytes(b"p")
    plain = Layer(size=4 * MIB, chunk_size=MIB, chunks={0: d, 1: b})
    layer = Layer(size=4 * MIB, chunk_size=MIB, chunks={0: d, 1: b}, packed={0: Packed(b, p, 10, 20)})
    assert b"packed" not in plain.encode()  # layers without packs keep their encoding (and ids)
    again = parse_manifest(layer.manifest_id(), layer.encode())
    assert again.packed == {0: Packed(b, p, 10, 20)} and again.needs() == ({b}, {p})
    assert plain.needs() == ({d, b}, set())
    bad = [
        {3: Packed(b, p, 0, 1)},  # no chunk at 3
        {0: Packed("zz", p, 0, 1)},
        {0: Packed(b, "zz", 0, 1)},
        {0: Packed(b, p, -1, 1)},
        {0: Packed(b, p, 0, 1 << 40)},
    ]
    for packed in bad:
        with pytest.raises(Exception, match="packed entry"):
            Layer(size=4 * MIB, chunk_size=MIB, chunks={0: d, 1: b}, packed=packed).encode()
    for entries in ([[2, b, p, 0, 1]], [[0, b, p, 0]], [[0, b, p, 0, 1], [0, b, p, 0, 1]], [], {}):
        body = json.loads(layer.encode())
        body["packed"] = entries
        blob = canonical_json(body)
        with pytest.raises(CorruptObject, match="malformed"):
            parse_manifest(digest_bytes(blob), blob)


def packed_image(store: Store, ref: str) -> tuple[bytes, str, str]:
    """An image of 3 chunks over a base image: chunk 0 packed over its base,
    chunk 2 packed over zeros (a hole below), chunk 1 the base's. Returns
    (content, base chunk digest, pack id)."""
    base0, base1 = os.urandom(MIB), os.urandom(MIB)
    for data in (base0, base1):
        store.write_chunk(digest_bytes(data), data)
    below = Layer(size=3 * MIB, chunk_size=MIB, chunks={0: digest_bytes(base0), 1: digest_bytes(base1)})
    below_id = store.put_layer(below)
    new0, new2 = changed(base0, [1, 200], seed=1), changed(bytes(MIB), [9], seed=1)
    writer = PackWriter()
    at0, at2 = writer.add(new0, base0), writer.add(new2, None)
    pack = store.put_pack(writer)
    top = Layer(size=3 * MIB, chunk_size=MIB, chunks={0: digest_bytes(new0), 2: digest_bytes(new2)}, parent=below_id,
                packed={0: Packed(digest_bytes(base0), pack, *at0), 2: Packed(None, pack, *at2)})
    store.set_ref(ref, store.put_layer(top))
    return new0 + base1 + new2, digest_bytes(base0), pack


def test_a_packed_layer_is_published_read_and_exported_like_any(store: Store, tmp_path: Path) -> None:
    content, base, pack = packed_image(store, "packed:v1")
    manifest = store.resolve("packed:v1")
    packed = store.packed_map(manifest)
    digest0 = store.chunk_map(manifest)[1][0]
    assert store.read_chunk(digest0, packed[digest0]) == content[:MIB]
    with pytest.raises(MissingChunk):
        store.read_chunk(digest0)  # not an object of its own
    chunks, packs = store.read_needs(manifest)
    assert base in chunks and digest0 not in chunks and packs == {pack}
    export_image(store, "packed:v1", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == content
    info = inspect_image(store, "packed:v1")
    assert info.missing_chunks == 0 and info.stored_bytes > 0
    assert verify_store(store).ok
    # a manifest whose pack is not stored is refused
    lost = Layer(size=MIB, chunk_size=MIB, chunks={0: digest0}, packed={0: Packed(base, digest_bytes(b"gone"), 0, 9)})
    with pytest.raises(MissingChunk, match="pack"):
        store.put_layer(lost)


def test_a_corrupt_or_missing_pack_is_found_by_verify_and_never_served(tmp_path: Path) -> None:
    store = local_store(tmp_path / "s")
    content, _base, pack = packed_image(store, "packed:v1")
    manifest = store.resolve("packed:v1")
    digest0 = store.chunk_map(manifest)[1][0]
    path = tmp_path / "s" / "objects" / "objects" / pack_key(pack)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptObject):
        store.read_chunk(digest0, store.packed_map(manifest)[digest0])
    report = verify_store(store)
    assert not report.ok and any(pack in e for e in report.errors)
    path.unlink()
    store.packs.pop(pack)  # as another process would find it: verify read it (for the sound entry) last
    report = verify_store(store)
    assert any(f"pack {pack}" in e and "missing" in e for e in report.errors)
    with pytest.raises(MissingChunk, match="pack"):
        store.read_chunk(digest0, store.packed_map(manifest)[digest0])


def test_gc_keeps_a_pack_and_its_base_while_a_layer_needs_them(store: Store, tmp_path: Path) -> None:
    content, base, pack = packed_image(store, "packed:v1")
    later = time.time() + 2 * HOUR
    for step in range(3):
        gc.collect(store, grace=HOUR, now=later + step * 2 * HOUR)
    assert pack_key(pack) in keys(store, "packs/") and f"chunks/{base[:2]}/{base}" in keys(store, "chunks/")
    export_image(store, "packed:v1", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == content
    store.delete_ref("packed:v1")
    for step in range(3, 6):
        gc.collect(store, grace=HOUR, now=later + step * 2 * HOUR)
    assert keys(store, "packs/") == set() and keys(store, "chunks/") == set()


def test_a_push_copies_packs_and_bases_and_squash_keeps_entries(tmp_path: Path) -> None:
    src, dst = local_store(tmp_path / "src"), local_store(tmp_path / "dst")
    content, _base, pack = packed_image(src, "packed:v1")
    result = copy(src, dst, "packed:v1")
    assert result.chunks_sent == 2  # the two whole chunks: the base of chunk 0 and chunk 1
    assert keys(dst, "packs/") == {pack_key(pack)}
    export_image(dst, "packed:v1", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == content
    assert verify_store(dst).ok
    # a manifests-only pull still copies the packs (they are read only from the store itself)
    lazy = local_store(tmp_path / "lazy", remote=src.backend)
    copy(src, lazy, "packed:v1", chunks=False)
    assert keys(lazy, "packs/") == {pack_key(pack)} and keys(lazy, "chunks/") == set()
    export_image(lazy, "packed:v1", tmp_path / "lazy.img")
    assert (tmp_path / "lazy.img").read_bytes() == content
    flat = squash(src, src.resolve("packed:v1"))
    assert src.get_layer(flat).parent is None and set(src.get_layer(flat).packed) == {0, 2}
    src.set_ref("flat:v1", flat)
    export_image(src, "flat:v1", tmp_path / "flat.img")
    assert (tmp_path / "flat.img").read_bytes() == content
