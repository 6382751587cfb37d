"""Host side of the guest agent protocol (vmm/guest/README.md).

JSON lines both ways over the VM's virtio-serial port (a unix socket here);
bulk bytes (file blocks, process output) follow their line raw, the line's
`raw` field saying how many. Every request carries an `id`; the guest answers each with one final reply
(`end: true`, or `error` + `code`), streams (process output, file reads,
watches) send more replies with the same id before it. Many requests are in
flight at once: one reader thread per connection hands each reply to the
queue of the request that owns its id, and replies to ids nobody waits for
(an earlier connection's) are dropped.

Lines sent while nothing in the guest has the port open are dropped, so a
new connection resends `hello` until the guest answers; the hello's session
token tells the guest that the previous connection's streams are dead.

The guest is not trusted: a line longer than MAX_LINE is cut and dropped,
and so is a raw payload it announces past that size (the connection is
closed: nothing after it can be framed); a reply that is not a JSON object
is skipped, each request's queue is bounded
(a consumer that stops reading loses its stream, not the host's memory), and
the number of requests in flight per sandbox is capped.
"""

from __future__ import annotations

import base64
import itertools
import json
import queue
import secrets
import select
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerstore.errors import StrataError

from layerstore.unixsock import connect_unix


DEFAULT_MAX_OUTPUT = 1 << 20  # bytes of a command's output kept by `run`; config `exec_output_limit`
MAX_LINE = 4 << 20  # a guest line longer than this is dropped (the agent sends <= ~350 KiB)
MAX_IN_FLIGHT = 512  # requests open at once on one sandbox
QUEUE_REPLIES = 1024  # replies buffered per request before its stream is dropped
WRITE_BLOCK = 1 << 20  # bytes of a file per write message (sent raw after its line)
HELLO_EVERY = 0.25  # seconds between hellos while the guest has not answered
RESEED_VERSION = 3  # the agent protocol that has `reseed`
SEND_TIMEOUT = 30.0  # a guest that takes no input for this long is stuck
# QEMU's port takes one client: a second one's hellos wait unanswered.
BUSY_HINT = " (is another process, such as strata serve, connected to this sandbox's agent?)"


class AgentError(StrataError):
    """The guest agent did not answer, or answered nonsense."""


class AgentTimeout(AgentError):
    """The guest did not finish in time (the command may still be running)."""


class AgentBusy(AgentError):
    """Too many requests are open on this sandbox's agent."""


class AgentGone(AgentError):
    """The connection to the agent closed (the VM stopped, paused or moved)."""


class Interrupted(AgentError):
    """`Stream.interrupt()` was called: whoever read the stream has left."""


class GuestRefused(AgentError):
    """The guest answered with an error; `code` says which kind
    (not_found exists invalid denied not_dir is_dir no_space internal)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    output: str
    dropped: int = 0  # bytes of output past the cap, not kept


@dataclass(frozen=True)
class Exit:
    code: int
    status: str
    signal: int = 0


@dataclass(frozen=True)
class Entry:
    """A file in the guest, as the agent's `stat` sees it."""
    name: str
    type: str  # file dir symlink other
    path: str
    size: int
    mode: int
    perm: str
    owner: str
    group: str
    mtime_ns: int
    symlink: str = ""

    @classmethod
    def parse(cls, d: Any) -> "Entry":
        try:
            return cls(str(d["name"]), str(d["type"]), str(d["path"]), int(d["size"]), int(d["mode"]),
                       str(d["perm"]), str(d["owner"]), str(d["group"]), int(d["mtime_ns"]),
                       str(d.get("symlink", "")))
        except (KeyError, TypeError, ValueError):
            raise AgentError(f"guest agent sent a malformed file entry: {str(d)[:80]!r}") from None


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    cmd: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    tag: str = ""


@dataclass(frozen=True)
class Output:
    """A piece of a process's output: fd 1 stdout, 2 stderr, 3 terminal.
    `offset` counts all of the process's output; `lost` bytes before it
    were dropped by the guest's ring before anyone read them."""
    fd: int
    data: bytes
    offset: int
    lost: int = 0


