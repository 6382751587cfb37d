"""The mount daemon: wires store, cache, fetcher, sandboxes and FUSE together,
and answers a control socket for the CLI, the VMM and the API.

`strata mount MOUNTPOINT` starts `python -m fusefs.daemon` in its own session,
hands it its MountSettings (control.py: the node's configuration) on stdin,
waits until the mount is serving (or prints the daemon's error), and returns.
`strata umount`, SIGTERM or SIGINT unmount cleanly: the FUSE loop stops,
sandboxes are fsynced, the cache index is flushed, the socket is removed.

The control socket is `control_socket(mountpoint, settings.run_dir)`;
its operations, messages and wire format are defined in protocol.py, and
`Daemon.handlers` maps each request class to the method answering it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import socketserver
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable

import pyfuse3
import trio

from layerstore.errors import InvalidInput, NotFound, StrataError
from layerstore.delta import publish_delta
from layerstore.pack import encode_entry
from layerstore.refs import Ref, parse_ref
from layerstore.squash import depth, squash
from layerstore.store import Store, open_store
from layerstore.unixsock import bind_unix, connect_unix

from .cache import ChunkCache
from .control import MountSettings, check_mountpoint, check_sid, control_socket
from .fetch import ChunkFetcher
from .fs import StrataFS
from .malloc import keep_freed_memory, warm_heap
from .protocol import (MAX_LINE, AwaitSeal, CacheDrop, CacheDropped, CreateDisk, DiskInfo, DiskList, DiskRemoved,
                       Handlers, ListDisks, MountStats, Pin, Pinned, Ping, Pong, Prefetch, PrefetchRecorded,
                       PrefetchStarted, RecordPrefetch, RemoveDisk, Seal, Sealed, SealState, Shutdown, ShuttingDown,
                       Stats, Unpin, Unpinned, answer, encode_error)
from .upper import ChunkReader, SealTicket, UpperLayer
from .view import LayerView

log = logging.getLogger("strata.fusefs")

RECORD_WINDOW = 10.0  # seconds of a layer's first use on a node recorded as its working set
SET_CHUNKS_MAX = 64 << 20  # compressed bytes of a working set's packed chunks stored again whole
RECORD_SHARE = 0.5  # a recorded working set names at most this share of its layer's chunk slots (its size)
SEALERS = 2  # seal jobs at once: a snapshot seals a disk and a RAM layer
WRITE_BEHIND = 128 << 20  # bytes of fetched chunks that may wait for their cache write (fetch.py)
WRITE_SETTLE = 0.25  # seconds without a fetch before those writes start (under half the bytes waiting)
RECENT = 128 << 20  # bytes of recent chunks the fetcher keeps in memory (a seal's and what it reads below)
KEEP_SEALED = 32 << 20  # bytes of a seal's chunks kept in memory (of RECENT)
READ_AHEAD_KIB = 4096  # the kernel's read-ahead on the mount: four chunks (set_read_ahead)


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


class _ControlHandler(socketserver.StreamRequestHandler):
    """One connection: request lines in, reply lines out, until the client closes."""

    def handle(self) -> None:
        daemon: Daemon = self.server.daemon  # type: ignore[attr-defined]
        while line := self.rfile.readline(MAX_LINE + 1):
            if len(line) > MAX_LINE and not line.endswith(b"\n"):
                # the rest of the line is unread: answer, then drop the connection
                self.wfile.write(encode_error(InvalidInput(f"request too large (more than {MAX_LINE} bytes)")))
                return
            self.wfile.write(daemon.handle(line))
            self.wfile.flush()


class _ControlServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 256  # a busy API node sends many requests at once (socketserver's default is 5)

    def server_bind(self) -> None:
        bind_unix(self.socket, self.server_address)  # a run dir deeper than a socket address holds


class Daemon:
    """One mount: the FUSE loop in the main thread, the control server in another."""

    def __init__(self, mountpoint: Path, catalogue: Catalogue, socket_path: Path) -> None:
        self.mountpoint = mountpoint
        self.cat = catalogue
        self.socket_path = socket_path
        self.fs = StrataFS(catalogue)
        catalogue.fs = self.fs
        self._token: trio.lowlevel.TrioToken | None = None
        self.started = time.time()
        self.read_ahead_kib = READ_AHEAD_KIB

    @property
    def handlers(self) -> Handlers:
        """Which method answers which request (protocol.py defines the messages)."""
        return {Ping: self.ping, Stats: self.stats, CreateDisk: self.create_disk, ListDisks: self.list_disks,
                RemoveDisk: self.remove_disk, Seal: self.seal, AwaitSeal: self.await_seal,
                RecordPrefetch: self.record_prefetch, Prefetch: self.prefetch,
                CacheDrop: self.cache_drop, Pin: self.pin, Unpin: self.unpin, Shutdown: self.shutdown}

    def handle(self, line: bytes) -> bytes:
        """The reply line to one request line (never raises)."""
        return answer(line, self.handlers)

    def ping(self, _r: Ping) -> Pong:
        return Pong(pid=os.getpid(), mountpoint=str(self.mountpoint), store=self.cat.store.describe(),
                    uptime=round(time.time() - self.started, 3))

    def stats(self, _r: Stats) -> MountStats:
        return MountStats(cache=self.cat.cache.snapshot_stats(), fetches=self.cat.fetcher.fetches,
                          memory_hits=self.cat.fetcher.memory_hits, sources=dict(self.cat.store.sources),
                          disks=len(self.cat.sandboxes), open_files=self.fs.open_handles())

    def _disk_path(self, sid: str) -> Path:
        return self.mountpoint / "sandboxes" / sid / "disk.img"

    def create_disk(self, r: CreateDisk) -> DiskInfo:
        upper = self.cat.create_sandbox(r.sid, image=r.image, manifest=r.manifest, size=r.size, volatile=r.volatile)
        return self.cat.sandbox_info(upper, self._disk_path(upper.sid))

    def list_disks(self, _r: ListDisks) -> DiskList:
        return DiskList([self.cat.sandbox_info(u, self._disk_path(u.sid)) for u in list(self.cat.sandboxes.values())])

    def remove_disk(self, r: RemoveDisk) -> DiskRemoved:
        self.cat.remove_sandbox(r.sid)
        return DiskRemoved(r.sid)

    def seal(self, r: Seal) -> Sealed:
        return self.cat.seal(r.sid, wait=r.wait)

    def await_seal(self, r: AwaitSeal) -> Sealed:
        return self.cat.await_seal(r.sid)

    def record_prefetch(self, r: RecordPrefetch) -> PrefetchRecorded:
        return self.cat.record_prefetch(parse_ref(r.image))

    def prefetch(self, r: Prefetch) -> PrefetchStarted:
        view = self.cat.view_for_manifest(r.manifest)
        self.cat.start_prefetch(view)
        return PrefetchStarted(manifest=view.manifest_id)

    def cache_drop(self, _r: CacheDrop) -> CacheDropped:
        self.cat.fetcher.flush()  # else a write still behind would refill it
        freed = self.cat.cache.drop()
        self.cat.fetcher.forget_all()
        self.cat.forget_prefetched()
        if self.cat.fs is not None:
            self.cat.fs.forget_pages()  # and the kernel's copy of the read-only files
        return CacheDropped(freed=freed)

    def pin(self, r: Pin) -> Pinned:
        """Fetch every chunk of an image into the cache and keep it there
        (evicted only as a last resort) until `unpin`: an operator's way to
        keep a hot template local."""
        ref = parse_ref(r.image)
        digests = sorted(set(self.cat.view_for_ref(ref).digests()))
        self.cat.cache.pin(("admin", str(ref)), digests)
        list(self.cat._prefetch.map(self.cat.fetcher.prefetch, digests))
        self.cat.fetcher.flush()
        return Pinned(image=str(ref), chunks=len(digests), cached=sum(map(self.cat.cache.contains, digests)))

    def unpin(self, r: Unpin) -> Unpinned:
        ref = parse_ref(r.image)
        self.cat.cache.unpin(("admin", str(ref)))
        return Unpinned(image=str(ref))

    def shutdown(self, _r: Shutdown) -> ShuttingDown:
        if self._token is not None:
            trio.from_thread.run_sync(pyfuse3.terminate, trio_token=self._token)
        return ShuttingDown(pid=os.getpid())

    async def _watch_signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for _sig in signals:
                pyfuse3.terminate()
                return

    async def _tune_read_ahead(self, ready: Callable[[], None]) -> None:
        """Set the mount's read-ahead, then say the mount is ready.

        The kernel sets read-ahead itself when it gets the reply to FUSE
        INIT, which the loop sends once running; no other request is served
        before that reply, so a stat of the mount returning means it is
        done. Ready only after ours is set: a restore started at once on a
        fresh mount otherwise read its kernel in 128 KiB requests (~0.1 s).
        """
        try:
            await trio.to_thread.run_sync(os.stat, self.mountpoint)
        except OSError as exc:
            log.warning("mount not answering its own stat: %s", exc)
        else:
            await trio.to_thread.run_sync(set_read_ahead, self.mountpoint, self.read_ahead_kib)
        ready()

    async def _main(self, ready: Callable[[], None]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals, nursery.cancel_scope)
            nursery.start_soon(self._tune_read_ahead, ready)
            await pyfuse3.main(min_tasks=4, max_tasks=64)
            nursery.cancel_scope.cancel()

    def run(self, ready: Callable[[], None]) -> None:
        options = set(pyfuse3.default_options)
        options.add("fsname=strata")
        options.add("subtype=strata")
        if os.geteuid() == 0:
            options.add("allow_other")  # the VMM may run as another user
        self.cat.load_sandboxes()
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        server = _ControlServer(str(self.socket_path), _ControlHandler)
        server.daemon = self  # type: ignore[attr-defined]
        os.chmod(self.socket_path, 0o600)
        pyfuse3.init(self.fs, str(self.mountpoint), options)
        thread = threading.Thread(target=server.serve_forever, name="strata-control", daemon=True)
        thread.start()
        try:
            trio.run(self._main, ready)
        finally:
            server.shutdown()
            server.server_close()
            self.socket_path.unlink(missing_ok=True)
            pyfuse3.close(unmount=True)
            self.fs.shutdown()
            self.cat.close()


def set_read_ahead(mountpoint: Path, kib: int) -> bool:
    """Raise the kernel's read-ahead for this mount (READ_AHEAD_KIB).

    The kernel default (128 KiB) splits a sequential read of a 1 MiB chunk into
    eight FUSE requests; at 1 MiB it is one, and measured sequential reads
    through the mount went from 278 to 365 MB/s warm and 175 to 210 MB/s
    cold. At 4 MiB the kernel keeps several 1 MiB requests in flight, which
    the daemon answers on as many threads: warm buffered reads went from
    0.27-0.44x the raw file's speed to 0.56-0.62x (`bench/fuse_read.py`,
    alternated runs), with restores and forks no slower (a RAM file's
    faults read around them by this much too). Needs root (a sysfs write);
    elsewhere the default stays.
    Reads /proc/self/mountinfo instead of stat()ing the mount, which would
    wait on this very daemon.
    """
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4] == str(mountpoint):
                    with open(f"/sys/class/bdi/{fields[2]}/read_ahead_kb", "w") as ra:
                        ra.write(str(kib))
                    return True
    except OSError as exc:
        log.info("read-ahead left at the kernel default: %s", exc)
    return False


def serve(settings: MountSettings, ready: Callable[[], None]) -> None:
    """Run a daemon in this process until unmounted."""
    mountpoint = check_mountpoint(Path(settings.mountpoint))
    sock = control_socket(mountpoint, settings.run_dir)
    if sock.exists():
        try:
            with socket.socket(socket.AF_UNIX) as s:
                connect_unix(s, sock)
            raise InvalidInput(f"a Strata daemon already serves {mountpoint}")
        except (ConnectionRefusedError, FileNotFoundError):
            sock.unlink(missing_ok=True)
    if not os.path.exists("/dev/fuse"):
        raise StrataError("/dev/fuse is missing: load the fuse module (modprobe fuse) or run with --device /dev/fuse")
    store = open_store(settings.store, **settings.store_options)
    cache = ChunkCache(settings.cache_dir, capacity=settings.cache_size)
    cat = Catalogue(store, cache, settings.upper_dir, squash_depth=settings.squash_depth)
    Daemon(mountpoint, cat, sock).run(ready)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the background daemon process (`python -m fusefs.daemon`)."""
    parser = argparse.ArgumentParser(prog="strata-mountd", description="reads its MountSettings (JSON) on stdin")
    parser.add_argument("--ready-fd", type=int)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ready_file = os.fdopen(args.ready_fd, "w") if args.ready_fd is not None else None
    if keep_freed_memory():  # chunk-sized buffers come and go on the event loop: no page faults for each
        warm_heap(RECENT)  # and the first cold restore's chunks land in pages already mapped

    def ready() -> None:
        if ready_file is not None:
            ready_file.write("ready\n")
            ready_file.close()

    try:
        serve(MountSettings.from_json(sys.stdin.buffer.read()), ready)
    except StrataError as exc:
        log.error("%s", exc)
        if ready_file is not None and not ready_file.closed:
            ready_file.write(f"error: {exc}\n")
            ready_file.close()
        return 1
    except Exception as exc:
        log.exception("daemon failed")
        if ready_file is not None and not ready_file.closed:
            ready_file.write(f"error: internal error: {type(exc).__name__}: {exc}\n")
            ready_file.close()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
