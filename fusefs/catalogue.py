"""The filesystem's model: what a mount serves and what it does to it.

Image views (one per manifest, shared), sandboxes (an upper layer each, with
their seals published on a pool beside them), and the working sets fetched
ahead when a layer is first opened and recorded after. fs.py serves this
over FUSE and daemon.py over the control socket; neither holds state of its
own about images or sandboxes.
"""

from __future__ import annotations

import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from layerstore.delta import publish_delta
from layerstore.errors import InvalidInput, NotFound, StrataError
from layerstore.pack import encode_entry
from layerstore.refs import Ref, parse_ref
from layerstore.squash import depth, squash
from layerstore.store import Store

from .cache import ChunkCache
from .control import check_sid
from .fetch import ChunkFetcher
from .protocol import DiskInfo, PrefetchRecorded, Sealed, SealState
from .upper import ChunkReader, SealTicket, UpperLayer
from .view import LayerView

if TYPE_CHECKING:
    from .fs import StrataFS

log = logging.getLogger("strata.fusefs")

RECORD_WINDOW = 10.0  # seconds of a layer's first use on a node recorded as its working set
SET_CHUNKS_MAX = 64 << 20  # compressed bytes of a working set's packed chunks stored again whole
RECORD_SHARE = 0.5  # a recorded working set names at most this share of its layer's chunk slots (its size)
SEALERS = 2  # seal jobs at once: a snapshot seals a disk and a RAM layer
WRITE_BEHIND = 128 << 20  # bytes of fetched chunks that may wait for their cache write (fetch.py)
WRITE_SETTLE = 0.25  # seconds without a fetch before those writes start (under half the bytes waiting)
RECENT = 128 << 20  # bytes of recent chunks the fetcher keeps in memory (a seal's and what it reads below)
KEEP_SEALED = 32 << 20  # bytes of a seal's chunks kept in memory (of RECENT)


