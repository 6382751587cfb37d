"""A team's volume as a guest's FUSE mount sees it: path operations on
layerstore's volumes (vmm/volumeport.py carries the guest's requests), each
failing with the errno the guest's caller gets, and the node's staging of
the files the guest has open for writing.

Reads come from the published file's layer, a range at a time, through a
small cache of decoded chunks (the guest reads 128 KiB to 1 MiB at a time
and a chunk is 1 MiB), or from the staging file while this node holds one
for that path. A write goes to the staging file of the guest's open file
(`fh`), copied from the published bytes on the first write:

    <staging>/<fh>   sparse file, the file as this guest is writing it

`flush` (close, fsync) publishes it: a new layer, then a compare-and-swap
of the volume's index replacing the file's entry (keeping its mode and
owner). A file removed or replaced by a directory meanwhile is not brought
back: what was written to it goes, as to an unlinked file. The volume's
index is read again after `index_ttl` (other writers: the content API,
other sandboxes, other nodes) and at once after this node's own changes.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from posixpath import basename, dirname

from layerstore.errors import Conflict, InvalidInput, NotFound, StrataError
from layerstore.store import Store
from layerstore.volumes import (DIRECTORY, FILE, MAX_ENTRIES, MAX_PATH, SYMLINK, Entry, Volume, VolumeFull, Volumes,
                                check_path, put_entry, read_bytes, remove, store_bytes)

log = logging.getLogger("strata.vmm.volumes")

MAX_READ = 1 << 20  # bytes one read may ask for
MAX_LISTED = 20_000  # entries one directory listing answers (the guest takes a reply of at most 4 MiB)
MAX_OPEN = 1024  # files one sandbox has open for writing in one volume
DISK_RESERVE = 2 << 30  # bytes of the node's disk staged writes leave free (for its sandboxes and records)
CACHED_CHUNKS = 16  # decoded chunks kept (1 MiB each by default)
CACHED_MAPS = 32  # layers whose chunk maps are kept


def fail(code: int, message: str = "") -> OSError:
    return OSError(code, message or os.strerror(code))


def errno_of(exc: BaseException) -> int:
    """The errno a guest's caller gets for `exc`."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    if isinstance(exc, NotFound):
        return errno.ENOENT
    if isinstance(exc, Conflict):  # (names in the way are EEXIST from the edits below)
        return errno.EAGAIN  # the volume changed too fast for the compare-and-swap
    if isinstance(exc, VolumeFull):
        return errno.ENOSPC
    if isinstance(exc, InvalidInput):
        return errno.EINVAL
    return errno.EIO


def attr(entry: Entry, *, size: int | None = None) -> dict[str, object]:
    out: dict[str, object] = {"type": entry.type, "mode": entry.mode, "uid": entry.uid, "gid": entry.gid,
                              "size": entry.size if size is None else size, "mtime": entry.mtime,
                              "ctime": entry.ctime}
    if entry.target is not None:
        out["target"] = entry.target
    return out


def guest_path(text: object) -> str:
    """A path from the guest, as the volume's key; EINVAL for a non-string,
    `..`, NUL; ENAMETOOLONG is folded into EINVAL by check_path's caps."""
    if not isinstance(text, str):
        raise fail(errno.EINVAL, "path must be a string")
    try:
        return check_path(text)
    except InvalidInput as exc:
        raise fail(errno.EINVAL, str(exc)) from None


@dataclass
class Staged:
    """A file this guest has open for writing, as staged on the node."""

    path: str
    file: Path
    dirty: bool = False  # written since it was staged or last published
    base: str | None = None  # the published layer it holds when clean (None: empty)
    orphan: bool = False  # its name was removed or replaced meanwhile: what it holds is never published
    mtime: float | None = None  # set by the guest after its last write (`cp -p`): published as is


