"""A sandbox's writable disk: a copy-on-write upper layer over a read-only stack.

On-disk layout of one sandbox (`UPPER_ROOT/<sid>/`):

    state.json       {"base": <manifest id>, "size": N, "chunk_size": C,
                      "gen": g, "sealing": [g1, g2, ...], "layers": [<sealed ids>],
                      "seq": n (counts the records written; absent = 0),
                      "volatile": true (only a VM's RAM: never fsynced, see create)}
                     replaced (temp file, fsync, rename) by durable records
    state.next       <the same JSON>\n<its blake3, hex>\n<older bytes: ignored>
                     the records that need not be durable (a seal's switch):
                     overwritten in place, never renamed or truncated, and
                     read only if it checks out and its seq is the higher
    gen-<g>.data     sparse file of N bytes: whole chunks, and pages of partial ones
    gen-<g>.dirty    written on fsync (atomically):

        +---------------------------------+----------------------------------+
        | chunk bitmap: one bit per chunk | partial chunks, by index:        |
        | whole in gen-<g>.data           | <u32 LE index><page bitmap> ...  |
        | (ceil(chunks / 8) bytes)        | (one bit per 4 KiB page held)    |
        +---------------------------------+----------------------------------+

Reads resolve chunk by chunk and, in a partial chunk, page by page: the
current generation, then the frozen ones newest first, then the read-only
lower stack. A write of whole 4 KiB pages to a chunk the generation lacks
only records the pages: no copy-up (a guest's RAM written back at a snapshot
is hundreds of scattered pages, and copying up each one's 1 MiB chunk cost
a decode and a 1 MiB write apiece). Any other write to such a chunk first
completes it from below. A frozen generation's partial chunks are composed
over what is below, in memory, by the seal's background job as it publishes
them: a published layer names whole chunks (stored as their changed pages:
layerstore/delta.py).

Durability: `fsync` fsyncs the data file, then replaces the bitmap, then the
state (a volatile layer replaces them without flushing the disk), for the
current generation and the frozen ones still publishing. After a crash,
chunks marked in the last bitmap hold at least what was fsynced; unsynced
writes may be lost, as on any disk. A seal's switch does not flush the
generation it freezes (a second under a fast writer, and a VM snapshot's
guest waited for it): its background job does, first, and a crash before
that publishes, after the restart, what the disk had fsynced.

Why two state files: replacing a file by rename makes ext4 write the new
file's data at once (auto_da_alloc), and under a fast writer that write
queued behind the writer's: up to 117 ms for a seal's non-durable record,
against 5 ms for an overwrite in place. A torn `state.next` (a power cut
mid-write) fails its check and the durable `state.json` is read instead.

Seal (an incremental snapshot) is a metadata switch under an exclusive lock:
the current generation freezes and joins the `sealing` queue, and a new empty
generation takes writes. Writers are held only for that switch, never for
hashing or uploading, and a write lands wholly in one generation. A
background job then hashes and stores the frozen dirty chunks as a layer
(parent = base) and, once the manifest is published, makes it the new base
and deletes the frozen files. Queued generations publish oldest first; reads
check the current generation, then the frozen ones newest first, then the
lower stack.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from concurrent.futures import Future
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from layerstore.digest import digest_bytes
from layerstore.errors import InvalidInput, NotFound, StrataError

from .view import LayerView, chunk_spans

MAX_DISK = 16 << 40  # bytes: the largest sandbox disk (a sparse file)
PAGE = 4096  # bytes: what a partial chunk holds or lacks

class RWLock:
    """Many readers/writers of data (shared) or one seal switch (exclusive)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting_exclusive:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if not self._shared:
                self._cond.notify_all()

    def try_acquire_shared(self) -> bool:
        """acquire_shared if that needs no waiting (for callers on an event loop)."""
        with self._cond:
            if self._exclusive or self._waiting_exclusive:
                return False
            self._shared += 1
            return True

    def acquire_exclusive(self) -> None:
        with self._cond:
            self._waiting_exclusive += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting_exclusive -= 1
            self._exclusive = True

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()


