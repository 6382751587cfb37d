"""Host side of the guest agent protocol (vmm/guest/README.md).

One line per message over the virtio-serial port's unix socket:
`PING id` -> `PONG id`; `RUN id <base64 cmd>` -> `OUT id <base64 output>`,
`EXIT id <code>`. Lines sent while nothing in the guest has the port open are
dropped, so `wait_ready` resends PING until a PONG arrives, and `run` on a
connection that has not seen a PONG yet (a new process attaching to a running
VM) does that first; replies to ids we are not waiting for (from an earlier
connection) are skipped.
"""

from __future__ import annotations

import base64
import itertools
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from layerstore.errors import StrataError


class AgentError(StrataError):
    """The guest agent did not answer, or answered nonsense."""


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    output: str


class Agent:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._sock: socket.socket | None = None
        self._buf = b""
        self._ids = itertools.count(1)
        self._synced = False  # a PONG arrived on the current connection

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

    def _line(self, deadline: float) -> str | None:
        sock = self._connect(deadline)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(min(left, 0.25))
            try:
                part = sock.recv(65536)
            except socket.timeout:
                return ""
            except OSError as exc:
                raise AgentError(f"agent connection failed: {exc.strerror or exc} (VM stopped?)") from None
            if not part:
                raise AgentError("agent connection closed (VM stopped?)")
            self._buf += part
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode("ascii", "replace").strip()

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Resend PING until the guest answers; returns seconds waited."""
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            token = f"p{next(self._ids)}"
            self._send(f"PING {token}\n", deadline)
            until = min(deadline, time.monotonic() + 0.25)
            while True:
                line = self._line(until)
                if line is None:
                    break
                if line == f"PONG {token}":
                    self._synced = True
                    return time.monotonic() - started
        raise AgentError(f"guest agent did not answer within {timeout:.0f} s")

    def run(self, command: str, *, timeout: float = 60.0) -> RunResult:
        """Run `sh -c command` in the guest; output is stdout and stderr together."""
        if not self._synced:
            self.wait_ready(timeout)
        token = f"r{next(self._ids)}"
        deadline = time.monotonic() + timeout
        payload = base64.b64encode(command.encode()).decode()
        self._send(f"RUN {token} {payload}\n", deadline)
        output = None
        while True:
            line = self._line(deadline)
            if line is None:
                raise AgentError(f"guest command timed out after {timeout:.0f} s: {command[:60]!r}")
            parts = line.split(" ", 2)
            if len(parts) < 2 or parts[1] != token:
                continue
            try:
                if parts[0] == "OUT":
                    output = base64.b64decode(parts[2] if len(parts) > 2 else "", validate=True).decode(
                        "utf-8", "replace")
                elif parts[0] == "EXIT":
                    return RunResult(int(parts[2]), output or "")
            except (ValueError, IndexError):  # bad base64, a code that is not a number, a missing field
                self.close()  # what follows on this connection cannot be trusted: resync on the next command
                raise AgentError(f"guest agent sent a malformed reply: {line[:80]!r}") from None
            if parts[0] == "ERR":
                raise AgentError(f"guest agent refused the command: {line}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._synced = False
