"""A minimal QMP client (QEMU's JSON control protocol over a unix socket).

Commands are sent one at a time; asynchronous events that arrive in between
are kept in `events` and otherwise ignored. Every call has a deadline, so a
wedged QEMU produces an error, never a hang.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from layerstore.errors import StrataError

from layerstore.unixsock import connect_unix


class QMPError(StrataError):
    """QEMU refused a command, or could not be reached in time."""


class QMP:
    def __init__(self, path: str | Path, *, timeout: float = 30.0) -> None:
        self.path = str(path)
        self.timeout = timeout
        self.events: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                connect_unix(self._sock, self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self._sock.close()
                if time.monotonic() > deadline:
                    raise QMPError(f"QMP socket {self.path} did not appear within {timeout:.0f} s") from None
                time.sleep(0.02)
        self._buf = b""
        greeting = self._read(deadline)
        if "QMP" not in greeting:
            raise QMPError(f"unexpected QMP greeting: {greeting}")
        self.execute("qmp_capabilities")

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise QMPError(f"QMP on {self.path} did not answer in time")
            self._sock.settimeout(left)
            try:
                part = self._sock.recv(65536)
            except socket.timeout:
                continue
            if not part:
                raise QMPError(f"QMP connection {self.path} closed (QEMU exited?)")
            self._buf += part
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def execute(self, command: str, arguments: dict[str, Any] | None = None, *, timeout: float | None = None,
                fd: int | None = None) -> Any:
        """Run one command and return its `return` value (QMPError on `error`).

        `fd` goes along with the command (SCM_RIGHTS), as `getfd` wants it.
        """
        message: dict[str, Any] = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        data = json.dumps(message).encode() + b"\n"
        try:
            if fd is None:
                self._sock.sendall(data)
            elif socket.send_fds(self._sock, [data], [fd]) != len(data):
                raise OSError("short write")
        except OSError as exc:
            raise QMPError(f"QMP {command}: {exc}") from None
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read(deadline)
            if "event" in reply:
                self.events.append(reply)
                continue
            if "error" in reply:
                raise QMPError(f"QMP {command} failed: {reply['error'].get('desc', reply['error'])}")
            return reply.get("return")

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
