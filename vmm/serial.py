"""The guest agent over Firecracker's serial port.

Firecracker has one UART (ttyS0) wired to its stdin/stdout and no
virtio-serial, so the agent (`strata.agent=/dev/ttyS0`) talks there.
Firecracker only reads a stdin that is a tty or a FIFO
(src/vmm/src/devices/legacy/serial.rs, `is_fifo`: a socket is ignored), and
our VMs outlive the process that started them, so the serial is two named
FIFOs in the VM's workdir that any later process can open; Firecracker holds
both open O_RDWR, so it never sees EOF or EPIPE when hosts come and go.
agent.lock makes sure only one host process talks to the agent at a time.
"""

from __future__ import annotations

import fcntl
import os
import select
import time
from pathlib import Path

from .agent import Agent, AgentError

SERIAL_IN = "serial.in"
SERIAL_OUT = "serial.out"
AGENT_LOCK = "agent.lock"
# Firecracker makes its stdout O_NONBLOCK (device_manager/mod.rs,
# set_stdout_nonblocking): guest output that does not fit the FIFO is lost.
SERIAL_PIPE_SIZE = 1 << 20


def make_serial(workdir: Path) -> tuple[int, int]:
    """Fresh FIFOs in `workdir`; returns the fds Firecracker gets as stdin and
    stdout (both O_RDWR: it then never sees EOF on stdin nor EPIPE on stdout
    while no host is connected)."""
    os.mkfifo(workdir / SERIAL_IN, 0o600)
    os.mkfifo(workdir / SERIAL_OUT, 0o600)
    stdin = os.open(workdir / SERIAL_IN, os.O_RDWR | os.O_CLOEXEC)
    stdout = os.open(workdir / SERIAL_OUT, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.fcntl(stdout, fcntl.F_SETPIPE_SZ, SERIAL_PIPE_SIZE)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size: keep the 64 KiB default
    return stdin, stdout


class _SerialChannel:
    """The host end of the guest's ttyS0: the two FIFOs Firecracker has as
    stdin and stdout, with the subset of the socket API `Agent` uses
    (sendall, recv, settimeout, close). Opening it takes agent.lock, so two
    processes never read each other's replies; stale output left by an
    earlier host is discarded (Agent also skips replies to unknown ids)."""

    def __init__(self, workdir: Path) -> None:
        self._lock = os.open(workdir / AGENT_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise AgentError(f"the guest agent of {workdir} is in use by another process") from None
        self._read = self._write = -1
        try:
            self._read = os.open(workdir / SERIAL_OUT, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            # ENXIO when nothing holds the FIFO for reading, i.e. Firecracker is gone
            self._write = os.open(workdir / SERIAL_IN, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self.close()
            raise AgentError(f"guest serial port of {workdir} unavailable: {exc.strerror} (VM stopped?)") from None
        while True:
            try:
                if not os.read(self._read, 65536):
                    break
            except BlockingIOError:
                break
        self._timeout: float | None = None

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def shutdown(self, how: int) -> None:
        pass  # close() is enough: the reader polls with a timeout

    def _wait(self, fd: int, event: int, timeout: float | None) -> bool:
        poller = select.poll()  # not select(): a busy service may hold fds above 1024
        poller.register(fd, event)
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def recv(self, size: int) -> bytes:
        if not self._wait(self._read, select.POLLIN, self._timeout):
            raise TimeoutError("no guest output")
        try:
            return os.read(self._read, size)  # b"" once no writer is left: Firecracker exited
        except BlockingIOError:
            raise TimeoutError("no guest output") from None

    def sendall(self, data: bytes) -> None:
        # Agent's timeouts are about replies; input the port has not taken
        # within 30 s means the guest stopped reading it.
        view = memoryview(data)
        deadline = time.monotonic() + 30.0
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the guest serial port takes no input")
            if self._wait(self._write, select.POLLOUT, left):
                try:
                    view = view[os.write(self._write, view):]
                except BlockingIOError:
                    continue

    def close(self) -> None:
        for fd in (self._read, self._write, self._lock):
            if fd >= 0:
                os.close(fd)
        self._read = self._write = self._lock = -1


class SerialAgent(Agent):
    """`Agent` over Firecracker's serial port instead of a unix socket.

    Only the transport differs, so this overrides `_open` to hand Agent a
    `_SerialChannel` (socket-like) and keeps the protocol code (hellos, id
    matching, streams) in one place.
    """

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir / SERIAL_OUT)
        self.workdir = workdir
        self._held: _SerialChannel | None = None

    def _open(self, deadline: float) -> _SerialChannel:
        channel, self._held = self._held, None
        return channel if channel is not None else _SerialChannel(self.workdir)

    def connect(self) -> None:
        """Take the port now (AgentError if another process holds it)."""
        if self._held is None:
            self._held = _SerialChannel(self.workdir)

    def close(self) -> None:
        super().close()
        if self._held is not None:
            self._held.close()
            self._held = None

