"""Delta layers: a sandbox's changed chunks published over their parent
stack, each stored as the pages that changed, all in one pack.

A seal (fusefs/upper.py) freezes the chunks a sandbox wrote since its last
one; a VM snapshot's RAM changes a few pages in each of tens of chunks.
Stored as whole chunks (importer.py with `slots`) that is one object and a
MiB per chunk; here it is one pack (layerstore/pack.py) for the lot:

    for each dirty index i, with D the chunk's digest and P the parent's chunk at i:
      all zeros           -> a whiteout (if the parent had data), else nothing
      D == P              -> nothing: the parent's chunk stays
      D == P's base       -> D, that whole chunk (never an entry over itself)
      mostly changed      -> a whole chunk object, as an import stores it
      else                -> an entry in the pack over the base: P itself, or,
                             if P is packed, P's own base (chains stay one deep)

then the pack is put, then the manifest (`chunks` names every D; `packed`
says where the packed ones are). Base bytes come from `read_base` (the
mount's chunk fetcher: cache or memory, the store only if it must).

A write lease (layerstore/lease.py) is taken only when a chunk goes whole:
that is where a chunk the store already holds is reused, which a GC must
not delete before the manifest names it. A pack is a new object, and a base
is named by the parent stack, which the sandbox keeps alive; so a seal of
changed pages alone costs no lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import NamedTuple

import blake3

from .importer import ImportResult
from .lease import Lease
from .manifest import Layer, Packed
from .pack import PAGE, PackWriter, changed_pages, encode_entry
from .store import Store

WHOLE_SHARE = 0.5  # a chunk with more of its pages changed is stored whole
PACK_BUDGET = 32 << 20  # past this many packed bytes, further chunks are stored whole (packs are read whole)


class _Chunk(NamedTuple):
    """What one dirty index becomes: digest None = zeros; `whole` = stored as
    its own object (`stored` bytes put); `entry` = packed over `base`;
    neither = the parent's chunk, or the same content packed below."""

    index: int
    digest: str | None
    whole: bool = False
    stored: int = 0
    base: str | None = None
    entry: bytes | None = None


