"""E2B's volumes: a team's persistent file trees (layerstore/volumes.py
keeps them in the store), managed with an API key (`/volumes`) and read
and written with the volume's own bearer token (`/volumecontent/{id}/...`).

Another team's volume is unknown (404), exactly like a missing one. On the
content API an unknown volume and a wrong token are the same 401, so the
token is all a content request can learn from. Uploads are staged within
`max_upload` and count against the team's `team_max_stored`, like images.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from posixpath import basename

import anyio

from layerstore.config import DEFAULT_TEAM, NodeConfig
from layerstore.errors import InvalidInput, NotFound, StrataError
from layerstore.store import Store
from layerstore.volumes import (DIRECTORY, FILE, Entry, Volume, Volumes, VolumeSnapshot, check_path, check_volume_id,
                                make_dir, put_entry, read_bytes, remove, set_metadata, store_bytes)
from vmm.registry import SandboxRecord

from . import models as m
from .catalog import Catalog
from .exceptions import Unauthorized
from .teams import Caller
from .uploads import staged

TOKEN = re.compile(r"^[0-9a-f]{64}$")  # how a volume token looks (layerstore/volumes.py makes them)
DEFAULT_FILE_MODE, DEFAULT_DIR_MODE = 0o644, 0o755


def check_mount_path(path: str) -> str:
    """A guest directory to mount a volume on: absolute and normal (no `.`,
    `..`, `//` or trailing `/`), not `/` and not under /proc, /sys or /dev."""
    parts = path.split("/")[1:]
    if (not path.startswith("/") or path == "/" or any(p in ("", ".", "..") for p in parts)
            or "\0" in path or len(path) > 4096):
        raise InvalidInput(f"invalid volume mount path {path!r}: an absolute directory such as /mnt/data "
                           "(no '.', '..', '//' or trailing '/'), not /")
    if parts[0] in ("proc", "sys", "dev"):
        raise InvalidInput(f"invalid volume mount path {path!r}: not under /proc, /sys or /dev")
    return path


def _info(volume: Volume) -> m.VolumeAndToken:
    return m.VolumeAndToken(volumeID=volume.id, name=volume.name, token=volume.token)


def _snapshot_info(snap: VolumeSnapshot) -> m.VolumeSnapshot:
    return m.VolumeSnapshot(snapshotID=snap.id, volumeID=snap.source, name=snap.volume.name,
                            takenAt=m.timestamp(snap.taken))


def _stat(path: str, entry: Entry) -> m.VolumeEntryStat:
    times = {k: m.timestamp(entry.mtime) for k in ("atime", "mtime")}
    return m.VolumeEntryStat(name=basename(path), type=entry.type, path="/" + path, size=entry.size,
                             mode=entry.mode, uid=entry.uid, gid=entry.gid, ctime=m.timestamp(entry.ctime),
                             target=entry.target, **times)


class TeamVolumes:
    def __init__(self, store: Store, config: NodeConfig, catalog: Catalog, *, uploads: Path) -> None:
        self._store = store
        self._volumes = Volumes(store.backend)
        self._config = config
        self._catalog = catalog
        self._uploads = uploads

    # the control plane: a team's API key ------------------------------------------------------
    def _own(self, caller: Caller, volume_id: str) -> Volume:
        volume = self._volumes.get(check_volume_id(volume_id))
        caller.check_sees(volume.owner, f"volume {volume_id} not found")
        return volume

    def create(self, caller: Caller, name: str, *, from_snapshot: str | None = None) -> m.VolumeAndToken:
        """A new volume, empty or with the files of one of the team's volume snapshots."""
        entries = self._own_snapshot(caller, from_snapshot).volume.entries if from_snapshot else None
        return _info(self._volumes.create(name, caller.team, entries=entries))

    def snapshot(self, caller: Caller, volume_id: str) -> m.VolumeSnapshot:
        """Keep the volume as it is now; counted in `team_max_stored` only by
        what it holds that the volume no longer does."""
        return _snapshot_info(self._volumes.snapshot(self._own(caller, volume_id).id))

    def snapshots(self, caller: Caller, volume_id: str) -> list[m.VolumeSnapshot]:
        volume = self._own(caller, volume_id)
        return [_snapshot_info(s) for s in self._volumes.snapshots() if s.source == volume.id]

    def delete_snapshot(self, caller: Caller, snapshot_id: str) -> None:
        self._volumes.delete_snapshot(self._own_snapshot(caller, snapshot_id).id)

    def _own_snapshot(self, caller: Caller, snapshot_id: str) -> VolumeSnapshot:
        snap = self._volumes.get_snapshot(snapshot_id)
        caller.check_sees(snap.volume.owner, f"volume snapshot {snapshot_id} not found")
        return snap

    def list(self, caller: Caller) -> list[m.Volume]:
        return [m.Volume(volumeID=v.id, name=v.name) for v in self._volumes.list() if caller.sees(v.owner)]

    def get(self, caller: Caller, volume_id: str) -> m.VolumeAndToken:
        return _info(self._own(caller, volume_id))

    def mounts(self, caller: Caller, wanted: list[m.SandboxVolumeMount]) -> dict[str, str]:
        """A create's volumeMounts as {guest path: volume id}: each names one
        of the caller's team's volumes (another team's is as missing) at an
        absolute, normal guest path, one volume per path, none inside another."""
        by_name = {v.name: v.id for v in self._volumes.list() if v.owner == caller.team}
        out: dict[str, str] = {}
        for mount in wanted:
            path = check_mount_path(mount.path)
            if mount.name not in by_name:
                raise NotFound(f"volume {mount.name} not found")
            if any(path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in out):
                raise InvalidInput(f"volume mount {path} overlaps another mount")
            out[path] = by_name[mount.name]
        return out

    def names(self, records: list[SandboxRecord]) -> dict[str, str]:
        """{volume id: name} of the volumes `records` mount (one store read each)."""
        out = {}
        for volume_id in sorted({v for r in records for v in r.volumes.values()}):
            try:
                out[volume_id] = self._volumes.get(volume_id).name
            except StrataError:
                continue  # deleted (or unreadable): shown by id
        return out

    def destroy(self, caller: Caller, volume_id: str) -> None:
        """Remove the volume; its files' data stays until GC finds nothing else names it."""
        self._volumes.delete(self._own(caller, volume_id).id)

    # the content plane: the volume's bearer token ----------------------------------------------
    def authorized(self, volume_id: str, authorization: str | None) -> Volume:
        """The volume whose token `Authorization: Bearer` carries, as the store
        has it now (the reads below answer from it: one store read per
        request); 401 otherwise (an unknown volume included)."""
        scheme, _, token = (authorization or "").partition(" ")
        volume = None
        if scheme.lower() == "bearer" and TOKEN.match(token.strip()):  # else nothing is read for it
            try:
                volume = self._volumes.get_by_token(volume_id, token.strip())
            except (NotFound, StrataError):
                volume = None
        if volume is None:
            raise Unauthorized("missing or invalid volume token (Authorization: Bearer <token from /volumes>)")
        return volume

    def stat(self, volume: Volume, path: str) -> m.VolumeEntryStat:
        path = check_path(path)
        return _stat(path, volume.entry(path))

    def list_dir(self, volume: Volume, path: str, depth: int) -> list[m.VolumeEntryStat]:
        path = check_path(path)
        return [_stat(p, volume.entries[p]) for p in volume.children(path, depth=depth)]

    def make_dir(self, volume: Volume, path: str, *, uid: int | None, gid: int | None, mode: int | None,
                 force: bool) -> m.VolumeEntryStat:
        path, now = check_path(path), time.time()
        entry = Entry(DIRECTORY, DEFAULT_DIR_MODE if mode is None else mode, uid or 0, gid or 0, now, now)
        changed = self._volumes.change(volume.id, lambda v: make_dir(v, path, entry, parents=force))
        return _stat(path, changed.entry(path))

    def remove(self, volume: Volume, path: str) -> None:
        path = check_path(path)
        self._volumes.change(volume.id, lambda v: remove(v, path))

    def set_metadata(self, volume: Volume, path: str, body: m.VolumeMetadata) -> m.VolumeEntryStat:
        path, now = check_path(path), time.time()
        changed = self._volumes.change(volume.id, lambda v: set_metadata(v, path, uid=body.uid, gid=body.gid,
                                                                          mode=body.mode, now=now))
        return _stat(path, changed.entry(path))

    def read(self, volume: Volume, path: str) -> Iterator[bytes]:
        """The file's bytes, chunk by chunk (NotFound / InvalidInput before the first)."""
        path = check_path(path)
        entry = volume.entry(path)
        if entry.type != FILE:
            raise NotFound(f"/{path} is not a file")
        return read_bytes(self._store, entry)

    async def write(self, volume: Volume, path: str, chunks: AsyncIterator[bytes], *, declared: str | None,
                    uid: int | None, gid: int | None, mode: int | None, force: bool) -> m.VolumeEntryStat:
        """Store the body as the file at `path` (parents made). An existing
        file is replaced only with `force` (E2B's overwrite flag)."""
        path = check_path(path)
        owner = Caller(volume.owner or DEFAULT_TEAM)
        await anyio.to_thread.run_sync(lambda: self._catalog.check_stored(owner, int(declared or 0)
                                                                          if (declared or "").isdigit() else 0))
        async with staged(chunks, directory=self._uploads, limit=self._config.max_upload, declared=declared,
                          allow_empty=True) as staged_path:
            await anyio.to_thread.run_sync(lambda: self._catalog.check_stored(owner, staged_path.stat().st_size))
            layer, size = await anyio.to_thread.run_sync(lambda: store_bytes(self._store, staged_path))
        now = time.time()
        entry = Entry(FILE, DEFAULT_FILE_MODE if mode is None else mode, uid or 0, gid or 0, now, now, size, layer)
        changed = await anyio.to_thread.run_sync(lambda: self._volumes.change(
            volume.id, lambda v: put_entry(v, path, entry, parents=True, replace_file=force)))
        return _stat(path, changed.entry(path))
