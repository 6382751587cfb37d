"""E2B's envd, served by the node: its `process` and `filesystem` Connect
services and `/files`, translated into guest agent requests (vmm/agent.py).

The messages are envd's (process.proto, filesystem.proto in proto3 JSON,
api/connect.py); this module maps them to and from the agent's, and keeps
what envd keeps between calls (polling watchers). It knows nothing of HTTP:
api/routes/envd.py does the transport.

Streams survive the VM being replaced under them: when a sandbox's agent
connection ends (a snapshot restore, a supervisor reboot), a process stream
re-attaches to the new VM's agent from the last offset it sent, so the
client sees no gap and no repeat; a sandbox paused meanwhile ends the stream
with `unavailable`.
"""

from __future__ import annotations

import base64
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from vmm.agent import (Agent, AgentBusy, AgentError, AgentGone, AgentTimeout, Entry, Exit, GuestRefused, Output,
                       Stream, output_events)

from .connect import ConnectError

ENVD_VERSION = "0.5.7"  # the envd features served (stdin, default user, close stdin, octet-stream upload)
SIGNALS = {"SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9, 15: 15, 9: 9}
REATTACH_FOR = 60.0  # seconds a stream waits for its sandbox's VM to come back
MAX_WATCH_EVENTS = 10_000  # events a polling watcher keeps between polls

_GUEST_CODES = {"not_found": "not_found", "exists": "already_exists", "invalid": "invalid_argument",
                "denied": "permission_denied", "not_dir": "invalid_argument", "is_dir": "invalid_argument"}
_FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
                "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}
_FDS = {1: "stdout", 2: "stderr", 3: "pty"}


class DiskFull(ConnectError):
    """The guest's disk has no room: resource_exhausted in an RPC, 507 on
    /files (the SDK's NotEnoughSpaceException)."""

    def __init__(self, message: str) -> None:
        super().__init__("resource_exhausted", message)


def connect_error(exc: AgentError) -> ConnectError:
    """The Connect error for an agent failure."""
    if isinstance(exc, GuestRefused) and exc.code == "no_space":
        return DiskFull(str(exc))
    if isinstance(exc, GuestRefused):
        return ConnectError(_GUEST_CODES.get(exc.code, "internal"), str(exc))
    if isinstance(exc, AgentTimeout):
        return ConnectError("deadline_exceeded", str(exc))
    if isinstance(exc, AgentBusy):
        return ConnectError("resource_exhausted", str(exc))
    return ConnectError("unavailable", str(exc))


def new_token() -> str:
    return secrets.token_urlsafe(24)


# --- messages -----------------------------------------------------------------


def entry_info(e: Entry) -> dict[str, Any]:
    stamp = datetime.fromtimestamp(e.mtime_ns / 1e9, tz=timezone.utc)
    info: dict[str, Any] = {
        "name": e.name, "type": _FILE_TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"), "path": e.path,
        "size": str(e.size), "mode": e.mode & 0o777, "permissions": e.perm, "owner": e.owner, "group": e.group,
        "modifiedTime": stamp.isoformat().replace("+00:00", "Z")}
    if e.symlink:
        info["symlinkTarget"] = e.symlink
    return info


def _string(message: dict[str, Any], key: str) -> str:
    value = message.get(key, "")
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{key} must be a string")
    return value


def _bytes(value: Any, what: str) -> bytes:
    try:
        return base64.b64decode(value or "", validate=True)
    except (ValueError, TypeError):
        raise ConnectError("invalid_argument", f"{what} is not base64") from None


def int_of(message: Any, key: str, default: int) -> int:
    value = message.get(key, default) if isinstance(message, dict) else default
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConnectError("invalid_argument", f"{key} must be a number")
    try:
        return int(value)
    except ValueError:
        raise ConnectError("invalid_argument", f"{key} must be a number") from None


def pty_size(message: dict[str, Any]) -> tuple[int, int] | None:
    """`pty.size` as (cols, rows), or None without a pty."""
    pty = message.get("pty")
    if pty is None:
        return None
    size = pty.get("size") if isinstance(pty, dict) else None
    if not isinstance(size, dict):
        raise ConnectError("invalid_argument", "pty.size must be {cols, rows}")
    cols, rows = int_of(size, "cols", 80), int_of(size, "rows", 24)
    if not (0 < cols < 10000 and 0 < rows < 10000):
        raise ConnectError("invalid_argument", "pty.size is out of range")
    return cols, rows


def path_of(message: dict[str, Any], key: str = "path") -> str:
    path = _string(message, key)
    if not path:
        raise ConnectError("invalid_argument", f"{key} is required")
    if "\x00" in path:
        raise ConnectError("invalid_argument", f"{key} contains a NUL byte")
    return path


@dataclass(frozen=True)
class StartRequest:
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    tag: str
    stdin: bool
    pty: tuple[int, int] | None

    @classmethod
    def parse(cls, m: dict[str, Any]) -> "StartRequest":
        proc = m.get("process")
        if not isinstance(proc, dict) or not isinstance(proc.get("cmd"), str) or not proc["cmd"]:
            raise ConnectError("invalid_argument", "process.cmd is required")
        args, envs = proc.get("args") or [], proc.get("envs") or {}
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
            raise ConnectError("invalid_argument", "process.args must be a list of strings")
        if not (isinstance(envs, dict) and all(isinstance(v, str) for v in envs.values())):
            raise ConnectError("invalid_argument", "process.envs must map names to strings")
        if not all(isinstance(k, str) for k in envs):
            raise ConnectError("invalid_argument", "process.envs must map names to strings")
        return cls(proc["cmd"], args, envs, _string(proc, "cwd"), _string(m, "tag"), bool(m.get("stdin")),
                   pty_size(m))


def process_event(ev: Output | Exit | int | None) -> dict[str, Any]:
    """A StartResponse/ConnectResponse: start (a pid), data, end, or keepalive (None)."""
    if ev is None:
        return {"event": {"keepalive": {}}}
    if isinstance(ev, int):
        return {"event": {"start": {"pid": ev}}}
    if isinstance(ev, Output):
        return {"event": {"data": {_FDS.get(ev.fd, "stdout"): base64.b64encode(ev.data).decode()}}}
    end: dict[str, Any] = {"exitCode": ev.code, "exited": ev.signal == 0, "status": ev.status}
    return {"event": {"end": end}}


def process_info(p: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"config": {"cmd": p.cmd, "args": p.args, "envs": p.env, "cwd": p.cwd}, "pid": p.pid}
    if p.tag:
        info["tag"] = p.tag
    return info


# --- the sandbox a request is for ---------------------------------------------------


@dataclass
class Target:
    """One data-plane request's sandbox: how to reach its agent (again, after
    a restore) and what every process in it gets."""
    sid: str
    agent_of: Callable[[], Agent]  # the current VM's agent; raises ConnectError if paused or gone
    env: dict[str, str] = field(default_factory=dict)
    user: str = ""
    cwd: str = ""  # where processes start unless they say (an image's WorkingDir)
    log: Callable[[str, str], None] = lambda level, message: None  # the sandbox's event log
    reading: list[Stream] = field(default_factory=list)  # the guest streams this request answers from

    def reads(self, stream: Stream) -> Stream:
        """`stream`, from now on one this request answers from."""
        self.reading = [s for s in self.reading if not s.done] + [stream]
        return stream

    def interrupt(self) -> None:
        """Wake the thread waiting on this request's streams: its client has
        left, so its thread and place are given back now, not at the next
        keepalive (up to MAX_KEEPALIVE later). Any thread; never blocks."""
        for stream in self.reading:
            stream.interrupt()

    def call(self, fn: Callable[[Agent], Any]) -> Any:
        try:
            return fn(self.agent_of())
        except AgentError as exc:
            raise connect_error(exc) from None

    def pid_of(self, message: dict[str, Any]) -> int:
        """The pid a ProcessSelector names ({"pid": N} or {"tag": "..."})."""
        sel = message.get("process")
        if not isinstance(sel, dict):
            raise ConnectError("invalid_argument", "process selector is required")
        if "pid" in sel:
            return int_of(sel, "pid", 0)
        tag = sel.get("tag")
        for p in self.call(lambda a: a.processes()):
            if tag and p.tag == tag:
                return p.pid
        raise ConnectError("not_found", f"no process with tag {tag!r}" if tag else "process selector is empty")


# --- process streams ----------------------------------------------------------------


def start_process(target: Target, req: StartRequest) -> tuple[int, Stream]:
    env = {**target.env, **req.envs}
    pid, stream = target.call(lambda a: a.start(req.cmd, req.args, env=env, cwd=req.cwd or target.cwd,
                                                user=target.user,
                                                tag=req.tag, stdin=req.stdin, pty=req.pty))
    target.log("info", f"process {pid} started: {' '.join([req.cmd, *req.args])[:500]}")
    return pid, stream


def follow(target: Target, pid: int, stream: Stream, *, keepalive: float,
           deadline: float | None) -> Iterator[dict[str, Any]]:
    """A process's events as envd messages: start, data..., end; keepalives
    while idle. Re-attaches across a VM replacement (module docstring)."""
    offset, current = stream.offset, target.reads(stream)
    try:
        yield process_event(pid)
        while True:
            try:
                for ev in output_events(current, deadline, idle=keepalive):
                    if isinstance(ev, Output):
                        offset = ev.offset + len(ev.data)
                    yield process_event(ev)
                    if isinstance(ev, Exit):
                        target.log("info" if ev.code == 0 else "warn", f"process {pid} ended: {ev.status}")
                        return
            except AgentTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise ConnectError("deadline_exceeded", "the command's stream reached its timeout") from None
                yield process_event(None)
            except AgentGone:
                current = target.reads(_reattach(target, pid, offset))
            except AgentError as exc:
                raise connect_error(exc) from None
    finally:
        current.cancel()  # the client left, or the stream ended: the process goes on


def _reattach(target: Target, pid: int, offset: int) -> Stream:
    give_up = time.monotonic() + REATTACH_FOR
    while True:
        try:
            return target.agent_of().attach(pid, offset=offset)
        except GuestRefused as exc:
            raise connect_error(exc) from None
        except AgentError:
            if time.monotonic() > give_up:
                raise ConnectError("unavailable", f"sandbox {target.sid}'s guest did not come back") from None
            time.sleep(0.5)


# --- watchers envd keeps between polls ------------------------------------------------


def watch_event(ev: dict[str, Any]) -> dict[str, Any]:
    return {"name": str(ev.get("name", "")), "type": _EVENT_TYPES.get(str(ev.get("type")), "EVENT_TYPE_UNSPECIFIED")}


class _Watcher:
    def __init__(self, sid: str, stream: Stream, release: Callable[[], None]) -> None:
        self.sid, self.stream, self.release = sid, stream, release  # release: its place among long requests
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_WATCH_EVENTS)
        self.error: ConnectError | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self._drain, daemon=True, name="strata-envd-watcher").start()

    def _drain(self) -> None:
        try:
            while not self.stream.done:
                try:
                    reply = self.stream.next(3600)
                except AgentTimeout:
                    continue
                if isinstance(reply.get("event"), dict):
                    with self.lock:
                        self.events.append(watch_event(reply["event"]))
        except AgentError as exc:
            with self.lock:
                self.error = connect_error(exc)


