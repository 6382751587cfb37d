"""Layer manifests: canonical encoding, validation, stack resolution."""

from __future__ import annotations

import json

import pytest

from layerstore.digest import digest_bytes
from layerstore.errors import CorruptObject, InvalidInput
from layerstore.manifest import Layer, check_chunk_size, flatten, parse_manifest

D1, D2, D3 = "11" * 32, "22" * 32, "33" * 32
MiB = 1 << 20


def test_encoding_is_canonical_and_id_is_its_hash() -> None:
    a = Layer(size=5 * MiB, chunk_size=MiB, chunks={3: D2, 0: D1})
    b = Layer(size=5 * MiB, chunk_size=MiB, chunks={0: D1, 3: D2})
    assert a.encode() == b.encode()
    assert a.manifest_id() == digest_bytes(a.encode())
    assert b" " not in a.encode()
    parsed = parse_manifest(a.manifest_id(), a.encode())
    assert dict(parsed.chunks) == {0: D1, 3: D2} and parsed.size == 5 * MiB and parsed.parent is None


def test_roundtrip_with_parent_whiteout_annotations() -> None:
    layer = Layer(size=3 * MiB + 7, chunk_size=MiB, chunks={1: None, 3: D3}, parent=D1, annotations={"source": "x.img"})
    parsed = parse_manifest(layer.manifest_id(), layer.encode())
    assert parsed == layer or (dict(parsed.chunks) == {1: None, 3: D3} and parsed.annotations == {"source": "x.img"})
    assert parsed.chunk_count == 4


@pytest.mark.parametrize("size", [64 * 1024, MiB, MiB * 16])
def test_valid_chunk_sizes(size: int) -> None:
    assert check_chunk_size(size) == size


@pytest.mark.parametrize("size", [0, 1000, 32 * 1024, 3 * MiB, 32 * MiB, -MiB, True])
def test_invalid_chunk_sizes(size: int) -> None:
    with pytest.raises(InvalidInput):
        check_chunk_size(size)


@pytest.mark.parametrize(
    "layer",
    [
        Layer(size=MiB, chunk_size=MiB, chunks={1: D1}),  # index past the end
        Layer(size=MiB, chunk_size=MiB, chunks={-1: D1}),
        Layer(size=MiB, chunk_size=MiB, chunks={0: "zz"}),
        Layer(size=MiB, chunk_size=MiB, chunks={0: None}),  # whiteout without parent
        Layer(size=-1, chunk_size=MiB, chunks={}),
        Layer(size=MiB, chunk_size=MiB, chunks={}, parent="nope"),
    ],
)
def test_invalid_layers_do_not_encode(layer: Layer) -> None:
    with pytest.raises(InvalidInput):
        layer.encode()


def _raw(body: dict) -> tuple[str, bytes]:
    blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return digest_bytes(blob), blob


GOOD = {"v": 1, "kind": "layer", "size": 2 * MiB, "chunk_size": MiB, "parent": None, "chunks": [[0, D1]]}


@pytest.mark.parametrize(
    "change",
    [
        {"v": 2},
        {"kind": "snapshot"},
        {"chunks": [[1, D1], [0, D2]]},
        {"chunks": [[0, D1], [0, D2]]},
        {"chunks": [[0]]},
        {"chunks": "nope"},
        {"chunks": [[5, D1]]},
        {"size": "big"},
        {"chunk_size": 1000},
        {"extra": 1},
        {"parent": "../x"},
    ],
)
def test_malformed_manifests_are_refused(change: dict) -> None:
    manifest_id, blob = _raw({**GOOD, **change})
    with pytest.raises(CorruptObject, match=manifest_id):
        parse_manifest(manifest_id, blob)


def test_manifest_not_matching_its_id_is_refused() -> None:
    manifest_id, blob = _raw(GOOD)
    with pytest.raises(CorruptObject, match="hashes to"):
        parse_manifest(manifest_id, blob.replace(b"1048576", b"1048577"))
    with pytest.raises(CorruptObject):
        parse_manifest(digest_bytes(b"not json"), b"not json")


def test_flatten_resolves_top_down_with_whiteouts_and_shrink() -> None:
    base = Layer(size=4 * MiB, chunk_size=MiB, chunks={0: D1, 1: D1, 3: D3})
    top = Layer(size=3 * MiB, chunk_size=MiB, chunks={1: None, 2: D2}, parent="aa" * 32)
    assert flatten([top, base]) == {0: D1, 2: D2}
    assert flatten([base]) == {0: D1, 1: D1, 3: D3}


def test_flatten_rejects_mixed_chunk_sizes() -> None:
    base = Layer(size=4 * MiB, chunk_size=2 * MiB, chunks={0: D1})
    top = Layer(size=4 * MiB, chunk_size=MiB, chunks={}, parent="aa" * 32)
    with pytest.raises(CorruptObject):
        flatten([top, base])
