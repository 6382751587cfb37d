"""Leases and the GC lock: how writers and the garbage collector stay apart.

    leases/<uuid>   {"holder": "host:pid", "what": "push NAME", "ttl": 120, "token": "<uuid>"}
    locks/gc        {"holder": "host:pid", "ttl": 120, "token": "<uuid>"}

A push may skip a chunk the destination already holds; if that chunk were
unreferenced and a GC deleted it a moment later, the manifest the push then
publishes would name a missing chunk. So: a writer puts its lease first and
then waits out any live GC lock; a GC takes its lock first and then deletes
nothing while any live lease exists; and a writer checks its lease is still
there and fresh (`Lease.check`) right before it publishes. The store reads
its own writes (local directories, S3, SeaweedFS), so of two that start
together one always sees the other.

Time is the store's, never a node's: a lease or lock is live while the
store's own last-modified time of its object plus its ttl is later than
the store's now (the last-modified time of an object just written,
`store_now`). Nodes whose clocks disagree by hours still agree on that.
Leases are renewed by a heartbeat every ttl/3; one whose holder died stops
being live after `ttl` and is removed by the next GC.

The GC lock is taken with a conditional create (`Backend.put_new`: S3's
If-None-Match, a hard link locally): of two GCs exactly one gets it. A
stale lock (its holder died) is taken over with a conditional replace of
the version seen stale (`put_if`, If-Match), so again only one GC wins;
renewing is a conditional replace of the holder's own version, so a GC that
lost its lock finds out before it deletes anything more.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from types import TracebackType

from .backend import Backend, ObjectInfo, ObjectVersion
from .errors import BackendError, CorruptObject, NotFound, StrataError

LEASE_PREFIX = "leases/"
GC_LOCK = "locks/gc"
CLOCK_PREFIX = "locks/clock-"
DEFAULT_TTL = 120.0


def holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _record(ttl: float, token: str, **extra: str) -> bytes:
    return json.dumps({"holder": holder(), "ttl": ttl, "token": token, **extra}, sort_keys=True).encode()


def store_now(backend: Backend) -> float:
    """The store's clock: the last-modified time of an object written just now."""
    key = f"{CLOCK_PREFIX}{uuid.uuid4().hex}"
    backend.put(key, b"")
    try:
        info = backend.head(key)
    finally:
        backend.delete(key)
    if info is None:
        raise BackendError(f"{backend.describe()} lost an object it had just written ({key})")
    return info.modified


def read_record(backend: Backend, key: str) -> dict | None:
    """A lease or lock object, or None if absent; a torn or foreign one reads
    as having a ttl of 0 (expired)."""
    try:
        data = json.loads(backend.get(key))
        float(data["ttl"])
        return data
    except NotFound:
        return None
    except (ValueError, KeyError, TypeError):
        return {"holder": "?", "ttl": 0.0, "token": ""}


def is_live(record: dict, info: ObjectVersion | ObjectInfo, now: float) -> bool:
    """Renewed within its ttl, by the store's clock (`now` from `store_now`)."""
    return info.modified + float(record.get("ttl", 0.0)) > now


def live_leases(backend: Backend, *, now: float | None = None) -> dict[str, dict]:
    """Lease key -> record for every lease that is live by the store's clock."""
    now = store_now(backend) if now is None else now
    out = {}
    for info in backend.list(LEASE_PREFIX):
        record = read_record(backend, info.key)
        if record is not None and is_live(record, info, now):
            out[info.key] = record
    return out


def expired_leases(backend: Backend, *, now: float) -> list[str]:
    """Keys of leases whose holders stopped renewing them (GC removes them)."""
    out = []
    for info in backend.list(LEASE_PREFIX):
        record = read_record(backend, info.key)
        if record is not None and not is_live(record, info, now):
            out.append(info.key)
    return out