def publish_delta(
    store: Store,
    read_chunk: Callable[[int], bytes],
    size: int,
    *,
    parent: str,
    slots: list[int],
    read_base: Callable[[str], bytes],
    keep: Callable[[str, bytes], None] | None = None,
    annotations: Mapping[str, str] | None = None,
    whole_share: float = WHOLE_SHARE,
    workers: int = 4,
) -> ImportResult:
    """Publish chunks `slots` of a `size`-byte disk (each one's whole content
    from `read_chunk(index)`) as a layer over `parent`, changed pages packed
    (see the module docstring). `keep` is given each new chunk's digest and
    bytes as they are read (the mount keeps them in memory for the next seal
    and the snapshot's restores)."""
    started = time.monotonic()
    top, parent_map = store.chunk_map(parent)
    planner = _Planner(store, read_chunk, top.chunk_size, parent_map, store.packed_map(parent), read_base,
                       keep=keep, whole_share=whole_share)
    result = ImportResult(manifest_id="", ref=None, size=size, chunk_size=top.chunk_size, parent=parent)
    with planner.leases:
        indices = sorted({i for i in slots if 0 <= i < -(-size // top.chunk_size)})
        planner.find_bases(indices)
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="strata-delta") as pool:
            planned = list(pool.map(planner.plan, indices))
        chunks, packed = _store(store, planned, parent_map, planner.parent_packed, result)
        if planner.lease is not None:
            planner.lease.check()
        result.manifest_id = store.put_layer(Layer(size=size, chunk_size=top.chunk_size, chunks=chunks,
                                                   parent=parent, annotations=dict(annotations or {}),
                                                   packed=packed))
    result.seconds = time.monotonic() - started
    return result


class _Planner:
    """Decides, chunk by chunk (on several threads), how a dirty index is stored."""

    def __init__(self, store: Store, read_chunk: Callable[[int], bytes], chunk_size: int, parent_map: dict[int, str],
                 parent_packed: dict[str, Packed], read_base: Callable[[str], bytes], *,
                 keep: Callable[[str, bytes], None] | None, whole_share: float) -> None:
        self.store, self.read_chunk, self.cs = store, read_chunk, chunk_size
        self.parent_map, self.parent_packed, self.read_base = parent_map, parent_packed, read_base
        self.keep = keep
        self.whole_share = whole_share
        self.zero = bytes(chunk_size)
        self.bases: dict[int, str | None] = {}
        self.usable: set[str] = set()
        self._budget = PACK_BUDGET
        self._lock = threading.Lock()
        self.leases = ExitStack()  # holds the lease once a whole chunk needs it
        self.lease: Lease | None = None

    def find_bases(self, indices: list[int]) -> None:
        """Each index's base: the parent's chunk, or its base if that one is
        packed (None: zeros). One only the read path has (a lazy pull's)
        cannot be named by a layer of this store: those chunks go whole."""
        for index in indices:
            below = self.parent_map.get(index)
            self.bases[index] = self.parent_packed[below].base if below in self.parent_packed else below
        wanted = {b for b in self.bases.values() if b is not None}
        self.usable = wanted - self.store.local_missing_chunks(wanted)

    def plan(self, index: int) -> _Chunk:
        data = self.read_chunk(index)
        if data == self.zero[:len(data)]:
            return _Chunk(index, None)
        digest = blake3.blake3(data).hexdigest()
        if digest == self.parent_map.get(index) or digest in self.parent_packed:
            return _Chunk(index, digest)
        if self.keep is not None:
            self.keep(digest, data)
        base = self.bases[index]
        if digest == base and base in self.usable:  # back to the whole chunk below it: name that
            return _Chunk(index, digest, whole=True)
        entry = self._entry(data, base) if base is None or base in self.usable else None
        if entry is not None:
            return _Chunk(index, digest, base=base, entry=entry)
        self._leased()
        return _Chunk(index, digest, whole=True, stored=_put_whole(self.store, digest, data))

    def _leased(self) -> None:
        with self._lock:
            if self.lease is None:
                self.lease = self.leases.enter_context(Lease(self.store.backend, "seal"))

    def _entry(self, data: bytes, base: str | None) -> bytes | None:
        """`data` as an entry over `base`, or None if it is better stored whole
        (mostly changed, a base of another length, the pack full)."""
        base_bytes = self.read_base(base) if base is not None else None
        if base_bytes is not None and len(base_bytes) != len(data):
            return None
        pages = changed_pages(data, base_bytes)
        if len(pages) > self.whole_share * -(-len(data) // PAGE):
            return None
        entry = encode_entry(data, base_bytes, level=self.store.level, pages=pages)
        with self._lock:
            self._budget -= len(entry)
            return entry if self._budget >= 0 else None


def _store(store: Store, planned: list[_Chunk], parent_map: dict[int, str], parent_packed: dict[str, Packed],
           result: ImportResult) -> tuple[dict[int, str | None], dict[int, Packed]]:
    """Put the pack; the layer's `chunks` and `packed` (whole chunks are stored already)."""
    result.new_chunks = sum(1 for c in planned if c.stored)
    result.new_stored_bytes = sum(c.stored for c in planned)
    chunks: dict[int, str | None] = {}
    packed: dict[int, Packed] = {}
    writer = PackWriter()
    entries: list[tuple[int, str | None, tuple[int, int]]] = []
    for c in planned:
        if c.digest is None:
            if c.index in parent_map:
                chunks[c.index] = None  # a whiteout: the parent had data here
        elif c.digest == parent_map.get(c.index):
            continue  # unchanged: the parent's chunk stays
        else:
            chunks[c.index] = c.digest
            if c.entry is not None:
                entries.append((c.index, c.base, writer.add_entry(c.entry)))
            elif not c.whole:  # the same content is packed below: its entry serves
                packed[c.index] = parent_packed[c.digest]
    if entries:
        pack = store.put_pack(writer)
        result.new_stored_bytes += len(writer)
        packed.update({index: Packed(base, pack, *at) for index, base, at in entries})
    result.data_chunks = sum(1 for d in chunks.values() if d is not None)
    return chunks, packed


def _put_whole(store: Store, digest: str, data: bytes) -> int:
    """Store a chunk as its own object unless the store has it; the bytes put."""
    if not store.local_missing_chunks([digest]):
        return 0
    stored = store.write_chunk(digest, data)
    store.catalog.add_chunks([(digest, stored, len(data))])
    return stored

