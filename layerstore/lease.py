"""Leases and the GC lock: how writers and the garbage collector stay apart.

    leases/<uuid>   {"holder": "host:pid", "what": "push NAME", "expires": <unix s>}
    locks/gc        {"holder": "host:pid", "expires": <unix s>}

A push may skip a chunk the destination already holds; if that chunk were
unreferenced and a GC deleted it a moment later, the manifest the push then
publishes would name a missing chunk. So: a writer puts its lease first and
then waits out any live GC lock; a GC puts its lock first and then deletes
nothing while any live lease exists; and a writer checks its lease is still
there and was renewed in time (`Lease.check`) right before it publishes. The store reads its own writes (local
directories, S3, SeaweedFS), so of two that start together one always sees
the other. Leases are renewed by a heartbeat; one whose holder died expires
after `ttl` and is ignored (and removed by the next GC).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from types import TracebackType

from .backend import Backend
from .errors import BackendError, CorruptObject, NotFound, StrataError

LEASE_PREFIX = "leases/"
GC_LOCK = "locks/gc"
DEFAULT_TTL = 120.0


def holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _record(ttl: float, **extra: str) -> bytes:
    return json.dumps({"holder": holder(), "expires": time.time() + ttl, **extra}, sort_keys=True).encode()


def read_record(backend: Backend, key: str) -> dict | None:
    """A lease or lock object, or None if absent or unreadable (a torn one is treated as expired)."""
    try:
        data = json.loads(backend.get(key))
        float(data["expires"])
        return data
    except NotFound:
        return None
    except (ValueError, KeyError, TypeError):
        return {"holder": "?", "expires": 0.0}


def live_leases(backend: Backend, *, now: float | None = None) -> dict[str, dict]:
    """Lease key -> record for every lease that has not expired."""
    now = time.time() if now is None else now
    out = {}
    for info in backend.list(LEASE_PREFIX):
        record = read_record(backend, info.key)
        if record is not None and float(record["expires"]) > now:
            out[info.key] = record
    return out


class Lease:
    """Held while a push writes into a store; renewed every ttl/3 seconds."""

    def __init__(self, backend: Backend, what: str, *, ttl: float = DEFAULT_TTL, gc_wait: float = 300.0) -> None:
        self.backend = backend
        self.what = what
        self.ttl = ttl
        self.gc_wait = gc_wait
        self.key = f"{LEASE_PREFIX}{uuid.uuid4().hex}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._renewed = 0.0  # time.monotonic() of the last put that reached the store

    def __enter__(self) -> "Lease":
        self.backend.put(self.key, _record(self.ttl, what=self.what))
        self._renewed = time.monotonic()
        deadline = time.monotonic() + self.gc_wait
        while True:  # lease first, then wait out a GC that is deleting
            lock = read_record(self.backend, GC_LOCK)
            if lock is None or float(lock["expires"]) <= time.time():
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
                self.backend.put(self.key, _record(self.ttl, what=self.what))
                self._renewed = time.monotonic()
            except (BackendError, CorruptObject) as exc:  # keep trying; the lease may lapse
                self.error = exc

    def check(self) -> None:
        """Call right before publishing: refuse if the lease may have lapsed
        (no renewal reached the store for most of a ttl, or a GC removed it
        as expired), since a GC may then have deleted a chunk this writer
        skipped because it was stored. Nothing published is left broken:
        the caller publishes nothing and the user runs it again."""
        quiet = time.monotonic() - self._renewed
        if quiet > self.ttl * 0.75:
            raise StrataError(f"the write lease on {self.backend.describe()} went {quiet:.0f} s without a renewal "
                              f"(ttl {self.ttl:.0f} s; last error: {self.error}); nothing was published: run it again")
        try:
            self.backend.get(self.key)
        except NotFound:
            raise StrataError(f"the write lease on {self.backend.describe()} was removed as expired (a garbage "
                              "collection may have run); nothing was published: run it again") from None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.backend.delete(self.key)
        except StrataError:
            pass  # it expires on its own


class GcLock:
    """Held by a GC while it deletes; a GC that finds a live one does not delete."""

    def __init__(self, backend: Backend, *, ttl: float = DEFAULT_TTL) -> None:
        self.backend = backend
        self.ttl = ttl

    def acquire(self) -> dict | None:
        """Take the lock; returns the live lock of another GC instead, if there is one."""
        current = read_record(self.backend, GC_LOCK)
        if current is not None and float(current["expires"]) > time.time() and current["holder"] != holder():
            return current
        self.backend.put(GC_LOCK, _record(self.ttl))
        return None

    def renew(self) -> None:
        self.backend.put(GC_LOCK, _record(self.ttl))

    def release(self) -> None:
        self.backend.delete(GC_LOCK)