class Catalogue:
    """Everything the filesystem serves: image views, sandboxes, prefetch."""

    def __init__(self, store: Store, cache: ChunkCache, upper_root: Path, *, prefetch_workers: int = 4,
                 squash_depth: int = 32, record_window: float = RECORD_WINDOW,
                 record_share: float = RECORD_SHARE) -> None:
        self.store = store
        self.squash_depth = squash_depth  # a sealed stack deeper than this is squashed (layerstore/squash.py)
        self.cache = cache
        self.fetcher = ChunkFetcher(store, cache, write_behind=WRITE_BEHIND, write_settle=WRITE_SETTLE,
                                    memory=RECENT)
        self.upper_root = upper_root
        self.upper_root.mkdir(parents=True, exist_ok=True)
        self.sandboxes: dict[str, UpperLayer] = {}
        self.fs: StrataFS | None = None
        self._views: dict[str, LayerView] = {}
        self._lock = threading.Lock()
        self._prefetch = ThreadPoolExecutor(prefetch_workers, thread_name_prefix="strata-prefetch")
        # a VM snapshot seals its disk and its RAM at once: publish them side by
        # side (each sandbox's own seals still publish in order: upper.py)
        self._sealer = ThreadPoolExecutor(SEALERS, thread_name_prefix="strata-seal")
        self._prefetched: set[str] = set()
        self.record_window, self.record_share = record_window, record_share
        self._recorders: list[threading.Timer] = []
        self._closed = False
        self.seals: dict[str, SealTicket] = {}

    # views ------------------------------------------------------------------
    def view_for_manifest(self, manifest_id: str) -> LayerView:
        with self._lock:
            view = self._views.get(manifest_id)
        if view is not None:
            return view
        view = LayerView.of(self.fetcher, manifest_id)
        with self._lock:
            return self._views.setdefault(manifest_id, view)

    def view_for_ref(self, ref: Ref) -> LayerView:
        return self.view_for_manifest(self.store.resolve(ref))

    def list_refs(self) -> list[Ref]:
        return [ref for ref, _m, _u in self.store.list_refs()]

    # prefetch ---------------------------------------------------------------
    def schedule_prefetch(self, digest: str, *, settle: bool = False) -> None:
        """Fetch a chunk on a prefetch thread (`settle`: a working set's, see ChunkFetcher)."""
        try:
            self._prefetch.submit(self.fetcher.prefetch, digest, settle=settle)
        except RuntimeError:  # shutting down
            pass

    def start_prefetch(self, view: LayerView) -> None:
        """The first open of a layer on this node (a boot, a restore, or the
        VMM naming a snapshot's device state before its VM starts): fetch
        its recorded working set in the background, in recorded order, and
        record what the guest reads in its first `record_window` seconds, to
        be merged into that set for the next restore on any node.

        Returns at once: the set is read from the store on a prefetch
        thread. The FUSE event loop opens files, and that read there held up
        every request of the mount while it waited (4.5 ms on the local
        store in a cold restore; a round trip on S3)."""
        with self._lock:
            if view.manifest_id in self._prefetched:
                return
            self._prefetched.add(view.manifest_id)
        try:
            self._prefetch.submit(self._prefetch_set, view)
        except RuntimeError:  # shutting down
            pass

    def _prefetch_set(self, view: LayerView) -> None:
        try:
            indices = self.store.get_prefetch(view.manifest_id) or []
        except StrataError as exc:
            log.warning("prefetch list of %s unreadable: %s", view.manifest_id, exc)
            return
        digests = [d for d in (view.chunks.get(i) for i in indices) if d is not None]
        whole: dict[str, memoryview] = {}
        if any(self.fetcher.packed_base(d) is not None for d in digests):
            try:  # the set's packed chunks stored again whole: no bases to fetch
                whole = self.store.get_set_chunks(view.manifest_id)
            except StrataError as exc:
                log.warning("working-set chunks of %s unreadable: %s", view.manifest_id, exc)
            self.fetcher.learn_whole({d: whole[d] for d in digests if d in whole})
        for digest in digests:
            self.schedule_prefetch(digest, settle=True)
        if self.record_window > 0:
            timer = threading.Timer(self.record_window, self._record, (view, indices, bool(whole)))
            timer.daemon = True
            with self._lock:
                if self._closed:  # a set read while the mount closed: nothing left to record for
                    return
                self._recorders = [t for t in self._recorders if t.is_alive()] + [timer]
                timer.start()

    def forget_prefetched(self) -> None:
        """The cache was dropped: the next open of each layer fetches its
        recorded set again (else a restore after a drop ran without it)."""
        with self._lock:
            self._prefetched.clear()

    def _record(self, view: LayerView, known: list[int], stored_whole: bool = False) -> None:
        """Publish the layer's working set: what it had, then what the guest
        first read since (prefetches are not reads), at most `record_share`
        of the layer's size in chunks. (Not of its stored chunks: a guest's
        RAM layer stores only what the guest used, and a restore reads most
        of that, 68 of 108 here; capped at 54, the other 14 were fetched one
        by one as the guest faulted on them.) Its packed chunks are stored
        again whole beside it. Unchanged: no write, unless those were not
        found whole when the set was read (`stored_whole`: a set a pull
        copied, an unreadable object). A failure only costs the next restore
        its head start."""
        seen = set(known)
        merged = known + [i for i in list(view.touched) if i not in seen]
        merged = merged[:max(1, int(-(-view.size // view.chunk_size) * self.record_share))]
        packed = self._packed_in(view, merged)
        try:
            if merged != known:
                self.store.put_prefetch(view.manifest_id, merged)
            elif not packed or stored_whole:
                return
            if packed:
                self._store_set_chunks(view.manifest_id, packed)
        except StrataError as exc:
            log.warning("recording the working set of %s: %s", view.manifest_id, exc)

    def _packed_in(self, view: LayerView, indices: list[int]) -> list[str]:
        """The set's chunks that a restore would rebuild over a base, in set order."""
        return [d for d in dict.fromkeys(view.chunks[i] for i in indices if i in view.chunks)
                if self.fetcher.packed_base(d) is not None]

    def _store_set_chunks(self, manifest_id: str, packed: list[str]) -> None:
        """Store the set's packed chunks again, whole, beside it (up to
        `SET_CHUNKS_MAX` compressed bytes, in set order). A snapshot's RAM
        layer packs most chunks a restore reads over an older version (its
        base): a cold restore fetched ~30 bases for ~40 such chunks, each
        decompressed and hashed whole, on top of the set itself. Read
        without being remembered: the restore that used them is long past,
        and they would push the chunks in use out of the fetcher's memory."""
        entries: dict[str, bytes] = {}
        size = 0
        for digest in packed:
            entry = encode_entry(self.fetcher.read(digest, remember=False), None, level=self.store.level)
            if size + len(entry) > SET_CHUNKS_MAX:
                break
            entries[digest] = entry
            size += len(entry)
        if entries:
            self.store.put_set_chunks(manifest_id, entries)

    def record_prefetch(self, ref: Ref) -> PrefetchRecorded:
        view = self.view_for_ref(ref)
        indices = list(view.touched)
        self.store.put_prefetch(view.manifest_id, indices)
        packed = self._packed_in(view, indices)
        if packed:  # as an automatic recording does
            self._store_set_chunks(view.manifest_id, packed)
        return PrefetchRecorded(image=str(ref), manifest=view.manifest_id, chunks=len(indices))

    # sandboxes --------------------------------------------------------------
    def load_sandboxes(self) -> None:
        """Re-attach every sandbox found under the upper root (after a restart)."""
        for root in sorted(self.upper_root.iterdir()):
            if not root.is_dir():
                continue
            try:
                check_sid(root.name)
                state = UpperLayer.read_state(root)
                upper = UpperLayer(root, self.view_for_manifest(str(state["base"])), state, relower=self.view_for_manifest)
            except StrataError as exc:
                log.error("sandbox %s not loaded: %s", root.name, exc)
                continue
            self._attach(upper)
            tickets = upper.resume_seals(self._publish, self._sealer.submit)
            if tickets:
                self.seals[upper.sid] = tickets[-1]

    def _attach(self, upper: UpperLayer) -> None:
        self.sandboxes[upper.sid] = upper
        if self.fs is not None:
            self.fs.add_sandbox(upper.sid, upper)

    def create_sandbox(self, sid: str, *, image: str | None = None, manifest: str | None = None,
                       size: int | None = None, volatile: bool = False) -> UpperLayer:
        check_sid(sid)
        if (image is None) == (manifest is None):
            raise InvalidInput("give exactly one of image or manifest")
        if sid in self.sandboxes:
            raise InvalidInput(f"sandbox {sid} already exists")
        view = self.view_for_ref(parse_ref(image)) if image else self.view_for_manifest(manifest)  # type: ignore[arg-type]
        upper = UpperLayer.create(self.upper_root / sid, view, relower=self.view_for_manifest, size=size,
                                  volatile=volatile)
        self._attach(upper)
        self.start_prefetch(view)  # before the VMM opens it: the working set arrives while the VM starts
        return upper

    def remove_sandbox(self, sid: str) -> None:
        check_sid(sid)
        upper = self.sandboxes.get(sid)
        if upper is None:
            raise NotFound(f"sandbox {sid} not found")
        if upper.sealing:
            self._discard_seals(upper)
        if self.fs is not None:
            self.fs.remove_sandbox(sid)
        del self.sandboxes[sid]
        upper.close()
        shutil.rmtree(upper.root)

    def _discard_seals(self, upper: UpperLayer, *, timeout: float = 60.0) -> None:
        """A sandbox being removed drops its unpublished seals: a publish in
        flight is waited for (up to `timeout`), then whatever is still
        queued (a seal that failed, say) is discarded, so a kill never
        fails forever on a store that refused a seal."""
        ticket = self.seals.get(upper.sid)
        if ticket is not None and not ticket.future.done():
            try:
                ticket.future.result(timeout)
            except FutureTimeout:
                raise StrataError(f"sandbox {upper.sid}: a sealed layer is still being published after "
                                  f"{timeout:.0f} s; try again") from None
            except BaseException:  # noqa: S110 - failed: discarded below
                pass
        dropped = upper.discard_sealing()
        if dropped:
            log.warning("sandbox %s: discarded %d sealed layer(s) never published (removed)", upper.sid, dropped)

    def _publish(self, upper: UpperLayer, read_chunk: ChunkReader, dirty: list[int], base: str) -> str:
        # changed pages over the chunks below, in one pack (layerstore/delta.py)
        result = publish_delta(self.store, read_chunk, upper.size, parent=base, slots=dirty,
                               read_base=self.fetcher.read, keep=self._keeping(), annotations={"sandbox": upper.sid})
        if depth(self.store, result.manifest_id) <= self.squash_depth:
            return result.manifest_id
        try:  # on the seal thread, so in the background of the sandbox that sealed
            return squash(self.store, result.manifest_id, annotations={"sandbox": upper.sid})
        except StrataError as exc:  # the deep stack still reads; the next seal tries again
            log.warning("sandbox %s: squashing its layer stack failed: %s", upper.sid, exc)
            return result.manifest_id

    def _keeping(self) -> Callable[[str, bytes], None]:
        """What a seal calls with each chunk it stores, digest just computed
        from the bytes: keep it in memory, so the next seal composes its
        chunks, and the snapshot's restores and forks read them, without
        fetch or decode. At most KEEP_SEALED bytes per seal (a VM snapshot's
        RAM is tens of chunks; a disk sealed under a bulk writer can be
        hundreds, which memory would not hold anyway)."""
        room = [KEEP_SEALED]
        lock = threading.Lock()

        def keep(digest: str, data: bytes) -> None:
            with lock:
                room[0] -= len(data)
                if room[0] < 0:
                    return
            self.fetcher.keep(digest, data, hashed=True)
        return keep

    def seal(self, sid: str, *, wait: bool = False, timeout: float = 600) -> Sealed:
        upper = self.sandboxes.get(check_sid(sid))
        if upper is None:
            raise NotFound(f"sandbox {sid} not found")
        ticket = self.seals[sid] = upper.seal(self._publish, self._sealer.submit)
        return _sealed(ticket, ticket.result(timeout) if wait else None)

    def await_seal(self, sid: str, *, timeout: float = 600) -> Sealed:
        """The newest seal of `sid`, once published (its error if it failed)."""
        ticket = self.seals.get(check_sid(sid))
        if ticket is None:
            raise NotFound(f"sandbox {sid} has no seal to wait for")
        return _sealed(ticket, ticket.result(timeout))

    def sandbox_info(self, upper: UpperLayer, path: Path) -> DiskInfo:
        """The control protocol's view of a sandbox disk, served at `path`."""
        return DiskInfo(sid=upper.sid, base=upper.base, size=upper.size, dirty_chunks=upper.dirty_count(),
                        layers=list(upper.layers), last_seal=self._seal_state(upper.sid), path=str(path))

    def _seal_state(self, sid: str) -> SealState | None:
        ticket = self.seals.get(sid)
        if ticket is None:
            return None
        if not ticket.future.done():
            return SealState("publishing")
        if ticket.future.exception() is not None:
            return SealState("failed", error=str(ticket.future.exception()))
        return SealState("done", manifest=ticket.future.result())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for timer in self._recorders:
                timer.cancel()
        self._sealer.shutdown(wait=True)
        self._prefetch.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()
        for upper in self.sandboxes.values():
            try:
                upper.close()
            except OSError as exc:
                log.error("closing sandbox %s: %s", upper.sid, exc)
        self.cache.close()


def _sealed(ticket: SealTicket, manifest: str | None) -> Sealed:
    """The reply about a seal: its manifest once published (None if not waited for)."""
    return Sealed(sid=ticket.sid, dirty_chunks=ticket.dirty_chunks, switch_ms=round(ticket.switched_in * 1000, 3),
                  manifest=manifest)
