"""The store: chunks, manifests and refs over one backend, plus the catalog.

`Store` is the only place that knows the key layout and the publication
order that keeps readers safe:

    chunks/<aa>/<digest>    zstd frame of a chunk (layerstore/chunk.py)
    packs/<id>              chunks stored as the pages they change (layerstore/pack.py)
    manifests/<id>          canonical layer manifest (layerstore/manifest.py)
    snapshots/<id>          canonical snapshot manifest (layerstore/snapshot.py)
    refs/<name>/<tag>       {"manifest": id, ...} (layerstore/refs.py)
    templates/<name>        template (layerstore/templates.py; a tagged name
    template-tags/<name>/<tag>   under template-tags/)
    prefetch/<manifest id>  JSON list of chunk indices a sandbox reads first
    prefetch-chunks/<manifest id>  the packed ones among them, whole (layerstore/pack.py)

1. chunks and packs are put (durable when `put` returns);
2. a manifest is put only after the backend confirms every chunk and pack it
   needs, and its parent manifest, exist in this store (a manifests-only pull
   alone accepts chunks its read path can serve, see `put_layer`);
3. a ref is put only after its manifest exists.

So a reader that follows a ref never meets a dangling reference, and a crash
at any point leaves at worst unreferenced chunks, which GC reclaims.

`open_store` turns a store spec (a path or `s3://BUCKET/PREFIX`) and explicit
settings into a `Store`: its own backend, and the read path it assembles from
backend wrappers (layerstore/backend.py, readthrough.py, peers.py):

    Store.backend = RetryingBackend(LocalDirBackend | S3Backend)      own objects

    Store.read_chunk(d), Store.missing_chunks
      -> Store.read_path = ReadThroughBackend    counts sources; verifies what fallbacks send
           primary:  Store.backend                                    "local"
           fallback: Peer(url) ... one per peer, best effort,
                     cooling down on failure                          "peer"
           fallback: RetryingBackend(remote store)                    "remote"
      -> decode_chunk: zstd + blake3 against d (MissingChunk / CorruptObject)

Only chunk reads take the read path. Everything else (puts, lists, deletes,
existence checks, manifests, refs, and the chunk objects a node serves its
peers or pushes) is `Store.backend`, this store's own objects, so its leases,
GC and publication checks speak about one store and peers never relay.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from .backend import Backend, RetryingBackend
from .catalog import Catalog
from .chunk import CHUNK_PREFIX, DEFAULT_LEVEL, MAX_CHUNK_SIZE, chunk_key, decode_chunk, encode_chunk
from .digest import check_digest, digest_bytes
from .errors import CorruptObject, InvalidInput, MissingChunk, NotFound
from .localdir import LocalDirBackend
from .manifest import MAX_STACK_DEPTH, Layer, Packed, flatten, flatten_packed, manifest_key, parse_manifest
from .lru import Lru
from .oci import Runtime, runtime_of
from .pack import PackWriter, decode_entries, decode_entry, encode_entries, pack_key
from .readthrough import Fallback, ReadThroughBackend
from .refs import REF_PREFIX, Ref, decode_ref_owner, decode_ref_target, encode_ref_target, parse_ref, ref_from_key
from .snapshot import SNAPSHOT_PREFIX, Snapshot, is_snapshot_key, parse_snapshot, snapshot_key
from .templates import (TAGGED_TEMPLATE_PREFIX, TEMPLATE_PREFIX, Template, name_of_key, parse_template,
                        template_key)

if TYPE_CHECKING:
    from .config import NodeConfig

log = logging.getLogger("strata.store")

PREFETCH_PREFIX = "prefetch/"
SET_CHUNKS_PREFIX = "prefetch-chunks/"  # a working set's packed chunks, each over no base (pack.py)
PARTIAL_PREFIX = "partial/"  # a manifest published by a manifests-only pull: some chunks it names are elsewhere
PACK_CACHE = 64 << 20  # bytes of recently read packs a Store keeps
PARSED_ENTRIES = 1 << 18  # chunk entries of parsed manifests a Store keeps in memory


def _prefetch_key(manifest_id: str) -> str:
    check_digest(manifest_id, what="manifest id")
    return f"{PREFETCH_PREFIX}{manifest_id}"


def _set_chunks_key(manifest_id: str) -> str:
    check_digest(manifest_id, what="manifest id")
    return f"{SET_CHUNKS_PREFIX}{manifest_id}"


def _partial_key(manifest_id: str) -> str:
    check_digest(manifest_id, what="manifest id")
    return f"{PARTIAL_PREFIX}{manifest_id}"


def verify_chunk_object(key: str, blob: bytes) -> None:
    """Raise CorruptObject unless `blob` is the chunk object `key` names (read-through's check)."""
    decode_chunk(key.rsplit("/", 1)[-1], blob, max_size=MAX_CHUNK_SIZE)


def chunk_read_path(primary: Backend, fallbacks: Sequence[Fallback] = ()) -> ReadThroughBackend:
    """`primary` whose chunk reads fall back to `fallbacks` in order, each object verified."""
    return ReadThroughBackend(primary, fallbacks, prefix=CHUNK_PREFIX, verify=verify_chunk_object)


class Store:
    """Chunks, manifests and refs kept in a `Backend`, with a local `Catalog`.

    `backend` holds this store's own objects. `read_path` (default: the
    backend alone) is where chunks are read from: a ReadThroughBackend over
    `backend` whose fallbacks (peers, a remote store) serve what it lacks.
    Every chunk, whatever its source, is verified before it is returned;
    nothing is written back (caching is the mount's chunk cache's job).
    """

    def __init__(self, backend: Backend, catalog: Catalog, *, level: int = DEFAULT_LEVEL,
                 read_path: ReadThroughBackend | None = None) -> None:
        if read_path is not None and read_path.primary is not backend:
            raise ValueError("a store's read path must read its own backend first")
        self.backend = backend
        self.catalog = catalog
        self.level = level
        self.read_path = read_path or chunk_read_path(backend)
        self.packs: Lru[bytes] = Lru(PACK_CACHE, len)  # a restore reads most entries of a seal's pack
        self._parsed: Lru[Layer] = Lru(PARSED_ENTRIES, lambda layer: len(layer.chunks))  # stacks walked again

    def reap_tmp(self) -> int:
        """Remove temp files that writers which crashed left in a local store
        (older than a day, so a live writer's are never touched); S3 has
        none (a PUT is whole or absent). Returns how many were removed."""
        inner = getattr(self.backend, "inner", self.backend)
        return inner.reap_tmp() if isinstance(inner, LocalDirBackend) else 0

    @property
    def sources(self) -> collections.Counter[str]:
        """Where chunks read by this process came from: local, peer, remote; peer_rejected
        counts objects that failed verification (the mount daemon reports these)."""
        return self.read_path.counts

    def describe(self) -> str:
        return self.backend.describe()

    def describe_read_path(self) -> str:
        """Every store a chunk read may ask, in order."""
        return self.read_path.describe_path()

    def close(self) -> None:
        self.read_path.close()  # the backend and every fallback
        self.catalog.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # chunks -------------------------------------------------------------------
    def read_chunk(self, digest: str, via: Packed | None = None, *,
                   read_base: Callable[[str], bytes] | None = None) -> bytes:
        """Fetch, decompress and verify one chunk: its own object through the
        read path, or, `via` a layer's packed entry, rebuilt from its pack
        (this store's) and base (read by `read_base`, default this method:
        the mount passes its cached reader). Raises MissingChunk / CorruptObject.

        A pack is read whole: packs hold a seal's changed pages, not images."""
        if via is not None and via.base != digest:  # (an entry over itself: the chunk is whole)
            blob = self._pack(via.pack)
            if blob is not None:
                base = (read_base or self.read_chunk)(via.base) if via.base is not None else None
                try:
                    return decode_entry(digest, blob[via.offset:via.offset + via.length], base)
                except CorruptObject:
                    self.packs.pop(via.pack)  # read it again next time
                    raise
        try:
            blob = self.read_path.get(chunk_key(digest))
        except NotFound:
            packed = f" (or pack {via.pack})" if via is not None else ""
            raise MissingChunk(f"chunk {digest}{packed} is missing from {self.describe_read_path()}") from None
        return decode_chunk(digest, blob, max_size=MAX_CHUNK_SIZE)

    def chunk_object(self, digest: str) -> bytes:
        """A chunk's stored object (its zstd frame, unverified) from this
        store's own backend, never its fallbacks: what a peer asks for, and
        verifies itself. NotFound for a digest that is not one, or absent."""
        try:
            key = chunk_key(digest)
        except InvalidInput:
            raise NotFound(f"chunk {digest!r} not found") from None
        return self.backend.get(key)

    def _pack(self, pack_id: str) -> bytes | None:
        """A pack's bytes (recently read ones from memory), None if it is not stored."""
        blob = self.packs.get(pack_id)
        if blob is None:
            try:
                blob = self.backend.get(pack_key(pack_id))
            except NotFound:  # the same content may still be stored whole
                return None
            self.packs.put(pack_id, blob)
        return blob

    def put_pack(self, writer: PackWriter) -> str:
        """Store a built pack (durable on return); its id."""
        blob = writer.blob()
        pack_id = writer.pack_id()
        self.backend.put(pack_key(pack_id), blob)
        return pack_id

    def missing_packs(self, pack_ids: Iterable[str]) -> set[str]:
        """The packs among `pack_ids` this store lacks (packs are always a store's own)."""
        wanted = {pack_key(p): p for p in pack_ids}
        present = self.backend.has_many(wanted)
        return {p for k, p in wanted.items() if k not in present}

    def write_chunk(self, digest: str, data: bytes | memoryview, *, level: int | None = None) -> int:
        """Compress and store a chunk whose digest the caller computed; returns stored bytes."""
        blob = encode_chunk(data, level=self.level if level is None else level)
        self.backend.put(chunk_key(digest), blob)
        return len(blob)

    def put_chunk_object(self, digest: str, blob: bytes) -> None:
        """Store an already-encoded chunk object (see chunk.encode_chunk)."""
        self.backend.put(chunk_key(digest), blob)

    def local_missing_chunks(self, digests: Iterable[str]) -> set[str]:
        """The digests among `digests` this store itself lacks (one batch; no peer or remote asked).

        What imports and pushes dedup against and what `put_layer` checks: a
        chunk counts as present only where the lease of the writer (and the
        GC that honours it) is, so a manifest never names a chunk that only
        another store holds.
        """
        wanted = {chunk_key(d): d for d in digests}
        present = self.backend.has_many(wanted)
        return {d for k, d in wanted.items() if k not in present}

    def missing_chunks(self, digests: Iterable[str]) -> set[str]:
        """The digests among `digests` the read path cannot serve: neither this store nor any
        fallback that answers existence checks (the remote; peers promise nothing) holds them.

        For a restore's completeness check; never for dedup (see `local_missing_chunks`).
        """
        wanted = {chunk_key(d): d for d in digests}
        present = self.read_path.readable_many(wanted)
        return {d for k, d in wanted.items() if k not in present}

    # manifests ----------------------------------------------------------------
    def get_layer(self, manifest_id: str) -> Layer:
        """Load a manifest (parsed ones kept in memory, then the catalog, then
        the backend), always verified."""
        check_digest(manifest_id, what="manifest id")
        layer = self._parsed.get(manifest_id)
        if layer is not None:
            return layer
        blob = self.catalog.get_manifest(manifest_id)
        if blob is not None:
            try:
                layer = parse_manifest(manifest_id, blob)
                self._parsed.put(manifest_id, layer)
                return layer
            except CorruptObject:
                self.catalog.forget_manifest(manifest_id)
        try:
            blob = self.backend.get(manifest_key(manifest_id))
        except NotFound:
            raise NotFound(f"manifest {manifest_id} not found in {self.describe()}") from None
        layer = parse_manifest(manifest_id, blob)
        self.catalog.put_manifest(manifest_id, blob)
        self._parsed.put(manifest_id, layer)
        return layer

    def forget_layer(self, manifest_id: str) -> None:
        """Drop a deleted manifest from what this process and node keep of it."""
        self._parsed.pop(manifest_id)
        self.catalog.forget_manifest(manifest_id)

    def stack(self, manifest_id: str) -> list[Layer]:
        """The layer and its ancestors, top first."""
        layers: list[Layer] = []
        seen: set[str] = set()
        current: str | None = manifest_id
        while current is not None:
            if current in seen or len(layers) >= MAX_STACK_DEPTH:
                raise CorruptObject(f"manifest {manifest_id}: parent chain loops or is deeper than {MAX_STACK_DEPTH}")
            seen.add(current)
            layer = self.get_layer(current)
            layers.append(layer)
            current = layer.parent
        return layers

    def chunk_map(self, manifest_id: str) -> tuple[Layer, dict[int, str]]:
        """(top layer, resolved index -> digest map) of a layer stack."""
        layers = self.stack(manifest_id)
        return layers[0], flatten(layers)

    def packed_map(self, manifest_id: str) -> dict[str, Packed]:
        """Where the packed chunks of a layer stack are, by digest (for `read_chunk`)."""
        return flatten_packed(self.stack(manifest_id))

    def read_needs(self, manifest_id: str) -> tuple[set[str], set[str]]:
        """The chunk objects and packs that reading a layer stack takes (what a
        higher layer shadows is not needed)."""
        layers = self.stack(manifest_id)
        resolved, packed = set(flatten(layers).values()), flatten_packed(layers)
        chunks = {d for d in resolved if d not in packed}
        chunks |= {packed[d].base for d in resolved if d in packed and packed[d].base is not None}  # type: ignore[misc]
        return chunks, {packed[d].pack for d in resolved if d in packed}

    def has_layer(self, manifest_id: str) -> bool:
        """True if this store holds the manifest (the backend asked, not the catalog)."""
        return self.backend.stat(manifest_key(manifest_id)) is not None

    def put_layer(self, layer: Layer, *, read_through: bool = False) -> str:
        """Publish a manifest after confirming its chunks and parent are stored here.

        `read_through=True` is for a manifests-only pull alone: the chunks may
        instead be readable through the read path (the remote store), from
        which the mount loads them lazily.
        """
        blob = layer.encode()
        manifest_id = layer.manifest_id()
        digests, packs = layer.needs()
        elsewhere = self.local_missing_chunks(digests)
        missing = self.missing_chunks(elsewhere) if read_through else elsewhere
        lost_packs = self.missing_packs(packs)
        if lost_packs:
            raise MissingChunk(f"refusing to publish manifest {manifest_id}: {len(lost_packs)} pack(s) it names are "
                               f"missing from {self.describe()} (e.g. {sorted(lost_packs)[0]})")
        if missing:
            example = sorted(missing)[0]
            where = self.describe_read_path() if read_through else self.describe()
            raise MissingChunk(
                f"refusing to publish manifest {manifest_id}: {len(missing)} chunk(s) it names are missing "
                f"from {where} (e.g. {example})"
            )
        if layer.parent is not None and self.backend.stat(manifest_key(layer.parent)) is None:
            raise NotFound(f"refusing to publish manifest {manifest_id}: parent manifest {layer.parent} is missing")
        if elsewhere:  # before the manifest: a full copy later must not take this layer for complete
            self.backend.put(_partial_key(manifest_id), json.dumps({"missing": len(elsewhere)}).encode())
        self.backend.put(manifest_key(manifest_id), blob)
        self.catalog.put_manifest(manifest_id, blob)
        return manifest_id

    def partial_layers(self, manifest_ids: Iterable[str]) -> set[str]:
        """Those of `manifest_ids` published by a manifests-only pull whose chunks
        this store has not all received since (`put_layer`, `complete_layer`)."""
        wanted = {_partial_key(m): m for m in manifest_ids}
        return {wanted[k] for k in self.backend.has_many(wanted)} if wanted else set()

    def complete_layer(self, manifest_id: str) -> None:
        """Record that every chunk of a partially pulled layer is now in this store."""
        self.backend.delete(_partial_key(manifest_id))

    # snapshots ----------------------------------------------------------------
    def put_snapshot(self, snap: Snapshot) -> str:
        """Publish a snapshot after confirming every layer it names, and its parent, exist."""
        blob = snap.encode()
        snapshot_id = digest_bytes(blob)
        wanted = {manifest_key(layer_id) for layer_id in snap.layer_ids()}
        missing = wanted - self.backend.has_many(wanted)
        if missing:
            raise NotFound(
                f"refusing to publish snapshot {snapshot_id}: {len(missing)} layer manifest(s) it names are missing "
                f"(e.g. {sorted(missing)[0]})"
            )
        if snap.parent is not None and self.backend.stat(snapshot_key(snap.parent)) is None:
            raise NotFound(f"refusing to publish snapshot {snapshot_id}: parent snapshot {snap.parent} is missing")
        self.backend.put(snapshot_key(snapshot_id), blob)
        return snapshot_id

    def has_snapshot(self, snapshot_id: str) -> bool:
        """True if this store holds the snapshot manifest."""
        return self.backend.stat(snapshot_key(snapshot_id)) is not None

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        """Load and verify a snapshot manifest."""
        try:
            blob = self.backend.get(snapshot_key(snapshot_id))
        except NotFound:
            raise NotFound(f"snapshot {snapshot_id} not found in {self.describe()}") from None
        return parse_snapshot(snapshot_id, blob)

    def list_snapshots(self) -> list[str]:
        """Ids of every snapshot in the store."""
        return sorted(o.key.split("/", 1)[1] for o in self.backend.list(SNAPSHOT_PREFIX) if is_snapshot_key(o.key))

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot manifest; its layers and chunks stay until GC."""
        self.get_snapshot(snapshot_id)  # NotFound with a clear message
        self.backend.delete(snapshot_key(snapshot_id))

    # prefetch lists -------------------------------------------------------------
    def get_prefetch(self, manifest_id: str) -> list[int] | None:
        """The chunk indices recorded as the layer's working set (`put_prefetch`), or None.

        A torn or malformed list counts as none: it only costs laziness.
        """
        try:
            indices = json.loads(self.backend.get(_prefetch_key(manifest_id)))
            return [int(i) for i in indices]
        except NotFound:
            return None
        except (ValueError, TypeError):
            return None

    def put_prefetch(self, manifest_id: str, indices: Iterable[int]) -> None:
        """Record the chunk indices a sandbox of this layer reads first (prefetched on mount, pulled
        by `pull --prefetch`)."""
        self.backend.put(_prefetch_key(manifest_id), json.dumps([int(i) for i in indices]).encode())

    def get_set_chunks(self, manifest_id: str) -> dict[str, memoryview]:
        """The layer's working-set chunks stored whole (`put_set_chunks`): an
        entry over no base by digest, {} if there are none. A malformed
        object counts as none: it only costs the bases they save."""
        try:
            return decode_entries(self.backend.get(_set_chunks_key(manifest_id)))
        except NotFound:
            return {}
        except CorruptObject as exc:
            log.warning("layer %s: %s", manifest_id, exc)
            return {}

    def put_set_chunks(self, manifest_id: str, entries: Mapping[str, bytes]) -> None:
        """Store packed chunks of the layer's working set again, each as an
        entry over no base (`encode_entry(data, None)`), in one object beside
        the set: a restore on another node then reads them without fetching
        the base each was packed over. Deleted by GC with the layer."""
        self.backend.put(_set_chunks_key(manifest_id), encode_entries(entries))

    # templates ------------------------------------------------------------------
    def put_template(self, template: Template) -> None:
        """Publish a template after checking what it names exists."""
        if template.kind == "image":
            self.resolve(template.target)
        else:
            self.get_snapshot(template.target)
        self.backend.put(template.key, template.encode())

    def get_template(self, name: str) -> Template:
        try:
            return parse_template(name, self.backend.get(template_key(name)))
        except NotFound:
            raise NotFound(f"template {name} not found in {self.describe()}") from None

    def list_templates(self) -> list[Template]:
        out = []
        keys = [key for prefix in (TEMPLATE_PREFIX, TAGGED_TEMPLATE_PREFIX) for key, _size, _ in self.backend.list(prefix)]
        for key in keys:
            try:
                out.append(self.get_template(name_of_key(key)))
            except (NotFound, CorruptObject, InvalidInput):
                continue
        return sorted(out, key=lambda t: t.name)

    def delete_template(self, name: str) -> Template:
        template = self.get_template(name)
        self.backend.delete(template.key)
        return template

    # refs ---------------------------------------------------------------------
    def resolve(self, ref: Ref | str) -> str:
        """The manifest id a ref points at (NotFound if the ref does not exist)."""
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        try:
            blob = self.backend.get(ref.key)
        except NotFound:
            raise NotFound(f"image {ref} not found in {self.describe()}") from None
        manifest_id, _ = decode_ref_target(ref, blob)
        return manifest_id

    def runtime(self, ref: Ref | str) -> Runtime:
        """The process defaults (env, cwd, user) an image's top layer records
        from its OCI config; empty for an image imported from a disk."""
        return runtime_of(self.stack(self.resolve(ref))[0].annotations)

    def set_ref(self, ref: Ref | str, manifest_id: str, *, owner: str = "") -> None:
        """Point a ref at an existing manifest (recording `owner`: the API
        records the caller's team, the store itself `refs.STORE_OWNER`)."""
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        check_digest(manifest_id, what="manifest id")
        if self.backend.stat(manifest_key(manifest_id)) is None:
            raise NotFound(f"cannot tag {ref}: manifest {manifest_id} is not in {self.describe()}")
        self.backend.put(ref.key, encode_ref_target(manifest_id, owner=owner))
        self.catalog.set_ref(str(ref), manifest_id)

    def ref_owner(self, ref: Ref | str) -> str:
        """The owner recorded with a ref ("" if none; NotFound if no such ref)."""
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        try:
            return decode_ref_owner(self.backend.get(ref.key))
        except NotFound:
            raise NotFound(f"image {ref} not found in {self.describe()}") from None

    def ref_entry(self, ref: Ref | str) -> tuple[str, str]:
        """(manifest id, owner) of a ref, from one read so both describe the
        same write (NotFound if no such ref): what a reader that trusts a ref
        only for who wrote it checks (layerstore/rootfs.py's layer chains)."""
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        try:
            blob = self.backend.get(ref.key)
        except NotFound:
            raise NotFound(f"image {ref} not found in {self.describe()}") from None
        return decode_ref_target(ref, blob)[0], decode_ref_owner(blob)

    def delete_ref(self, ref: Ref | str) -> str:
        """Remove a ref; returns the manifest it pointed at. Chunks stay until GC."""
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        manifest_id = self.resolve(ref)
        self.backend.delete(ref.key)
        self.catalog.set_ref(str(ref), None)
        return manifest_id

    def list_refs(self) -> list[tuple[Ref, str, int]]:
        """Every well-formed ref as (ref, manifest id, updated), sorted by name."""
        out: list[tuple[Ref, str, int]] = []
        for key, _size, _ in self.backend.list(REF_PREFIX):
            ref = ref_from_key(key)
            if ref is None:
                continue
            try:
                manifest_id, updated = decode_ref_target(ref, self.backend.get(key))
            except (NotFound, CorruptObject):
                continue
            out.append((ref, manifest_id, updated))
        return sorted(out)

    # stats --------------------------------------------------------------------
    def stored_bytes(self, manifest_ids: Iterable[str]) -> tuple[int, int]:
        """(stored bytes, objects missing) of what reading these layer stacks
        takes: each chunk object and pack counted once."""
        chunks: set[str] = set()
        packs: set[str] = set()
        for manifest_id in manifest_ids:
            more_chunks, more_packs = self.read_needs(manifest_id)
            chunks |= more_chunks
            packs |= more_packs
        sizes = self.stored_sizes(chunks)
        pack_sizes = [self.backend.stat(pack_key(p)) for p in sorted(packs)]
        found = [s for s in pack_sizes if s is not None]
        return sum(sizes.values()) + sum(found), len(chunks) - len(sizes) + len(packs) - len(found)

    def stored_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        """Stored (compressed) bytes per chunk: catalog first, backend HEAD for the rest."""
        digests = list(digests)
        known = {d: s for d, (s, _raw) in self.catalog.chunk_sizes(digests).items()}
        unknown = [d for d in digests if d not in known]
        for digest in unknown:
            size = self.backend.stat(chunk_key(digest))
            if size is not None:
                known[digest] = size
        return known


@dataclass(frozen=True)
class ImageInfo:
    """What `strata image inspect` reports."""

    ref: str
    manifest_id: str
    size: int
    chunk_size: int
    layers: int
    chunk_slots: int
    data_chunks: int
    hole_chunks: int
    unique_chunks: int
    logical_bytes: int
    stored_bytes: int
    missing_chunks: int
    annotations: Mapping[str, str]

    @property
    def dedup_ratio(self) -> float:
        """Non-hole logical bytes per stored byte (compression and dedup together)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "ref": self.ref,
            "manifest": self.manifest_id,
            "size": self.size,
            "chunk_size": self.chunk_size,
            "layers": self.layers,
            "chunk_slots": self.chunk_slots,
            "data_chunks": self.data_chunks,
            "hole_chunks": self.hole_chunks,
            "unique_chunks": self.unique_chunks,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "missing_chunks": self.missing_chunks,
            "dedup_ratio": round(self.dedup_ratio, 3),
            "annotations": dict(self.annotations),
        }


def inspect_image(store: Store, ref: Ref | str) -> ImageInfo:
    """Size, chunk counts, stored bytes and dedup ratio of an image."""
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    manifest_id = store.resolve(ref)
    layers = store.stack(manifest_id)
    top = layers[0]
    resolved = flatten(layers)
    unique = set(resolved.values())
    stored, missing = store.stored_bytes([manifest_id])
    last = top.chunk_count - 1
    tail = top.size - last * top.chunk_size if top.size else 0
    logical = sum(tail if i == last else top.chunk_size for i in resolved)
    return ImageInfo(
        ref=str(ref),
        manifest_id=manifest_id,
        size=top.size,
        chunk_size=top.chunk_size,
        layers=len(layers),
        chunk_slots=top.chunk_count,
        data_chunks=len(resolved),
        hole_chunks=top.chunk_count - len(resolved),
        unique_chunks=len(unique),
        logical_bytes=logical,
        stored_bytes=stored,
        missing_chunks=missing,
        annotations=top.annotations,
    )


def open_store(
    spec: str,
    *,
    s3_endpoint: str = "",
    s3_region: str = "",
    s3_path_style: bool = True,
    remote: str = "",
    peers: Sequence[str] = (),
    peer_key: str = "",
    state_dir: Path | None = None,
    level: int = DEFAULT_LEVEL,
    create: bool = True,
    retry_attempts: int = 4,
    backend: Backend | None = None,
    direct_writes: bool = False,
) -> Store:
    """Open the store named by `spec`, a directory path or `s3://BUCKET/PREFIX`, with its read path.

    - `s3_endpoint`, `s3_region`, `s3_path_style` reach every s3:// store
      named here (`spec` and `remote`); empty means boto3's defaults, and S3
      credentials always come from boto3's own chain (AWS_* variables,
      ~/.aws, instance roles).
    - `remote` (a store spec) and `peers` (node URLs, asked with `peer_key`)
      are where chunks this store lacks are read from: peers first, then the
      remote (see the module doc's read path). A `remote` equal to `spec` is
      ignored.
    - `state_dir` holds the catalogs of S3 stores (a local store keeps its
      catalog inside its directory); an s3:// `spec` without it is refused,
      since a guessed default would scatter catalogs where nobody looks.
    - `backend` substitutes a ready-made primary backend (tests inject moto).
    - `direct_writes`: a local store writes its large objects around the
      page cache (LocalDirBackend's `direct`), for bulk commands.
    Nothing is read from the environment: the settings come from the
    caller (the node's NodeConfig.store_options at the top).

    The bucket is checked up front so a misconfigured store fails here, with
    one clear line, instead of halfway through work.
    """
    if not spec:
        raise InvalidInput("no store given: pass --store PATH|s3://BUCKET/PREFIX or set STRATA_STORE")
    s3 = {"endpoint": s3_endpoint, "region": s3_region, "path_style": s3_path_style}
    if spec.startswith("s3://"):
        from .s3 import S3Backend, S3Config  # boto3 costs ~0.2 s to import: only when needed

        if state_dir is None:
            raise InvalidInput(f"{spec}: an s3:// store keeps its catalog in the node's state directory; "
                               f"none was given (config state_dir, STRATA_STATE_DIR)")
        config = S3Config.from_url(spec, **s3)
        inner = backend or S3Backend(config)
        if isinstance(inner, S3Backend):
            RetryingBackend(inner, attempts=retry_attempts)._call(inner.check_bucket)
        name = hashlib.blake2b(f"{config.endpoint}|{spec}".encode(), digest_size=8).hexdigest()
        catalog_path = Path(state_dir) / "catalogs" / name
    elif "://" in spec:
        raise InvalidInput(f"unsupported store URL {spec!r}: use a directory path or s3://BUCKET/PREFIX")
    else:
        inner = backend or LocalDirBackend(spec, create=create, direct=direct_writes)
        catalog_path = Path(spec) / "catalog"
    fallbacks: list[Fallback] = []
    try:
        catalog = Catalog(catalog_path)
        if peers:
            from .peers import Peers  # httpx: only on nodes that have peers

            fallbacks += Peers(peers, api_key=peer_key).fallbacks()
        if remote and remote != spec:
            fallbacks.append(Fallback("remote", open_backend(remote, **s3, retry_attempts=retry_attempts)))
    except BaseException:
        inner.close()
        for fallback in fallbacks:
            fallback.source.close()
        raise
    own = RetryingBackend(inner, attempts=retry_attempts)
    return Store(own, catalog, level=level, read_path=chunk_read_path(own, fallbacks))


def open_backend(spec: str, *, endpoint: str = "", region: str = "", path_style: bool = True,
                 retry_attempts: int = 4, create: bool = False) -> Backend:
    """A bare, retrying backend for `spec` (a remote store read through, or a GC target)."""
    if spec.startswith("s3://"):
        from .s3 import S3Backend, S3Config

        inner: Backend = S3Backend(S3Config.from_url(spec, endpoint=endpoint, region=region, path_style=path_style))
    elif "://" in spec:
        raise InvalidInput(f"unsupported store URL {spec!r}: use a directory path or s3://BUCKET/PREFIX")
    else:
        inner = LocalDirBackend(spec, create=create)
    return RetryingBackend(inner, attempts=retry_attempts)


def open_node_backend(config: NodeConfig, spec: str) -> Backend:
    """The bare backend of store `spec` reached with the node's S3 settings
    (endpoint, region, path style): the remote this node writes its hold in,
    or the shared store a gateway reads node records from."""
    return open_backend(spec, endpoint=config.s3_endpoint, region=config.s3_region, path_style=config.path_style)