class VolumeFiles:
    """One mounted volume's operations for one sandbox (thread-safe)."""

    def __init__(self, store: Store, volume_id: str, staging: Path, *, max_staged: int,
                 check_stored: Callable[[int], None] | None = None, index_ttl: float = 1.0) -> None:
        self.volume_id = volume_id
        self._store = store
        self._volumes = Volumes(store.backend)
        self._staging_dir = staging
        self._max_staged = max_staged
        self._check_stored = check_stored
        self._ttl = index_ttl
        self._lock = threading.Lock()
        self._index: tuple[float, Volume] | None = None
        self._staged: dict[int, Staged] = {}
        self._fh_locks: dict[int, tuple[threading.Lock, int]] = {}  # fh -> (its lock, holders and waiters)
        self._released: OrderedDict[int, None] = OrderedDict()  # recent fhs closed: a late repeat of a write is EBADF
        self._chunks: OrderedDict[str, bytes] = OrderedDict()
        self._maps: OrderedDict[str, tuple[int, int, dict[int, str], dict]] = OrderedDict()

    # the index ---------------------------------------------------------------------------------
    def volume(self) -> Volume:
        with self._lock:
            cached = self._index
        if cached is not None and time.monotonic() - cached[0] < self._ttl:
            return cached[1]
        volume = self._volumes.get(self.volume_id)
        self._remember(volume)
        return volume

    def _remember(self, volume: Volume) -> None:
        with self._lock:
            self._index = (time.monotonic(), volume)

    def _change(self, edit: Callable[[Volume], Volume]) -> Volume:
        changed = self._volumes.change(self.volume_id, edit)
        self._remember(changed)
        return changed

    def _entry(self, path: str) -> Entry:
        return self.volume().entry(path)

    def _attr(self, path: str, entry: Entry) -> dict[str, object]:
        staged = self._staged_for(path)
        return attr(entry, size=staged.file.stat().st_size if staged is not None else None)

    def _staged_for(self, path: str) -> Staged | None:
        with self._lock:
            return next((s for s in self._staged.values() if s.path == path and s.dirty and not s.orphan), None)

    # reads -------------------------------------------------------------------------------------
    def stat(self, path: str) -> dict[str, object]:
        return {"attr": self._attr(path, self._entry(path))}

    def list(self, path: str) -> dict[str, object]:
        volume = self.volume()
        if volume.entry(path).type != DIRECTORY:
            raise fail(errno.ENOTDIR)
        if len(volume.children(path)) > MAX_LISTED:
            raise fail(errno.EFBIG, f"a directory of more than {MAX_LISTED} entries cannot be listed on the mount")
        return {"entries": [{"name": basename(p), "attr": self._attr(p, volume.entries[p])}
                            for p in volume.children(path)]}

    def read(self, path: str, offset: int, length: int) -> bytes:
        if offset < 0 or not 0 <= length <= MAX_READ:
            raise fail(errno.EINVAL, f"a read is at most {MAX_READ} bytes")
        staged = self._staged_for(path)
        if staged is not None:
            with open(staged.file, "rb") as f:
                return os.pread(f.fileno(), length, offset)
        entry = self._entry(path)
        if entry.type == DIRECTORY:
            raise fail(errno.EISDIR)
        if entry.type != FILE:
            raise fail(errno.EINVAL)
        end = min(entry.size, offset + length)
        if entry.layer is None or offset >= end:
            return b""
        return self._read_layer(entry.layer, offset, end)

    def _read_layer(self, layer: str, offset: int, end: int) -> bytes:
        size, chunk_size, resolved, packed = self._map(layer)
        parts, pos = [], offset
        while pos < min(end, size):
            index = pos // chunk_size
            chunk = self._chunk(resolved.get(index), packed, min(chunk_size, size - index * chunk_size))
            start = pos - index * chunk_size
            part = chunk[start:start + min(end - pos, len(chunk) - start)]
            parts.append(part)
            pos += len(part)
        return b"".join(parts)

    def _map(self, layer: str) -> tuple[int, int, dict[int, str], dict]:
        with self._lock:
            if layer in self._maps:
                self._maps.move_to_end(layer)
                return self._maps[layer]
        top, resolved = self._store.chunk_map(layer)
        found = (top.size, top.chunk_size, resolved, self._store.packed_map(layer))
        with self._lock:
            self._maps[layer] = found
            while len(self._maps) > CACHED_MAPS:
                self._maps.popitem(last=False)
        return found

    def _chunk(self, digest: str | None, packed: dict, want: int) -> bytes:
        if digest is None:  # a hole
            return bytes(want)
        with self._lock:
            if digest in self._chunks:
                self._chunks.move_to_end(digest)
                return self._chunks[digest]
        data = self._store.read_chunk(digest, packed.get(digest))  # verified against its digest
        if len(data) != want:
            raise fail(errno.EIO, f"chunk {digest} holds {len(data)} bytes, not {want}")
        with self._lock:
            self._chunks[digest] = data
            while len(self._chunks) > CACHED_CHUNKS:
                self._chunks.popitem(last=False)
        return data

    def statfs(self) -> dict[str, object]:
        used = len(self.volume().entries)
        return {"bsize": 4096, "blocks": 1 << 30, "bfree": 1 << 29, "files": MAX_ENTRIES,
                "ffree": max(MAX_ENTRIES - used, 0)}

    # names -------------------------------------------------------------------------------------
    def create(self, path: str, mode: int, uid: int, gid: int, fh: int) -> dict[str, object]:
        now = time.time()
        entry = Entry(FILE, mode & 0o7777, uid, gid, now, now)
        volume = self._change(lambda v: _put_new(v, path, entry))
        with self._held(fh):
            self._admit(fh)
            self._file(fh).write_bytes(b"")
            with self._lock:
                self._staged[fh] = Staged(path, self._file(fh))
        return {"attr": attr(volume.entry(path))}

    def make_dir(self, path: str, mode: int, uid: int, gid: int) -> dict[str, object]:
        now = time.time()
        volume = self._change(lambda v: _put_new(v, path, Entry(DIRECTORY, mode & 0o7777, uid, gid, now, now)))
        return {"attr": attr(volume.entry(path))}

    def symlink(self, path: str, target: str, uid: int, gid: int) -> dict[str, object]:
        if not isinstance(target, str) or not 0 < len(target.encode()) <= 4096 or "\0" in target:
            raise fail(errno.EINVAL, "a link's target is 1 to 4096 bytes, no NUL")
        now = time.time()
        entry = Entry(SYMLINK, 0o777, uid, gid, now, now, len(target.encode()), target=target)
        volume = self._change(lambda v: _put_new(v, path, entry))
        return {"attr": attr(volume.entry(path))}

    def unlink(self, path: str) -> dict[str, object]:
        def edit(volume: Volume) -> Volume:
            if volume.entry(path).type == DIRECTORY:
                raise fail(errno.EISDIR)
            return remove(volume, path)
        self._change(edit)
        self._orphan(path)
        return {}

    def rmdir(self, path: str) -> dict[str, object]:
        def edit(volume: Volume) -> Volume:
            if volume.entry(path).type != DIRECTORY:
                raise fail(errno.ENOTDIR)
            if volume.children(path):
                raise fail(errno.ENOTEMPTY)
            if path == "":
                raise fail(errno.EBUSY)
            return remove(volume, path)
        self._change(edit)
        return {}

    def rename(self, path: str, to: str, *, noreplace: bool) -> dict[str, object]:
        self._change(lambda v: _moved(v, path, to, noreplace=noreplace))
        if to != path:
            self._orphan(to)  # the file it replaced: its open writers write to nothing now
        with self._lock:
            for staged in self._staged.values():
                if staged.path == path or staged.path.startswith(path + "/"):
                    staged.path = to + staged.path[len(path):]
        return {}

    def _orphan(self, path: str) -> None:
        with self._lock:
            for staged in self._staged.values():
                if staged.path == path or staged.path.startswith(path + "/"):
                    staged.orphan = True

    def set_attr(self, path: str, *, fh: int | None, mode: int | None, uid: int | None, gid: int | None,
                 size: int | None, mtime: float | None) -> dict[str, object]:
        if size is not None:
            self._truncate(path, fh, size)
        if mtime is not None:
            with self._lock:
                for staged in self._staged.values():
                    if staged.path == path and not staged.orphan:
                        staged.mtime = mtime
        if (mode, uid, gid, mtime) != (None, None, None, None):
            def edit(volume: Volume) -> Volume:
                old = volume.entry(path)
                if path == "":
                    raise fail(errno.EPERM, "the volume's root keeps its attributes")
                new = replace(old, mode=old.mode if mode is None else mode & 0o7777,
                              uid=old.uid if uid is None else uid, gid=old.gid if gid is None else gid,
                              mtime=old.mtime if mtime is None else mtime, ctime=time.time())
                return replace(volume, entries={**volume.entries, path: new})
            self._change(edit)
        return self.stat(path)

    # writes ------------------------------------------------------------------------------------
    def open(self, path: str, fh: int, *, trunc: bool) -> dict[str, object]:
        entry = self._entry(path)
        if entry.type != FILE:
            raise fail(errno.EISDIR if entry.type == DIRECTORY else errno.EINVAL)
        if trunc:
            with self._held(fh):
                self._admit(fh)
                staged = Staged(path, self._file(fh), dirty=True)
                self._file(fh).write_bytes(b"")
                with self._lock:
                    self._staged[fh] = staged
        return self.stat(path)

    def write(self, fh: int, path: str, offset: int, data: bytes) -> dict[str, object]:
        if offset < 0:
            raise fail(errno.EINVAL)
        with self._held(fh):
            staged = self._stage(fh, path)
            if offset + len(data) > staged.file.stat().st_size:
                self._check_room(offset + len(data) - staged.file.stat().st_size)
            with open(staged.file, "r+b") as f:
                os.pwrite(f.fileno(), data, offset)
            staged.dirty, staged.mtime = True, None
        return {"size": len(data)}

    def flush(self, fh: int, path: str) -> dict[str, object]:
        with self._lock:
            known = fh in self._staged
        if known:
            with self._held(fh):
                with self._lock:
                    staged = self._staged.get(fh)
                if staged is not None and staged.dirty:
                    self._publish(staged)
                    path = staged.path
        try:
            return self.stat(path)
        except (NotFound, OSError):
            return {}  # removed while open: its writes went with it

    def release(self, fh: int, path: str) -> dict[str, object]:
        try:
            self.flush(fh, path)
        finally:
            with self._lock:
                known = fh in self._staged
            if known:
                with self._held(fh):
                    with self._lock:
                        self._staged.pop(fh, None)
                    self._file(fh).unlink(missing_ok=True)
            with self._lock:
                self._released[fh] = None
                while len(self._released) > MAX_OPEN * 4:
                    self._released.popitem(last=False)
        return {}

    def close(self) -> None:
        """Forget every staged file (the VM is gone; what it did not flush is lost, as on a crash)."""
        with self._lock:
            self._staged.clear()
        shutil.rmtree(self._staging_dir, ignore_errors=True)

    def publish_all(self) -> None:
        """Publish every staged file (before the VM is snapshotted or stopped)."""
        with self._lock:
            fhs = list(self._staged)
        for fh in fhs:
            with self._held(fh):
                with self._lock:
                    staged = self._staged.get(fh)
                if staged is None or not staged.dirty:
                    continue
                try:
                    self._publish(staged)
                except (OSError, StrataError) as exc:  # stays staged; the guest's own close reports it
                    log.warning("volume %s: /%s not published before a snapshot: %s", self.volume_id,
                                staged.path, exc)

    def _truncate(self, path: str, fh: int | None, size: int) -> None:
        if size < 0:
            raise fail(errno.EINVAL)
        key = fh if fh is not None else -1 - (hash(path) & 0xFFFFFFFF)  # a private handle for truncate(2)
        with self._held(key):
            try:
                staged = self._stage(key, path)
                grow = size - staged.file.stat().st_size
                if grow > 0:
                    self._check_room(grow)
                os.truncate(staged.file, size)
                staged.dirty = True
                if fh is None:
                    self._publish(staged)
            finally:
                if fh is None:  # truncate(2) is done (or failed) here: nothing of it stays staged
                    with self._lock:
                        self._staged.pop(key, None)
                    self._file(key).unlink(missing_ok=True)

    def _stage(self, fh: int, path: str) -> Staged:
        """The staging of `fh`, made from the published file when the node
        has none (first write, or a node that restarted, or a fork)."""
        with self._lock:
            staged = self._staged.get(fh)
            if fh in self._released:
                raise fail(errno.EBADF, "that file was closed")
        entry = None
        if staged is not None:
            if staged.orphan:  # written on, as an unlinked open file is, and never published
                return staged
            path = staged.path  # the node follows renames itself; the guest's may be an unlinked name
            if staged.dirty:
                return staged
            entry = self._entry(path)
            if entry.layer == staged.base:
                return staged
            # clean and someone else published since: start again from theirs
        entry = entry or self._entry(path)
        if entry.type != FILE:
            raise fail(errno.EISDIR if entry.type == DIRECTORY else errno.EINVAL)
        self._admit(fh)
        self._check_room(entry.size)
        staged = Staged(path, self._file(fh), base=entry.layer)
        self._staging_dir.mkdir(parents=True, exist_ok=True)
        with open(staged.file, "wb") as f:
            for block in read_bytes(self._store, entry):
                f.write(block)
        with self._lock:
            self._staged[fh] = staged
        return staged

    def _publish(self, staged: Staged) -> None:
        if staged.orphan:
            staged.dirty = False
            return
        size = staged.file.stat().st_size
        if self._check_stored is not None:
            try:
                self._check_stored(size)
            except StrataError as exc:
                raise fail(errno.EDQUOT, str(exc)) from None
        layer, size = store_bytes(self._store, staged.file)
        now = time.time()

        def edit(volume: Volume) -> Volume:
            old = volume.entries.get(staged.path)
            if old is None or old.type != FILE:
                return volume  # removed (or replaced) meanwhile
            new = replace(old, size=size, layer=layer, mtime=now if staged.mtime is None else staged.mtime, ctime=now)
            return replace(volume, entries={**volume.entries, staged.path: new})
        self._change(edit)
        staged.dirty, staged.base = False, layer

    def _admit(self, fh: int) -> None:
        """EMFILE unless `fh` is staged already or there is room for one more
        (every way a file gets staged: create, open with O_TRUNC, a write)."""
        with self._lock:
            if fh not in self._staged and len(self._staged) >= MAX_OPEN:
                raise fail(errno.EMFILE, f"at most {MAX_OPEN} files of a volume are open for writing at once")

    def _check_room(self, more: int) -> None:
        with self._lock:
            files = [s.file for s in self._staged.values()]
        used = sum(f.stat().st_size for f in files if f.exists())
        if used + more > self._max_staged:
            raise fail(errno.ENOSPC, f"files open for writing in this volume may hold {self._max_staged} "
                                     "bytes on the node until closed")
        if more > shutil.disk_usage(self._staging_dir).free - DISK_RESERVE:  # (made by _held, every caller's)
            raise fail(errno.ENOSPC, "the node's disk has no room for more staged writes")

    def _file(self, fh: int) -> Path:
        return self._staging_dir / f"{fh & 0xFFFFFFFFFFFFFFFF:x}"

    @contextmanager
    def _held(self, fh: int) -> Iterator[None]:
        """`fh`'s own lock, made on first use and dropped once no one holds
        or waits for it and nothing is staged for it: a guest naming handles
        it never opened leaves no lock behind."""
        with self._lock:
            lock, users = self._fh_locks.get(fh, (threading.Lock(), 0))
            self._fh_locks[fh] = (lock, users + 1)
        try:
            with lock:
                self._staging_dir.mkdir(parents=True, exist_ok=True)
                yield
        finally:
            with self._lock:
                users = self._fh_locks[fh][1] - 1
                if users == 0 and fh not in self._staged:
                    del self._fh_locks[fh]
                else:
                    self._fh_locks[fh] = (lock, users)


