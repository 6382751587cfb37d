"""The FUSE filesystem (pyfuse3 + trio): images, layers and sandbox disks as flat files.

The tree (images/, layers/, snapshots/, sandboxes/) is paths.py's.
This module only translates FUSE requests into calls on `Node` objects;
chunk fetching, caching and copy-on-write live in fetch.py, cache.py and
upper.py. Blocking work (disk, network) runs in worker threads via
`trio.to_thread`, so one slow fetch never stalls other requests. Errors map
to errno: unknown names ENOENT, writes to read-only files EROFS (or EACCES
from the mode bits), corrupt or unreachable chunks EIO (logged with the
digest), writes past the end EFBIG. Anything else a handler raises (a store
that fails in a way nobody foresaw, a bug) is EIO for that one request, with
a log line naming the operation and path: pyfuse3 would otherwise end the
whole daemon, and with it every sandbox's disk and RAM (`contained`).
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import pyfuse3
import trio

from layerstore.digest import is_digest
from layerstore.errors import Conflict, CorruptObject, InvalidInput, MissingChunk, NotFound, StrataError
from layerstore.refs import parse_ref

from .paths import DISK, IMAGES, LAYERS, SANDBOXES, SNAPSHOT_FILES, SNAPSHOTS
from .stream import ReadStream, ReadStreams
from .upper import UpperLayer
from .view import LayerView

if TYPE_CHECKING:
    from .catalogue import Catalogue

log = logging.getLogger("strata.fusefs")

READ_AHEAD_CHUNKS = 8
PAGES_AHEAD = 4  # cached chunks whose files are paged in ahead of an O_DIRECT reader (_read_ahead)


@dataclass
class Node:
    inode: int
    name: str
    parent: int
    is_dir: bool
    view: LayerView | None = None
    upper: UpperLayer | None = None
    children: dict[str, int] = field(default_factory=dict)
    key: str = ""  # e.g. "image:NAME:TAG", "sandbox:SID"
    # a read-only file that may still be opened read-write, for a VMM that maps
    # it privately (copy-on-write): QEMU opens memory-backend-file O_RDWR even
    # with share=off. Writes through write() are still refused.
    private_map: bool = False

    @property
    def writable(self) -> bool:
        return self.upper is not None

    @property
    def size(self) -> int:
        if self.upper is not None:
            return self.upper.size
        if self.view is not None:
            return self.view.size
        return 0


@dataclass
class Handle:
    node: Node
    last_end: int = -1
    pin_owner: object = None
    writable: bool = False  # opened for writing: its close flushes the disk
    # a read-only file opened read-write: a VMM mapping it privately, as a
    # restored guest's RAM (vmm/cowmemory.py), faulted in no order
    guest_ram: bool = False
    # an image read through the page cache (not O_DIRECT, not written): the
    # FUSE file keeps what it reads, so the chunk cache's files are read
    # around their page cache (StrataFS._read_around), read ahead once the
    # reads are sequential (its stream)
    around_cache: bool = False
    stream: ReadStream | None = None
    paged: range = range(0)  # the chunks whose cache files read-ahead last asked the kernel to page in


def contained(operation: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`operation` with every error that is not a FUSEError turned into EIO
    for this request alone, logged with the operation and path."""

    @functools.wraps(operation)
    async def handler(self: StrataFS, *args: Any) -> Any:
        try:
            return await operation(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("%s %s failed; answering EIO", operation.__name__, self.describe_request(args))
            raise pyfuse3.FUSEError(errno.EIO) from None

    return handler



def contain(cls: type[pyfuse3.Operations]) -> type[pyfuse3.Operations]:
    """Wrap every pyfuse3 operation `cls` implements in `contained`."""
    for name, value in list(vars(cls).items()):
        if name in vars(pyfuse3.Operations) and callable(value):
            setattr(cls, name, contained(value))
    return cls



@contain
class StrataFS(pyfuse3.Operations):
    """pyfuse3 operations over a `Catalogue` of images and sandboxes (catalogue.py)."""

    enable_writeback_cache = False

    def __init__(self, catalogue: Catalogue) -> None:
        super().__init__()
        self.cat = catalogue
        self._nodes: dict[int, Node] = {}
        self._next_inode = itertools.count(pyfuse3.ROOT_INODE + 1)
        self._handles: dict[int, Handle] = {}
        self._next_fh = itertools.count(1)
        self._lock = threading.Lock()
        self._mtime = time.time_ns()
        self.readahead = ThreadPoolExecutor(4, thread_name_prefix="strata-readahead")
        self.streams = ReadStreams()
        root = Node(pyfuse3.ROOT_INODE, "", pyfuse3.ROOT_INODE, True)
        self._nodes[root.inode] = root
        self.images = self._mkdir(root, IMAGES)
        self.layers = self._mkdir(root, LAYERS)
        self.snapshots = self._mkdir(root, SNAPSHOTS)
        self.sandboxes = self._mkdir(root, SANDBOXES)

    # tree -------------------------------------------------------------------
    def _mkdir(self, parent: Node, name: str, key: str = "") -> Node:
        node = Node(next(self._next_inode), name, parent.inode, True, key=key)
        self._nodes[node.inode] = node
        parent.children[name] = node.inode
        return node

    def _mkfile(self, parent: Node, name: str, *, view: LayerView | None = None, upper: UpperLayer | None = None) -> Node:
        node = Node(next(self._next_inode), name, parent.inode, False, view=view, upper=upper)
        self._nodes[node.inode] = node
        parent.children[name] = node.inode
        return node

    def add_sandbox(self, sid: str, upper: UpperLayer) -> None:
        with self._lock:
            if sid in self.sandboxes.children:
                raise InvalidInput(f"sandbox {sid} is already mounted")
            d = self._mkdir(self.sandboxes, sid, key=f"sandbox:{sid}")
            self._mkfile(d, DISK, upper=upper)

    def remove_sandbox(self, sid: str) -> None:
        with self._lock:
            inode = self.sandboxes.children.get(sid)
            if inode is None:
                raise NotFound(f"sandbox {sid} not found")
            d = self._nodes[inode]
            for child in d.children.values():
                if any(h.node.inode == child for h in self._handles.values()):
                    raise Conflict(f"sandbox {sid} is open; close it (stop its VM) first")
            for child in d.children.values():
                self._nodes.pop(child, None)
            del self.sandboxes.children[sid]
            self._nodes.pop(inode, None)
        # The kernel caches sandboxes/SID -> old inode for entry_timeout; a
        # sandbox re-created under the same id (resume after pause) must not
        # be looked up through the stale entry. Called from the control
        # thread, never from a request handler, so the synchronous form is safe.
        for parent, name in ((inode, DISK), (self.sandboxes.inode, sid)):
            try:
                pyfuse3.invalidate_entry(parent, name.encode())
            except (OSError, RuntimeError) as exc:  # ENOENT: the kernel had not cached it
                log.debug("invalidate %s: %s", name, exc)

    def forget_pages(self) -> None:
        """Make the kernel drop its page cache of every read-only file (images,
        snapshots: opened with keep_cache), so that a read after `strata cache
        drop` is as cold as on a node that never saw them (a VM mapping one
        privately faults its pages in again). Upper layers keep theirs: their
        pages may be dirty, and mapped by a running VM. Called from the
        control thread, never from a request handler."""
        with self._lock:
            inodes = [n.inode for n in self._nodes.values() if not n.is_dir and n.view is not None and not n.writable]
        for inode in inodes:
            try:
                pyfuse3.invalidate_inode(inode)
            except (OSError, RuntimeError) as exc:  # ENOENT: the kernel had not cached it
                log.debug("invalidate inode %d: %s", inode, exc)

    def _image_dir(self, name: str) -> Node | None:
        """images/NAME:TAG, resolved on demand so new imports appear without a remount."""
        with self._lock:
            inode = self.images.children.get(name)
            if inode is not None:
                return self._nodes[inode]
        try:
            ref = parse_ref(name)
            if str(ref) != name:
                return None
            view = self.cat.view_for_ref(ref)
        except (InvalidInput, NotFound):
            return None
        with self._lock:
            inode = self.images.children.get(name)
            if inode is not None:
                return self._nodes[inode]
            d = self._mkdir(self.images, name, key=f"image:{name}")
            self._mkfile(d, DISK, view=view)
            return d

    def _layer_dir(self, manifest_id: str) -> Node | None:
        with self._lock:
            inode = self.layers.children.get(manifest_id)
            if inode is not None:
                return self._nodes[inode]
        if not is_digest(manifest_id):
            return None
        try:
            view = self.cat.view_for_manifest(manifest_id)
        except (NotFound, CorruptObject):
            return None
        with self._lock:
            d = self._mkdir(self.layers, manifest_id, key=f"layer:{manifest_id}")
            self._mkfile(d, DISK, view=view).private_map = True  # a VM's RAM base (vmm/cowmemory.py)
            return d

    def _snapshot_dir(self, snapshot_id: str) -> Node | None:
        """snapshots/<id>/{disk.img,memory,state}: a snapshot's three layers, read-only."""
        with self._lock:
            inode = self.snapshots.children.get(snapshot_id)
            if inode is not None:
                return self._nodes[inode]
        if not is_digest(snapshot_id):
            return None
        try:
            snap = self.cat.store.get_snapshot(snapshot_id)
            views = {name: self.cat.view_for_manifest(snap.layers[role]) for role, name in SNAPSHOT_FILES.items()}
        except (NotFound, CorruptObject) as exc:
            log.warning("snapshot %s not served: %s", snapshot_id, exc)
            return None
        with self._lock:
            inode = self.snapshots.children.get(snapshot_id)
            if inode is not None:
                return self._nodes[inode]
            d = self._mkdir(self.snapshots, snapshot_id, key=f"snapshot:{snapshot_id}")
            for name, view in views.items():
                self._mkfile(d, name, view=view).private_map = name == SNAPSHOT_FILES["memory"]
            return d

    def _node(self, inode: int) -> Node:
        node = self._nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        a.entry_timeout = 1.0 if node.is_dir else 60.0
        a.attr_timeout = 1.0 if node.is_dir else 60.0
        if node.is_dir:
            a.st_mode = stat.S_IFDIR | 0o755
            a.st_nlink = 2
            a.st_size = 0
        else:
            a.st_mode = stat.S_IFREG | (0o644 if node.writable else 0o444)
            a.st_nlink = 1
            a.st_size = node.size
        a.st_blksize = 1 << 20
        a.st_blocks = -(-a.st_size // 512)
        a.st_uid = os.getuid()
        a.st_gid = os.getgid()
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self._mtime
        return a

    # FUSE operations --------------------------------------------------------
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self._node(parent_inode)
        text = name.decode("utf-8", "surrogateescape")
        if text == ".":
            return self._attrs(parent)
        if text == "..":
            return self._attrs(self._node(parent.parent))
        inode = parent.children.get(text)
        if inode is None and parent is self.images:
            d = await trio.to_thread.run_sync(self._image_dir, text)
            inode = d.inode if d else None
        elif inode is None and parent is self.layers:
            d = await trio.to_thread.run_sync(self._layer_dir, text)
            inode = d.inode if d else None
        elif inode is None and parent is self.snapshots:
            d = await trio.to_thread.run_sync(self._snapshot_dir, text)
            inode = d.inode if d else None
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(self._node(inode))

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(self._node(inode))

    async def setattr(self, inode, attr, fields, fh, ctx):  # noqa: ANN001, ANN201 - pyfuse3 signature
        node = self._node(inode)
        if fields.update_size and attr.st_size != node.size:
            raise pyfuse3.FUSEError(errno.EPERM)  # disks have a fixed size
        if fields.update_mode or fields.update_uid or fields.update_gid:
            raise pyfuse3.FUSEError(errno.EPERM)
        return self._attrs(node)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self._node(inode)
        if not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if node is self.images:
            await trio.to_thread.run_sync(self._refresh_images)
        elif node is self.snapshots:
            await trio.to_thread.run_sync(self._refresh_snapshots)
        return inode

    def _refresh_snapshots(self) -> None:
        try:
            for snapshot_id in self.cat.store.list_snapshots():
                self._snapshot_dir(snapshot_id)
        except StrataError as exc:
            log.warning("listing snapshots failed: %s", exc)

    def _refresh_images(self) -> None:
        try:
            names = [str(ref) for ref in self.cat.list_refs()]
        except StrataError as exc:
            log.warning("listing images failed: %s", exc)
            return
        for name in names:
            self._image_dir(name)

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node = self._node(fh)
        entries = sorted(node.children.items())
        for i, (name, inode) in enumerate(entries[start_id:], start_id):
            child = self._nodes.get(inode)
            if child is None:
                continue
            if not pyfuse3.readdir_reply(token, name.encode(), self._attrs(child), i + 1):
                break

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR) and not (node.writable or node.private_map):
            raise pyfuse3.FUSEError(errno.EROFS)
        if flags & os.O_TRUNC:
            raise pyfuse3.FUSEError(errno.EPERM)
        fh = next(self._next_fh)
        writable = bool(flags & (os.O_WRONLY | os.O_RDWR))
        handle = Handle(node, writable=writable, guest_ram=writable and not node.writable,
                        around_cache=not (writable or node.upper is not None or flags & os.O_DIRECT))
        self._handles[fh] = handle
        view = node.upper.lower if node.upper is not None else node.view
        if view is not None:
            handle.pin_owner = ("fh", fh)
            self.cat.cache.pin(handle.pin_owner, view.digests())
            self.cat.start_prefetch(view)
        info = pyfuse3.FileInfo(fh=fh)
        info.keep_cache = not node.writable  # immutable content: let the kernel cache pages
        info.direct_io = False
        return info

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        handle = self._handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        node = handle.node
        target = node.upper if node.upper is not None else node.view
        assert target is not None
        # Holes, chunks in memory, verified cache entries and an upper layer's
        # own pages need no waiting: answer on the event loop and skip a
        # thread hop (~0.2 ms here, milliseconds while the node seals).
        ready = self._read_ready(node, off, size)
        if ready is not None:
            if off == handle.last_end and not handle.guest_ram:
                self._read_ahead(handle, off + len(ready))
            handle.last_end = off + len(ready)
            return ready
        try:
            if handle.around_cache:
                data = await self._read_around(handle, off, size)
            else:
                data = await trio.to_thread.run_sync(target.read, off, size)
        except (CorruptObject, MissingChunk, StrataError) as exc:
            log.error("read of %s [%d, %d) failed: %s", self._path(node), off, off + size, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except OSError as exc:
            log.error("read of %s failed: %s", self._path(node), exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        if off == handle.last_end and not handle.guest_ram:
            self._read_ahead(handle, off + len(data))
        handle.last_end = off + len(data)
        return data

    async def _read_around(self, handle: Handle, off: int, size: int) -> memoryview:
        """A read of a buffered reader of an image (fusefs/stream.py), read
        ahead once it is sequential."""
        assert handle.node.view is not None
        if handle.stream is None and off == handle.last_end:
            handle.stream = self.streams.open(handle.node.view)
        return await self.streams.read(handle.node.view, off, size, stream=handle.stream)

    @staticmethod
    def _read_ready(node: Node, off: int, size: int) -> bytes | None:
        if node.upper is not None:
            return node.upper.read_ready(off, size)
        if node.view is not None and size <= node.view.chunk_size:
            return node.view.read_ready(off, size)
        return None

    def _read_ahead(self, handle: Handle, end: int) -> None:
        """Fetch the chunks after a run of reads that ended at `end`, and
        have the kernel page in the cache files of the next PAGES_AHEAD
        cached ones, unless the handle is read around the page cache: an
        O_DIRECT reader (a VMM's disk) has one read in flight, which then
        need not wait for the disk.

        Not for a sandbox's RAM (its volatile upper layer, or the layer a
        restored guest maps copy-on-write: `Handle.guest_ram`): a guest faults its
        pages in no order, and the kernel's read-around of a fault, as long
        as the mount's read-ahead, looks like such a run. What a restore
        needs there is its recorded working set; read-ahead only added
        fetches and daemon CPU to a cold restore (bench/vm_snapshot.py)."""
        node = handle.node
        if node.upper is not None and node.upper.volatile:
            return
        view = node.upper.lower if node.upper is not None else node.view
        if view is None or end >= view.size:
            return
        first = end // view.chunk_size
        chunk_count = -(-view.size // view.chunk_size)
        paged, handle.paged = handle.paged, range(first, first + PAGES_AHEAD)
        for index in range(first, min(first + READ_AHEAD_CHUNKS, chunk_count)):
            digest = view.chunks.get(index)
            if digest is None:
                continue
            if not self.cat.cache.contains(digest):
                self.cat.schedule_prefetch(digest)
            elif not handle.around_cache and index in handle.paged and index not in paged:
                self.readahead.submit(self.cat.cache.will_need, digest)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        upper = handle.node.upper
        if upper is None:
            raise pyfuse3.FUSEError(errno.EROFS)
        if off + len(buf) > upper.size:
            raise pyfuse3.FUSEError(errno.EFBIG)
        try:
            done = upper.write_ready(off, buf)
            if done is not None:
                return done
            return await trio.to_thread.run_sync(upper.write, off, buf)
        except (CorruptObject, MissingChunk, StrataError) as exc:
            log.error("copy-up for write to %s at %d failed: %s", self._path(handle.node), off, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except OSError as exc:
            log.error("write to %s failed: %s", self._path(handle.node), exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

    async def flush(self, fh: int) -> None:
        """A close: a descriptor opened for writing flushes the disk (as an
        fsync); a read-only one has nothing to flush. (QEMU closes the
        read-only descriptor it held while a migration had the disk
        inactive when the VM continues; an fsync there stalled the guest's
        resume after every snapshot by 25-120 ms, racing the seal.)"""
        handle = self._handles.get(fh)
        if handle is not None and handle.writable:
            await self.fsync(fh, False)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handles.get(fh)
        if handle is None or handle.node.upper is None:
            return
        try:
            await trio.to_thread.run_sync(handle.node.upper.fsync)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is not None and handle.stream is not None:
            handle.stream.close()
        if handle is not None and handle.pin_owner is not None:
            self.cat.cache.unpin(handle.pin_owner)

    async def releasedir(self, fh: int) -> None:
        return None

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        stats = self.cat.cache.snapshot_stats()
        s.f_blocks = stats["capacity"] // 4096
        s.f_bfree = s.f_bavail = max(0, stats["capacity"] - stats["size"]) // 4096
        s.f_files = len(self._nodes)
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # refusals: the tree is managed through the control socket, not by file operations
    async def create(self, parent_inode, name, mode, flags, ctx):  # noqa: ANN001, ANN201
        raise pyfuse3.FUSEError(errno.EROFS if parent_inode != self.sandboxes.inode else errno.EPERM)

    async def mkdir(self, parent_inode, name, mode, ctx):  # noqa: ANN001, ANN201
        raise pyfuse3.FUSEError(errno.EPERM)

    async def unlink(self, parent_inode, name, ctx):  # noqa: ANN001, ANN201
        raise pyfuse3.FUSEError(errno.EPERM)

    async def rmdir(self, parent_inode, name, ctx):  # noqa: ANN001, ANN201
        raise pyfuse3.FUSEError(errno.EPERM)

    async def rename(self, *args):  # noqa: ANN002, ANN201
        raise pyfuse3.FUSEError(errno.EPERM)

    def _path(self, node: Node) -> str:
        parts = []
        while node.inode != pyfuse3.ROOT_INODE:
            parts.append(node.name)
            node = self._nodes.get(node.parent) or self._nodes[pyfuse3.ROOT_INODE]
        return "/" + "/".join(reversed(parts))

    def describe_request(self, args: tuple[Any, ...]) -> str:
        """The path a request is about, as well as it can be told from its first
        arguments (an inode, or a parent inode and a name), for the log."""
        node = self._nodes.get(args[0]) if args and isinstance(args[0], int) else None
        if node is None and args and isinstance(args[0], int) and args[0] in self._handles:
            node = self._handles[args[0]].node
        path = self._path(node) if node is not None else "?"
        if len(args) > 1 and isinstance(args[1], bytes):
            path = path.rstrip("/") + "/" + args[1].decode("utf-8", "replace")
        return path

    def open_handles(self) -> int:
        return len(self._handles)

    def shutdown(self) -> None:
        self.readahead.shutdown(wait=False, cancel_futures=True)
        self.streams.close()