@dataclass(frozen=True)
class GuestMetrics:
    """One sample of the guest's resources: CPU since the previous sample,
    memory and root disk now (bytes)."""
    cpu_count: int
    cpu_used_pct: float
    mem_total: int
    mem_used: int
    mem_cache: int
    disk_total: int
    disk_used: int


def truncation_marker(dropped: int, cap: int) -> str:
    return f"\n[strata: output truncated: {dropped} more bytes past the {cap}-byte limit]\n"


_CLOSED = object()  # queued to every open request when the connection ends
_INTERRUPTED = object()  # queued by `Stream.interrupt`: its reader should stop waiting


class Stream:
    """The replies to one request, in order; iterate, or `cancel()`."""

    def __init__(self, agent: "Agent", rid: int, conn: "_Conn") -> None:
        self.agent, self.id, self._conn = agent, rid, conn
        self.replies: queue.Queue[Any] = queue.Queue(QUEUE_REPLIES)
        self.done = False
        self.interrupted = False
        self.offset = 0  # a process stream: the output offset it starts at

    def next(self, timeout: float) -> dict[str, Any]:
        """The next reply; the final one has `end`. Raises GuestRefused for an
        error reply, AgentGone if the connection ended, AgentTimeout, and
        Interrupted once `interrupt()` was called."""
        if self.done:
            raise AgentError("stream already ended")
        if self.interrupted:
            raise Interrupted("the stream's reader was interrupted")
        try:
            reply = self.replies.get(timeout=max(timeout, 0))
        except queue.Empty:
            raise AgentTimeout(f"the guest agent did not answer within {timeout:.0f} s") from None
        if reply is _INTERRUPTED:
            raise Interrupted("the stream's reader was interrupted")
        if reply is _CLOSED:
            self._finish()
            raise AgentGone("agent connection closed (VM stopped, paused or gone)")
        if reply.get("error") is not None or reply.get("end"):
            self._finish()
        if reply.get("error") is not None:
            raise GuestRefused(str(reply["error"])[:500], str(reply.get("code", "internal")))
        return reply

    def _finish(self) -> None:
        self.done = True
        self._conn.forget(self.id)

    def interrupt(self) -> None:
        """Wake a `next()` waiting on another thread, now and from then on
        (whoever reads the stream is gone). Any thread, never blocks; the
        reader still calls `cancel()`, which may block on the guest."""
        self.interrupted = True
        try:
            self.replies.put_nowait(_INTERRUPTED)
        except queue.Full:  # then no `next()` is waiting, and the next one sees the flag
            pass

    def cancel(self) -> None:
        """Stop the stream in the guest (a process keeps running), and wake
        whoever waits on it on another thread."""
        if not self.done:
            self._finish()
            self.interrupt()
            try:
                self._conn.send({"op": "cancel", "id": next(self.agent._ids), "target": self.id})
            except AgentError:
                pass