class Lease:
    """Held while a push or import writes into a store; renewed every ttl/3 seconds."""

    def __init__(self, backend: Backend, what: str, *, ttl: float = DEFAULT_TTL, gc_wait: float = 300.0) -> None:
        self.backend = backend
        self.what = what
        self.ttl = ttl
        self.gc_wait = gc_wait
        self.key = f"{LEASE_PREFIX}{uuid.uuid4().hex}"
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._renewed = 0.0  # time.monotonic() of the last put that reached the store

    def _put(self) -> None:
        self.backend.put(self.key, _record(self.ttl, self.token, what=self.what))
        self._renewed = time.monotonic()

    def __enter__(self) -> "Lease":
        self._put()
        deadline = time.monotonic() + self.gc_wait
        while True:  # lease first, then wait out a GC that is deleting
            lock = live_lock(self.backend)
            if lock is None:
                break
            if time.monotonic() > deadline:
                self.backend.delete(self.key)
                raise StrataError(f"{self.backend.describe()} is being garbage-collected by {lock['holder']}; "
                                  f"gave up after {self.gc_wait:.0f} s")
            time.sleep(0.5)
        self._thread = threading.Thread(target=self._heartbeat, name="strata-lease", daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._put()
            except (BackendError, CorruptObject) as exc:  # keep trying; check() refuses if it lapses
                self.error = exc

    def check(self) -> None:
        """Call right before publishing: refuse if the lease may have lapsed
        (no renewal reached the store for most of a ttl, or it is gone: a GC
        removed it as expired), since a GC may then have deleted a chunk this
        writer skipped because it was stored. Nothing published is left
        broken: the caller publishes nothing and the user runs it again."""
        quiet = time.monotonic() - self._renewed
        if quiet > self.ttl * 0.75:
            raise StrataError(f"the write lease on {self.backend.describe()} went {quiet:.0f} s without a renewal "
                              f"(ttl {self.ttl:.0f} s; last error: {self.error}); nothing was published: run it again")
        if self.backend.head(self.key) is None:
            raise StrataError(f"the write lease on {self.backend.describe()} was removed as expired (a garbage "
                              "collection may have run); nothing was published: run it again")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.backend.delete(self.key)
        except StrataError:
            pass  # it expires on its own


def live_lock(backend: Backend) -> dict | None:
    """The GC lock's record if a GC holds it (live by the store's clock), else None."""
    info = backend.head(GC_LOCK)
    if info is None:
        return None
    record = read_record(backend, GC_LOCK)
    if record is None or not is_live(record, info, store_now(backend)):
        return None
    return record


class GcLock:
    """Held by a GC while it deletes; a GC that finds a live one does not delete."""

    def __init__(self, backend: Backend, *, ttl: float = DEFAULT_TTL) -> None:
        self.backend = backend
        self.ttl = ttl
        self.token = uuid.uuid4().hex
        self.version: str | None = None

    def _data(self) -> bytes:
        return _record(self.ttl, self.token)

    def acquire(self) -> dict | None:
        """Take the lock; returns the live lock of another GC instead, if there is one."""
        for _ in range(5):  # the lock may change under us between looking and taking
            self.version = self.backend.put_new(GC_LOCK, self._data())
            if self.version is not None:
                return None
            info = self.backend.head(GC_LOCK)
            if info is None:
                continue  # released just now: try to create it again
            record = read_record(self.backend, GC_LOCK) or {}
            if record.get("token") == self.token:  # our own create, whose answer was lost
                self.version = info.version
                return None
            if is_live(record, info, store_now(self.backend)):
                return record
            self.version = self.backend.put_if(GC_LOCK, self._data(), info.version)  # take over a stale one
            if self.version is not None:
                return None
        return read_record(self.backend, GC_LOCK) or {"holder": "?"}

    def renew(self) -> None:
        """Extend the lock; StrataError if another GC took it (this one must stop deleting)."""
        if self.version is None:
            raise StrataError("renewing a GC lock that is not held")
        version = self.backend.put_if(GC_LOCK, self._data(), self.version)
        if version is None:
            self.version = None
            other = read_record(self.backend, GC_LOCK) or {"holder": "nobody"}
            raise StrataError(f"this GC lost its lock on {self.backend.describe()} (now held by "
                              f"{other.get('holder')}); it stopped deleting")
        self.version = version

    def release(self) -> None:
        """Delete the lock if it is still this GC's (a lock another GC took over is left alone)."""
        if self.version is None:
            return
        info = self.backend.head(GC_LOCK)
        if info is not None and info.version == self.version:
            self.backend.delete(GC_LOCK)
        self.version = None