def _write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if not durable:
        return
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _overwrite_checked(path: Path, body: bytes) -> None:
    """Write `body` and its digest over the start of `path` (see state.next)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"%s\n%s\n" % (body, digest_bytes(body).encode()), 0)
    finally:
        os.close(fd)


def _read_checked(path: Path) -> dict[str, object] | None:
    """What `_overwrite_checked` wrote to `path`, or None (none, torn or corrupt)."""
    try:
        body, check, _ = path.read_bytes().split(b"\n", 2)
        state = json.loads(body) if check.decode() == digest_bytes(body) else None
    except (FileNotFoundError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _zero_tail(data: bytes, n: int) -> bytes:
    """`data` made `n` bytes long: what the lower stack lacks past the image's end reads as zeros."""
    return data if len(data) == n else data + bytes(n - len(data))


def _bit(bits: bytearray, i: int) -> bool:
    """Bit `i` of a bitmap (chunks of a generation, pages of a partial chunk)."""
    return bool(bits[i >> 3] & (1 << (i & 7)))


def _set_bit(bits: bytearray, i: int) -> None:
    bits[i >> 3] |= 1 << (i & 7)


def _chunk_len(size: int, chunk_size: int, index: int) -> int:
    """Bytes of chunk `index` in a disk of `size` bytes (the last one may be short)."""
    return min(chunk_size, size - index * chunk_size)


