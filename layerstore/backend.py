"""The one interface every object store implements, and wrappers around it.

Strata's store is a flat key -> bytes namespace (keys like `chunks/ab/ab12...`,
`manifests/<id>`, `refs/<name>/<tag>`). Backends know nothing about chunks or
manifests; everything above them (hashing, verification, layout) is shared.
That keeps a backend small enough to check against the contract tests in
tests/test_backend_contract.py, which every backend must pass.

Keys are `/`-separated, each part matching [A-Za-z0-9._-]+ and not `.`/`..`;
`check_key` enforces that so no key can escape a directory or a prefix.
"""

from __future__ import annotations

import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, NamedTuple, Protocol, TypeVar, runtime_checkable

from .errors import BackendUnavailable, InvalidInput

_KEY_PART_RE = re.compile(r"[A-Za-z0-9._-]+")
T = TypeVar("T")


def check_key(key: str) -> str:
    """Return `key` if it is a safe object key, else raise InvalidInput."""
    if not isinstance(key, str) or not key or len(key) > 512:
        raise InvalidInput(f"invalid object key {key!r}")
    for part in key.split("/"):
        if part in (".", "..") or not _KEY_PART_RE.fullmatch(part):
            raise InvalidInput(f"invalid object key {key!r}")
    return key


class ObjectInfo(NamedTuple):
    """One listed object. `modified` (unix seconds) is when it was last put,
    by the store's clock: GC never deletes what is younger than its grace
    period."""

    key: str
    size: int
    modified: float


class ObjectVersion(NamedTuple):
    """What `head` says of one object: `version` changes with every put."""

    size: int
    modified: float
    version: str


@runtime_checkable
class Backend(Protocol):
    """A flat, durable key -> bytes store.

    Obligations, which the contract tests check for every implementation:
    - `put` is atomic and durable: once it returns, `get` returns exactly
      `data`, even after a crash; a reader never sees a partial object; while
      it runs, readers see the old object or none. Re-putting a key is allowed.
    - `get` returns the bytes last put, or raises NotFound.
    - `stat` returns the object's size in bytes, or None if absent.
    - `has_many` returns the subset of `keys` that exist, in as few round
      trips as the store allows (it is how imports skip existing chunks).
    - `list` yields an ObjectInfo (key, size, modified) for every key under
      `prefix` (a string prefix of the key), in any order, each once.
    - `head` returns the object's size, last-modified time (the store's
      clock) and version (changed by every put), or None if absent.
    - `put_new` puts only if the key is absent and returns the new version,
      else None and changes nothing; of concurrent `put_new`s on one key,
      exactly one succeeds. `put_if` puts only if the object's version is
      still `version` (None, nothing changed, if it was replaced or
      deleted). These are what the GC lock is made of (layerstore/lease.py):
      S3's conditional writes (If-None-Match, If-Match), a hard link and a
      lock file on a local directory.
    - `delete` removes a key; deleting an absent key is not an error.
      `delete_many` does the same for many keys in as few round trips as the
      store allows (GC's delete phase); it may have removed some keys when
      it raises.
    - Failures: NotFound for a missing key, BackendUnavailable when the store
      can't be reached or fails transiently (the only error worth retrying),
      AccessDenied for bad credentials, BackendError for the rest.
    - Safe to call from many threads at once.
    """

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def stat(self, key: str) -> int | None: ...

    def has_many(self, keys: Iterable[str]) -> set[str]: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def head(self, key: str) -> ObjectVersion | None: ...

    def put_new(self, key: str, data: bytes) -> str | None: ...

    def put_if(self, key: str, data: bytes, version: str) -> str | None: ...

    def delete(self, key: str) -> None: ...

    def delete_many(self, keys: Iterable[str]) -> None: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


