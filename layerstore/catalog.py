"""The node's local catalog, in LMDB.

The catalog is a cache of facts about a store that are expensive to ask an
object store for again: which chunks this node has written or seen and their
sizes, manifest bodies (so mounting reads no network), and the refs last seen.
It is never the authority on whether a chunk exists in a shared store: the
importer asks the backend before it publishes a manifest, because another
node's GC may have removed what the catalog remembers. Losing the catalog
loses nothing: nothing rebuilds it wholesale, each entry is learnt again
from the backend when next needed (a manifest on its next load, a chunk's
sizes on its next import, a ref when it is next set).

Schema (one LMDB environment, named sub-databases, all keys bytes):

    meta       b"schema"             -> b"1"
    chunks     digest (32 raw bytes) -> struct <QQd: stored bytes, raw bytes, first seen (unix s)
    manifests  id (32 raw bytes)     -> canonical manifest bytes (verified on every load)
    refs       b"NAME:TAG"           -> manifest id (64 hex ascii)

Later modules add their own sub-databases (the chunk cache's LRU index) in the
same environment and document them beside their code.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Iterable, Iterator

import lmdb

from .errors import BackendError

SCHEMA_VERSION = b"1"
_CHUNK = struct.Struct("<QQd")


class Catalog:
    """LMDB-backed local catalog. Thread-safe; many processes may share it."""

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = 8 << 30) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=16, max_readers=256, subdir=True)
        except (OSError, lmdb.Error) as exc:
            raise BackendError(f"cannot open catalog at {self.path}: {exc}") from None
        self._meta = self.env.open_db(b"meta")
        self._chunks = self.env.open_db(b"chunks")
        self._manifests = self.env.open_db(b"manifests")
        self._refs = self.env.open_db(b"refs")
        with self.env.begin(write=True) as txn:
            found = txn.get(b"schema", db=self._meta)
            if found is None:
                txn.put(b"schema", SCHEMA_VERSION, db=self._meta)
            elif found != SCHEMA_VERSION:
                raise BackendError(f"catalog {self.path} has schema {found!r}, this Strata knows {SCHEMA_VERSION!r}")

    def open_db(self, name: bytes) -> object:
        """A named sub-database for another module's index (e.g. the chunk cache)."""
        return self.env.open_db(name)

    # chunks -----------------------------------------------------------------
    def add_chunks(self, records: Iterable[tuple[str, int, int]]) -> None:
        """Record (digest, stored bytes, raw bytes) for chunks known to be stored."""
        now = time.time()
        with self.env.begin(write=True, db=self._chunks) as txn:
            for digest, stored, raw in records:
                key = bytes.fromhex(digest)
                if txn.get(key) is None:
                    txn.put(key, _CHUNK.pack(stored, raw, now))

    def has_chunk(self, digest: str) -> bool:
        """True if this node recorded the chunk as stored (a hint, not proof)."""
        with self.env.begin(db=self._chunks) as txn:
            return txn.get(bytes.fromhex(digest)) is not None

    def chunk_sizes(self, digests: Iterable[str]) -> dict[str, tuple[int, int]]:
        """(stored, raw) sizes for the digests the catalog knows."""
        out: dict[str, tuple[int, int]] = {}
        with self.env.begin(db=self._chunks) as txn:
            for digest in digests:
                value = txn.get(bytes.fromhex(digest))
                if value is not None:
                    stored, raw, _ = _CHUNK.unpack(value)
                    out[digest] = (stored, raw)
        return out

    def forget_chunks(self, digests: Iterable[str]) -> None:
        """Drop chunks from the catalog (after GC deleted them, or verify found them bad)."""
        with self.env.begin(write=True, db=self._chunks) as txn:
            for digest in digests:
                txn.delete(bytes.fromhex(digest))

    def chunk_count(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self._chunks)["entries"]

    # manifests --------------------------------------------------------------
    def put_manifest(self, manifest_id: str, blob: bytes) -> None:
        with self.env.begin(write=True, db=self._manifests) as txn:
            txn.put(bytes.fromhex(manifest_id), blob)

    def get_manifest(self, manifest_id: str) -> bytes | None:
        with self.env.begin(db=self._manifests) as txn:
            value = txn.get(bytes.fromhex(manifest_id))
            return bytes(value) if value is not None else None

    def forget_manifest(self, manifest_id: str) -> None:
        with self.env.begin(write=True, db=self._manifests) as txn:
            txn.delete(bytes.fromhex(manifest_id))

    # refs -------------------------------------------------------------------
    def set_ref(self, ref: str, manifest_id: str | None) -> None:
        with self.env.begin(write=True, db=self._refs) as txn:
            if manifest_id is None:
                txn.delete(ref.encode())
            else:
                txn.put(ref.encode(), manifest_id.encode())

    def refs(self) -> Iterator[tuple[str, str]]:
        with self.env.begin(db=self._refs) as txn:
            items = [(k.decode(), v.decode()) for k, v in txn.cursor()]
        return iter(items)

    def clear(self) -> None:
        """Forget everything: the store's objects stay, each entry is re-learnt when next needed."""
        with self.env.begin(write=True) as txn:
            for db in (self._chunks, self._manifests, self._refs):
                txn.drop(db, delete=False)

    def close(self) -> None:
        self.env.close()
