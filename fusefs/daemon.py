"""The mount daemon: wires store, cache, the catalogue (catalogue.py) and FUSE
together, and answers a control socket for the CLI, the VMM and the API.

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
import signal
import socket
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pyfuse3
import trio

from layerstore.errors import InvalidInput, StrataError
from layerstore.logs import configure as configure_logging
from layerstore.malloc import keep_freed_memory, warm_heap
from layerstore.refs import parse_ref
from layerstore.store import open_store
from layerstore.unixsock import bind_unix, connect_unix

from .cache import ChunkCache
from .catalogue import RECENT, Catalogue
from .control import MountSettings, check_mountpoint, control_socket
from .fs import StrataFS
from .paths import MountPaths
from .protocol import (MAX_LINE, AwaitSeal, CacheDrop, CacheDropped, CreateDisk, DiskInfo, DiskList, DiskRemoved,
                       Handlers, ListDisks, MountStats, Pin, Pinned, Ping, Pong, Prefetch, PrefetchRecorded,
                       PrefetchStarted, RecordPrefetch, RemoveDisk, Seal, Sealed, Shutdown, ShuttingDown,
                       Stats, Unpin, Unpinned, answer, encode_error)

log = logging.getLogger("strata.fusefs")

READ_AHEAD_KIB = 4096  # the kernel's read-ahead on the mount: four chunks (set_read_ahead)


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
        self.paths = MountPaths(mountpoint)
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

    def create_disk(self, r: CreateDisk) -> DiskInfo:
        upper = self.cat.create_sandbox(r.sid, image=r.image, manifest=r.manifest, size=r.size, volatile=r.volatile)
        return self.cat.sandbox_info(upper, self.paths.sandbox(upper.sid))

    def list_disks(self, _r: ListDisks) -> DiskList:
        return DiskList([self.cat.sandbox_info(u, self.paths.sandbox(u.sid))
                         for u in list(self.cat.sandboxes.values())])

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
    eight FUSE requests; at 4 MiB the kernel keeps several 1 MiB requests in
    flight, which the daemon answers on as many threads, and sequential
    reads are faster with restores and forks no slower (bench/fuse_read.py,
    figures in bench/README.md). Needs root (a sysfs write); elsewhere the
    default stays.
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
    configure_logging(args.log_level)
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
