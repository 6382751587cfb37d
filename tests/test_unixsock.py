"""Unix sockets deeper than a socket address holds (layerstore/unixsock.py)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from layerstore.unixsock import bind_unix, connect_unix


def test_a_socket_past_the_address_limit_is_reached_through_its_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 80) / ("y" * 80)
    deep.mkdir(parents=True)
    path = deep / "s.sock"
    with pytest.raises(OSError):  # what a plain connect does with it
        socket.socket(socket.AF_UNIX).connect(str(path))
    server = socket.socket(socket.AF_UNIX)
    bind_unix(server, path)
    assert path.is_socket()
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(16).upper())

    t = threading.Thread(target=answer)
    t.start()
    with socket.socket(socket.AF_UNIX) as client:
        connect_unix(client, path)
        client.sendall(b"ping")
        assert client.recv(16) == b"PING"
    t.join(5)
    server.close()
    with socket.socket(socket.AF_UNIX) as client, pytest.raises(FileNotFoundError):
        connect_unix(client, deep / "gone" / "s.sock")  # what the VMM clients retry on
    short = tmp_path / "short.sock"
    with socket.socket(socket.AF_UNIX) as client, pytest.raises(FileNotFoundError):
        connect_unix(client, short)
