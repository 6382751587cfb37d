"""The node's on-disk chunk cache: bounded, LRU, pinnable, restart-safe.

Layout of a cache directory (`strata mount --cache-dir D`):

    D/chunks/<aa>/<digest>   the chunk's *uncompressed* bytes, so a warm read
                             is one pread, no zstd on the hot path
    D/tmp/                   temp files of in-flight inserts
    D/index/                 LMDB: sub-database "entries"
                               digest (32 raw bytes) -> <Qd: bytes, last access (unix s)

Rules, each tested in tests/test_fusefs_cache.py:
- The byte total never exceeds `capacity`. Space is reserved (evicting first)
  before a file is written; an insert that cannot get space is skipped (the
  caller still has the verified bytes and serves them), never an overrun.
- Eviction is LRU. Above the high watermark (default 90%) it evicts down to
  the low watermark (80%) so eviction happens in batches, not per insert.
- Pinned chunks (the chunks of images a running sandbox has open) are evicted
  only when no unpinned chunk is left to evict.
- Entries are written to tmp/ then renamed, so a file under chunks/ is whole.
  Still, after a restart every entry is re-hashed on its first use (a disk
  can lose unsynced data in a crash); a mismatch drops the entry and counts a
  miss, so a torn entry is refetched, never served.
- The index survives restarts: a restarted daemon keeps what it had, in LRU
  order. Entries whose files vanished are dropped; a chunk file the index
  does not know (its commit was lost in a crash) is adopted, and like every
  entry after a restart it is re-hashed before it is served.
- The index is a cache of the files, so it is never fatal: LMDB trusts its
  pages and a torn or garbled index can crash its reader, so it is first
  read through in a child process (`_index_readable`); if that fails the
  index is set aside and rebuilt from the chunk files.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Hashable, Iterable, TypeVar

import blake3
import lmdb

from layerstore.digest import check_digest, is_digest
from layerstore.directio import DirectWriter, pread_into

_ENTRY = struct.Struct("<Qd")
T = TypeVar("T")
log = logging.getLogger("strata.fusefs")

# Read every entry of an index in a child: exit 0 only if all of it is sound.
_CHECK_INDEX = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=4, subdir=True)
with env.begin() as txn:
    if txn.get(b"entries") is not None:
        db = env.open_db(b"entries", txn=txn, create=False)
        for key, value in txn.cursor(db=db):
            if len(key) != 32 or len(value) != 16:
                sys.exit(3)
"""


