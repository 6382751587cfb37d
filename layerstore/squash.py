"""Squash: one layer equal to a whole stack, so a lineage never grows without bound.

A sandbox's disk and RAM are layer stacks: the image's layers, then one
layer per seal (every pause and snapshot adds one). Reads resolve top-down,
so depth costs lookups and manifests, and stacks deeper than
MAX_STACK_DEPTH are refused as corrupt. A sandbox paused a thousand times
would break; so when a stack passes a depth, its top is replaced by a
squashed layer:

    stack (top first)              squashed
    L9 {3: c9}                     S {0: c1, 1: c7, 3: c9, 5: c5}
    L8 {1: c7, 2: null}              parent: null
    ...                              annotations: {"squashed": "10", ...}
    L0 {0: c1, 1: c2, 2: c3}

It maps every index the stack resolves (whiteouts and holes stay holes),
names chunks already stored (nothing is read, copied or recompressed: only
a manifest is written; a packed chunk keeps its pack entry), and reads back
byte for byte as the stack did. The
old layers stay while anything names them; GC reclaims what only they held.
"""

from __future__ import annotations

from collections.abc import Mapping

from .manifest import Layer, flatten, flatten_packed
from .store import Store


def depth(store: Store, manifest_id: str) -> int:
    """How many layers the stack topped by `manifest_id` has."""
    return len(store.stack(manifest_id))


def squash(store: Store, manifest_id: str, *, annotations: Mapping[str, str] | None = None) -> str:
    """Publish one parentless layer equal to the stack topped by
    `manifest_id` and return its id (`manifest_id` itself if it has no
    parent). Chunks the store reads through from elsewhere (a lazy pull)
    may stay there; a chunk found nowhere is MissingChunk and nothing is
    published."""
    layers = store.stack(manifest_id)
    if len(layers) == 1:
        return manifest_id
    top = layers[0]
    chunks, where = flatten(layers), flatten_packed(layers)
    squashed = Layer(size=top.size, chunk_size=top.chunk_size, chunks=chunks, parent=None,
                     annotations={**top.annotations, **(annotations or {}), "squashed": str(len(layers))},
                     packed={i: where[d] for i, d in chunks.items() if d in where})
    return store.put_layer(squashed, read_through=True)
