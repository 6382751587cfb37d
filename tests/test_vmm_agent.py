"""vmm/agent.py against a scripted guest on a real unix socket: what a
malformed or hostile reply does to the host (a clear AgentError, never a
crash of the caller)."""

from __future__ import annotations

import base64
import socket
import threading
from pathlib import Path
from typing import Callable

import pytest

from vmm.agent import Agent, AgentError


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
