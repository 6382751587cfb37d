"""Read-through: a backend whose reads fall back to other sources, verified.

A node's store is a local backend plus the places it may read a chunk it
lacks: other nodes (layerstore/peers.py) and the shared remote store. That
composition is a wrapper, built where a store is opened (store.open_store),
so the read path is visible in one place:

    ReadThroughBackend(local, [peer A, peer B, remote], prefix="chunks/")

Obligations of `ReadThroughBackend` (it implements `Backend`):
- Writes, lists, deletes and existence checks (`put`, `delete`,
  `delete_many`, `list`, `stat`, `has_many`) go to the primary only: what a
  store holds is what its primary holds, so leases, GC and publication
  checks all speak about one store.
- `get` of a key under `prefix` that the primary lacks asks each fallback in
  order. An object from a fallback is returned only after `verify(key, blob)`
  accepted it; one that fails (CorruptObject) is counted as
  `<label>_rejected`, reported to the fallback's `on_failure`, and the next
  fallback is asked. Nothing is written back (caching is the mount's chunk
  cache's job). Keys outside `prefix` are the primary's alone.
- Errors: NotFound naming every store asked when none holds the key;
  BackendUnavailable when none returned it and a fallback that is not
  `best_effort` could not be reached (the object may well exist there);
  CorruptObject when the only copies found failed verification. A
  best-effort fallback's failures (a peer down) only count as misses.
- `counts` tallies where each `get` under `prefix` was answered from: the
  primary's label ("local"), a fallback's label ("peer", "remote"), and
  `<label>_rejected` for objects that failed verification. Store.sources
  reads it; the mount daemon reports it.

The primary's objects are not verified here (the reader verifies what it
decodes, Store.read_chunk); a fallback's object is decoded here to decide
whether to use it and again by the reader, a cost paid only on the network
path, where the fetch dominates.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .backend import Backend, ObjectInfo, ObjectVersion
from .errors import BackendUnavailable, CorruptObject, NotFound

Verify = Callable[[str, bytes], None]


@runtime_checkable
class Source(Protocol):
    """Somewhere a read-through `get` may find an object its primary lacks.

    - `get` returns the object's bytes (unverified) or raises NotFound;
      BackendUnavailable when the source can't be reached.
    - `has_many` returns the subset of `keys` the source promises to serve
      (an empty set if it promises nothing, as a peer does).
    Every `Backend` is a `Source`.
    """

    def get(self, key: str) -> bytes: ...

    def has_many(self, keys: Iterable[str]) -> set[str]: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Fallback:
    """One source a `ReadThroughBackend` asks after its primary.

    `label` names it in the counters ("peer", "remote"); `best_effort` makes
    its failures plain misses (a peer) instead of an error worth surfacing
    (the remote store); `on_failure(why)` is told when it could not be reached
    or sent an object that failed verification (a peer sits out a while).
    """

    label: str
    source: Source
    best_effort: bool = False
    on_failure: Callable[[str], None] | None = None

    def failed(self, why: str) -> None:
        if self.on_failure is not None:
            self.on_failure(why)


class ReadThroughBackend:
    """A primary backend whose reads under `prefix` fall back to `fallbacks`, verified (see module doc)."""

    def __init__(self, primary: Backend, fallbacks: Sequence[Fallback] = (), *, prefix: str,
                 verify: Verify, label: str = "local") -> None:
        self.primary = primary
        self.fallbacks = tuple(fallbacks)
        self.prefix = prefix
        self.label = label
        self._verify = verify
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, label: str) -> None:
        with self._lock:
            self.counts[label] += 1

    def get(self, key: str) -> bytes:
        try:
            blob = self.primary.get(key)
        except NotFound:
            if not key.startswith(self.prefix):
                raise
        else:
            if key.startswith(self.prefix):
                self._count(self.label)
            return blob
        unreachable: list[str] = []
        corrupt: CorruptObject | None = None
        for fallback in self.fallbacks:
            try:
                blob = fallback.source.get(key)
                self._verify(key, blob)
            except NotFound:
                continue
            except BackendUnavailable as exc:
                fallback.failed(str(exc))
                if not fallback.best_effort:
                    unreachable.append(str(exc))
                continue
            except CorruptObject as exc:
                self._count(f"{fallback.label}_rejected")
                fallback.failed(f"sent an object that fails verification ({exc})")
                if not fallback.best_effort:
                    corrupt = exc
                continue
            self._count(fallback.label)
            return blob
        if unreachable:
            raise BackendUnavailable(f"object {key} is not in {self.describe_path()} and "
                                     f"{len(unreachable)} store(s) could not be asked: {unreachable[0]}")
        if corrupt is not None:
            raise corrupt
        raise NotFound(f"object {key} not found in {self.describe_path()}")

    def readable_many(self, keys: Iterable[str]) -> set[str]:
        """The keys `get` can serve: the primary's, then what each fallback promises of the rest."""
        wanted = list(dict.fromkeys(keys))
        found = self.primary.has_many(wanted)
        for fallback in self.fallbacks:
            rest = [k for k in wanted if k not in found and k.startswith(self.prefix)]
            if not rest:
                break
            found |= fallback.source.has_many(rest)
        return found

    def describe_path(self) -> str:
        """Every store a read may ask, in order: `local -> peer http://b:8080 -> remote s3://...`."""
        return " -> ".join([self.primary.describe(),
                            *(f"{f.label} {f.source.describe()}" for f in self.fallbacks)])

    # primary only ---------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        self.primary.put(key, data)

    def stat(self, key: str) -> int | None:
        return self.primary.stat(key)

    def head(self, key: str) -> ObjectVersion | None:
        return self.primary.head(key)

    def put_new(self, key: str, data: bytes) -> str | None:
        return self.primary.put_new(key, data)

    def put_if(self, key: str, data: bytes, version: str) -> str | None:
        return self.primary.put_if(key, data, version)

    def has_many(self, keys: Iterable[str]) -> set[str]:
        return self.primary.has_many(keys)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.primary.list(prefix)

    def delete(self, key: str) -> None:
        self.primary.delete(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        self.primary.delete_many(keys)

    def describe(self) -> str:
        return self.primary.describe()

    def close(self) -> None:
        self.primary.close()
        for fallback in self.fallbacks:
            fallback.source.close()
