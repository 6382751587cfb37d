"""A sandbox's writable disk: a copy-on-write upper layer over a read-only stack.

On-disk layout of one sandbox (`UPPER_ROOT/<sid>/`):

    state.json       {"base": <manifest id>, "size": N, "chunk_size": C,
                      "gen": g, "sealing": [g1, g2, ...], "layers": [<sealed ids>],
                      "volatile": true (only a VM's RAM: never fsynced, see create)}
    gen-<g>.data     sparse file of N bytes; a dirty chunk holds its full content
    gen-<g>.dirty    bitmap, one bit per chunk, written on fsync (atomically)

Reads resolve chunk by chunk: the current generation if the chunk is dirty
there, else the generation being sealed, else the read-only lower stack.
A write to a clean chunk first copies the chunk's current content up (unless
it overwrites the whole chunk), so the data file always holds whole chunks.

Durability: `fsync` fsyncs the data file, then replaces the bitmap, then the
state (a volatile layer replaces them without flushing the disk). After a
crash, chunks marked in the last bitmap hold at least what was fsynced;
unsynced writes may be lost, as on any disk.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from layerstore.errors import InvalidInput, NotFound, StrataError

from .view import LayerView, chunk_spans

MAX_DISK = 16 << 40  # bytes: the largest sandbox disk (a sparse file)

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


def _zero_tail(data: bytes, n: int) -> bytes:
    """`data` made `n` bytes long: what the lower stack lacks past the image's end reads as zeros."""
    return data if len(data) == n else data + bytes(n - len(data))


