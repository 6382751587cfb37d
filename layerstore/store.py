"""The store: chunks, manifests and refs over one backend, plus the catalog.

`Store` is the only place that knows the key layout and the publication
order that keeps readers safe:

    chunks/<aa>/<digest>    zstd frame of a chunk (layerstore/chunk.py)
    manifests/<id>          canonical layer manifest (layerstore/manifest.py)
    snapshots/<id>          canonical snapshot manifest (layerstore/snapshot.py)
    refs/<name>/<tag>       {"manifest": id, ...} (layerstore/refs.py)

1. chunks are put (durable when `put` returns);
2. a manifest is put only after the backend confirms every chunk it names,
   and its parent manifest, exist;
3. a ref is put only after its manifest exists.

So a reader that follows a ref never meets a dangling reference, and a crash
at any point leaves at worst unreferenced chunks, which GC reclaims.

`open_store` turns a user's store spec (a path or `s3://BUCKET/PREFIX`) into a
`Store`; the backend is always wrapped in `RetryingBackend`.
"""

from __future__ import annotations

import collections
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from .backend import Backend, RetryingBackend
from .catalog import Catalog
from .chunk import DEFAULT_LEVEL, MAX_CHUNK_SIZE, chunk_key, decode_chunk, encode_chunk
from .digest import check_digest, digest_bytes
from .config import DEFAULT_STATE_DIR
from .errors import BackendUnavailable, CorruptObject, InvalidInput, MissingChunk, NotFound, StrataError
from .localdir import LocalDirBackend
from .manifest import MAX_STACK_DEPTH, Layer, flatten, manifest_key, parse_manifest
from .refs import Ref, decode_ref_target, encode_ref_target, parse_ref, ref_from_key
from .snapshot import Snapshot, is_snapshot_key, parse_snapshot, snapshot_key
from .templates import Template, parse_template, template_key

if TYPE_CHECKING:
    from .peers import Peers



