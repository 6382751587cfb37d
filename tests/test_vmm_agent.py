"""vmm/agent.py against a scripted guest on a real unix socket: what a
malformed or hostile reply does to the host (a clear AgentError, never a
crash of the caller)."""

from __future__ import annotations

import base64
import socket
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Callable

import pytest

from vmm.agent import Agent, AgentBusy, AgentError, AgentTimeout, truncation_marker


def scripted_guest(path: Path, reply: Callable[[str, str], list[str]]) -> threading.Thread:
    """A guest agent answering PING, and RUN with whatever `reply(id, command)` says."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rw") as f:
            for line in f:
                verb, rid, *rest = line.split()
                if verb == "PING":
                    f.write(f"PONG {rid}\n")
                elif verb == "RUN":
                    f.write("".join(r + "\n" for r in reply(rid, base64.b64decode(rest[0]).decode())))
                f.flush()
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_a_well_formed_reply(tmp_path: Path) -> None:
    scripted_guest(tmp_path / "a.sock", lambda rid, cmd: [f"OUT {rid} {b64(cmd.upper())}", f"EXIT {rid} 3"])
    result = Agent(tmp_path / "a.sock").run("echo hi", timeout=10)
    assert (result.exit_code, result.output) == (3, "ECHO HI")


@pytest.mark.parametrize("lines", [
    lambda rid: [f"OUT {rid} {b64('x')}", f"EXIT {rid} seven"],  # not a number
    lambda rid: [f"OUT {rid} {b64('x')}", f"EXIT {rid}"],  # no code
    lambda rid: [f"OUT {rid} !!!not-base64!!!", f"EXIT {rid} 0"],
])
def test_a_malformed_reply_is_a_clear_error(tmp_path: Path, lines: Callable[[str], list[str]]) -> None:
    scripted_guest(tmp_path / "a.sock", lambda rid, cmd: lines(rid))
    with pytest.raises(AgentError, match="malformed reply"):
        Agent(tmp_path / "a.sock").run("true", timeout=10)


def flooding_guest(path: Path, *, lines: int, end: bool) -> None:
    """A guest answering PING, then RUN with `lines` MiB of base64 ("y\\n"
    repeated), written a chunk at a time so the test's own memory stays small;
    `end` closes the line and sends EXIT 0, else the line never ends."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    chunk = base64.b64encode(b"y\n" * 3 * (1 << 17))  # 1 MiB of base64, whole quads

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"PONG p1\n")
            rid = conn.recv(4096).split()[1]
            try:
                conn.sendall(b"OUT " + rid + b" ")
                for _ in range(lines):
                    conn.sendall(chunk)
                if end:
                    conn.sendall(b"\nEXIT " + rid + b" 0\n")
                    conn.recv(1)  # until the host hangs up
            except OSError:
                pass
        server.close()

    threading.Thread(target=serve, daemon=True).start()


def test_a_guest_flooding_output_costs_the_host_a_bounded_buffer(tmp_path: Path) -> None:
    """~38 MB of output against a 64 KiB cap: the head is kept with a marker
    saying how much was dropped, and the host never held the flood."""
    flooding_guest(tmp_path / "a.sock", lines=50, end=True)
    agent = Agent(tmp_path / "a.sock")
    tracemalloc.start()
    try:
        result = agent.run("yes", timeout=60, max_output=64 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        agent.close()
    sent = 50 * 3 * (1 << 18)
    assert result.exit_code == 0
    assert result.output.startswith("y\ny\n")
    assert result.output.endswith(truncation_marker(result.dropped, 64 << 10))
    assert len(result.output) < (64 << 10) + 200
    assert abs(result.dropped - (sent - (64 << 10))) <= 4
    assert peak < 8 << 20, f"the host buffered {peak} bytes of a guest's flood"


def test_a_flood_that_never_ends_its_line_times_out_with_a_bounded_buffer(tmp_path: Path) -> None:
    """A guest that sends output without ever ending the line: a timeout, not an out-of-memory host."""
    flooding_guest(tmp_path / "a.sock", lines=1 << 20, end=False)  # until the host hangs up
    agent = Agent(tmp_path / "a.sock")
    tracemalloc.start()
    try:
        with pytest.raises(AgentTimeout, match="timed out"):
            agent.run("flood", timeout=2, max_output=1 << 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        agent.close()
    assert peak < 8 << 20, f"the host buffered {peak} bytes of a guest's flood"


def test_two_threads_on_one_sandbox_each_get_their_own_reply(tmp_path: Path) -> None:
    """The guest answers one request at a time; the host sends one at a time,
    so neither thread reads the other's OUT or EXIT."""
    def reply(rid: str, cmd: str) -> list[str]:
        time.sleep(0.05)
        return [f"OUT {rid} {b64(cmd)}", f"EXIT {rid} {len(cmd)}"]

    scripted_guest(tmp_path / "a.sock", reply)
    agent = Agent(tmp_path / "a.sock")
    results: dict[str, tuple[int, str]] = {}

    def run(cmd: str) -> None:
        r = agent.run(cmd, timeout=30)
        results[cmd] = (r.exit_code, r.output)

    threads = [threading.Thread(target=run, args=(f"echo {'x' * i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {f"echo {'x' * i}": (5 + i, f"echo {'x' * i}") for i in range(8)}


def test_a_command_waiting_behind_a_long_one_gives_up_with_busy(tmp_path: Path) -> None:
    scripted_guest(tmp_path / "a.sock", lambda rid, cmd: (time.sleep(3), [f"EXIT {rid} 0"])[1])
    agent = Agent(tmp_path / "a.sock")
    first = threading.Thread(target=agent.run, args=("sleep 3",), kwargs={"timeout": 30})
    first.start()
    time.sleep(0.5)
    with pytest.raises(AgentBusy, match="busy"):
        agent.run("true", timeout=1)
    first.join()
    assert agent.run("true", timeout=10).exit_code == 0