class _Generation:
    """One data file plus its dirty bitmap."""

    def __init__(self, root: Path, gen: int, size: int, chunk_size: int, *, create: bool) -> None:
        self.gen = gen
        self.data_path = root / f"gen-{gen}.data"
        self.dirty_path = root / f"gen-{gen}.dirty"
        count = -(-size // chunk_size)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        self.fd = os.open(self.data_path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, size)
        self.bitmap = bytearray(-(-count // 8))
        if self.dirty_path.exists():
            stored = self.dirty_path.read_bytes()
            self.bitmap[: len(stored)] = stored[: len(self.bitmap)]
        self.changed = create

    def is_dirty(self, index: int) -> bool:
        return bool(self.bitmap[index >> 3] & (1 << (index & 7)))

    def mark(self, index: int) -> None:
        self.bitmap[index >> 3] |= 1 << (index & 7)
        self.changed = True

    def dirty_indices(self) -> list[int]:
        out = []
        for byte_index, byte in enumerate(self.bitmap):
            if byte:
                out.extend(byte_index * 8 + bit for bit in range(8) if byte & (1 << bit))
        return out

    def sync(self, *, durable: bool = True) -> None:
        if durable:
            os.fsync(self.fd)
        if self.changed:
            self.changed = False
            _write_atomic(self.dirty_path, bytes(self.bitmap), durable=durable)

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


# publish(upper, frozen generation's data path, dirty indices, base id) -> new manifest id
Publisher = Callable[["UpperLayer", Path, list[int], str], str]


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
        try:
            state = json.loads((root / "state.json").read_text())
        except FileNotFoundError:
            raise NotFound(f"sandbox {root.name} has no state (not a sandbox directory)") from None
        except ValueError as exc:
            raise StrataError(f"sandbox {root.name}: state.json is corrupt ({exc})") from None
        return state

    def _persist_state(self) -> None:
        state = {"base": self.base, "size": self.size, "chunk_size": self.chunk_size, "gen": self.current.gen,
                 "sealing": [g.gen for g in self.sealing], "layers": self.layers,
                 **({"volatile": True} if self.volatile else {})}
        _write_atomic(self.root / "state.json", json.dumps(state).encode(), durable=not self.volatile)

    # data path --------------------------------------------------------------
    def _chunk_lock(self, index: int) -> threading.Lock:
        return self._chunk_locks[index % len(self._chunk_locks)]

    def _read_below(self, index: int, inner: int, n: int) -> bytes:
        """Chunk content under the current generation: newest frozen one first."""
        for frozen in reversed(self.sealing):
            if frozen.is_dirty(index):
                return os.pread(frozen.fd, n, index * self.chunk_size + inner)
        return _zero_tail(self.lower.read(index * self.chunk_size + inner, n), n)

    def read(self, offset: int, length: int) -> bytes:
        end = min(self.size, offset + length)
        if offset < 0 or offset >= end:
            return b""
        parts: list[bytes] = []
        self._lock.acquire_shared()
        try:
            for index, inner, n, pos in chunk_spans(offset, end, self.chunk_size):
                if self.current.is_dirty(index):
                    parts.append(os.pread(self.current.fd, n, pos))
                else:
                    parts.append(self._read_below(index, inner, n))
        finally:
            self._lock.release_shared()
        return b"".join(parts)

    def write(self, offset: int, data: bytes) -> int:
        if offset < 0 or offset + len(data) > self.size:
            raise InvalidInput(f"write of {len(data)} bytes at {offset} is past the end of a {self.size}-byte disk")
        cs = self.chunk_size
        view = memoryview(data)
        self._lock.acquire_shared()
        try:
            gen = self.current
            for index, inner, n, pos in chunk_spans(offset, offset + len(data), cs):
                chunk_len = self._chunk_len(index)
                with self._chunk_lock(index):
                    if not gen.is_dirty(index):
                        if not (inner == 0 and n == chunk_len):
                            below = self._read_below(index, 0, chunk_len)
                            os.pwrite(gen.fd, below, index * cs)
                        gen.mark(index)
                    os.pwrite(gen.fd, view[pos - offset : pos - offset + n], pos)
        finally:
            self._lock.release_shared()
        return len(data)

    def write_ready(self, offset: int, data: bytes) -> int | None:
        """A write done at once, or None if it needs `write` (a thread).

        Done at once when every chunk it touches is in the current
        generation already, or can be copied up without waiting: what is
        below is a frozen generation, a hole or a chunk in memory or in the
        verified cache. Cheap enough for the FUSE event loop (a 1 MiB copy
        at most per chunk): writing back a guest's RAM at a snapshot is
        hundreds of scattered 4 KiB writes, and a thread hop each cost more
        (~3 ms on a busy 2-core node) than the write. Never waits: a seal
        switch under way or a chunk another writer is copying up is a None.
        """
        end = offset + len(data)
        if offset < 0 or end > self.size or not data or not self._lock.try_acquire_shared():
            return None
        try:
            gen = self.current
            for index, _inner, n, _pos in chunk_spans(offset, end, self.chunk_size):
                if gen.is_dirty(index):
                    continue
                # a whole chunk overwritten: `write` marks it and writes it under its lock
                if n == self._chunk_len(index) or not self._copy_up_ready(gen, index):
                    return None
            return os.pwrite(gen.fd, data, offset)
        finally:
            self._lock.release_shared()

    def _chunk_len(self, index: int) -> int:
        return min(self.chunk_size, self.size - index * self.chunk_size)

    def _copy_up_ready(self, gen: _Generation, index: int) -> bool:
        """Copy chunk `index` up into `gen` if that needs no waiting (see
        write_ready). Marked dirty only once its content is there, so a
        read in between sees the chunk as it was."""
        lock = self._chunk_lock(index)
        if not lock.acquire(blocking=False):
            return False
        try:
            if not gen.is_dirty(index):
                below = self._below_ready(index)
                if below is None:
                    return False
                os.pwrite(gen.fd, below, index * self.chunk_size)
                gen.mark(index)
            return True
        finally:
            lock.release()

    def _below_ready(self, index: int) -> bytes | None:
        """`_read_below` of a whole chunk, if it can be had without waiting."""
        n = self._chunk_len(index)
        for frozen in reversed(self.sealing):
            if frozen.is_dirty(index):
                return os.pread(frozen.fd, n, index * self.chunk_size)
        data = self.lower.read_ready(index * self.chunk_size, n, max_disk_read=n)
        return None if data is None else _zero_tail(data, n)

    def fsync(self) -> None:
        self._lock.acquire_shared()
        try:
            with self._seal_lock:
                self.current.sync(durable=not self.volatile)
                if self._state_changed:
                    self._persist_state()
                    self._state_changed = False
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
            frozen.sync(durable=not self.volatile)
            self.current.sync(durable=not self.volatile)
            self._persist_state()
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

    def _publish_oldest(self, frozen: _Generation, publish: Publisher) -> None:
        dirty = frozen.dirty_indices()
        new_base = publish(self, frozen.data_path, dirty, self.base) if dirty else self.base
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