class Store:
    """Chunks, manifests and refs kept in a `Backend`, with a local `Catalog`.

    `remote` (optional) is where chunks this store lacks are read from: a
    node's local store after a manifests-only `strata pull`; `peers`
    (optional, layerstore/peers.py) are other nodes asked first. Every
    chunk, whatever its source, is verified before it is returned; nothing
    is written back (caching is the mount's chunk cache's job).
    """

    def __init__(self, backend: Backend, catalog: Catalog, *, level: int = DEFAULT_LEVEL,
                 remote: Backend | None = None, peers: Peers | None = None) -> None:
        self.backend = backend
        self.catalog = catalog
        self.level = level
        self.remote = remote
        self.peers = peers
        # where chunks read by this process came from (local, peer, remote; peer_rejected = failed verification)
        self.sources: collections.Counter[str] = collections.Counter()

    def describe(self) -> str:
        return self.backend.describe()

    def close(self) -> None:
        self.backend.close()
        if self.remote is not None:
            self.remote.close()
        if self.peers is not None:
            self.peers.close()
        self.catalog.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # chunks -------------------------------------------------------------------
    def read_chunk(self, digest: str) -> bytes:
        """Fetch, decompress and verify one chunk. Raises MissingChunk / CorruptObject."""
        key = chunk_key(digest)
        try:
            blob = self.backend.get(key)
            self.sources["local"] += 1
            return decode_chunk(digest, blob, max_size=MAX_CHUNK_SIZE)
        except NotFound:
            pass
        if self.peers is not None:
            for peer in self.peers.candidates():
                try:
                    data = decode_chunk(digest, peer.get_chunk(digest), max_size=MAX_CHUNK_SIZE)
                except NotFound:
                    continue
                except BackendUnavailable as exc:
                    self.peers.failed(peer, str(exc))
                    continue
                except CorruptObject as exc:  # a lying or broken peer: never used, never again soon
                    self.sources["peer_rejected"] += 1
                    self.peers.failed(peer, f"sent a chunk that fails verification ({exc})")
                    continue
                self.sources["peer"] += 1
                return data
        if self.remote is None:
            raise MissingChunk(f"chunk {digest} is missing from {self.describe()}")
        try:
            blob = self.remote.get(key)
        except NotFound:
            raise MissingChunk(f"chunk {digest} is missing from {self.describe()} and its remote "
                               f"{self.remote.describe()}") from None
        self.sources["remote"] += 1
        return decode_chunk(digest, blob, max_size=MAX_CHUNK_SIZE)

    def write_chunk(self, digest: str, data: bytes | memoryview, *, level: int | None = None) -> int:
        """Compress and store a chunk whose digest the caller computed; returns stored bytes."""
        blob = encode_chunk(data, level=self.level if level is None else level)
        self.backend.put(chunk_key(digest), blob)
        return len(blob)

    def put_chunk_object(self, digest: str, blob: bytes) -> None:
        """Store an already-encoded chunk object (see chunk.encode_chunk)."""
        self.backend.put(chunk_key(digest), blob)

    def local_missing_chunks(self, digests: Iterable[str]) -> set[str]:
        """The digests among `digests` this store itself lacks (its remote not asked)."""
        wanted = {chunk_key(d): d for d in digests}
        present = self.backend.has_many(wanted)
        return {d for k, d in wanted.items() if k not in present}

    def missing_chunks(self, digests: Iterable[str]) -> set[str]:
        """The digests among `digests` that neither this store nor its remote holds (one batch each)."""
        missing = self.local_missing_chunks(digests)
        if self.remote is not None and missing:
            present = self.remote.has_many([chunk_key(d) for d in missing])
            missing = {d for d in missing if chunk_key(d) not in present}
        return missing

    # manifests ----------------------------------------------------------------
    def get_layer(self, manifest_id: str) -> Layer:
        """Load a manifest (catalog first, then backend), always verified."""
        check_digest(manifest_id, what="manifest id")
        blob = self.catalog.get_manifest(manifest_id)
        if blob is not None:
            try:
                return parse_manifest(manifest_id, blob)
            except CorruptObject:
                self.catalog.forget_manifest(manifest_id)
        try:
            blob = self.backend.get(manifest_key(manifest_id))
        except NotFound:
            raise NotFound(f"manifest {manifest_id} not found in {self.describe()}") from None
        layer = parse_manifest(manifest_id, blob)
        self.catalog.put_manifest(manifest_id, blob)
        return layer

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

    def put_layer(self, layer: Layer) -> str:
        """Publish a manifest after confirming its chunks and parent are stored."""
        blob = layer.encode()
        manifest_id = layer.manifest_id()
        digests = {d for d in layer.chunks.values() if d is not None}
        missing = self.missing_chunks(digests)
        if missing:
            example = sorted(missing)[0]
            raise MissingChunk(
                f"refusing to publish manifest {manifest_id}: {len(missing)} chunk(s) it names are missing "
                f"from {self.describe()} (e.g. {example})"
            )
        if layer.parent is not None and self.backend.stat(manifest_key(layer.parent)) is None:
            raise NotFound(f"refusing to publish manifest {manifest_id}: parent manifest {layer.parent} is missing")
        self.backend.put(manifest_key(manifest_id), blob)
        self.catalog.put_manifest(manifest_id, blob)
        return manifest_id

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

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        """Load and verify a snapshot manifest."""
        try:
            blob = self.backend.get(snapshot_key(snapshot_id))
        except NotFound:
            raise NotFound(f"snapshot {snapshot_id} not found in {self.describe()}") from None
        return parse_snapshot(snapshot_id, blob)

    def list_snapshots(self) -> list[str]:
        """Ids of every snapshot in the store."""
        return sorted(o.key.split("/", 1)[1] for o in self.backend.list("snapshots/") if is_snapshot_key(o.key))

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot manifest; its layers and chunks stay until GC."""
        self.get_snapshot(snapshot_id)  # NotFound with a clear message
        self.backend.delete(snapshot_key(snapshot_id))

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
        for key, _size, _ in self.backend.list("templates/"):
            name = key.split("/", 1)[1]
            try:
                out.append(self.get_template(name))
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

    def set_ref(self, ref: Ref | str, manifest_id: str) -> None:
        """Point a ref at an existing manifest."""
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        check_digest(manifest_id, what="manifest id")
        if self.backend.stat(manifest_key(manifest_id)) is None:
            raise NotFound(f"cannot tag {ref}: manifest {manifest_id} is not in {self.describe()}")
        self.backend.put(ref.key, encode_ref_target(manifest_id))
        self.catalog.set_ref(str(ref), manifest_id)

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
        for key, _size, _ in self.backend.list("refs/"):
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
    sizes = store.stored_sizes(unique)
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
        stored_bytes=sum(sizes.values()),
        missing_chunks=len(unique) - len(sizes),
        annotations=top.annotations,
    )


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where per-node state lives for remote stores (STRATA_STATE_DIR)."""
    env = os.environ if env is None else env
    return Path(os.path.expanduser(env.get("STRATA_STATE_DIR", DEFAULT_STATE_DIR)))


