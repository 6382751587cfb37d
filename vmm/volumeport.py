"""The node's end of a sandbox's volume port (vmm/guest/README.md, "Volume
port"): the guest's FUSE mounts ask, this answers from vmm/volumefs.py, for
the volumes mounted in that sandbox and no others.

Everything from the guest is hostile: a line is at most `MAX_LINE` bytes
and raw data at most `MAX_RAW`, a request names a volume by id and only
mounted ones are served, paths go through the volume's own checks, at most
`MAX_IN_FLIGHT` requests run at once (the reader waits, so a flooding guest
only slows itself), and a request that fails in an unexpected way answers
EIO and is logged; it never ends the port.

The guest sends a request again with its id when it had no answer (the
node was away: a snapshot, a restore, a fork, a restart). Replies to
changes are remembered (`Replies`, kept by the node per sandbox across its
VM's restarts), keyed by the request's line (its id, op and fields; not a
write's data, which would mean hashing every MiB written: ids are unique
per agent run, and the node forgets them when the guest goes back in time),
so a repeat of a change already made gets the same answer instead of
making it twice.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from layerstore.unixsock import connect_unix

from .volumefs import MAX_READ, VolumeFiles, errno_of, fail, guest_path

log = logging.getLogger("strata.vmm.volumes")

MAX_LINE = 64 * 1024
MAX_RAW = MAX_READ
MAX_IN_FLIGHT = 32
WORKERS = 4
REMEMBERED = 512  # replies to changes kept for repeats
CHANGES = frozenset({"create", "mkdir", "symlink", "unlink", "rmdir", "rename", "setattr", "open", "write",
                     "flush", "release"})
MAX_ID = (1 << 32) - 1  # uid, gid
MAX_TIME = 1 << 34  # seconds: a time past year 2514 is a guest's mistake


class Replies:
    """Recent replies to changes, by the request's line (thread-safe)."""

    def __init__(self, *, limit: int = REMEMBERED) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._done: OrderedDict[bytes, bytes] = OrderedDict()
        self._running: set[bytes] = set()

    def begin(self, key: bytes) -> bytes | None | bool:
        """The remembered reply, or False if the same request is running
        (the repeat is dropped: the first answers), or None: run it."""
        with self._lock:
            if key in self._done:
                return self._done[key]
            if key in self._running:
                return False
            self._running.add(key)
            return None

    def end(self, key: bytes, reply: bytes | None) -> None:
        with self._lock:
            self._running.discard(key)
            if reply is not None:
                self._done[key] = reply
                while len(self._done) > self._limit:
                    self._done.popitem(last=False)


class VolumePort:
    """Serves one VM's volume port until the VM goes (its socket closes) or `close`."""

    def __init__(self, socket_path: Path, volumes: dict[str, VolumeFiles], replies: Replies, *,
                 name: str = "", connect_timeout: float = 10.0) -> None:
        self._path = socket_path
        self._volumes = volumes
        self._replies = replies
        self._name = name or socket_path.parent.name
        self._connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._slots = threading.Semaphore(MAX_IN_FLIGHT)
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix=f"strata-volumes-{self._name}")
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"strata-volume-port-{self._name}")
        self._closed = threading.Event()

    def start(self) -> "VolumePort":
        self._sock = self._connect()
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    @contextmanager
    def held(self, *, timeout: float = 60.0) -> Iterator[None]:
        """No request runs while held: those in flight finish first, those
        read meanwhile wait (a snapshot publishes exactly what the guest
        was told is done). After `timeout` it goes on without a stuck one."""
        taken, deadline = 0, time.monotonic() + timeout
        try:
            while taken < MAX_IN_FLIGHT and self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                taken += 1
            if taken < MAX_IN_FLIGHT:
                log.warning("sandbox %s: volume requests still running after %.0f s; snapshotting anyway",
                            self._name, timeout)
            yield
        finally:
            for _ in range(taken):
                self._slots.release()

    def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._sock is not None:
            self._sock.close()

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self._connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connect_unix(sock, self._path)  # a state directory's path may pass sun_path's 108 bytes
                return sock
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _serve(self) -> None:
        """Serve connections until the VM goes: after a guest breaks the
        protocol the node hangs up and connects again (the guest reopens its
        port and sends what it still waits for), at most twice a second."""
        while not self._closed.is_set():
            if not self._serve_connection():
                return
            time.sleep(0.5)
            try:
                if self._sock is not None:
                    self._sock.close()
                self._sock = self._connect()
            except OSError:
                return

    def _serve_connection(self) -> bool:
        """Read requests until the connection ends: False when the VM closed
        it (or `close`), True after a protocol violation (this end hung up)."""
        assert self._sock is not None
        stream = self._sock.makefile("rb", buffering=1 << 20)
        try:
            while not self._closed.is_set():
                line = stream.readline(MAX_LINE + 1)
                if not line:
                    return False
                if len(line) > MAX_LINE or not line.endswith(b"\n"):
                    return self._violation(f"a line over {MAX_LINE} bytes")
                request = _parse(line)
                raw_size = request.get("raw", 0) if request is not None else 0
                if not isinstance(raw_size, int) or not 0 <= raw_size <= MAX_RAW:
                    return self._violation("raw data over 1 MiB")
                raw = stream.read(raw_size) if raw_size else b""
                if len(raw) != raw_size:
                    return False
                if request is None or not isinstance(request.get("id"), int):
                    continue  # not a request: nothing to answer
                self._slots.acquire()
                self._pool.submit(self._answer, request, raw, line)
            return False
        except Exception as exc:  # noqa: BLE001 (whatever a guest sends, the port ends cleanly and says why)
            if not self._closed.is_set():
                log.info("sandbox %s: volume port closed: %s", self._name, exc)
            return False
        finally:
            stream.close()

    def _violation(self, what: str) -> bool:
        log.warning("sandbox %s: volume port: %s; hanging up", self._name, what)
        assert self._sock is not None
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def _answer(self, request: dict[str, Any], raw: bytes, line: bytes) -> None:
        key = hashlib.blake2b(line, digest_size=16).digest() if request.get("op") in CHANGES else None
        try:
            if key is not None:
                earlier = self._replies.begin(key)
                if earlier is False:
                    return
                if earlier is not None:
                    self._send(earlier)
                    return
            reply = self._reply(request, raw)
            if key is not None:
                self._replies.end(key, reply)
                key = None
            self._send(reply)
        finally:
            if key is not None:
                self._replies.end(key, None)
            self._slots.release()

    def _reply(self, request: dict[str, Any], raw: bytes) -> bytes:
        rid = request["id"]
        try:
            result = self._call(request, raw)
        except Exception as exc:  # every failure is the guest's errno; the port stays up
            code = errno_of(exc)
            if code == errno.EIO:
                log.warning("sandbox %s: volume %s %s failed: %s", self._name, request.get("vol"),
                            request.get("op"), exc)
            return _line({"id": rid, "errno": code})
        if isinstance(result, bytes):
            return _line({"id": rid, "errno": 0, "raw": len(result)}) + result
        return _line({"id": rid, "errno": 0, **result})

    def _call(self, r: dict[str, Any], raw: bytes) -> dict[str, Any] | bytes:
        files = self._volumes.get(r.get("vol"))  # type: ignore[arg-type]
        if files is None:
            raise fail(errno.EACCES, "that volume is not mounted in this sandbox")
        op = r.get("op")
        if op == "statfs":
            return files.statfs()
        path = guest_path(r.get("path"))
        handler = _HANDLERS.get(op)  # type: ignore[arg-type]
        if handler is None:
            raise fail(errno.ENOSYS, f"unknown op {op!r}")
        return handler(files, path, r, raw)

    def _send(self, data: bytes) -> None:
        try:
            with self._send_lock:
                assert self._sock is not None
                self._sock.sendall(data)
        except OSError:
            pass  # the VM went: the guest sends again to whoever serves it next


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # a guest's `[[[[...` is just not a request
        return None
    return value if isinstance(value, dict) else None


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _int(r: dict[str, Any], name: str, default: int | None = None) -> int:
    value = r.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not -(1 << 63) <= value < 1 << 64:
        raise fail(errno.EINVAL, f"{name} must be an integer")
    return value