@dataclass
class CacheStats:
    capacity: int = 0
    size: int = 0
    entries: int = 0
    pinned: int = 0
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    insertions: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    skipped_inserts: int = 0
    torn_entries: int = 0
    index_rebuilds: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ChunkCache:
    """Bounded on-disk cache of verified, uncompressed chunks."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity: int,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
    ) -> None:
        if capacity <= 0:
            raise ValueError("cache capacity must be positive")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        self.root = Path(root)
        self.capacity = capacity
        self._high = int(capacity * high_watermark)
        self._low = int(capacity * low_watermark)
        self._chunks = self.root / "chunks"
        self._tmp = self.root / "tmp"
        self._chunks.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(exist_ok=True)
        for stale in self._tmp.iterdir():
            stale.unlink(missing_ok=True)
        # No fsync per commit: the index is reconciled with the files at start
        # (an entry without its file is dropped, a file without an entry is
        # removed), so a crash costs refetches, never wrong data.
        rebuilt = not _index_readable(self.root / "index")
        if rebuilt:
            _set_aside(self.root / "index")
        self._env = lmdb.open(str(self.root / "index"), map_size=1 << 30, max_dbs=4, subdir=True, sync=False,
                              metasync=False)
        self._db = self._env.open_db(b"entries")
        self._lock = threading.Lock()
        self._writer = DirectWriter()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._verified: set[str] = set()
        self._pins: dict[Hashable, set[str]] = {}
        self._pin_count: collections.Counter[str] = collections.Counter()
        self._reserved = 0
        self._touched: dict[str, float] = {}
        self.stats = CacheStats(capacity=capacity, index_rebuilds=int(rebuilt))
        self._load()

    # setup ------------------------------------------------------------------
    def _path(self, digest: str) -> Path:
        return self._chunks / digest[:2] / digest

    def _load(self) -> None:
        """Rebuild the in-memory LRU from the index, reconciling with the files."""
        entries: list[tuple[float, str, int]] = []
        gone: list[bytes] = []
        with self._env.begin(db=self._db) as txn:
            for key, value in txn.cursor():
                digest = bytes(key).hex()
                size, atime = _ENTRY.unpack(value)  # sizes checked by _index_readable
                try:
                    actual = os.stat(self._path(digest)).st_size
                except FileNotFoundError:
                    gone.append(bytes(key))
                    continue
                if actual != size:
                    gone.append(bytes(key))
                    self._path(digest).unlink(missing_ok=True)
                    continue
                entries.append((atime, digest, size))
        entries += self._adopt({d for _a, d, _s in entries})
        if gone:
            with self._env.begin(write=True, db=self._db) as txn:
                for key in gone:
                    txn.delete(key)
        for _atime, digest, size in sorted(entries):
            self._lru[digest] = size
        self.stats.size = sum(self._lru.values())
        self.stats.entries = len(self._lru)
        if self.stats.size > self.capacity:  # capacity lowered since last run
            with self._lock:
                self._evict_locked(self.stats.size - self._low)

    def _adopt(self, known: set[str]) -> list[tuple[float, str, int]]:
        """Chunk files the index does not name: entries again (verified on
        first use, as every entry after a restart), oldest write first.
        Files that cannot be chunks are removed."""
        found = []
        for sub in self._chunks.iterdir():
            for f in sub.iterdir():
                if f.name in known:
                    continue
                if sub.name != f.name[:2] or not is_digest(f.name) or not f.is_file():
                    _remove(f)
                    continue
                st = f.stat()
                found.append((st.st_mtime, f.name, st.st_size))
        if found:
            with self._env.begin(write=True, db=self._db) as txn:
                for atime, digest, size in found:
                    txn.put(bytes.fromhex(digest), _ENTRY.pack(size, atime))
        return found

    # reads ------------------------------------------------------------------
    def _verify_once(self, digest: str, path: Path) -> bool:
        if digest in self._verified:
            return True
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False
        if blake3.blake3(data).hexdigest() != digest:
            return False
        with self._lock:
            self._verified.add(digest)
        return True

    def _drop_torn(self, digest: str) -> None:
        with self._lock:
            size = self._lru.pop(digest, None)
            if size is not None:
                self.stats.size -= size
                self.stats.entries -= 1
                self.stats.torn_entries += 1
        self._path(digest).unlink(missing_ok=True)
        with self._env.begin(write=True, db=self._db) as txn:
            txn.delete(bytes.fromhex(digest))

    def _touch(self, digest: str) -> bool:
        with self._lock:
            if digest not in self._lru:
                self.stats.misses += 1
                return False
            self._lru.move_to_end(digest)
            self._touched[digest] = time.time()
            return True

    def read(self, digest: str, offset: int = 0, length: int = -1) -> bytes | None:
        """Bytes [offset, offset+length) of a cached chunk (all if length < 0), or None on a miss."""
        return self._read_entry(digest, lambda path: _pread(path, offset, length))

    def read_into(self, digest: str, offset: int, out: memoryview) -> int | None:
        """Like `read`, into `out` and around the page cache where aligned
        (layerstore/directio.py): for a reader that keeps what it reads (a
        FUSE file's page cache), so the cache file's own would be a second
        copy whose allocation cost a warm read a third of the daemon's CPU."""
        return self._read_entry(digest, lambda path: pread_into(path, out, offset, direct=self._writer.direct))

    def _read_entry(self, digest: str, read: Callable[[Path], T]) -> T | None:
        """`read(path)` of a cached chunk's file, counted as a hit; None,
        counted as a miss, if it is not cached, torn or evicted meanwhile."""
        if not self._touch(digest):
            return None
        path = self._path(digest)
        if not self._verify_once(digest, path):
            self._drop_torn(digest)
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            value = read(path)
        except FileNotFoundError:  # evicted between touch and open
            with self._lock:
                self.stats.misses += 1
            return None
        with self._lock:
            self.stats.hits += 1
        return value

    def read_verified(self, digest: str, offset: int, length: int) -> bytes | None:
        """Like `read`, but only for entries already verified in this process; never hashes.

        Cheap enough (one pread) to run on the FUSE event loop for small reads.
        """
        with self._lock:
            if digest not in self._verified or digest not in self._lru:
                return None
            self._lru.move_to_end(digest)
            self._touched[digest] = time.time()
        try:
            fd = os.open(self._path(digest), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        with self._lock:
            self.stats.hits += 1
        return data

    def will_need(self, digest: str) -> None:
        """Ask the kernel to read a cached chunk's file into the page cache
        now, without waiting (a read about to come then finds it there)."""
        try:
            fd = os.open(self._path(digest), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # evicted meanwhile
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def contains(self, digest: str) -> bool:
        with self._lock:
            return digest in self._lru

    # writes -----------------------------------------------------------------
    def put(self, digest: str, data: bytes) -> bool:
        """Insert verified chunk bytes; False if no space could be made (all pinned)."""
        check_digest(digest, what="chunk digest")
        size = len(data)
        with self._lock:
            if digest in self._lru:
                return True
            if size > self.capacity or not self._make_room_locked(size):
                self.stats.skipped_inserts += 1
                return False
            self._reserved += size
        path = self._path(digest)
        tmp = self._tmp / f"{digest}.{uuid.uuid4().hex[:8]}"
        try:
            path.parent.mkdir(exist_ok=True)
            self._write_file(tmp, data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._reserved -= size
                self.stats.skipped_inserts += 1
            return False
        now = time.time()
        with self._env.begin(write=True, db=self._db) as txn:
            txn.put(bytes.fromhex(digest), _ENTRY.pack(size, now))
        with self._lock:
            self._reserved -= size
            self._lru[digest] = size
            self._verified.add(digest)
            self.stats.size += size
            self.stats.entries += 1
            self.stats.insertions += 1
            self.stats.bytes_fetched += size
            if self.stats.size + self._reserved > self._high:
                self._evict_locked(self.stats.size + self._reserved - self._low)
        return True

    def _write_file(self, path: Path, data: bytes) -> None:
        """Write a cache file around the page cache where the filesystem
        allows (layerstore/directio.py).

        Direct I/O skips filling the page cache with a second copy of data
        the reader already has in memory, and on virtualised hosts it costs a
        fraction of the kernel time of a buffered write (bench/fuse_read.py).
        """
        with self._writer.open(path, os.O_CREAT | os.O_EXCL, 0o600) as f:
            f.pwrite(data, 0)

    def _make_room_locked(self, size: int) -> bool:
        over = self.stats.size + self._reserved + size - self.capacity
        if over <= 0:
            return True
        target = max(over, self.stats.size + self._reserved + size - self._low)
        freed = self._evict_locked(target)
        return freed >= over

    def _evict_locked(self, want: int) -> int:
        """Evict at least `want` bytes if possible: unpinned LRU first, pinned last."""
        victims: list[str] = []
        freed = 0
        for pinned_pass in (False, True):
            for digest, size in self._lru.items():
                if freed >= want:
                    break
                if (self._pin_count[digest] > 0) == pinned_pass:
                    victims.append(digest)
                    freed += size
        return self._remove_locked(victims)

    def _remove_locked(self, victims: list[str]) -> int:
        freed = 0
        for digest in victims:
            size = self._lru.pop(digest)
            self._path(digest).unlink(missing_ok=True)
            self._verified.discard(digest)
            self._touched.pop(digest, None)
            self.stats.size -= size
            self.stats.entries -= 1
            self.stats.evictions += 1
            self.stats.bytes_evicted += size
            freed += size
        if victims:
            with self._env.begin(write=True, db=self._db) as txn:
                for digest in victims:
                    txn.delete(bytes.fromhex(digest))
        return freed

    def drop(self, digests: Iterable[str] | None = None) -> int:
        """Evict the given chunks (or every unpinned one); returns bytes freed."""
        with self._lock:
            if digests is None:
                victims = [d for d in self._lru if self._pin_count[d] == 0]
            else:
                victims = [d for d in dict.fromkeys(digests) if d in self._lru]
            return self._remove_locked(victims)

    # pins -------------------------------------------------------------------
    def pin(self, owner: Hashable, digests: Iterable[str]) -> None:
        """Prefer to keep `digests` while `owner` (e.g. an open file) holds them."""
        new = set(digests)
        with self._lock:
            old = self._pins.get(owner, set())
            self._pin_count.update(new - old)
            self._pins[owner] = old | new
            self.stats.pinned = sum(1 for d in self._lru if self._pin_count[d] > 0)

    def unpin(self, owner: Hashable) -> None:
        with self._lock:
            for digest in self._pins.pop(owner, set()):
                self._pin_count[digest] -= 1
                if self._pin_count[digest] <= 0:
                    del self._pin_count[digest]
            self.stats.pinned = sum(1 for d in self._lru if self._pin_count[d] > 0)

    # lifecycle --------------------------------------------------------------
    def snapshot_stats(self) -> dict[str, int]:
        with self._lock:
            return self.stats.as_dict()

    def flush(self) -> None:
        """Persist access times so LRU order survives a restart."""
        with self._lock:
            touched, self._touched = self._touched, {}
            sizes = {d: self._lru[d] for d in touched if d in self._lru}
        if not sizes:
            return
        with self._env.begin(write=True, db=self._db) as txn:
            for digest, size in sizes.items():
                txn.put(bytes.fromhex(digest), _ENTRY.pack(size, touched[digest]))

    def close(self) -> None:
        self.flush()
        self._env.close()


def _index_readable(index: Path) -> bool:
    """Whether the LMDB index at `index` reads through without error, tried
    in a child process: a torn file can crash LMDB's reader outright. An
    absent index is readable (there is nothing to lose)."""
    if not (index / "data.mdb").exists():
        return True
    try:
        r = subprocess.run([sys.executable, "-c", _CHECK_INDEX, str(index)], capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


def _set_aside(index: Path) -> None:
    """Move an unreadable index out of the way (kept for a post-mortem;
    one at a time), so a fresh one is rebuilt from the chunk files."""
    broken = index.with_name("index.broken")
    log.warning("cache index %s is unreadable: moved to %s, rebuilding it from the chunk files", index, broken)
    shutil.rmtree(broken, ignore_errors=True)
    index.rename(broken)


def _pread(path: Path, offset: int, length: int) -> bytes:
    """Bytes [offset, offset+length) of the file at `path` (all of it if length < 0)."""
    with open(path, "rb", buffering=0) as f:
        return f.read() if length < 0 else os.pread(f.fileno(), length, offset)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
