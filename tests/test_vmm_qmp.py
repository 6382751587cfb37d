"""vmm/qmp.py against a real QEMU (`-machine none`: a QMP server without a
guest, up in milliseconds): commands and their errors, fd passing, events
kept, and every way QEMU can fail to answer ending in QMPError within the
deadline, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import needs_qemu
from vmm.qmp import QMP, QMPError

pytestmark = needs_qemu


@pytest.fixture
def qemu(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    sock = tmp_path / "qmp.sock"
    proc = subprocess.Popen(["qemu-system-x86_64", "-machine", "none", "-nodefaults", "-nographic", "-S",
                             "-qmp", f"unix:{sock},server=on,wait=off"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield proc, sock
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(30)


def test_commands_answer_and_refusals_are_qmp_errors(qemu: tuple[subprocess.Popen, Path]) -> None:
    _, sock = qemu
    qmp = QMP(sock, timeout=30)  # waits for the socket to appear
    try:
        assert qmp.execute("query-status")["status"] == "prelaunch"
        with pytest.raises(QMPError, match="no-such-command.*failed"):
            qmp.execute("no-such-command")
        assert qmp.execute("query-status")["running"] is False  # the connection is still in step
        r, w = os.pipe()
        try:
            qmp.execute("getfd", {"fdname": "passed"}, fd=r)  # SCM_RIGHTS: QEMU now holds the pipe
            qmp.execute("closefd", {"fdname": "passed"})
            with pytest.raises(QMPError, match="failed"):
                qmp.execute("closefd", {"fdname": "passed"})  # gone: QEMU really had it
        finally:
            os.close(r)
            os.close(w)
        qmp.execute("cont")
        deadline = time.monotonic() + 10
        while not any(e.get("event") == "RESUME" for e in qmp.events) and time.monotonic() < deadline:
            qmp.execute("query-status")  # events arriving between commands are kept
        assert any(e.get("event") == "RESUME" for e in qmp.events)
    finally:
        qmp.close()


def test_a_wedged_qemu_is_an_error_within_the_deadline(qemu: tuple[subprocess.Popen, Path]) -> None:
    proc, sock = qemu
    qmp = QMP(sock, timeout=30)
    try:
        proc.send_signal(signal.SIGSTOP)  # alive, connected, silent
        started = time.monotonic()
        with pytest.raises(QMPError, match="did not answer in time"):
            qmp.execute("query-status", timeout=1)
        assert time.monotonic() - started < 10
    finally:
        qmp.close()


def test_qemu_exiting_is_an_error_not_a_hang(qemu: tuple[subprocess.Popen, Path]) -> None:
    proc, sock = qemu
    qmp = QMP(sock, timeout=30)
    try:
        proc.kill()
        proc.wait(30)
        with pytest.raises(QMPError, match="closed|QMP query-status"):
            qmp.execute("query-status", timeout=5)
    finally:
        qmp.close()


def test_a_socket_that_never_appears_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(QMPError, match="did not appear within"):
        QMP(tmp_path / "absent.sock", timeout=0.5)