class _Conn:
    """One connection to the agent and its reader thread."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        # A socket stays blocking: the reader sleeps in recv (close's shutdown
        # wakes it) and sends poll for room first. A serial channel polls in
        # its recv, and its sendall has a deadline of its own.
        self.is_socket = isinstance(sock, socket.socket)
        sock.settimeout(None if self.is_socket else 0.5)
        self.session = secrets.token_hex(8)
        self.open: dict[int, Stream] = {}
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.alive = True
        self.dropped_lines = 0
        self.reader = threading.Thread(target=self._read, daemon=True, name="strata-agent-reader")
        self.reader.start()

    def send(self, message: dict[str, Any], raw: bytes = b"") -> None:
        """One request line, then `raw` bytes if any (the line says how many)."""
        if raw:
            message = {**message, "raw": len(raw)}
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n" + raw
        try:
            with self.send_lock:
                if self.is_socket:
                    _send_within(self.sock, line, SEND_TIMEOUT)
                else:
                    self.sock.sendall(line)
        except OSError as exc:
            self.close()
            raise AgentGone(f"agent connection failed: {exc.strerror or exc} (VM stopped?)") from None

    def register(self, stream: Stream) -> None:
        with self.lock:
            if not self.alive:
                raise AgentGone("agent connection closed (VM stopped?)")
            if len(self.open) >= MAX_IN_FLIGHT:
                raise AgentBusy(f"{MAX_IN_FLIGHT} requests are already open on this sandbox's agent")
            self.open[stream.id] = stream

    def forget(self, rid: int) -> None:
        with self.lock:
            self.open.pop(rid, None)

    def _read(self) -> None:
        buf, skipping = b"", False
        waiting: dict[str, Any] | None = None  # a reply whose raw bytes are still arriving
        try:
            while self.alive:
                try:
                    part = self.sock.recv(1 << 20)
                except (TimeoutError, socket.timeout):
                    continue
                if not part:
                    break
                buf += part
                while True:
                    if waiting is not None:
                        if len(buf) < waiting["raw"]:
                            break
                        waiting["data"], buf = buf[:waiting["raw"]], buf[waiting["raw"]:]
                        self._deliver(waiting)
                        waiting = None
                    line, newline, rest = buf.partition(b"\n")
                    if not newline:
                        break
                    buf = rest
                    if skipping:  # the end of an over-long line
                        skipping = False
                        continue
                    waiting = self._parse(line)
                if len(buf) > MAX_LINE and waiting is None:
                    buf, skipping = b"", True
                    self.dropped_lines += 1
        except OSError:
            pass
        self.close()

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        """Deliver a reply line, or return it if raw bytes follow it."""
        try:
            reply = json.loads(line)
            raw = reply.get("raw", 0)
        except (ValueError, TypeError, AttributeError):
            self.dropped_lines += 1
            return None
        if isinstance(raw, int) and 0 < raw <= MAX_LINE:
            return reply
        if raw:  # a size we will not buffer: nothing after it can be framed
            self.dropped_lines += 1
            self.close()
            return None
        self._deliver(reply)
        return None

    def _deliver(self, reply: dict[str, Any]) -> None:
        try:
            rid = reply["id"]
        except (TypeError, KeyError):
            self.dropped_lines += 1
            return
        with self.lock:
            stream = self.open.get(rid) if isinstance(rid, int) else None
        if stream is None:
            return
        try:
            stream.replies.put(reply, timeout=10)
        except queue.Full:  # its reader stopped reading: drop the stream, not the host
            self.forget(rid)

    def close(self) -> None:
        with self.lock:
            was, self.alive = self.alive, False
            streams, self.open = list(self.open.values()), {}
        if not was:
            return
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass
        self.sock.close()
        for s in streams:
            try:
                s.replies.put_nowait(_CLOSED)
            except queue.Full:
                pass


class Agent:
    """The host's handle on one VM's guest agent; safe to share between threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._ids = itertools.count(1)
        self._conn: _Conn | None = None
        self._lock = threading.Lock()
        self.boot = ""  # the guest agent's boot token: changes when the guest rebooted
        self.version = 0  # the guest agent's protocol version (its hello's "strata-agent N")

    def _open(self, deadline: float) -> Any:
        """A connected socket-like object (sendall, recv, settimeout, close)."""
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connect_unix(s, self.path)
                return s
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.monotonic() > deadline:
                    raise AgentError(f"agent socket {self.path} did not appear") from None
                time.sleep(0.05)

    def _connection(self, deadline: float) -> _Conn:
        with self._lock:
            if self._conn is not None and self._conn.alive:
                return self._conn
            conn = _Conn(self._open(deadline))
            try:
                self._hello(conn, deadline)
            except AgentError:
                conn.close()
                raise
            self._conn = conn
            return conn

    def _hello(self, conn: _Conn, deadline: float) -> None:
        while True:
            stream = Stream(self, next(self._ids), conn)
            conn.register(stream)
            conn.send({"op": "hello", "id": stream.id, "session": conn.session})
            left = deadline - time.monotonic()
            try:
                reply = stream.next(min(HELLO_EVERY, max(left, 0.01)))
            except AgentTimeout:
                conn.forget(stream.id)
                if left <= 0:
                    raise AgentTimeout(f"guest agent did not answer{BUSY_HINT}") from None
                continue
            self.boot = str(reply.get("boot", ""))
            self.version = _version(reply.get("version"))
            return

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Connect and resend hello until the guest answers; returns seconds waited."""
        started = time.monotonic()
        try:
            self._connection(started + timeout)
        except AgentTimeout:
            raise AgentTimeout(f"guest agent did not answer within {timeout:.0f} s{BUSY_HINT}") from None
        return time.monotonic() - started

    def open_stream(self, op: str, *, timeout: float = 60.0, **fields: Any) -> Stream:
        """Send a request; its replies arrive on the returned Stream."""
        conn = self._connection(time.monotonic() + timeout)
        stream = Stream(self, next(self._ids), conn)
        conn.register(stream)
        conn.send({"op": op, "id": stream.id, **fields})
        return stream

    def call(self, op: str, *, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        """A request with one reply."""
        deadline = time.monotonic() + timeout
        stream = self.open_stream(op, timeout=timeout, **fields)
        try:
            while True:
                reply = stream.next(deadline - time.monotonic())
                if reply.get("end"):
                    return reply
        except AgentTimeout:
            stream.cancel()
            raise

    def send(self, op: str, raw: bytes = b"", **fields: Any) -> None:
        """A request whose reply only matters if it fails (file writes)."""
        conn = self._connection(time.monotonic() + 10)
        conn.send({"op": op, "id": 0, **fields}, raw)

    # --- processes ------------------------------------------------------------

    def start(self, cmd: str, args: list[str], *, env: dict[str, str] | None = None, cwd: str = "",
              user: str = "", tag: str = "", stdin: bool = False, merge: bool = False, pty: tuple[int, int] | None = None,
              timeout: float = 60.0) -> tuple[int, Stream]:
        """Start a process; returns its pid and the stream of its output
        (`output_events` reads it)."""
        fields: dict[str, Any] = {"cmd": cmd, "args": args, "env": env or {}, "cwd": cwd, "user": user,
                                  "tag": tag, "stdin": stdin, "merge": merge}
        if pty is not None:
            fields["pty"] = {"cols": pty[0], "rows": pty[1]}
        stream = self.open_stream("start", timeout=timeout, **fields)
        first = stream.next(timeout)
        stream.offset = _int(first, "off")
        return _int(first, "pid"), stream

    def attach(self, pid: int, *, offset: int = -1, timeout: float = 60.0) -> Stream:
        """Follow a running (or recently exited) process's output from
        `offset` (-1: only what comes next)."""
        stream = self.open_stream("attach", timeout=timeout, pid=pid, **{"from": offset})
        stream.offset = _int(stream.next(timeout), "off")
        return stream

    def processes(self, *, timeout: float = 30.0) -> list[ProcessInfo]:
        out = []
        for p in self.call("list", timeout=timeout).get("procs") or []:
            try:
                out.append(ProcessInfo(int(p["pid"]), str(p["cmd"]), [str(a) for a in p.get("args") or []],
                                       {str(k): str(v) for k, v in (p.get("env") or {}).items()},
                                       str(p.get("cwd", "")), str(p.get("tag", ""))))
            except (KeyError, TypeError, ValueError):
                raise AgentError(f"guest agent sent a malformed process: {str(p)[:80]!r}") from None
        return out

    def metrics(self, *, timeout: float = 30.0) -> GuestMetrics:
        m = self.call("metrics", timeout=timeout).get("metrics")
        try:
            return GuestMetrics(int(m["cpu_count"]), float(m["cpu_used_pct"]), int(m["mem_total"]),
                                int(m["mem_used"]), int(m["mem_cache"]), int(m["disk_total"]), int(m["disk_used"]))
        except (KeyError, TypeError, ValueError):
            raise AgentError(f"guest agent sent malformed metrics: {str(m)[:80]!r}") from None

    def reseed(self, seed: bytes, *, timeout: float = 10.0) -> None:
        """Have the guest credit `seed` to its kernel's entropy pool and
        rekey its CRNG (vmm/guest/agent/random.go says why). Not waited
        for: the agent applies it before any request sent after it; a guest
        that fails it says so on its console. AgentError if the agent
        predates it."""
        self._connection(time.monotonic() + timeout)  # its hello tells the version
        if self.version < RESEED_VERSION:
            raise AgentError(f"the guest agent (protocol {self.version}) predates reseed")
        self.send("reseed", data=base64.b64encode(seed).decode())

    def send_input(self, pid: int, data: bytes, *, timeout: float = 30.0) -> None:
        self.call("input", timeout=timeout, pid=pid, data=base64.b64encode(data).decode())

    def close_stdin(self, pid: int, *, timeout: float = 30.0) -> None:
        self.call("close_stdin", timeout=timeout, pid=pid)

    def signal(self, pid: int, sig: int, *, timeout: float = 30.0) -> None:
        self.call("signal", timeout=timeout, pid=pid, sig=sig)

    def resize(self, pid: int, cols: int, rows: int, *, timeout: float = 30.0) -> None:
        self.call("resize", timeout=timeout, pid=pid, pty={"cols": cols, "rows": rows})

    def run(self, command: str, *, timeout: float = 60.0, max_output: int = DEFAULT_MAX_OUTPUT,
            env: dict[str, str] | None = None) -> RunResult:
        """Run `sh -c command` in /root; output is stdout and stderr in the
        order they arrived, its first `max_output` bytes kept (then a marker)."""
        deadline = time.monotonic() + timeout
        _, stream = self.start("/bin/sh", ["-c", command], env=env, cwd="/root", merge=True, timeout=timeout)
        kept, dropped = bytearray(), 0
        try:
            for event in output_events(stream, deadline):
                if isinstance(event, Exit):
                    text = kept.decode("utf-8", "replace")
                    if dropped:
                        text += truncation_marker(dropped, max_output)
                    return RunResult(event.code if event.code >= 0 else 128 + event.signal, text, dropped)
                room = max_output - len(kept)
                kept += event.data[:room]
                dropped += max(len(event.data) - room, 0)
        except AgentTimeout:
            stream.cancel()
            raise AgentTimeout(f"guest command timed out after {timeout:.0f} s: {command[:60]!r}") from None
        raise AgentError("the guest ended the command's stream without an exit")

    # --- files ----------------------------------------------------------------

    def stat(self, path: str, *, user: str = "", timeout: float = 30.0) -> Entry:
        return Entry.parse(self.call("stat", timeout=timeout, path=path, user=user).get("entry"))

    def list_dir(self, path: str, *, depth: int = 1, user: str = "", timeout: float = 60.0) -> list[Entry]:
        reply = self.call("ls", timeout=timeout, path=path, depth=depth, user=user)
        return [Entry.parse(e) for e in reply.get("entries") or []]

    def make_dir(self, path: str, *, user: str = "", timeout: float = 30.0) -> Entry:
        return Entry.parse(self.call("mkdir", timeout=timeout, path=path, user=user).get("entry"))

    def move(self, source: str, dest: str, *, user: str = "", timeout: float = 30.0) -> Entry:
        return Entry.parse(self.call("move", timeout=timeout, path=source, dest=dest, user=user).get("entry"))

    def remove(self, path: str, *, user: str = "", timeout: float = 60.0) -> None:
        self.call("remove", timeout=timeout, path=path, user=user)

    def read_file(self, path: str, *, user: str = "", timeout: float = 60.0) -> Iterator[bytes]:
        """The file's bytes in blocks; `timeout` bounds the wait for each block.
        The first block (or the error) is fetched before this returns."""
        stream = self.open_stream("read", timeout=timeout, path=path, user=user)
        first = stream.next(timeout)
        return _file_blocks(stream, first, timeout)

    def write_file(self, path: str, blocks: Iterable[bytes], *, user: str = "",
                   timeout: float = 60.0) -> Entry:
        """Write a file (parents made, replaced if there) from blocks of any
        size; sent pipelined, checked once at the end."""
        handle = self.open_write(path, user=user, timeout=timeout)
        try:
            for block in blocks:
                self.write_block(handle, block)
        finally:
            entry = self.close_write(handle, timeout=timeout)
        return entry

    def open_write(self, path: str, *, user: str = "", timeout: float = 60.0) -> int:
        """Start writing a file; send its bytes with write_block, then close_write."""
        return _int(self.call("open", timeout=timeout, path=path, user=user), "handle")

    def write_block(self, handle: int, block: bytes) -> None:
        for i in range(0, len(block), WRITE_BLOCK):
            self.send("write", block[i:i + WRITE_BLOCK], handle=handle)  # raw: no base64 for the guest to undo

    def close_write(self, handle: int, *, timeout: float = 60.0) -> Entry:
        """Finish a file: its entry, or the first error any write met."""
        return Entry.parse(self.call("close", timeout=timeout, handle=handle).get("entry"))

    def watch(self, path: str, *, recursive: bool = False, timeout: float = 30.0) -> Stream:
        """A stream of {"event": {"name", "type"}} replies for changes under path."""
        stream = self.open_stream("watch", timeout=timeout, path=path, recursive=recursive)
        stream.next(timeout)
        return stream

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def output_events(stream: Stream, deadline: float | None = None,
                  idle: float = 3600.0) -> Iterator[Output | Exit]:
    """A process stream's output as Output events, ending with its Exit.
    `deadline` (monotonic) bounds the whole stream; `idle` each wait."""
    while True:
        wait = idle if deadline is None else min(idle, deadline - time.monotonic())
        reply = stream.next(wait)
        if reply.get("end"):
            ex = reply.get("exit") or {}
            try:
                yield Exit(int(ex.get("code", -1)), str(ex.get("status", "")), int(ex.get("signal", 0)))
            except (TypeError, ValueError):
                raise AgentError(f"guest agent sent a malformed exit: {str(ex)[:80]!r}") from None
            return
        data = reply.get("data")
        if data:
            yield Output(_int(reply, "fd"), _b64(data), _int(reply, "off"), int(reply.get("lost") or 0))


def _file_blocks(stream: Stream, first: dict[str, Any], timeout: float) -> Iterator[bytes]:
    reply = first
    try:
        while not reply.get("end"):
            if reply.get("data"):
                yield _b64(reply["data"])
            reply = stream.next(timeout)
    finally:
        stream.cancel()


def _send_within(sock: socket.socket, data: bytes, timeout: float) -> None:
    """sendall on a blocking socket, but a peer that takes nothing for
    `timeout` seconds is an error rather than a hang."""
    view, deadline = memoryview(data), time.monotonic() + timeout
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    while view:
        if not poller.poll(max(deadline - time.monotonic(), 0) * 1000):
            raise TimeoutError("the guest agent takes no input")
        try:
            view = view[sock.send(view, socket.MSG_DONTWAIT):]
        except BlockingIOError:
            continue


def _b64(data: Any) -> bytes:
    """A reply's data: raw bytes as they came, or base64 in the JSON."""
    if isinstance(data, bytes):
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (ValueError, TypeError):
        raise AgentError("guest agent sent malformed data") from None


def _int(reply: dict[str, Any], key: str) -> int:
    try:
        return int(reply.get(key) or 0)
    except (TypeError, ValueError):
        raise AgentError(f"guest agent sent a malformed {key}: {str(reply.get(key))[:40]!r}") from None


def _version(text: object) -> int:
    """N of an agent's "strata-agent N" (0 if it says anything else)."""
    name, _, number = str(text or "").partition(" ")
    return int(number) if name == "strata-agent" and number.isdigit() and len(number) < 6 else 0
