"""Layer manifests: what a layer holds, in a canonical, hashable encoding.

A layer is a sparse map from chunk index to chunk digest over a byte range of
`size` bytes cut into `chunk_size` pieces, plus an optional parent layer. A
layer holds only the chunks that differ from its parent; reading resolves
top-down through the stack (top layer first, then its parent, ...), and an
index that no layer maps is a hole (zeros). A `null` digest is a *whiteout*:
an explicit hole in this layer that hides the parent's chunk at that index.

Stored at `manifests/<id>` as canonical JSON (sorted keys, no spaces, UTF-8):

    {
      "annotations": {"source": "disk.img"},     optional, str -> str
      "chunk_size": 1048576,                     power of two, 64 KiB .. 16 MiB
      "chunks": [[0, "af13..."], [7, null], ...] ascending unique indices
      "kind": "layer",
      "packed": [[0, "b7c1..." | null, "5e0d...", 0, 9120], ...]
                                                 optional: chunks stored in a pack
      "parent": "9c2e..." | null,                manifest id of the layer below
      "size": 68719476736,                       logical bytes
      "v": 1
    }

A `packed` entry `[index, base, pack, offset, length]` says chunk `index`
(whose digest `chunks` still names) is not an object of its own: it is
rebuilt from bytes [offset, offset+length) of `packs/<pack>` laid over the
whole chunk `base` (zeros if null), then checked against its digest
(layerstore/pack.py). Everything that needs a layer's objects (GC, push,
verify, a restore's completeness check) asks `Layer.needs()`.

The manifest id is the blake3-256 of exactly those bytes, so two imports of
the same content produce the same id, and a fetched manifest is verified by
re-hashing it. `parse_manifest` rejects anything else with a message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from .chunk import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from .pack import MAX_ENTRY
from .digest import check_digest, digest_bytes, is_digest
from .errors import CorruptObject, InvalidInput

FORMAT_VERSION = 1
MAX_SIZE = 1 << 50  # 1 PiB: far above any disk image, small enough to catch garbage
MAX_STACK_DEPTH = 256


def canonical_json(body: Mapping[str, object]) -> bytes:
    """The one encoding every manifest kind is hashed in: sorted keys, no spaces, UTF-8."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def check_hashes_to(what: str, object_id: str, blob: bytes) -> None:
    """Refuse stored manifest bytes that are not exactly what `object_id` names."""
    check_digest(object_id, what=f"{what} id")
    actual = digest_bytes(blob)
    if actual != object_id:
        raise CorruptObject(f"{what} {object_id}: content hashes to {actual} (corrupt object)")


def check_annotations(annotations: Mapping[str, str]) -> None:
    for key, value in annotations.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidInput("annotations must map strings to strings")


def check_chunk_size(chunk_size: int) -> int:
    """Return `chunk_size` if it is a power of two in [64 KiB, 16 MiB]."""
    if (
        not isinstance(chunk_size, int)
        or isinstance(chunk_size, bool)
        or chunk_size < MIN_CHUNK_SIZE
        or chunk_size > MAX_CHUNK_SIZE
        or chunk_size & (chunk_size - 1)
    ):
        raise InvalidInput(f"chunk size {chunk_size!r} must be a power of two from 64 KiB to 16 MiB")
    return chunk_size


MANIFEST_PREFIX = "manifests/"


def manifest_key(manifest_id: str) -> str:
    """The object key of the manifest with this id (validated)."""
    check_digest(manifest_id, what="manifest id")
    return f"{MANIFEST_PREFIX}{manifest_id}"


class Packed(NamedTuple):
    """Where a packed chunk is: its base chunk (None: zeros) and its entry in a pack."""

    base: str | None
    pack: str
    offset: int
    length: int


