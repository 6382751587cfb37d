"""Volumes: a team's named, persistent, writable file tree kept in the store.

A volume outlives sandboxes and nodes: it is one small JSON object naming
its files, and each file's bytes are a layer (chunked, hashed, compressed
and deduplicated against every image and snapshot, like any other data):

    volumes/<ID>   {"v": 1, "name": "<name>", "owner": "<team>", "created": <unix s>,
                    "token": "<64 hex: the content API's bearer token>",
                    "entries": {"<path>": {"type": "file" | "directory" | "symlink",
                                           "mode": <perm bits>, "uid": <n>, "gid": <n>,
                                           "mtime": <unix s>, "ctime": <unix s>, "size": <bytes>,
                                           "layer": "<manifest id>" (files with data),
                                           "target": "<link text>" (symlinks)}, ...}}

A volume snapshot is the volume as it was, kept whole and never changed
(its files' layers stay while it does), from which new volumes are made:

    volume-snapshots/<SID>   {"v": 1, "source": "<volume id>", "taken": <unix s>,
                              "name", "owner", "created", "entries": as the volume's (no token)}

Paths are relative, normalised (`a/b.txt`; the root is "" and has no
entry), and every entry's parent directory has one. A change is a
compare-and-swap of the whole object (`Backend.put_if`), retried a few
times, so two writers (two requests, or two nodes sharing the store)
never lose each other's update. GC keeps every layer a volume or a volume
snapshot names.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from posixpath import dirname

from .backend import Backend
from .digest import check_digest
from .errors import Conflict, CorruptObject, InvalidInput, NotFound
from .importer import import_image
from .store import Store

VOLUME_PREFIX = "volumes/"
SNAPSHOT_PREFIX = "volume-snapshots/"
MAX_ENTRIES = 100_000  # files and directories in one volume (its index is read and written whole)
MAX_INDEX_BYTES = 32 << 20  # one volume's index, encoded: every listing, quota check and GC reads it
MAX_PATH, MAX_PART = 4096, 255
CAS_TRIES = 16
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")  # E2B's pattern, with a length cap
_ID_RE = re.compile(r"vol[0-9a-f]{16}")
_SNAPSHOT_RE = re.compile(r"vs[0-9a-f]{16}")
_TOKEN_TAIL = re.compile(rb'"token":"([0-9a-f]{64})","v":1}\Z')  # how encode() ends an index (sorted keys)
FILE, DIRECTORY, SYMLINK = "file", "directory", "symlink"


@dataclass(frozen=True)
class Entry:
    type: str
    mode: int
    uid: int = 0
    gid: int = 0
    mtime: float = 0.0
    ctime: float = 0.0
    size: int = 0
    layer: str | None = None  # a file's bytes; None: empty
    target: str | None = None  # a symlink's text


@dataclass(frozen=True)
class Volume:
    id: str
    name: str
    owner: str
    created: float
    token: str
    entries: dict[str, Entry] = field(default_factory=dict)

    def entry(self, path: str) -> Entry:
        """The entry at `path` (the root is a directory); NotFound if none."""
        if path == "":
            return Entry(DIRECTORY, 0o755, mtime=self.created, ctime=self.created)
        try:
            return self.entries[path]
        except KeyError:
            raise NotFound(f"path /{path} not found in volume {self.name}") from None

    def children(self, path: str, *, depth: int = 1) -> list[str]:
        """Paths under directory `path`, at most `depth` levels down, sorted."""
        if self.entry(path).type != DIRECTORY:
            raise InvalidInput(f"/{path} is not a directory")
        prefix = f"{path}/" if path else ""
        return sorted(p for p in self.entries
                      if p.startswith(prefix) and p[len(prefix):].count("/") < depth)

    def layers(self) -> list[str]:
        return sorted({e.layer for e in self.entries.values() if e.layer})

    def encode(self) -> bytes:
        body = {"v": 1, "name": self.name, "owner": self.owner, "created": self.created, "token": self.token,
                "entries": {p: {k: v for k, v in asdict(e).items() if v is not None}
                            for p, e in sorted(self.entries.items())}}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class VolumeSnapshot:
    id: str
    source: str  # the volume it was taken of
    taken: float
    volume: Volume  # its name, owner and entries then (token blank)

    def encode(self) -> bytes:
        body = json.loads(self.volume.encode())
        del body["token"]
        body.update(source=self.source, taken=self.taken)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def check_snapshot_id(text: str) -> str:
    """A volume snapshot id from a user; NotFound for text that cannot be one."""
    if not isinstance(text, str) or not _SNAPSHOT_RE.fullmatch(text):
        raise NotFound(f"volume snapshot {text!r} not found")
    return text


def parse_snapshot(snapshot_id: str, blob: bytes) -> VolumeSnapshot:
    try:
        data = json.loads(blob)
        source, taken = check_volume_id(data.pop("source")), float(data.pop("taken"))
        volume = parse_volume(source, json.dumps({**data, "token": ""}).encode())
        return VolumeSnapshot(snapshot_id, source, taken, volume)
    except (ValueError, KeyError, TypeError, AttributeError, NotFound) as exc:
        raise CorruptObject(f"volume snapshot {snapshot_id} is malformed: {exc}") from None


@dataclass(frozen=True)
class Salvaged:
    """A volume's (or volume snapshot's) index that no reader can parse. GC keeps, unverified, every
    layer its bytes may name, and reports it: one bad index neither stops GC for the rest of the
    store nor loses its own data, and `strata verify` names it for an operator to mend."""

    key: str
    reason: str
    layers: tuple[str, ...]  # every 64-hex string in its bytes (layer ids, and the token: never a layer)


def salvage(key: str, blob: bytes, reason: str) -> Salvaged:
    found = sorted(set(re.findall(r"[0-9a-f]{64}", blob.decode("latin-1"))))
    return Salvaged(key, reason[:300], tuple(found))


class VolumeFull(InvalidInput):
    """A change would take a volume past MAX_ENTRIES or MAX_INDEX_BYTES."""


def new_volume_id() -> str:
    return "vol" + secrets.token_hex(8)


def is_volume_id(text: object) -> bool:
    return isinstance(text, str) and _ID_RE.fullmatch(text) is not None


def check_volume_id(text: str) -> str:
    """A volume id from a user; NotFound for text that cannot be one."""
    if not is_volume_id(text):
        raise NotFound(f"volume {text!r} not found")
    return text


def check_volume_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidInput(f"invalid volume name {name!r}: letters, digits, '_' and '-', at most 128")
    return name


def check_path(text: str) -> str:
    """A client's path as the volume's key: `/a//b/` -> `a/b`, `/` -> "".
    `..` is refused (it never leaves the volume, but a client sending it
    means something the volume cannot do), as are NUL and oversized names."""
    if not isinstance(text, str) or len(text) > MAX_PATH or "\0" in text:
        raise InvalidInput("invalid path: at most 4096 characters, no NUL")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidInput(f"invalid path {text!r}: '..' is not allowed in a volume path")
    if any(len(p.encode()) > MAX_PART for p in parts):
        raise InvalidInput(f"invalid path {text!r}: a name is longer than {MAX_PART} bytes")
    return "/".join(parts)


def check_entry(path: str, entry: Entry) -> None:
    """InvalidInput unless `path` and `entry` are as a reader of the index takes them (parse_volume)."""
    if check_path(path) != path or entry.type not in (FILE, DIRECTORY, SYMLINK) or entry.size < 0:
        raise InvalidInput(f"bad entry {path[:200]!r}")
    if entry.layer is not None:
        check_digest(entry.layer, what="layer")


def check_entries(new: dict[str, Entry], old: dict[str, Entry] | None = None) -> None:
    """InvalidInput unless each entry `new` holds and `old` did not (as it is) passes check_entry:
    what is written is what every reader can read. A bad index, once written, is unreadable to all
    of them: its sandboxes' mounts, listings, quotas, and GC (which then only salvages it)."""
    old = old or {}
    for path, entry in new.items():
        if old.get(path) is not entry:
            check_entry(path, entry)