def parallel_has(stat: Callable[[str], int | None], keys: Iterable[str], *, workers: int) -> set[str]:
    """Existence check of many keys through `stat`, `workers` at a time.

    For stores without a batch existence call (S3): the batch is answered in
    one round of concurrent HEADs instead of a serial walk.
    """
    unique = list(dict.fromkeys(keys))
    if not unique:
        return set()
    if len(unique) == 1 or workers <= 1:
        return {k for k in unique if stat(k) is not None}
    with ThreadPoolExecutor(max_workers=min(workers, len(unique)), thread_name_prefix="strata-has") as pool:
        sizes = list(pool.map(stat, unique))
    return {k for k, size in zip(unique, sizes) if size is not None}


class RetryingBackend:
    """Retries calls that fail with BackendUnavailable, with jittered backoff.

    Only transient failures are retried; NotFound, AccessDenied and the like
    surface at once. After `attempts` tries the last error propagates, so a
    dead store produces an error in bounded time, never a hang.
    """

    def __init__(
        self,
        inner: Backend,
        *,
        attempts: int = 4,
        base_delay: float = 0.1,
        max_delay: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.inner = inner
        self._attempts = max(1, attempts)
        self._base = base_delay
        self._max = max_delay
        self._sleep = sleep

    def _call(self, fn: Callable[[], T]) -> T:
        for attempt in range(self._attempts):
            try:
                return fn()
            except BackendUnavailable:
                if attempt + 1 >= self._attempts:
                    raise
                delay = min(self._max, self._base * (2**attempt))
                self._sleep(delay * (0.5 + random.random() / 2))
        raise AssertionError("unreachable")

    def put(self, key: str, data: bytes) -> None:
        self._call(lambda: self.inner.put(key, data))

    def get(self, key: str) -> bytes:
        return self._call(lambda: self.inner.get(key))

    def stat(self, key: str) -> int | None:
        return self._call(lambda: self.inner.stat(key))

    def head(self, key: str) -> ObjectVersion | None:
        return self._call(lambda: self.inner.head(key))

    # Conditional writes are not retried: a first try that took effect but
    # lost its answer would make the retry report a conflict with itself.
    # Their callers (the GC lock) tell that case apart by the record's token.
    def put_new(self, key: str, data: bytes) -> str | None:
        return self.inner.put_new(key, data)

    def put_if(self, key: str, data: bytes, version: str) -> str | None:
        return self.inner.put_if(key, data, version)

    def has_many(self, keys: Iterable[str]) -> set[str]:
        keys = list(keys)
        return self._call(lambda: self.inner.has_many(keys))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Listing is materialised so a retry restarts cleanly instead of
        # yielding duplicates from a half-consumed first attempt.
        return iter(self._call(lambda: list(self.inner.list(prefix))))

    def delete(self, key: str) -> None:
        self._call(lambda: self.inner.delete(key))

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._call(lambda: self.inner.delete_many(keys))  # deleting twice is harmless: a retry is safe

    def describe(self) -> str:
        return self.inner.describe()

    def close(self) -> None:
        self.inner.close()


class DryRunBackend:
    """Records writes instead of doing them; reads pass through.

    What a dry run of a maintenance job (GC) needs: the job runs its real code
    path, including its lock and bookkeeping writes, and the store is left as
    it was. `deleted` and `written` say what would have been deleted and put.
    Reads do not see the recorded writes, so this is not a `Backend` by the
    contract (a `get` after a `put` does not return it): use it only for jobs
    that read before they write, as GC does.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.deleted: list[str] = []
        self.written: list[str] = []
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        with self._lock:
            self.written.append(key)

    def put_new(self, key: str, data: bytes) -> str | None:
        self.put(key, data)
        return "dry-run"

    def put_if(self, key: str, data: bytes, version: str) -> str | None:
        self.put(key, data)
        return "dry-run"

    def head(self, key: str) -> ObjectVersion | None:
        return self.inner.head(key)

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self.deleted.append(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = [check_key(k) for k in keys]
        with self._lock:
            self.deleted.extend(keys)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def stat(self, key: str) -> int | None:
        return self.inner.stat(key)

    def has_many(self, keys: Iterable[str]) -> set[str]:
        return self.inner.has_many(keys)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def describe(self) -> str:
        return f"{self.inner.describe()} (dry run)"

    def close(self) -> None:
        self.inner.close()