def _opt(r: dict[str, Any], name: str) -> int | None:
    return None if r.get(name) is None else _int(r, name)


def _id(r: dict[str, Any], name: str, default: int | None = 0) -> int | None:
    """A uid or gid: 0 .. 2^32-1 (what every reader of the volume can hold)."""
    value = _opt(r, name) if default is None else _int(r, name, default)
    if value is not None and not 0 <= value <= MAX_ID:
        raise fail(errno.EINVAL, f"{name} must be 0..{MAX_ID}")
    return value


def _mode(r: dict[str, Any], name: str = "mode", default: int | None = None) -> int | None:
    value = _opt(r, name) if default is None else _int(r, name, default)
    if value is not None and not 0 <= value <= 0o7777:
        raise fail(errno.EINVAL, "mode is permission bits (0..0o7777)")
    return value


def _mtime(r: dict[str, Any]) -> float | None:
    value = r.get("mtime")
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= MAX_TIME:
        raise fail(errno.EINVAL, f"mtime must be a number of seconds 0..{MAX_TIME}")
    return float(value)


Handler = Callable[[VolumeFiles, str, dict[str, Any], bytes], "dict[str, Any] | bytes"]
_HANDLERS: dict[str, Handler] = {
    "stat": lambda f, p, r, raw: f.stat(p),
    "list": lambda f, p, r, raw: f.list(p),
    "read": lambda f, p, r, raw: f.read(p, _int(r, "off"), _int(r, "len")),
    "create": lambda f, p, r, raw: f.create(p, _mode(r, default=0o644), _id(r, "uid"),  # type: ignore[arg-type]
                                           _id(r, "gid"), _int(r, "fh")),
    "open": lambda f, p, r, raw: f.open(p, _int(r, "fh"), trunc=bool(r.get("trunc"))),
    "write": lambda f, p, r, raw: f.write(_int(r, "fh"), p, _int(r, "off"), raw),
    "flush": lambda f, p, r, raw: f.flush(_int(r, "fh"), p),
    "release": lambda f, p, r, raw: f.release(_int(r, "fh"), p),
    "setattr": lambda f, p, r, raw: f.set_attr(p, fh=_opt(r, "fh"), mode=_mode(r), uid=_id(r, "uid", None),
                                               gid=_id(r, "gid", None), size=_opt(r, "size"), mtime=_mtime(r)),
    "mkdir": lambda f, p, r, raw: f.make_dir(p, _mode(r, default=0o755), _id(r, "uid"),  # type: ignore[arg-type]
                                             _id(r, "gid")),
    "symlink": lambda f, p, r, raw: f.symlink(p, r.get("target"), _id(r, "uid"),  # type: ignore[arg-type]
                                              _id(r, "gid")),
    "unlink": lambda f, p, r, raw: f.unlink(p),
    "rmdir": lambda f, p, r, raw: f.rmdir(p),
    "rename": lambda f, p, r, raw: f.rename(p, guest_path(r.get("to")), noreplace=bool(r.get("noreplace"))),
}