def parse_volume(volume_id: str, blob: bytes) -> Volume:
    try:
        data = json.loads(blob)
        entries = {}
        for path, e in data["entries"].items():
            entry = Entry(**e)
            check_entry(path, entry)
            entries[path] = entry
        return Volume(volume_id, check_volume_name(data["name"]), str(data["owner"]), float(data["created"]),
                      str(data["token"]), entries)
    except (ValueError, KeyError, TypeError, InvalidInput) as exc:
        raise CorruptObject(f"volume {volume_id} is malformed: {exc}") from None


class Volumes:
    """The volumes of one store (the backend's compare-and-swap makes
    concurrent writers safe, on one node or many)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._locks: dict[str, threading.Lock] = {}  # volume id -> this process's writers take turns
        self._guard = threading.Lock()

    def create(self, name: str, owner: str, *, entries: dict[str, Entry] | None = None) -> Volume:
        """A new volume, empty or holding `entries` (a snapshot's); Conflict
        if `owner` already has one of that name."""
        check_volume_name(name)
        check_entries(entries or {})
        if any(v.name == name and v.owner == owner for v in self.list()):
            raise Conflict(f"volume {name} already exists")
        volume = Volume(new_volume_id(), name, owner, time.time(), secrets.token_hex(32), dict(entries or {}))
        if self._backend.put_new(VOLUME_PREFIX + volume.id, _encoded(volume)) is None:
            raise Conflict(f"volume id {volume.id} is taken: try again")
        return volume

    def get(self, volume_id: str) -> Volume:
        return self._read(check_volume_id(volume_id))[0]

    def get_by_token(self, volume_id: str, token: str) -> Volume | None:
        """The volume if `token` is its token, else None, compared before the
        index is parsed (the content API asks this of every request, its
        caller not yet known to be anyone): encode() ends every index with
        its token."""
        blob = self._blob(check_volume_id(volume_id))[0]
        tail = _TOKEN_TAIL.search(blob, max(len(blob) - 100, 0))
        if tail is not None and not secrets.compare_digest(tail.group(1), token.encode("utf-8", "replace")):
            return None
        volume = parse_volume(volume_id, blob)
        return volume if secrets.compare_digest(volume.token.encode(), token.encode("utf-8", "replace")) else None

    def list(self) -> list[Volume]:
        """Every volume, by name; a malformed one is left out (GC salvages it: gc_roots)."""
        out = []
        for info in self._backend.list(VOLUME_PREFIX):
            try:
                out.append(self.get(info.key[len(VOLUME_PREFIX):]))
            except NotFound:
                continue  # deleted since the listing
            except CorruptObject:
                continue
        return sorted(out, key=lambda v: (v.name, v.id))

    def publish(self, volume: Volume) -> None:
        """Write `volume` as it is (a copy from another store: push, pull),
        replacing what this store had under its id."""
        try:
            check_volume_name(volume.name)
            check_entries(volume.entries)
        except InvalidInput as exc:
            raise InvalidInput(f"volume {volume.id} not published: {exc}") from None
        self._backend.put(VOLUME_PREFIX + check_volume_id(volume.id), _encoded(volume))

    def delete(self, volume_id: str) -> Volume:
        volume = self.get(volume_id)
        self._backend.delete(VOLUME_PREFIX + volume.id)
        return volume

    def snapshot(self, volume_id: str) -> VolumeSnapshot:
        """Keep the volume as it is now, whole (later changes do not touch it)."""
        volume = self.get(volume_id)
        snap = VolumeSnapshot("vs" + secrets.token_hex(8), volume.id, time.time(), replace(volume, token=""))
        if self._backend.put_new(SNAPSHOT_PREFIX + snap.id, snap.encode()) is None:
            raise Conflict(f"volume snapshot id {snap.id} is taken: try again")
        return snap

    def get_snapshot(self, snapshot_id: str) -> VolumeSnapshot:
        key = SNAPSHOT_PREFIX + check_snapshot_id(snapshot_id)
        try:
            return parse_snapshot(snapshot_id, self._backend.get(key))
        except NotFound:
            raise NotFound(f"volume snapshot {snapshot_id} not found") from None

    def snapshots(self) -> list[VolumeSnapshot]:
        """Every volume snapshot, oldest first; a malformed one is left out (GC salvages it: gc_roots)."""
        out = []
        for info in self._backend.list(SNAPSHOT_PREFIX):
            try:
                out.append(self.get_snapshot(info.key[len(SNAPSHOT_PREFIX):]))
            except NotFound:
                continue
            except CorruptObject:
                continue
        return sorted(out, key=lambda s: (s.taken, s.id))

    def delete_snapshot(self, snapshot_id: str) -> VolumeSnapshot:
        snap = self.get_snapshot(snapshot_id)
        self._backend.delete(SNAPSHOT_PREFIX + snap.id)
        return snap

    def gc_roots(self) -> tuple[list[str], list[Salvaged]]:
        """The layers every volume and volume snapshot names, and the indexes that are malformed
        (with what may be layers in their bytes), for GC: nothing here is left out or raised."""
        layers: set[str] = set()
        salvaged = []
        for prefix, parse in ((VOLUME_PREFIX, parse_volume), (SNAPSHOT_PREFIX, parse_snapshot)):
            for info in self._backend.list(prefix):
                try:
                    blob = self._backend.get(info.key)
                except NotFound:
                    continue  # deleted since the listing
                try:
                    found = parse(info.key[len(prefix):], blob)
                except CorruptObject as exc:
                    salvaged.append(salvage(info.key, blob, str(exc)))
                    continue
                layers.update((found.volume if isinstance(found, VolumeSnapshot) else found).layers())
        return sorted(layers), salvaged

    def change(self, volume_id: str, edit: Callable[[Volume], Volume]) -> Volume:
        """Apply `edit` to the current volume and publish the result if
        nobody changed it meanwhile (else read again and retry, after a
        growing random pause). Writers in this process take turns, so only
        other processes' (other nodes') writes make it retry."""
        check_volume_id(volume_id)
        with self._guard:
            lock = self._locks.setdefault(volume_id, threading.Lock())
        with lock:
            for attempt in range(CAS_TRIES):
                volume, version = self._read(volume_id)
                changed = edit(volume)
                if len(changed.entries) > MAX_ENTRIES:
                    raise VolumeFull(f"volume {volume.name} would hold more than {MAX_ENTRIES} entries")
                check_entries(changed.entries, volume.entries)
                if self._backend.put_if(VOLUME_PREFIX + volume.id, _encoded(changed), version) is not None:
                    return changed
                time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** attempt)))
        raise Conflict(f"volume {volume_id} is changing too fast: try again")

    def _read(self, volume_id: str) -> tuple[Volume, str]:
        blob, version = self._blob(volume_id)
        return parse_volume(volume_id, blob), version

    def _blob(self, volume_id: str) -> tuple[bytes, str]:
        key = VOLUME_PREFIX + volume_id
        head = self._backend.head(key)
        if head is None:
            raise NotFound(f"volume {volume_id} not found")
        if head.size > MAX_INDEX_BYTES:
            raise CorruptObject(f"volume {volume_id} is malformed: its index of {head.size} bytes passes "
                                f"{MAX_INDEX_BYTES}")
        try:
            blob = self._backend.get(key)
        except NotFound:
            raise NotFound(f"volume {volume_id} not found") from None
        return blob, head.version


def _encoded(volume: Volume) -> bytes:
    """The index to write; VolumeFull past MAX_INDEX_BYTES (long paths fill it before MAX_ENTRIES)."""
    blob = volume.encode()
    if len(blob) > MAX_INDEX_BYTES:
        raise VolumeFull(f"volume {volume.name}'s index would pass {MAX_INDEX_BYTES >> 20} MiB ({len(blob)} bytes)")
    return blob


# edits: pure functions of a volume, applied under `Volumes.change` -------------------------------
def with_parents(volume: Volume, path: str, *, uid: int = 0, gid: int = 0, now: float) -> dict[str, Entry]:
    """The entries plus any missing parent directories of `path`; InvalidInput
    if a parent is a file."""
    entries = dict(volume.entries)
    parent = dirname(path)
    missing = []
    while parent:
        found = entries.get(parent)
        if found is not None:
            if found.type != DIRECTORY:
                raise InvalidInput(f"/{parent} is not a directory")
            break
        missing.append(parent)
        parent = dirname(parent)
    for p in missing:
        entries[p] = Entry(DIRECTORY, 0o755, uid, gid, now, now)
    return entries


def put_entry(volume: Volume, path: str, entry: Entry, *, parents: bool, replace_file: bool) -> Volume:
    """`volume` with `entry` at `path`. Parent directories are made when
    `parents`, else one missing is NotFound; a directory in the way is a
    Conflict, and so is an existing file unless `replace_file`."""
    if path == "":
        raise Conflict("the volume's root cannot be replaced")
    if not parents and dirname(path) and dirname(path) not in volume.entries:
        raise NotFound(f"parent directory /{dirname(path)} not found")
    entries = with_parents(volume, path, uid=entry.uid, gid=entry.gid, now=entry.mtime)
    old = entries.get(path)
    if old is not None and (old.type == DIRECTORY or not replace_file):
        raise Conflict(f"/{path} already exists" + (" (a directory)" if old.type == DIRECTORY else ""))
    entries[path] = entry
    return replace(volume, entries=entries)


def make_dir(volume: Volume, path: str, entry: Entry, *, parents: bool) -> Volume:
    """`volume` with directory `path`; with `parents` (E2B's force) an
    existing directory is fine and missing parents are made."""
    found = volume.entries.get(path) if path else Entry(DIRECTORY, 0o755)
    if found is not None and found.type == DIRECTORY and parents:
        return volume
    return put_entry(volume, path, entry, parents=parents, replace_file=False)


def remove(volume: Volume, path: str) -> Volume:
    """`volume` without `path` and, for a directory, everything under it."""
    volume.entry(path)
    if path == "":
        raise InvalidInput("the volume's root cannot be removed: destroy the volume instead")
    entries = {p: e for p, e in volume.entries.items() if p != path and not p.startswith(path + "/")}
    return replace(volume, entries=entries)


def set_metadata(volume: Volume, path: str, *, uid: int | None, gid: int | None, mode: int | None,
                 now: float) -> Volume:
    old = volume.entry(path)
    if path == "":
        raise InvalidInput("the volume's root has no metadata to change")
    new = replace(old, uid=old.uid if uid is None else uid, gid=old.gid if gid is None else gid,
                  mode=old.mode if mode is None else mode, ctime=now)
    return replace(volume, entries={**volume.entries, path: new})


# file bytes: layers ----------------------------------------------------------------------------
def store_bytes(store: Store, path: os.PathLike[str] | str) -> tuple[str | None, int]:
    """The file at `path` as a layer of `store`: (manifest id, size); an
    empty file needs none."""
    size = os.stat(path).st_size
    if size == 0:
        return None, 0
    return import_image(store, path, None, annotations={"source": "volume"}).manifest_id, size


def read_bytes(store: Store, entry: Entry) -> Iterator[bytes]:
    """A file entry's bytes, a chunk at a time, each verified as it is read."""
    if entry.type != FILE:
        raise InvalidInput("not a file")
    if entry.layer is None or entry.size == 0:
        return
    top, resolved = store.chunk_map(entry.layer)
    packed = store.packed_map(entry.layer)
    if top.size != entry.size:
        raise CorruptObject(f"layer {entry.layer} holds {top.size} bytes, the volume says {entry.size}")
    cs = top.chunk_size
    for index in range((top.size + cs - 1) // cs):
        want = min(cs, top.size - index * cs)
        digest = resolved.get(index)
        data = store.read_chunk(digest, packed.get(digest)) if digest is not None else bytes(want)
        if len(data) != want:
            raise CorruptObject(f"chunk {digest} holds {len(data)} bytes, slot {index} needs {want}")
        yield data
