"""A sandbox's writable disk: a copy-on-write upper layer over a read-only stack.

On-disk layout of one sandbox (`UPPER_ROOT/<sid>/`):

    state.json       {"base": <manifest id>, "size": N, "chunk_size": C,
                      "gen": g, "sealing": g' | null, "layers": [<sealed ids>]}
    gen-<g>.data     sparse file of N bytes; a dirty chunk holds its full content
    gen-<g>.dirty    bitmap, one bit per chunk, written on fsync (atomically)

Reads resolve chunk by chunk: the current generation if the chunk is dirty
there, else the generation being sealed, else the read-only lower stack.
A write to a clean chunk first copies the chunk's current content up (unless
it overwrites the whole chunk), so the data file always holds whole chunks.

Durability: `fsync` fsyncs the data file, then replaces the bitmap, then the
state. After a crash, chunks marked in the last bitmap hold at least what was
fsynced; unsynced writes may be lost, as on any disk.

Seal (an incremental snapshot) is a metadata switch under an exclusive lock:
the current generation freezes and becomes `sealing`, and a new empty
generation takes writes. Writers are held only for that switch, never for
hashing or uploading, and a write lands wholly in one generation. A
background job then hashes and stores the frozen dirty chunks as a layer
(parent = base) and, once the manifest is published, makes it the new base
and deletes the frozen files.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from layerstore.errors import InvalidInput, NotFound, StrataError

from .view import LayerView

_SID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_sid(sid: str) -> str:
    """Sandbox ids become directory names: a strict alphabet, no path tricks."""
    if not isinstance(sid, str) or not _SID_RE.fullmatch(sid):
        raise InvalidInput(f"invalid sandbox id {sid!r}: letters, digits, '.', '_', '-', at most 64")
    return sid


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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


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

    def sync(self) -> None:
        os.fsync(self.fd)
        if self.changed:
            self.changed = False
            _write_atomic(self.dirty_path, bytes(self.bitmap))

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
        self._lock = RWLock()
        self._chunk_locks = [threading.Lock() for _ in range(64)]
        self.current = _Generation(root, int(state["gen"]), self.size, self.chunk_size, create=False)  # type: ignore[arg-type]
        sealing = state.get("sealing")
        self.sealing = (
            _Generation(root, int(sealing), self.size, self.chunk_size, create=False) if sealing is not None else None  # type: ignore[arg-type]
        )
        self._state_changed = False
        self._seal_lock = threading.Lock()
        self.pending_seal: SealTicket | None = None

    # creation / loading -----------------------------------------------------
    @classmethod
    def create(cls, root: Path, lower: LayerView, *, relower: Callable[[str], LayerView]) -> "UpperLayer":
        """A fresh, empty upper layer over `lower` (fails if `root` exists)."""
        try:
            root.mkdir(parents=True)
        except FileExistsError:
            raise InvalidInput(f"sandbox {root.name} already exists") from None
        state = {"base": lower.manifest_id, "size": lower.size, "chunk_size": lower.chunk_size, "gen": 1,
                 "sealing": None, "layers": []}
        gen = _Generation(root, 1, lower.size, lower.chunk_size, create=True)
        gen.sync()
        gen.close()
        _write_atomic(root / "state.json", json.dumps(state).encode())
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
                 "sealing": self.sealing.gen if self.sealing else None, "layers": self.layers}
        _write_atomic(self.root / "state.json", json.dumps(state).encode())

    # data path --------------------------------------------------------------
    def _chunk_lock(self, index: int) -> threading.Lock:
        return self._chunk_locks[index % len(self._chunk_locks)]

    def _read_below(self, index: int, inner: int, n: int) -> bytes:
        """Chunk content under the current generation."""
        if self.sealing is not None and self.sealing.is_dirty(index):
            return os.pread(self.sealing.fd, n, index * self.chunk_size + inner)
        return self.lower.read(index * self.chunk_size + inner, n)

    def read(self, offset: int, length: int) -> bytes:
        end = min(self.size, offset + length)
        if offset < 0 or offset >= end:
            return b""
        cs = self.chunk_size
        parts: list[bytes] = []
        self._lock.acquire_shared()
        try:
            pos = offset
            while pos < end:
                index, inner = divmod(pos, cs)
                n = min(cs - inner, end - pos)
                if self.current.is_dirty(index):
                    parts.append(os.pread(self.current.fd, n, pos))
                else:
                    parts.append(self._read_below(index, inner, n))
                pos += n
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
            pos, done = offset, 0
            while done < len(data):
                index, inner = divmod(pos, cs)
                chunk_len = min(cs, self.size - index * cs)
                n = min(chunk_len - inner, len(data) - done)
                with self._chunk_lock(index):
                    if not gen.is_dirty(index):
                        if not (inner == 0 and n == chunk_len):
                            below = self._read_below(index, 0, chunk_len)
                            os.pwrite(gen.fd, below, index * cs)
                        gen.mark(index)
                    os.pwrite(gen.fd, view[done : done + n], pos)
                pos += n
                done += n
        finally:
            self._lock.release_shared()
        return len(data)

    def fsync(self) -> None:
        self._lock.acquire_shared()
        try:
            with self._seal_lock:
                self.current.sync()
                if self._state_changed:
                    self._persist_state()
                    self._state_changed = False
        finally:
            self._lock.release_shared()

    def dirty_count(self) -> int:
        return len(self.current.dirty_indices())

    # seal -------------------------------------------------------------------
    def seal(self, publish: Publisher, run: Callable[[Callable[[], None]], None]) -> SealTicket:
        """Freeze the current generation and start publishing it as a layer.

        `run` starts the background job (e.g. an executor's submit). Only one
        seal runs at a time per sandbox; a second waits for the first's switch.
        """
        with self._seal_lock:
            if self.sealing is not None:
                raise StrataError(f"sandbox {self.sid}: a seal is still being published; try again when it finishes")
            started = time.monotonic()
            self._lock.acquire_exclusive()
            try:
                frozen = self.current
                self.current = _Generation(self.root, frozen.gen + 1, self.size, self.chunk_size, create=True)
                self.sealing = frozen
            finally:
                self._lock.release_exclusive()
            switched = time.monotonic() - started
            frozen.sync()
            self.current.sync()
            self._persist_state()
            dirty = frozen.dirty_indices()
            future: Future[str] = Future()
            ticket = SealTicket(self.sid, frozen.gen, len(dirty), future, switched)
            self.pending_seal = ticket

        def job() -> None:
            try:
                future.set_result(self._finish_seal(frozen, dirty, publish))
            except BaseException as exc:  # the frozen generation stays; a later seal retries
                future.set_exception(exc)

        run(job)
        return ticket

    def resume_seal(self, publish: Publisher, run: Callable[[Callable[[], None]], None]) -> SealTicket | None:
        """After a restart: finish a seal that was switched but not published."""
        frozen = self.sealing
        if frozen is None:
            return None
        dirty = frozen.dirty_indices()
        future: Future[str] = Future()
        ticket = SealTicket(self.sid, frozen.gen, len(dirty), future, 0.0)
        self.pending_seal = ticket

        def job() -> None:
            try:
                future.set_result(self._finish_seal(frozen, dirty, publish))
            except BaseException as exc:
                future.set_exception(exc)

        run(job)
        return ticket

    def _finish_seal(self, frozen: _Generation, dirty: list[int], publish: Publisher) -> str:
        new_base = publish(self, frozen.data_path, dirty, self.base) if dirty else self.base
        new_lower = self._relower(new_base) if new_base != self.base else self.lower
        self._lock.acquire_exclusive()
        try:
            if new_base != self.base:
                self.layers.append(new_base)
            self.lower = new_lower
            self.base = new_base
            self.sealing = None
        finally:
            self._lock.release_exclusive()
        with self._seal_lock:
            self._persist_state()
        frozen.remove()
        return new_base

    def close(self) -> None:
        try:
            self.fsync()
        finally:
            self.current.close()
            if self.sealing is not None:
                self.sealing.close()