class Watchers:
    """envd's CreateWatcher/GetWatcherEvents/RemoveWatcher: a watch stream
    drained into a bounded list until polled. Each holds a thread (and a
    guest stream) until removed, so each holds its team's place among long
    requests (`release`, api/limits.py) until then too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, _Watcher] = {}

    def create(self, target: Target, path: str, recursive: bool, *,
               release: Callable[[], None] = lambda: None) -> str:
        """A watcher's id; `release` is called once it is removed or its sandbox dropped."""
        stream = target.call(lambda a: a.watch(path, recursive=recursive))
        wid = secrets.token_hex(8)
        with self._lock:
            self._by_id[wid] = _Watcher(target.sid, stream, release)
        return wid

    def _get(self, sid: str, wid: str) -> _Watcher:
        with self._lock:
            w = self._by_id.get(wid)
        if w is None or w.sid != sid:
            raise ConnectError("not_found", f"no watcher {wid}")
        return w

    def poll(self, sid: str, wid: str) -> list[dict[str, Any]]:
        w = self._get(sid, wid)
        with w.lock:
            events, error = list(w.events), w.error
            w.events.clear()
        if error is not None and not events:
            self.remove(sid, wid)
            raise error
        return events

    def remove(self, sid: str, wid: str) -> None:
        w = self._get(sid, wid)
        with self._lock:
            if self._by_id.pop(wid, None) is None:
                return  # removed meanwhile, and released then
        w.stream.cancel()
        w.release()

    def drop_sandbox(self, sid: str) -> None:
        with self._lock:
            gone = [self._by_id.pop(wid) for wid, w in list(self._by_id.items()) if w.sid == sid]
        for w in gone:
            w.stream.cancel()
            w.release()