def open_store(
    spec: str,
    *,
    env: Mapping[str, str] | None = None,
    create: bool = True,
    level: int = DEFAULT_LEVEL,
    retry_attempts: int = 4,
    backend: Backend | None = None,
) -> Store:
    """Open the store named by `spec`: a directory path, or `s3://BUCKET/PREFIX`.

    For S3 the endpoint and credentials come from STRATA_S3_ENDPOINT and the
    usual AWS_* variables; the bucket is checked up front so a misconfigured
    store fails here, with one clear line, instead of halfway through work.
    `backend` substitutes a ready-made backend (tests use it to inject moto).
    """
    env = dict(os.environ if env is None else env)
    if not spec:
        raise InvalidInput("no store given: pass --store PATH|s3://BUCKET/PREFIX or set STRATA_STORE")
    if spec.startswith("s3://"):
        from .s3 import S3Backend, S3Config  # boto3 costs ~0.2 s to import: only when needed

        config = S3Config.from_url(spec, env)
        inner = backend or S3Backend(config)
        if isinstance(inner, S3Backend):
            RetryingBackend(inner, attempts=retry_attempts)._call(inner.check_bucket)
        name = hashlib.blake2b(f"{config.endpoint}|{spec}".encode(), digest_size=8).hexdigest()
        catalog_path = state_dir(env) / "catalogs" / name
    elif "://" in spec:
        raise InvalidInput(f"unsupported store URL {spec!r}: use a directory path or s3://BUCKET/PREFIX")
    else:
        inner = backend or LocalDirBackend(spec, create=create)
        catalog_path = Path(spec) / "catalog"
    try:
        catalog = Catalog(catalog_path)
    except StrataError:
        inner.close()
        raise
    remote = peers = None
    if env.get("STRATA_REMOTE") and env["STRATA_REMOTE"] != spec:
        remote = open_backend(env["STRATA_REMOTE"], env=env, retry_attempts=retry_attempts)
    if env.get("STRATA_PEERS"):
        from .peers import Peers

        peers = Peers(env["STRATA_PEERS"].split(","), api_key=env.get("STRATA_PEER_KEY", ""))
    return Store(RetryingBackend(inner, attempts=retry_attempts), catalog, level=level, remote=remote, peers=peers)


def open_backend(spec: str, *, env: Mapping[str, str], retry_attempts: int = 4, create: bool = False) -> Backend:
    """A bare backend for `spec` (a remote store read through, or a GC target)."""
    if spec.startswith("s3://"):
        from .s3 import S3Backend, S3Config

        inner: Backend = S3Backend(S3Config.from_url(spec, env))
    elif "://" in spec:
        raise InvalidInput(f"unsupported store URL {spec!r}: use a directory path or s3://BUCKET/PREFIX")
    else:
        inner = LocalDirBackend(spec, create=create)
    return RetryingBackend(inner, attempts=retry_attempts)