# edits: pure functions of a volume, applied under Volumes.change ------------------------------
def _put_new(volume: Volume, path: str, entry: Entry) -> Volume:
    """`volume` with a new `entry` at `path`: EEXIST if anything is there,
    ENOENT / ENOTDIR for a missing parent or one that is not a directory."""
    if path == "" or path in volume.entries:
        raise fail(errno.EEXIST)
    parent = dirname(path)
    if parent and parent not in volume.entries:
        raise fail(errno.ENOENT)
    if parent and volume.entries[parent].type != DIRECTORY:
        raise fail(errno.ENOTDIR)
    return put_entry(volume, path, entry, parents=False, replace_file=False)


def _moved(volume: Volume, path: str, to: str, *, noreplace: bool) -> Volume:
    """`volume` with `path` (and, for a directory, all under it) at `to`,
    rename(2)'s rules: a file there is replaced, an empty directory by a
    directory; a directory cannot move under itself."""
    source = volume.entry(path)
    if path == "" or to == "":
        raise fail(errno.EBUSY)
    if to == path:
        return volume
    if to.startswith(path + "/"):
        raise fail(errno.EINVAL, "a directory cannot move under itself")
    parent = dirname(to)
    if parent and parent not in volume.entries:
        raise fail(errno.ENOENT)
    if parent and volume.entries[parent].type != DIRECTORY:
        raise fail(errno.ENOTDIR)
    target = volume.entries.get(to)
    if target is not None:
        if noreplace:
            raise fail(errno.EEXIST)
        if target.type == DIRECTORY and source.type != DIRECTORY:
            raise fail(errno.EISDIR)
        if target.type != DIRECTORY and source.type == DIRECTORY:
            raise fail(errno.ENOTDIR)
        if target.type == DIRECTORY and volume.children(to):
            raise fail(errno.ENOTEMPTY)
    entries = {p: e for p, e in volume.entries.items() if p != to}
    moved = {p: e for p, e in entries.items() if p == path or p.startswith(path + "/")}
    if len(to) + max(len(p) for p in moved) - len(path) > MAX_PATH:
        raise fail(errno.ENAMETOOLONG, f"a path under /{to[:200]} would be longer than {MAX_PATH}")
    for p in moved:
        del entries[p]
    for p, e in moved.items():
        entries[to + p[len(path):]] = replace(e, ctime=time.time()) if p == path else e
    return replace(volume, entries=entries)