def _page_runs(pages: bytearray, start: int, n: int) -> Iterator[tuple[bool, int, int]]:
    """Split [start, start + n) of a partial chunk into runs of pages it
    holds (True) or lacks: yields (held, offset in chunk, length)."""
    end = start + n
    while start < end:
        held = _bit(pages, start // PAGE)
        stop = min(end, (start // PAGE + 1) * PAGE)
        while stop < end and _bit(pages, stop // PAGE) == held:
            stop = min(end, stop + PAGE)
        yield held, start, stop - start
        start = stop


class _Generation:
    """One data file plus its dirty map: whole chunks and partial ones' pages."""

    def __init__(self, root: Path, gen: int, size: int, chunk_size: int, *, create: bool) -> None:
        self.gen = gen
        self.data_path = root / f"gen-{gen}.data"
        self.dirty_path = root / f"gen-{gen}.dirty"
        self.size = size
        self.chunk_size = chunk_size
        count = -(-size // chunk_size)
        # A generation the state names may have no files after a crash (a
        # seal's switch creates them without flushing): it is empty. A new
        # one starts empty whatever a crash left under its name.
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_CREAT | (os.O_TRUNC if create else 0)
        self.fd = os.open(self.data_path, flags, 0o600)
        if os.fstat(self.fd).st_size != size:
            os.ftruncate(self.fd, size)
        self.bitmap = bytearray(-(-count // 8))
        self._page_bytes = -(-(chunk_size // PAGE) // 8)
        self.pages: dict[int, bytearray] = {}  # partial chunk -> bitmap of the pages held
        if create:
            self.dirty_path.unlink(missing_ok=True)
        elif self.dirty_path.exists():
            self._load(self.dirty_path.read_bytes())
        self.changed = create

    def _load(self, stored: bytes) -> None:
        self.bitmap[:] = stored[: len(self.bitmap)].ljust(len(self.bitmap), b"\0")
        record = 4 + self._page_bytes
        for at in range(len(self.bitmap), len(stored) - record + 1, record):
            index = int.from_bytes(stored[at : at + 4], "little")
            if index < len(self.bitmap) * 8 and not self.is_dirty(index):
                self.pages[index] = bytearray(stored[at + 4 : at + record])

    def is_dirty(self, index: int) -> bool:
        """The generation holds all of chunk `index`."""
        return _bit(self.bitmap, index)

    def mark(self, index: int) -> None:
        """Chunk `index` is whole in the data file (call once its bytes are there)."""
        _set_bit(self.bitmap, index)
        self.pages.pop(index, None)
        self.changed = True

    def mark_pages(self, index: int, inner: int, n: int) -> None:
        """Bytes [inner, inner + n) of chunk `index`, whole pages, are in the data file."""
        pages = self.pages.get(index)
        pages = bytearray(self._page_bytes) if pages is None else pages
        for page in range(inner // PAGE, -(-(inner + n) // PAGE)):
            _set_bit(pages, page)
        if int.from_bytes(pages, "little").bit_count() == -(-_chunk_len(self.size, self.chunk_size, index) // PAGE):
            self.mark(index)
        else:
            self.pages[index] = pages
            self.changed = True

    def dirty_indices(self) -> list[int]:
        """Chunks the generation holds all or part of."""
        out = []
        for byte_index, byte in enumerate(self.bitmap):
            if byte:
                out.extend(byte_index * 8 + bit for bit in range(8) if byte & (1 << bit))
        return sorted(out + list(self.pages))

    def sync(self, *, durable: bool = True) -> None:
        # The map is taken before the data is flushed: a chunk or page marked
        # in it had its bytes written before the mark, so they are flushed
        # too; one marked by a writer meanwhile waits for the next sync.
        changed, self.changed = self.changed, False
        if changed:
            records = b"".join(index.to_bytes(4, "little") + pages for index, pages in list(self.pages.items()))
            stored = bytes(self.bitmap) + records
        if durable:
            os.fsync(self.fd)
        if changed:
            _write_atomic(self.dirty_path, stored, durable=durable)

    def close(self) -> None:
        os.close(self.fd)

    def remove(self) -> None:
        self.close()
        self.data_path.unlink(missing_ok=True)
        self.dirty_path.unlink(missing_ok=True)


@dataclass
class SealTicket:
    """A seal in progress; `result()` waits for the published manifest id."""

    sid: str
    generation: int
    dirty_chunks: int
    future: Future[str]
    switched_in: float

    def result(self, timeout: float | None = None) -> str:
        return self.future.result(timeout)


# read_chunk(index) -> chunk `index`'s whole content as a seal froze it
ChunkReader = Callable[[int], bytes]
# publish(upper, read_chunk, dirty indices, base id) -> new manifest id
Publisher = Callable[["UpperLayer", ChunkReader, list[int], str], str]


class UpperLayer:
    """The copy-on-write disk of one sandbox."""

    def __init__(
        self, root: Path, lower: LayerView, state: dict[str, object], *, relower: Callable[[str], LayerView]
    ) -> None:
        self.root = root
        self._relower = relower
        self.sid = root.name
        self.lower = lower
        self.size = int(state["size"])  # type: ignore[arg-type]
        self.chunk_size = int(state["chunk_size"])  # type: ignore[arg-type]
        self.base = str(state["base"])
        self.layers: list[str] = list(state.get("layers", []))  # type: ignore[arg-type]
        self.volatile = bool(state.get("volatile", False))
        self._lock = RWLock()
        self._chunk_locks = [threading.Lock() for _ in range(64)]
        self.current = _Generation(root, int(state["gen"]), self.size, self.chunk_size, create=False)  # type: ignore[arg-type]
        queued = state.get("sealing") or []
        queued = [queued] if isinstance(queued, int) else queued
        # frozen generations waiting to be published, oldest first
        self.sealing: list[_Generation] = [
            _Generation(root, int(g), self.size, self.chunk_size, create=False) for g in queued  # type: ignore[union-attr]
        ]
        self._publish_lock = threading.Lock()
        self._published: dict[int, str] = {}
        self._state_changed = False
        self._state_seq = int(state.get("seq", 0))  # type: ignore[call-overload]
        self._seal_lock = threading.Lock()
        self.pending_seal: SealTicket | None = None

    # creation / loading -----------------------------------------------------
    @classmethod
    def create(cls, root: Path, lower: LayerView, *, relower: Callable[[str], LayerView],
               size: int | None = None, volatile: bool = False) -> "UpperLayer":
        """A fresh, empty upper layer over `lower` (fails if `root` exists),
        `size` bytes long: at least the lower's, and past its end the disk
        reads zeros (a sandbox's disk larger than its image).

        A `volatile` layer (a VM's RAM) is not made durable by fsync: its
        content means nothing after the host's crash (the VM is gone with
        it), so fsync only orders (every write before it is in the layer,
        and a restarted daemon still finds it), at no disk flush."""
        size = lower.size if size is None else size
        if size < lower.size or size > MAX_DISK:
            raise InvalidInput(f"disk size {size} is outside {lower.size}..{MAX_DISK} bytes (its image's size and up)")
        try:
            root.mkdir(parents=True)
        except FileExistsError:
            raise InvalidInput(f"sandbox {root.name} already exists") from None
        state = {"base": lower.manifest_id, "size": size, "chunk_size": lower.chunk_size, "gen": 1,
                 "sealing": [], "layers": [], **({"volatile": True} if volatile else {})}
        gen = _Generation(root, 1, size, lower.chunk_size, create=True)
        gen.sync(durable=not volatile)
        gen.close()
        _write_atomic(root / "state.json", json.dumps(state).encode(), durable=not volatile)
        return cls(root, lower, state, relower=relower)

    @staticmethod
    def read_state(root: Path) -> dict[str, object]:
        """The newest state record: state.json, or state.next where it checks out and is newer."""
        try:
            state = json.loads((root / "state.json").read_text())
        except FileNotFoundError:
            raise NotFound(f"sandbox {root.name} has no state (not a sandbox directory)") from None
        except ValueError as exc:
            raise StrataError(f"sandbox {root.name}: state.json is corrupt ({exc})") from None
        newer = _read_checked(root / "state.next")
        return newer if newer is not None and newer.get("seq", 0) > state.get("seq", 0) else state  # type: ignore[operator]

    def _persist_state(self, *, durable: bool = True) -> None:
        """Record the state: durably in state.json, or (not durable, or a
        volatile layer) in state.next, made durable by the next fsync."""
        self._state_seq += 1
        state = {"base": self.base, "size": self.size, "chunk_size": self.chunk_size, "gen": self.current.gen,
                 "sealing": [g.gen for g in self.sealing], "layers": self.layers, "seq": self._state_seq,
                 **({"volatile": True} if self.volatile else {})}
        if durable and not self.volatile:
            _write_atomic(self.root / "state.json", json.dumps(state).encode())
        else:
            _overwrite_checked(self.root / "state.next", json.dumps(state).encode())
        self._state_changed = not durable

    # data path --------------------------------------------------------------
    def _chunk_lock(self, index: int) -> threading.Lock:
        return self._chunk_locks[index % len(self._chunk_locks)]

    def _compose(self, gens: list[_Generation], index: int, inner: int, n: int,
                 lower: Callable[[int, int], bytes | None]) -> bytes | None:
        """Bytes [inner, inner + n) of chunk `index` as the generations `gens`
        (newest first) hold them over what `lower(offset, n)` reads; None
        when `lower` does (it would have to wait)."""
        base = index * self.chunk_size
        for at, gen in enumerate(gens):
            if gen.is_dirty(index):
                return os.pread(gen.fd, n, base + inner)
            pages = gen.pages.get(index)
            if pages is not None:
                parts = []
                for held, start, length in _page_runs(pages, inner, n):
                    part = (os.pread(gen.fd, length, base + start) if held
                            else self._compose(gens[at + 1 :], index, start, length, lower))
                    if part is None:
                        return None
                    parts.append(part)
                return b"".join(parts)
        data = lower(base + inner, n)
        return None if data is None else _zero_tail(data, n)

    def _read_below(self, index: int, inner: int, n: int) -> bytes:
        """Chunk content under the current generation: newest frozen one first."""
        data = self._compose(self.sealing[::-1], index, inner, n, self.lower.read)
        assert data is not None  # lower.read waits instead
        return data

    def read(self, offset: int, length: int) -> bytes:
        end = min(self.size, offset + length)
        if offset < 0 or offset >= end:
            return b""
        parts: list[bytes] = []
        self._lock.acquire_shared()
        try:
            gens = [self.current, *self.sealing[::-1]]
            for index, inner, n, _pos in chunk_spans(offset, end, self.chunk_size):
                data = self._compose(gens, index, inner, n, self.lower.read)
                assert data is not None  # lower.read waits instead
                parts.append(data)
        finally:
            self._lock.release_shared()
        return b"".join(parts)

    def read_ready(self, offset: int, length: int, *, max_disk_read: int = 64 << 10) -> bytes | None:
        """A read within one chunk served without waiting, or None if it needs
        `read` (a thread): the generations' pages over what is below, when
        that is a hole, a chunk in memory or a verified cache entry. For the
        FUSE event loop: QEMU probes its disk's alignment with two small
        reads whenever it reopens it (after every snapshot), and a thread
        hop costs milliseconds while the node seals. Reads at most
        `max_disk_read` bytes from disk, but a chunk in memory is served
        whole (a restored guest's RAM is read in 1 MiB requests, each of
        which would otherwise wait for a thread); never waits for a seal's
        switch."""
        end = min(self.size, offset + length)
        if offset < 0 or offset >= end:
            return b""
        index, inner = divmod(offset, self.chunk_size)
        if (end - 1) // self.chunk_size != index:
            return None
        if not self._lock.try_acquire_shared():
            return None
        try:
            gens = [self.current, *self.sealing[::-1]]
            if end - offset > max_disk_read and any(g.is_dirty(index) or index in g.pages for g in gens):
                return None  # its own pages are a disk read of up to the whole length
            return self._compose(gens, index, inner, end - offset,
                                 lambda off, n: self.lower.read_ready(off, n, max_disk_read=max_disk_read))
        finally:
            self._lock.release_shared()

    def write(self, offset: int, data: bytes) -> int:
        if offset < 0 or offset + len(data) > self.size:
            raise InvalidInput(f"write of {len(data)} bytes at {offset} is past the end of a {self.size}-byte disk")
        cs = self.chunk_size
        view = memoryview(data)
        self._lock.acquire_shared()
        try:
            gen = self.current
            for index, inner, n, pos in chunk_spans(offset, offset + len(data), cs):
                piece = view[pos - offset : pos - offset + n]
                with self._chunk_lock(index):
                    if gen.is_dirty(index):
                        os.pwrite(gen.fd, piece, pos)
                    elif self._whole_pages(index, inner, n):
                        os.pwrite(gen.fd, piece, pos)
                        gen.mark_pages(index, inner, n)
                    else:
                        self._complete(gen, index, self._read_below(index, 0, self._chunk_len(index)))
                        os.pwrite(gen.fd, piece, pos)
        finally:
            self._lock.release_shared()
        return len(data)

    def write_ready(self, offset: int, data: bytes) -> int | None:
        """A write done at once, or None if it needs `write` (a thread).

        Done at once when every chunk it touches is in the current
        generation already, is written in whole pages, or can be completed
        without waiting: what is below is a frozen generation, a hole or a
        chunk in memory or in the verified cache. Cheap enough for the FUSE
        event loop (a 1 MiB copy at most per chunk): writing back a guest's
        RAM at a snapshot is hundreds of scattered 4 KiB writes, and a
        thread hop each cost more (~3 ms on a busy 2-core node) than the
        write. Never waits: a seal switch under way or a chunk another
        writer holds is a None, and a None wrote nothing.
        """
        end = offset + len(data)
        if offset < 0 or end > self.size or not data or not self._lock.try_acquire_shared():
            return None
        held: list[threading.Lock] = []
        try:
            gen = self.current
            paged = []
            for index, inner, n, _pos in chunk_spans(offset, end, self.chunk_size):
                if gen.is_dirty(index):
                    continue
                lock = self._chunk_lock(index)
                if lock not in held:
                    if not lock.acquire(blocking=False):
                        return None
                    held.append(lock)
                if self._whole_pages(index, inner, n):
                    paged.append((index, inner, n))
                elif not self._complete_ready(gen, index):
                    return None
            done = os.pwrite(gen.fd, data, offset)
            for index, inner, n in paged:  # marked once their bytes are there: a read in between sees the old
                gen.mark_pages(index, inner, n)
            return done
        finally:
            for lock in held:
                lock.release()
            self._lock.release_shared()

    def _chunk_len(self, index: int) -> int:
        return _chunk_len(self.size, self.chunk_size, index)

    def _whole_pages(self, index: int, inner: int, n: int) -> bool:
        """[inner, inner + n) of chunk `index` is whole pages (the chunk's last one may be short)."""
        return inner % PAGE == 0 and (n % PAGE == 0 or inner + n == self._chunk_len(index))

    def _complete(self, gen: _Generation, index: int, below: bytes) -> None:
        """Make chunk `index` whole in `gen` from `below` (its whole content
        under `gen`), keeping the pages `gen` holds. Caller holds the chunk's
        lock (or `gen` is frozen). Marked only once its content is there, so
        a read in between sees the chunk as it was."""
        base = index * self.chunk_size
        pages = gen.pages.get(index)
        if pages is None:
            os.pwrite(gen.fd, below, base)
        else:
            for held, start, length in _page_runs(pages, 0, len(below)):
                if not held:
                    os.pwrite(gen.fd, below[start : start + length], base + start)
        gen.mark(index)

    def _complete_ready(self, gen: _Generation, index: int) -> bool:
        """`_complete` chunk `index` in `gen` if what is below needs no waiting (see write_ready)."""
        n = self._chunk_len(index)
        below = self._compose(self.sealing[::-1], index, 0, n,
                              lambda off, length: self.lower.read_ready(off, length, max_disk_read=length))
        if below is None:
            return False
        self._complete(gen, index, below)
        return True

    def fsync(self) -> None:
        self._lock.acquire_shared()
        try:
            with self._seal_lock:
                for gen in (*self.sealing, self.current):  # writes before a seal are in a frozen one
                    gen.sync(durable=not self.volatile)
                if self._state_changed:
                    self._persist_state()
        finally:
            self._lock.release_shared()

    def dirty_count(self) -> int:
        return len(self.current.dirty_indices())

    # seal -------------------------------------------------------------------
    def seal(self, publish: Publisher, run: Callable[[Callable[[], None]], None]) -> SealTicket:
        """Freeze the current generation and queue its publication as a layer.

        Seals never wait for earlier ones: frozen generations queue up and are
        published oldest first (each layer's parent is the one before it), so
        a sandbox can be sealed as often as it likes while writers run. `run`
        starts the background job (an executor's submit).
        """
        with self._seal_lock:
            started = time.monotonic()
            self._lock.acquire_exclusive()
            try:
                frozen = self.current
                self.current = _Generation(self.root, frozen.gen + 1, self.size, self.chunk_size, create=True)
                self.sealing.append(frozen)
            finally:
                self._lock.release_exclusive()
            switched = time.monotonic() - started
            # nothing flushed: under a busy writer any fsync waits for its
            # data (~1 s here), and a VM snapshot's guest waits for the switch
            self._persist_state(durable=False)
            ticket = SealTicket(self.sid, frozen.gen, len(frozen.dirty_indices()), Future(), switched)
            self.pending_seal = ticket
        run(lambda: self._publish_job(ticket, publish))
        return ticket

    def resume_seals(self, publish: Publisher, run: Callable[[Callable[[], None]], None]) -> list[SealTicket]:
        """After a restart: publish every generation that was frozen but not published."""
        tickets = []
        for frozen in list(self.sealing):
            ticket = SealTicket(self.sid, frozen.gen, len(frozen.dirty_indices()), Future(), 0.0)
            tickets.append(ticket)
            run(lambda t=ticket: self._publish_job(t, publish))
        if tickets:
            self.pending_seal = tickets[-1]
        return tickets

    def _publish_job(self, ticket: SealTicket, publish: Publisher) -> None:
        """Publish queued generations oldest first, up to and including the ticket's."""
        try:
            with self._publish_lock:
                while True:
                    with self._seal_lock:
                        if ticket.generation in self._published:
                            break
                        if not self.sealing or self.sealing[0].gen > ticket.generation:
                            raise StrataError(f"sandbox {self.sid}: generation {ticket.generation} is not queued")
                        oldest = self.sealing[0]
                    self._publish_oldest(oldest, publish)
            ticket.future.set_result(self._published[ticket.generation])
        except BaseException as exc:  # the frozen generations stay queued; a later seal retries them
            ticket.future.set_exception(exc)

    def _frozen_chunk(self, frozen: _Generation, index: int) -> bytes:
        """Chunk `index` as the oldest frozen generation `frozen` leaves it:
        its pages laid over the whole chunk below (one read of it), in memory;
        nothing is written back."""
        n = self._chunk_len(index)
        at = index * self.chunk_size
        if frozen.is_dirty(index):
            return os.pread(frozen.fd, n, at)
        out = bytearray(_zero_tail(self.lower.chunk(index), n))
        view = memoryview(out)
        for held, start, length in _page_runs(frozen.pages[index], 0, n):
            if held:
                os.preadv(frozen.fd, [view[start:start + length]], at + start)
        return bytes(out)

    def _publish_oldest(self, frozen: _Generation, publish: Publisher) -> None:
        frozen.sync(durable=not self.volatile)  # what the switch left: a restart republishes all of it
        dirty = frozen.dirty_indices()

        new_base = publish(self, partial(self._frozen_chunk, frozen), dirty, self.base) if dirty else self.base
        new_lower = self._relower(new_base) if new_base != self.base else self.lower
        self._lock.acquire_exclusive()
        try:
            if new_base != self.base:
                self.layers.append(new_base)
            self.lower = new_lower
            self.base = new_base
            self.sealing.remove(frozen)
        finally:
            self._lock.release_exclusive()
        with self._seal_lock:
            self._published[frozen.gen] = new_base
            self._persist_state()
        frozen.remove()

    def discard_sealing(self) -> int:
        """Drop the frozen generations not yet published (the sandbox is going
        away); returns how many. Only when no publish job runs."""
        with self._publish_lock, self._seal_lock:
            dropped = list(self.sealing)
            self.sealing.clear()
            self.pending_seal = None
            self._persist_state()
        for frozen in dropped:
            frozen.remove()
        return len(dropped)

    def close(self) -> None:
        try:
            self.fsync()
        finally:
            self.current.close()
            for frozen in self.sealing:
                frozen.close()
