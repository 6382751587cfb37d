"""layerstore/squash.py: a squashed stack reads back exactly as the stack
did, writes only a manifest, and keeps a lineage shallow however often it
is sealed."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from layerstore.chunk import encode_chunk
from layerstore.digest import digest_bytes
from layerstore.manifest import Layer, flatten
from layerstore.squash import depth, squash
from layerstore.store import Store, open_store

CHUNK = 64 * 1024


def put_chunk(store: Store, data: bytes) -> str:
    digest = digest_bytes(data)
    store.put_chunk_object(digest, encode_chunk(data))
    return digest


def build(store: Store, stacks: list[dict[int, int | None]], size_chunks: int) -> str:
    """Publish layers bottom first: index -> a byte value to fill the chunk with, or None (whiteout)."""
    parent = None
    for spec in stacks:
        chunks = {i: None if v is None else put_chunk(store, bytes([v]) * CHUNK) for i, v in spec.items()
                  if v is not None or parent is not None}  # a whiteout needs a layer below
        parent = store.put_layer(Layer(size=size_chunks * CHUNK, chunk_size=CHUNK, chunks=chunks, parent=parent))
    assert parent is not None
    return parent


layer_spec = st.dictionaries(st.integers(0, 11), st.one_of(st.none(), st.integers(1, 255)), max_size=6)


@settings(max_examples=40, deadline=None)
@given(stacks=st.lists(layer_spec, min_size=1, max_size=8))
def test_a_squashed_stack_resolves_as_the_stack_did(tmp_path_factory, stacks) -> None:  # noqa: ANN001
    with open_store(str(tmp_path_factory.mktemp("s"))) as store:
        top = build(store, stacks, 12)
        before_chunks = {k for k, _s, _ in store.backend.list("chunks/")}
        flat = squash(store, top, annotations={"sandbox": "sb1"})
        assert store.chunk_map(flat)[1] == store.chunk_map(top)[1]
        assert depth(store, flat) == 1
        assert {k for k, _s, _ in store.backend.list("chunks/")} == before_chunks  # only a manifest written
        if len(stacks) > 1:
            layer = store.get_layer(flat)
            assert layer.parent is None and layer.annotations["squashed"] == str(len(stacks))
            assert layer.annotations["sandbox"] == "sb1"
        else:
            assert flat == top


def test_a_lineage_sealed_a_thousand_times_stays_shallow(tmp_path: Path) -> None:
    """1,000 seals (one dirty chunk each) squashed past depth 32: every
    layer stays readable, never near MAX_STACK_DEPTH, and the last reads
    back every write."""
    rng = random.Random(7)
    expected: dict[int, str] = {}
    with open_store(str(tmp_path / "s")) as store:
        top = store.put_layer(Layer(size=64 * CHUNK, chunk_size=CHUNK, chunks={}))
        deepest = 0
        for n in range(1000):
            i = rng.randrange(64)
            expected[i] = put_chunk(store, n.to_bytes(4, "big") * (CHUNK // 4))
            top = store.put_layer(Layer(size=64 * CHUNK, chunk_size=CHUNK, chunks={i: expected[i]}, parent=top))
            if depth(store, top) > 32:
                top = squash(store, top)
            deepest = max(deepest, depth(store, top))
        assert deepest <= 33
        assert flatten(store.stack(top)) == expected
