"""Host side of the guest agent protocol (vmm/guest/README.md).

One line per message over the virtio-serial port's unix socket:
`PING id` -> `PONG id`; `RUN id <base64 cmd>` -> `OUT id <base64 output>`,
`EXIT id <code>`. Lines sent while nothing in the guest has the port open are
dropped, so `wait_ready` resends PING until a PONG arrives, and `run` on a
connection that has not seen a PONG yet (a new process attaching to a running
VM) does that first; replies to ids we are not waiting for (from an earlier
connection) are skipped.

The guest is not trusted. A reply line longer than the caller's output cap
is cut while it arrives: its head is kept, the rest read and dropped, so a
guest printing gigabytes costs the host a bounded buffer, and the result
says how much was dropped. One request at a time per Agent (a lock), so two
threads' commands on one sandbox never read each other's replies.
"""

from __future__ import annotations

import base64
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from layerstore.errors import StrataError


DEFAULT_MAX_OUTPUT = 1 << 20  # bytes of a command's output kept; config `exec_output_limit`
SMALL_LINE = 4096  # any reply but OUT is this short; longer is nonsense


class AgentError(StrataError):
    """The guest agent did not answer, or answered nonsense."""


class AgentTimeout(AgentError):
    """The guest did not finish in time (the command may still be running)."""


class AgentBusy(AgentError):
    """Another request holds this sandbox's agent for longer than we wait."""


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    output: str
    dropped: int = 0  # bytes of output past the cap, not kept


def truncation_marker(dropped: int, cap: int) -> str:
    return f"\n[strata: output truncated: {dropped} more bytes past the {cap}-byte limit]\n"


class Agent:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._sock: socket.socket | None = None
        self._buf = b""
        self._ids = itertools.count(1)
        self._synced = False  # a PONG arrived on the current connection
        self._cut: bytes | None = None  # head of an over-long line being dropped
        self._dropped = 0  # bytes of that line dropped so far
        self._lock = threading.Lock()

    def _connect(self, deadline: float) -> socket.socket:
        while self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.path)
                self._sock = s
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.monotonic() > deadline:
                    raise AgentError(f"agent socket {self.path} did not appear") from None
                time.sleep(0.05)
        return self._sock

    def _send(self, line: str, deadline: float) -> None:
        try:
            self._connect(deadline).sendall(line.encode())
        except OSError as exc:
            raise AgentError(f"agent connection failed: {exc.strerror or exc} (VM stopped?)") from None

    def _line(self, deadline: float, *, cap: int = SMALL_LINE) -> tuple[str, int] | None:
        """The next line with how many of its bytes past `cap` were dropped;
        ("", 0) when 0.25 s pass without one (wait_ready resends), None at
        `deadline`."""
        sock = self._connect(deadline)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(min(left, 0.25))
            try:
                part = sock.recv(1 << 20)
            except socket.timeout:
                return "", 0
            except OSError as exc:
                raise AgentError(f"agent connection failed: {exc.strerror or exc} (VM stopped?)") from None
            if not part:
                raise AgentError("agent connection closed (VM stopped?)")
            self._buf += part
            if len(self._buf) > cap and b"\n" not in self._buf:
                self._drop(cap)
        raw, _, self._buf = self._buf.partition(b"\n")
        dropped = 0
        if self._cut is not None:  # the end of a line whose head we kept
            raw, dropped = self._cut, self._dropped + len(raw)
            self._cut, self._dropped = None, 0
        elif len(raw) > cap:
            raw, dropped = raw[:cap], len(raw) - cap
        return raw.decode("ascii", "replace").strip(), dropped

    def _drop(self, cap: int) -> None:
        if self._cut is None:
            self._cut, self._buf = self._buf[:cap], self._buf[cap:]
        self._dropped += len(self._buf)
        self._buf = b""

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Resend PING until the guest answers; returns seconds waited."""
        with self._hold(timeout):
            return self._ping(timeout)

    def _ping(self, timeout: float) -> float:
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            token = f"p{next(self._ids)}"
            self._send(f"PING {token}\n", deadline)
            until = min(deadline, time.monotonic() + 0.25)
            while (got := self._line(until)) is not None:
                if got[0] == f"PONG {token}":
                    self._synced = True
                    return time.monotonic() - started
        raise AgentTimeout(f"guest agent did not answer within {timeout:.0f} s")

    @contextmanager
    def _hold(self, timeout: float) -> Iterator[None]:
        if not self._lock.acquire(timeout=timeout):
            raise AgentBusy(f"another command kept the sandbox's agent busy for {timeout:.0f} s")
        try:
            yield
        finally:
            self._lock.release()

    def run(self, command: str, *, timeout: float = 60.0, max_output: int = DEFAULT_MAX_OUTPUT) -> RunResult:
        """Run `sh -c command` in the guest; output is stdout and stderr
        together, its first `max_output` bytes kept (then a marker)."""
        deadline = time.monotonic() + timeout
        with self._hold(timeout):
            if not self._synced:
                self._ping(max(deadline - time.monotonic(), 0.1))
            return self._run(command, deadline, timeout, max_output)

    def _run(self, command: str, deadline: float, timeout: float, max_output: int) -> RunResult:
        token = f"r{next(self._ids)}"
        self._send(f"RUN {token} {base64.b64encode(command.encode()).decode()}\n", deadline)
        cap = len(f"OUT {token} ") + -(-max_output // 3) * 4  # base64 of max_output bytes
        output, dropped = "", 0
        while True:
            got = self._line(deadline, cap=cap)
            if got is None:
                raise AgentTimeout(f"guest command timed out after {timeout:.0f} s: {command[:60]!r}")
            line, cut = got
            parts = line.split(" ", 2)
            if len(parts) < 2 or parts[1] != token:
                continue
            try:
                if parts[0] == "OUT":
                    output, dropped = self._output(parts[2] if len(parts) > 2 else "", cut, max_output)
                elif parts[0] == "EXIT" and not cut:
                    return RunResult(int(parts[2]), output, dropped)
                elif cut:
                    raise ValueError("over-long line")
            except (ValueError, IndexError):  # bad base64, a code that is not a number, a missing field
                self.close()  # what follows on this connection cannot be trusted: resync on the next command
                raise AgentError(f"guest agent sent a malformed reply: {line[:80]!r}") from None
            if parts[0] == "ERR":
                raise AgentError(f"guest agent refused the command: {line}")

    @staticmethod
    def _output(b64: str, cut: int, max_output: int) -> tuple[str, int]:
        """Decode an OUT payload; one cut short keeps its whole base64 quads."""
        if cut:
            b64 = b64[:len(b64) // 4 * 4]
        data = base64.b64decode(b64, validate=True)
        dropped = len(data) - max_output + cut * 3 // 4 if cut else max(len(data) - max_output, 0)
        text = data[:max_output].decode("utf-8", "replace")
        return (text + truncation_marker(dropped, max_output), dropped) if dropped else (text, 0)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._synced = False
