"""The embedded backend: objects as files in a local directory.

On-disk layout of a local store directory:

    STORE/
      STRATA              marker: "strata-store 1\\n" (format version)
      objects/<key>       one file per object, e.g. objects/chunks/ab/ab12...
      tmp/                temp files; a crash may leave some, ignored and reaped
      catalog/            LMDB catalog (layerstore/catalog.py), not objects
      .conditional.lock   flock(2)ed by put_if, so compare-and-put is one step

`put` writes a temp file in tmp/ (same filesystem; with `direct`, a large
object around the page cache), fsyncs it, renames it into
place and fsyncs the directory, so an object is either whole and durable or
absent, whatever moment the process dies at. `put_new` links the temp file
into place instead, which fails if the key exists.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Iterable, Iterator

from .backend import ObjectInfo, ObjectVersion, check_key
from .directio import SMALL, DirectWriter
from .errors import AccessDenied, BackendError, InvalidInput, NotFound

MARKER = "strata-store 1\n"
TMP_MAX_AGE = 24 * 3600
CONDITIONAL_LOCK = ".conditional.lock"  # held by put_if: compare and put as one step, across processes


def _os_error(exc: OSError, what: str) -> Exception:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AccessDenied(f"local store: permission denied {what}: {exc.strerror}")
    if exc.errno == errno.ENOSPC:
        return BackendError(f"local store: no space left on device {what}")
    return BackendError(f"local store: {what}: {exc.strerror or exc}")


class LocalDirBackend:
    """A `Backend` over a directory on a local filesystem."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, fsync: bool = True,
                 direct: bool = False) -> None:
        """`direct` writes large objects around the page cache (layerstore/directio.py):
        for a bulk writer (an import, a push or pull) whose objects nobody reads
        back soon. A node keeps the default: what it seals, its forks read at once."""
        self.root = Path(root).absolute()
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._fsync = fsync
        self._known_dirs: set[Path] = set()
        self._lock = threading.Lock()
        self._writer = DirectWriter(direct=direct)
        marker = self.root / "STRATA"
        if marker.exists():
            if marker.read_text() != MARKER:
                raise InvalidInput(f"{self.root} holds a store of an unknown format ({marker} differs)")
        elif not create:
            raise NotFound(f"no Strata store at {self.root}")
        elif self.root.exists() and not self.root.is_dir():
            raise InvalidInput(f"store path {self.root} exists and is not a directory")
        elif self.root.exists() and any(p.name not in ("objects", "tmp", "catalog") for p in self.root.iterdir()):
            raise InvalidInput(f"store path {self.root} is a non-empty directory that is not a Strata store")
        else:
            try:
                self._objects.mkdir(parents=True, exist_ok=True)
                self._tmp.mkdir(exist_ok=True)
                tmp = self._tmp / f"marker.{uuid.uuid4().hex}"
                tmp.write_text(MARKER)
                os.replace(tmp, marker)
            except OSError as exc:
                raise _os_error(exc, f"creating store at {self.root}") from None

    def describe(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        return self._objects / check_key(key)

    def _ensure_dir(self, directory: Path) -> None:
        if directory in self._known_dirs:
            return
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._known_dirs.add(directory)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_aside(key, data)
        try:
            os.replace(tmp, path)
            self._sync_dir(path.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise _os_error(exc, f"writing {key}") from None

    def _write_aside(self, key: str, data: bytes) -> Path:
        """`data` in a temp file of the store (synced), ready to be renamed or
        linked into place. With `direct`, large objects (chunks, packs) go
        around the page cache: copying them in was most of an import's
        system time on this host (1 GiB: 1.0-1.2 s -> 0.3-0.45 s)."""
        path = self._path(key)
        tmp = self._tmp / f"{path.name}.{uuid.uuid4().hex}"
        try:
            self._ensure_dir(path.parent)
            with self._writer.open(tmp, os.O_CREAT | os.O_EXCL, large=len(data) >= SMALL) as f:
                f.pwrite(data, 0)
                if self._fsync:
                    f.fsync()
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise _os_error(exc, f"writing {key}") from None
        return tmp

    def _sync_dir(self, directory: Path) -> None:
        if self._fsync:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def head(self, key: str) -> ObjectVersion | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(exc, f"checking {key}") from None
        return ObjectVersion(st.st_size, st.st_mtime, f"{st.st_ino}.{st.st_mtime_ns}")

    def put_new(self, key: str, data: bytes) -> str | None:
        """Written aside, then hard-linked into place: link(2) fails if the key exists."""
        path = self._path(key)
        tmp = self._write_aside(key, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        except OSError as exc:
            raise _os_error(exc, f"writing {key}") from None
        finally:
            tmp.unlink(missing_ok=True)
        self._sync_dir(path.parent)
        info = self.head(key)
        return info.version if info is not None else None

    def put_if(self, key: str, data: bytes, version: str) -> str | None:
        """Compare and put under an exclusive lock file every process of the store shares."""
        with open(self.root / CONDITIONAL_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = self.head(key)
            if current is None or current.version != version:
                return None
            self.put(key, data)
            info = self.head(key)
            return info.version if info is not None else None

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise NotFound(f"object {key} not found in {self.root}") from None
        except OSError as exc:
            raise _os_error(exc, f"reading {key}") from None

    def stat(self, key: str) -> int | None:
        info = self.head(key)
        return None if info is None else info.size

    def has_many(self, keys: Iterable[str]) -> set[str]:
        return {k for k in keys if self.stat(k) is not None}

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix:
            check_key(prefix.rstrip("/") or "x")
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._objects / base if base else self._objects
        for dirpath, _dirs, files in os.walk(top):
            rel = os.path.relpath(dirpath, self._objects)
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    try:
                        st = os.stat(os.path.join(dirpath, name))
                        yield ObjectInfo(key, st.st_size, st.st_mtime)
                    except FileNotFoundError:
                        continue

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _os_error(exc, f"deleting {key}") from None

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def reap_tmp(self, *, max_age: float = TMP_MAX_AGE, now: float | None = None) -> int:
        """Remove temp files older than `max_age` (left by crashed writers)."""
        cutoff = (time.time() if now is None else now) - max_age
        removed = 0
        for entry in os.scandir(self._tmp):
            try:
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def close(self) -> None:
        pass
