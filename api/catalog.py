"""What the node's store names, as the API shows it: snapshots, templates,
images, and chunk objects for peers.

Lookups by client-given names are strict: text that cannot be a snapshot id,
image ref or chunk digest is simply unknown (404), so a path-like name never
reaches the store. A snapshot is deleted only when nothing needs it any more
(templates, and the paused sandboxes the node reports as `node_users`).
Every method takes the caller: another team's object is unknown, and a name
another team holds cannot be taken over (api/teams.py). Image names in the
store's own namespace (`strata-*`, layerstore/refs.py) are no team's to
write or remove: only an admin may (`writable_ref`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import anyio

from layerstore import inventory
from layerstore.config import DEFAULT_TEAM, NodeConfig
from layerstore.errors import InvalidInput, NotFound, StrataError
from layerstore.importer import import_image
from layerstore.refs import RESERVED_PREFIX, Ref, is_reserved, parse_ref
from layerstore.store import Store, inspect_image
from layerstore.templates import DEFAULT_TAG, Template, check_tag, check_template_name, new_template
from layerstore.volumes import Volumes

from . import models as m
from .sources import snapshot_id_of
from .teams import Caller, check_quota
from .uploads import staged

def _ref(text: str) -> str:
    try:
        return str(parse_ref(text))
    except InvalidInput:
        raise NotFound(f"image {text!r} not found") from None


def check_not_reserved(caller: Caller, ref: Ref) -> None:
    """InvalidInput (400) if `ref` is in the store's own namespace and the
    caller no admin: the OCI importer builds new images on its
    `strata-oci:<chain id>` disks, the node boots from `strata-boot`."""
    if is_reserved(ref) and not caller.admin:
        raise InvalidInput(f"image name {ref.name!r} is reserved: names starting with {RESERVED_PREFIX!r} are the "
                           "node's own (OCI layer chains, boot layers, the demo image); choose another name")


def writable_ref(caller: Caller, text: str) -> str:
    """`text` as NAME:TAG for an image the caller writes: 400 if it is no
    ref or a reserved name (`check_not_reserved`); checked where the request
    is parsed, before a byte of the body is read."""
    ref = parse_ref(text)
    check_not_reserved(caller, ref)
    return str(ref)


class Catalog:
    def __init__(self, store: Store, config: NodeConfig, *, uploads: Path,
                 node_users: Callable[[], dict[str, list[str]]],
                 deleted: Callable[[], None] = lambda: None) -> None:
        """Templates show `config.sandbox_memory` (E2B shows it per template);
        uploads are staged under `uploads`, at most `config.max_upload` bytes;
        `deleted` is told when a name is removed (the node's hold in its
        remote may shrink)."""
        self.store = store
        self.config = config
        self._uploads = uploads
        self._node_users = node_users  # snapshot id -> the node's paused sandboxes waking from it
        self._deleted = deleted

    # teams --------------------------------------------------------------------------------
    def _snapshot_team(self, snapshot_id: str) -> str:
        return self.store.get_snapshot(inventory.check_snapshot_id(snapshot_id)).annotations.get("team", "")

    def _check_snapshot(self, caller: Caller, snapshot_id: str) -> None:
        caller.check_sees(self._snapshot_team(snapshot_id), f"snapshot {snapshot_id} not found")

    def check_snapshot_quota(self, caller: Caller) -> None:
        if self.config.team_limit(self.config.team_max_snapshots, caller.team) is None:
            return  # no quota: no need to read every snapshot
        used = len(inventory.list_snapshots(self.store, team=caller.team))
        check_quota(self.config, caller, setting="team_max_snapshots", used=used, adding=1)

    def check_template_free(self, caller: Caller, name: str) -> str:
        """The name's canonical spelling (layerstore/templates.py), if it is
        valid and free for the caller (409 otherwise): a template's NAME is
        its team's with every tag of it (another team holds no NAME:TAG of
        it), and no template takes the exact name of another team's image
        (it would stand before that image for its own team)."""
        name = check_template_name(name)
        if snapshot_id_of(name) is not None:
            raise InvalidInput(f"template name {name!r} is spelled like a snapshot id, which names that snapshot")
        self._check_template_name_free(caller, name)
        if ":" in name:
            try:
                caller.check_may_replace(self.store.ref_owner(name), f"image {name}")
            except (NotFound, InvalidInput):
                pass
        return name

    def _stored_bytes(self, team: str) -> int:
        """Bytes stored for a team's images, snapshots and volumes, each chunk and pack once."""
        layers = [manifest for ref, manifest, _u in self.store.list_refs()
                  if (self.store.ref_owner(ref) or DEFAULT_TEAM) == team]
        for s in inventory.list_snapshots(self.store, team=team):
            layers += self.store.get_snapshot(s.snapshot_id).layers.values()
        volumes = Volumes(self.store.backend)
        layers += [layer for v in volumes.list() if (v.owner or DEFAULT_TEAM) == team for layer in v.layers()]
        layers += [layer for s in volumes.snapshots() if (s.volume.owner or DEFAULT_TEAM) == team
                   for layer in s.volume.layers()]
        return self.store.stored_bytes(layers)[0]

    # snapshots (layerstore/inventory.py answers; this only shapes the reply) ------------
    def snapshots(self, caller: Caller, *, sandbox: str | None = None,
                  name: str | None = None) -> list[m.SnapshotInfo]:
        """The caller's snapshots with the templates naming them, optionally
        only those taken of `sandbox` or named `name`."""
        team = None if caller.admin else caller.team
        if name is not None:
            try:
                name = check_template_name(name)  # my-snap:default is my-snap
            except InvalidInput:
                return []
        return [m.SnapshotInfo(snapshotID=s.snapshot_id, names=s.names)
                for s in inventory.list_snapshots(self.store, sandbox=sandbox, name=name, team=team)]

    def snapshot(self, caller: Caller, snapshot_id: str) -> m.SnapshotDetail:
        """A snapshot's parent chain, layers and stored size, and the templates naming it."""
        self._check_snapshot(caller, snapshot_id)
        d = inventory.inspect_snapshot(self.store, snapshot_id, node_users=self._node_users())
        layers = [m.SnapshotLayer(role=x.role, manifest=x.manifest, size=x.size, stored_bytes=x.stored_bytes)
                  for x in d.layers]
        return m.SnapshotDetail(snapshotID=d.snapshot_id, parents=d.parents, layers=layers,
                                stored_bytes=d.stored_bytes, vm=d.vm, annotations=d.annotations,
                                templates=d.templates)

    def delete_snapshot(self, caller: Caller, snapshot_id: str) -> None:
        """Delete a snapshot manifest (Conflict while a template or paused sandbox needs it)."""
        self._check_snapshot(caller, snapshot_id)
        inventory.delete_snapshot(self.store, snapshot_id, node_users=self._node_users())
        self._deleted()

    # templates ------------------------------------------------------------------------
    def _template(self, t: Template) -> m.Template:
        return m.Template(templateID=t.name, buildID=t.target[:32] if t.kind == "snapshot" else t.target,
                          cpuCount=1, memoryMB=self.config.sandbox_memory, diskSizeMB=0, aliases=[t.name], names=[t.name],
                          createdAt=m.timestamp(t.created), updatedAt=m.timestamp(t.created), kind=t.kind,
                          target=t.target)

    def templates(self, caller: Caller) -> list[m.Template]:
        return [self._template(t) for t in self.store.list_templates() if caller.sees(t.owner) or t.public]

    def template_alias(self, caller: Caller, alias: str) -> m.TemplateAlias:
        """E2B's Template.exists: the caller's template of that name, or a
        public one (another team's is unknown here, as everywhere; E2B
        answers 403)."""
        try:
            template = self.store.get_template(check_template_name(alias))
        except InvalidInput:
            raise NotFound(f"template {alias!r} not found") from None
        if not template.public:
            caller.check_sees(template.owner, f"template {alias} not found")
        return m.TemplateAlias(templateID=template.name, public=template.public)

    def create_template(self, caller: Caller, name: str, *, image: str | None, snapshot: str | None) -> m.Template:
        """Name one of the caller's images (NAME:TAG) or snapshots; exactly one
        of them. A name another team holds is 409."""
        if (image is None) == (snapshot is None):
            raise InvalidInput("give exactly one of image (NAME:TAG) or snapshot (id)")
        self.check_template_free(caller, name)
        template = new_template(name, "image" if image else "snapshot", image or snapshot or "", owner=caller.team)
        if image:
            self._check_image(caller, template.target)
        else:
            self._check_snapshot(caller, template.target)
        self.store.put_template(template)
        return self._template(template)

    # E2B's template tags: NAME:TAG names of one template, each a template of its own
    def assign_tags(self, caller: Caller, target: str, tags: list[str]) -> m.AssignedTemplateTags:
        """Give what `target` (NAME:TAG, the caller's) names to NAME:TAG2 for
        each tag: the same image or snapshot and process defaults. A tag
        another team holds is 409; every tag is checked before any is written."""
        source = self.store.get_template(self._own_template(caller, target))
        base = source.name.partition(":")[0]
        names = [self.check_template_free(caller, f"{base}:{check_tag(tag)}") for tag in tags]
        if not names:
            raise InvalidInput("give at least one tag")
        for name in names:
            self.store.put_template(replace(source, name=name, created=time.time(), owner=caller.team))
        return m.AssignedTemplateTags(tags=[n.partition(":")[2] or DEFAULT_TAG for n in names],
                                      buildID=build_id(source))

    def remove_tags(self, caller: Caller, name: str, tags: list[str]) -> None:
        """Remove NAME:TAG for each tag (what they named stays); all must be the caller's."""
        names = [self._own_template(caller, f"{name.partition(':')[0]}:{check_tag(tag)}") for tag in tags]
        for full in names:
            self.store.delete_template(full)

    def tags(self, caller: Caller, name: str) -> list[m.TemplateTag]:
        """The tags of template NAME the caller may start (its team's, public ones)."""
        base = check_template_name(name).partition(":")[0]
        found = [t for t in self.store.list_templates()
                 if t.name.partition(":")[0] == base and (caller.sees(t.owner) or t.public)]
        if not found:
            raise NotFound(f"template {name!r} not found")
        return [m.TemplateTag(tag=t.name.partition(":")[2] or DEFAULT_TAG, buildID=build_id(t),
                              createdAt=m.timestamp(t.created)) for t in sorted(found, key=lambda t: t.name)]

    def _own_template(self, caller: Caller, name: str) -> str:
        """The canonical name of the caller's template `name`; NotFound otherwise."""
        try:
            template = self.store.get_template(check_template_name(name))
        except InvalidInput:
            raise NotFound(f"template {name!r} not found") from None
        caller.check_sees(template.owner, f"template {name} not found")
        return template.name

    def delete_template(self, caller: Caller, name: str) -> None:
        """Remove a template name (what it named stays); a snapshot id here
        is E2B's delete_snapshot: the snapshot goes with the caller's names
        for it (409 while a paused sandbox needs it)."""
        snapshot_id = snapshot_id_of(name)
        if snapshot_id is not None:
            self._check_snapshot(caller, snapshot_id)
            inventory.delete_snapshot(self.store, snapshot_id, node_users=self._node_users(), with_names=True)
            self._deleted()
            return
        try:
            owner = self.store.get_template(name).owner
        except InvalidInput:
            raise NotFound(f"template {name!r} not found") from None
        caller.check_sees(owner, f"template {name} not found in {self.store.describe()}")
        self.store.delete_template(name)  # what it named is still a root: the hold stays

    # images ---------------------------------------------------------------------------
    def images(self, caller: Caller) -> list[m.ImageInfo]:
        """The caller's image refs; size None where the manifest cannot be read."""
        out = []
        for ref, manifest_id, updated in self.store.list_refs():
            if not caller.sees(self.store.ref_owner(ref)):
                continue
            try:
                size = self.store.get_layer(manifest_id).size
            except StrataError:
                size = None
            out.append(m.ImageInfo(ref=str(ref), manifest=manifest_id, size=size, updated=updated))
        return out

    def _check_image(self, caller: Caller, ref: str) -> str:
        ref = _ref(ref)
        caller.check_sees(self.store.ref_owner(ref), f"image {ref} not found in {self.store.describe()}")
        return ref

    def image(self, caller: Caller, ref: str) -> m.ImageDetail:
        info = inspect_image(self.store, self._check_image(caller, ref))
        return m.ImageDetail(ref=info.ref, manifest=info.manifest_id, size=info.size, chunk_size=info.chunk_size,
                             layers=info.layers, data_chunks=info.data_chunks, hole_chunks=info.hole_chunks,
                             unique_chunks=info.unique_chunks, stored_bytes=info.stored_bytes,
                             missing_chunks=info.missing_chunks)

    def delete_image(self, caller: Caller, ref: str) -> None:
        """Remove the ref; its data stays until GC. A reserved name is 400
        (`check_not_reserved`) whoever holds it."""
        check_not_reserved(caller, parse_ref(_ref(ref)))
        self.store.delete_ref(self._check_image(caller, ref))
        self._deleted()

    def check_import(self, caller: Caller, ref: str, declared: str | None) -> None:
        """Before a byte is read: the ref is not reserved (400), not another
        team's (409), and the declared size fits the team's stored-bytes
        quota (429)."""
        check_not_reserved(caller, parse_ref(ref))
        self._check_ref_free(caller, ref)
        self.check_stored(caller, int(declared) if declared and declared.isdigit() else 0)

    def check_stored(self, caller: Caller, adding: int) -> None:
        """QuotaExceeded if `adding` raw bytes would take the team past
        team_max_stored (raw bytes: what they store is at most that)."""
        if self.config.team_limit(self.config.team_max_stored, caller.team) is not None:
            check_quota(self.config, caller, setting="team_max_stored", used=self._stored_bytes(caller.team),
                        adding=adding, unit=" bytes")

    async def import_stream(self, caller: Caller, ref: str, chunks: AsyncIterator[bytes], *,
                            declared: str | None = None) -> m.ImportResult:
        """Import a raw image sent as `chunks` as `ref` (already a valid NAME:TAG)
        for the caller's team; `declared` is the client's Content-Length,
        checked before reading."""
        await anyio.to_thread.run_sync(lambda: self.check_import(caller, ref, declared))
        async with staged(chunks, directory=self._uploads, limit=self.config.max_upload, declared=declared) as path:
            # again with what arrived: a chunked upload declares no size
            await anyio.to_thread.run_sync(lambda: self.check_stored(caller, path.stat().st_size))
            result = await anyio.to_thread.run_sync(
                lambda: import_image(self.store, str(path), None, annotations={"source": "api upload"}))
            await anyio.to_thread.run_sync(lambda: self._publish(caller, ref, result.manifest_id))
        return m.ImportResult(ref=ref, manifest=result.manifest_id, size=result.size, new_chunks=result.new_chunks,
                              new_stored_bytes=result.new_stored_bytes, seconds=round(result.seconds, 3))

    def _publish(self, caller: Caller, ref: str, manifest_id: str) -> None:
        self._check_ref_free(caller, ref)  # again: another team may have taken the name during the upload
        self.store.set_ref(ref, manifest_id, owner=caller.team)

    def _check_template_name_free(self, caller: Caller, name: str) -> None:
        """Conflict if another team has a template under NAME (of `NAME[:TAG]`), with any tag."""
        base = name.partition(":")[0]
        for template in self.store.list_templates():
            if template.name.partition(":")[0] == base:
                caller.check_may_replace(template.owner, f"template {base}, with its tags,")

    def _check_ref_free(self, caller: Caller, ref: str) -> None:
        """Conflict if `ref` is another team's image, or under the NAME of
        another team's template (a template stands before an image of its
        name, and its tags are its team's: check_template_free)."""
        self._check_template_name_free(caller, ref)
        try:
            owner = self.store.ref_owner(ref)
        except NotFound:
            return
        caller.check_may_replace(owner, f"image {ref}")

    # chunks for peers ---------------------------------------------------------------------
    def chunk(self, digest: str) -> bytes:
        """A stored chunk object (zstd frame) from this node's own store only:
        a peer falls back to the remote itself, and verifies the digest."""
        return self.store.chunk_object(digest)


def build_id(template: Template) -> str:
    """E2B's build id (a UUID) of what a template names: tags naming the
    same image or snapshot share it."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"strata:{template.kind}:{template.target}"))
