"""What the node's store names, as the API shows it: snapshots, templates,
images, and chunk objects for peers.

Lookups by client-given names are strict: text that cannot be a snapshot id,
image ref or chunk digest is simply unknown (404), so a path-like name never
reaches the store. A snapshot is deleted only when nothing needs it any more
(templates, and the paused sandboxes the node reports as `node_users`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio

from layerstore.chunk import chunk_key
from layerstore import inventory
from layerstore.errors import InvalidInput, NotFound, StrataError
from layerstore.importer import import_image
from layerstore.refs import parse_ref
from layerstore.store import Store, inspect_image
from layerstore.templates import Template, new_template

from . import models as m
from .uploads import staged

def _ref(text: str) -> str:
    try:
        return str(parse_ref(text))
    except InvalidInput:
        raise NotFound(f"image {text!r} not found") from None


class Catalog:
    def __init__(self, store: Store, *, memory_mib: int, uploads: Path, max_upload: int,
                 node_users: Callable[[], dict[str, list[str]]]) -> None:
        """`memory_mib` is what a template's sandboxes get (E2B shows it per
        template); uploads are staged under `uploads`, at most `max_upload` bytes."""
        self.store = store
        self._memory_mib = memory_mib
        self._uploads = uploads
        self._max_upload = max_upload
        self._node_users = node_users  # snapshot id -> the node's paused sandboxes waking from it

    # snapshots (layerstore/inventory.py answers; this only shapes the reply) ------------
    def snapshots(self, *, sandbox: str | None = None, name: str | None = None) -> list[m.SnapshotInfo]:
        """Every snapshot with the templates naming it, optionally only those
        taken of `sandbox` or named `name`."""
        return [m.SnapshotInfo(snapshotID=s.snapshot_id, names=s.names)
                for s in inventory.list_snapshots(self.store, sandbox=sandbox, name=name)]

    def snapshot(self, snapshot_id: str) -> m.SnapshotDetail:
        """A snapshot's parent chain, layers and stored size, and the templates naming it."""
        d = inventory.inspect_snapshot(self.store, snapshot_id, node_users=self._node_users())
        layers = [m.SnapshotLayer(role=x.role, manifest=x.manifest, size=x.size, stored_bytes=x.stored_bytes)
                  for x in d.layers]
        return m.SnapshotDetail(snapshotID=d.snapshot_id, parents=d.parents, layers=layers,
                                stored_bytes=d.stored_bytes, vm=d.vm, annotations=d.annotations,
                                templates=d.templates)

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot manifest (Conflict while a template or paused sandbox needs it)."""
        inventory.delete_snapshot(self.store, snapshot_id, node_users=self._node_users())

    # templates ------------------------------------------------------------------------
    def _template(self, t: Template) -> m.Template:
        return m.Template(templateID=t.name, buildID=t.target[:32] if t.kind == "snapshot" else t.target,
                          cpuCount=1, memoryMB=self._memory_mib, diskSizeMB=0, aliases=[t.name], names=[t.name],
                          createdAt=m.timestamp(t.created), updatedAt=m.timestamp(t.created), kind=t.kind,
                          target=t.target)

    def templates(self) -> list[m.Template]:
        return [self._template(t) for t in self.store.list_templates()]

    def create_template(self, name: str, *, image: str | None, snapshot: str | None) -> m.Template:
        """Name an imported image (NAME:TAG) or a snapshot; exactly one of them."""
        if (image is None) == (snapshot is None):
            raise InvalidInput("give exactly one of image (NAME:TAG) or snapshot (id)")
        template = new_template(name, "image" if image else "snapshot", image or snapshot or "")
        self.store.put_template(template)
        return self._template(template)

    def delete_template(self, name: str) -> None:
        try:
            self.store.delete_template(name)
        except InvalidInput:
            raise NotFound(f"template {name!r} not found") from None

    # images ---------------------------------------------------------------------------
    def images(self) -> list[m.ImageInfo]:
        """Every image ref; size None where the manifest cannot be read."""
        out = []
        for ref, manifest_id, updated in self.store.list_refs():
            try:
                size = self.store.get_layer(manifest_id).size
            except StrataError:
                size = None
            out.append(m.ImageInfo(ref=str(ref), manifest=manifest_id, size=size, updated=updated))
        return out

    def image(self, ref: str) -> m.ImageDetail:
        info = inspect_image(self.store, _ref(ref))
        return m.ImageDetail(ref=info.ref, manifest=info.manifest_id, size=info.size, chunk_size=info.chunk_size,
                             layers=info.layers, data_chunks=info.data_chunks, hole_chunks=info.hole_chunks,
                             unique_chunks=info.unique_chunks, stored_bytes=info.stored_bytes,
                             missing_chunks=info.missing_chunks)

    def delete_image(self, ref: str) -> None:
        """Remove the ref; its data stays until GC."""
        self.store.delete_ref(_ref(ref))

    async def import_stream(self, ref: str, chunks: AsyncIterator[bytes], *,
                            declared: str | None = None) -> m.ImportResult:
        """Import a raw image sent as `chunks` as `ref` (already a valid NAME:TAG);
        `declared` is the client's Content-Length, checked before reading."""
        async with staged(chunks, directory=self._uploads, limit=self._max_upload, declared=declared) as path:
            result = await anyio.to_thread.run_sync(
                lambda: import_image(self.store, str(path), ref, annotations={"source": "api upload"}))
        return m.ImportResult(ref=ref, manifest=result.manifest_id, size=result.size, new_chunks=result.new_chunks,
                              new_stored_bytes=result.new_stored_bytes, seconds=round(result.seconds, 3))

    # chunks for peers ---------------------------------------------------------------------
    def chunk(self, digest: str) -> bytes:
        """A stored chunk object (zstd frame) from this node's own store only:
        a peer falls back to the remote itself, and verifies the digest."""
        try:
            key = chunk_key(digest)
        except InvalidInput:
            raise NotFound(f"chunk {digest!r} not found") from None
        return self.store.backend.get(key)