@dataclass(frozen=True)
class Layer:
    """One layer manifest. `chunks` maps index -> digest, or None for a
    whiteout; `packed` says which of those chunks live in packs, and where."""

    size: int
    chunk_size: int
    chunks: Mapping[int, str | None]
    parent: str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)
    packed: Mapping[int, Packed] = field(default_factory=dict)

    def needs(self) -> tuple[set[str], set[str]]:
        """The chunk objects and the packs this layer (not its parents) reads from."""
        chunks = {d for i, d in self.chunks.items() if d is not None and i not in self.packed}
        chunks |= {p.base for p in self.packed.values() if p.base is not None}
        return chunks, {p.pack for p in self.packed.values()}

    @property
    def chunk_count(self) -> int:
        """Number of chunk slots covering `size` bytes."""
        return -(-self.size // self.chunk_size)

    def encode(self) -> bytes:
        """Canonical bytes of this manifest (validates first)."""
        _validate(self)
        body: dict[str, object] = {
            "chunk_size": self.chunk_size,
            "chunks": [[i, self.chunks[i]] for i in sorted(self.chunks)],
            "kind": "layer",
            "parent": self.parent,
            "size": self.size,
            "v": FORMAT_VERSION,
        }
        if self.annotations:
            body["annotations"] = dict(self.annotations)
        if self.packed:
            body["packed"] = [[i, *self.packed[i]] for i in sorted(self.packed)]
        return canonical_json(body)

    def manifest_id(self) -> str:
        """blake3 of the canonical encoding."""
        return digest_bytes(self.encode())


def _validate(layer: Layer) -> None:
    if not isinstance(layer.size, int) or isinstance(layer.size, bool) or not 0 <= layer.size <= MAX_SIZE:
        raise InvalidInput(f"layer size {layer.size!r} out of range")
    check_chunk_size(layer.chunk_size)
    if layer.parent is not None:
        check_digest(layer.parent, what="parent manifest id")
    count = layer.chunk_count
    for index, digest in layer.chunks.items():
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise InvalidInput(f"chunk index {index!r} outside a layer of {count} chunks")
        if digest is not None and not is_digest(digest):
            raise InvalidInput(f"chunk {index}: malformed digest {str(digest)[:80]!r}")
        if digest is None and layer.parent is None:
            raise InvalidInput(f"chunk {index}: whiteout in a layer without a parent")
    for index, where in layer.packed.items():
        _check_packed(layer, index, where)
    check_annotations(layer.annotations)


def _check_packed(layer: Layer, index: int, where: Packed) -> None:
    if not isinstance(index, int) or layer.chunks.get(index) is None:
        raise InvalidInput(f"packed entry {index!r} names no chunk of the layer")
    if not isinstance(where, Packed):
        raise InvalidInput(f"packed entry {index}: not a [base, pack, offset, length] entry")
    if where.base is not None and not is_digest(where.base):
        raise InvalidInput(f"packed entry {index}: malformed base digest {str(where.base)[:80]!r}")
    if not is_digest(where.pack):
        raise InvalidInput(f"packed entry {index}: malformed pack id {str(where.pack)[:80]!r}")
    for name, value, top in (("offset", where.offset, MAX_SIZE), ("length", where.length, MAX_ENTRY)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
            raise InvalidInput(f"packed entry {index}: {name} {value!r} out of range")


def parse_manifest(manifest_id: str, blob: bytes) -> Layer:
    """Verify `blob` hashes to `manifest_id` and decode it, or raise CorruptObject."""
    check_hashes_to("manifest", manifest_id, blob)
    try:
        body = json.loads(blob)
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        if body.get("v") != FORMAT_VERSION:
            raise ValueError(f"unsupported format version {body.get('v')!r}")
        if body.get("kind") != "layer":
            raise ValueError(f"unknown manifest kind {body.get('kind')!r}")
        extra = set(body) - {"v", "kind", "size", "chunk_size", "parent", "chunks", "annotations", "packed"}
        if extra:
            raise ValueError(f"unknown fields {sorted(extra)}")
        entries = body["chunks"]
        if not isinstance(entries, list):
            raise ValueError("chunks is not a list")
        chunks: dict[int, str | None] = {}
        previous = -1
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 2:
                raise ValueError("chunk entry is not an [index, digest] pair")
            index, digest = entry
            if not isinstance(index, int) or index <= previous:
                raise ValueError("chunk indices are not ascending integers")
            previous = index
            chunks[index] = digest
        layer = Layer(
            size=body["size"],
            chunk_size=body["chunk_size"],
            chunks=chunks,
            parent=body["parent"],
            annotations=body.get("annotations", {}),
            packed=_parse_packed(body["packed"]) if "packed" in body else {},
        )
        _validate(layer)
    except (ValueError, KeyError, TypeError, InvalidInput) as exc:
        raise CorruptObject(f"manifest {manifest_id}: malformed ({exc})") from None
    return layer


def _parse_packed(entries: object) -> dict[int, Packed]:
    if not isinstance(entries, list) or not entries:
        raise ValueError("packed is not a non-empty list")
    packed: dict[int, Packed] = {}
    previous = -1
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 5:
            raise ValueError("packed entry is not [index, base, pack, offset, length]")
        index = entry[0]
        if not isinstance(index, int) or index <= previous:
            raise ValueError("packed indices are not ascending integers")
        previous = index
        packed[index] = Packed(*entry[1:])
    return packed


def flatten_packed(stack: list[Layer]) -> dict[str, Packed]:
    """Where the packed chunks of a stack (top first) are, by digest: any
    layer's entry for a digest rebuilds it (a live top keeps every layer
    below it, and what each needs, from GC)."""
    where: dict[str, Packed] = {}
    for layer in reversed(stack):
        for index, digest in layer.chunks.items():
            if digest is not None and index in layer.packed:
                where[digest] = layer.packed[index]
    return where


def flatten(stack: list[Layer]) -> dict[int, str]:
    """Resolve a layer stack (top first) into index -> digest; holes omitted.

    The top layer's size and chunk size are the stack's; every layer below
    must share the chunk size, and indices past the top's size are dropped.
    """
    if not stack:
        return {}
    top = stack[0]
    count = top.chunk_count
    resolved: dict[int, str | None] = {}
    for layer in reversed(stack):
        if layer.chunk_size != top.chunk_size:
            raise CorruptObject(
                f"layer stack mixes chunk sizes {layer.chunk_size} and {top.chunk_size}"
            )
        resolved.update(layer.chunks)
    return {i: d for i, d in resolved.items() if d is not None and i < count}
