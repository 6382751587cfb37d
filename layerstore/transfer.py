"""Push and pull: copy what a name needs from one store to another.

    1. a lease at the destination (layerstore/lease.py) so its GC keeps
       what this copy relies on;
    2. the chunks the destination lacks: one batched existence check, then
       bounded parallel copies, each verified against its digest before it
       is written (a corrupt source chunk stops the copy; nothing names it);
       packs likewise, always, even without chunks (a pack holds a seal's
       changed pages and is read only from the store that has the layer);
    3. layer manifests, parents first, then snapshot manifests, parents
       first (each refused by the destination if anything it names is
       missing);
    4. the name itself (ref or template) last.

A reader of the destination never sees a name whose data is not all there,
and an interrupted copy resumes: step 2 skips the chunks already copied.
`chunks=False` copies manifests and the name only: a pull into a node
store whose read path has the source as its remote, so the mount loads
chunks lazily from it (the destination still refuses a manifest naming a
chunk its read path cannot serve). Every other copy publishes a manifest
only where each chunk it names is stored (Store.put_layer).

A manifests-only pull into a node's store (`lazy_pull`) leaves the chunks in the
source, which may collect them: removing its ref there must not break the
node's image. So `lazy_pull` holds a lease in the source for the whole copy (its
GC deletes nothing meanwhile), writes the node's hold there before copying
(layerstore/nodes.py: the layers pulled and every layer the node still reads
lazily) and rewrites it from the node's store once the name is published.
A source that refuses the hold refuses the lazy pull: nothing is published
and `pull --full` is the way left (fail closed, whoever runs the pull).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .chunk import MAX_CHUNK_SIZE, chunk_key, decode_chunk
from .digest import digest_bytes
from .errors import BackendError, CorruptObject, MissingChunk, NotFound, StrataError
from .lease import Lease
from .nodes import Holds
from .pack import pack_key
from .reach import Closure, Name, parse_name
from .store import Store
from .templates import Template
from .volumes import Volume, Volumes

Progress = Callable[[int], None]


@dataclass
class TransferResult:
    name: str
    chunks_total: int
    chunks_sent: int
    bytes_sent: int
    manifests_sent: int
    snapshots_sent: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def copy(
    src: Store,
    dst: Store,
    name_text: str,
    *,
    chunks: bool = True,
    prefetch: bool = False,
    workers: int = 8,
    progress: Progress | None = None,
    on_total: Progress | None = None,
) -> TransferResult:
    """Copy `name` (NAME:TAG, snapshot id, volume id or template) and its closure from
    `src` to `dst`. `chunks=False, prefetch=True` copies only the chunks of
    the image's recorded prefetch list (`strata image record-prefetch`): the
    working set a sandbox reads first; the rest loads lazily."""
    started = time.monotonic()
    name = parse_name(name_text)
    closure = Closure()
    published = closure.add(src, name, strict=True)
    wanted, packs = closure.chunks, closure.packs
    prefetch_lists: dict[str, list[int]] = {}
    if not chunks and prefetch:
        wanted, prefetch_lists = _prefetch_set(src, closure)
    with Lease(dst.backend, f"copy {name} from {src.describe()}") as lease:
        sent = sent_bytes = 0
        published_layers = {m for m in closure.layers if dst.has_layer(m)}
        partial = dst.partial_layers(published_layers) if chunks else set()
        if chunks and published_layers:
            # A manifest is only ever published after its chunks (a manifests-only pull's are marked
            # partial), and GC deletes manifests before chunks and nothing while our lease lives: the
            # chunks of the complete layers the destination has are there. Only the other layers'
            # chunks need an existence check (an incremental push asks about the changed chunks).
            complete = published_layers - partial
            wanted = {d for m in closure.layers if m not in complete for d in src.get_layer(m).needs()[0]}
        sent_bytes += _copy_packs(src, dst, dst.missing_packs(packs))
        if chunks or prefetch:
            missing = sorted(dst.local_missing_chunks(wanted))
            if on_total is not None:
                on_total(len(missing))

            def one(digest: str) -> int:
                try:
                    blob = src.backend.get(chunk_key(digest))
                except NotFound:
                    raise MissingChunk(f"chunk {digest} is missing from {src.describe()}") from None
                decode_chunk(digest, blob, max_size=MAX_CHUNK_SIZE)  # CorruptObject before anything is written
                dst.put_chunk_object(digest, blob)
                if progress is not None:
                    progress(1)
                return len(blob)

            with ThreadPoolExecutor(max(1, workers), thread_name_prefix="strata-copy") as pool:
                for size in pool.map(one, missing):
                    sent += 1
                    sent_bytes += size
        lease.check()
        manifests = [m for m in closure.layers if m not in published_layers]
        for layer_id in manifests:
            # refused if a chunk is missing from the destination (or, lazily, from its read path)
            dst.put_layer(src.get_layer(layer_id), read_through=not chunks)
        snapshots = [s for s in closure.snapshots if not dst.has_snapshot(s)]
        for snapshot_id in snapshots:
            dst.put_snapshot(src.get_snapshot(snapshot_id))
        for layer_id in partial:  # every chunk it names is here now
            dst.complete_layer(layer_id)
        for layer_id, indices in prefetch_lists.items():
            dst.put_prefetch(layer_id, indices)
        if isinstance(published, Template):
            dst.put_template(published)
        elif isinstance(published, Volume):
            Volumes(dst.backend).publish(published)
        elif isinstance(published, str):
            dst.set_ref(name.value, published)
    return TransferResult(str(name), len(closure.chunks), sent, sent_bytes, len(manifests), len(snapshots),
                          time.monotonic() - started)


def lazy_pull(
    src: Store,
    dst: Store,
    name_text: str,
    *,
    holds: Holds,
    prefetch: bool = False,
    workers: int = 8,
    progress: Progress | None = None,
    on_total: Progress | None = None,
) -> TransferResult:
    """Copy `name`'s manifests (and, with `prefetch`, its working set) from
    `src`, the node's remote, into the node's store `dst`, the chunks left
    in `src`: what `dst` then reads lazily is held in `src` (`holds`, this
    node's hold there) before anything is published, or nothing is."""
    with contextlib.ExitStack() as stack:
        try:
            lease = stack.enter_context(Lease(src.backend, f"lazy pull of {name_text} into {dst.describe()}"))
        except BackendError as exc:
            raise _unrecorded(src, holds, exc) from None
        planned = Closure()
        planned.add(src, parse_name(name_text), strict=True)  # under the lease: no GC deletes from here on
        try:
            holds.refresh(dst, also=[Name("layer", m) for m in planned.layers])
        except BackendError as exc:
            raise _unrecorded(src, holds, exc) from None
        lease.check()  # the lease was live until the hold was written: later GCs all see the hold
        result = copy(src, dst, name_text, chunks=False, prefetch=prefetch, workers=workers,
                      progress=progress, on_total=on_total)
        holds.refresh(dst)  # exactly what dst reads lazily now, before the lease ends
    return result


def _unrecorded(src: Store, holds: Holds, exc: BackendError) -> StrataError:
    return StrataError(f"a lazy pull must record in {src.describe()} what this node reads from there "
                       f"(holds/{holds.node_id}), and that failed: {exc}; nothing was pulled (`strata pull "
                       "--full` copies every chunk instead)")


def _copy_packs(src: Store, dst: Store, packs: set[str]) -> int:
    """Copy `packs` (each checked against its id first); the bytes sent."""
    sent = 0
    for pack_id in sorted(packs):
        try:
            blob = src.backend.get(pack_key(pack_id))
        except NotFound:
            raise MissingChunk(f"pack {pack_id} is missing from {src.describe()}") from None
        if digest_bytes(blob) != pack_id:
            raise CorruptObject(f"pack {pack_id} in {src.describe()}: content hashes to something else")
        dst.backend.put(pack_key(pack_id), blob)
        sent += len(blob)
    return sent


def _prefetch_set(src: Store, closure: Closure) -> tuple[set[str], dict[str, list[int]]]:
    """Chunk objects the prefetch lists recorded for the closure's layers read
    (a packed chunk's base), and the lists."""
    wanted: set[str] = set()
    lists: dict[str, list[int]] = {}
    for layer_id in closure.layers:
        indices = src.get_prefetch(layer_id)
        if indices is None:
            continue
        chunk_map = src.chunk_map(layer_id)[1]
        packed = src.packed_map(layer_id)
        for digest in (chunk_map[i] for i in indices if i in chunk_map):
            base = packed[digest].base if digest in packed else digest
            if base is not None:
                wanted.add(base)
        lists[layer_id] = indices
    return wanted, lists
