"""Socket helpers of the tests that play a hostile guest against the
resolver and the domain gate: is a connection readable, did the server
close it, and a request trickled a byte at a time until it does."""

from __future__ import annotations

import select
import socket
import time


def readable(conn: socket.socket, seconds: float) -> bool:
    """poll(2), not select(2): a test holding hundreds of sockets has descriptors past FD_SETSIZE."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(seconds * 1000))


def closed_within(conn: socket.socket, seconds: float) -> bool:
    """Does the server close `conn` within `seconds` (reading whatever it sends)?"""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if readable(conn, 0.2):
            try:
                if not conn.recv(4096):
                    return True
            except OSError:
                return True
    return False


def trickled_until_closed(conn: socket.socket, data: bytes, *, every: float = 0.25) -> bool:
    """Send `data` one byte each `every` seconds: True if the server closed
    the connection before the last byte (a slow-loris cut off), False if it
    took all of it and kept waiting."""
    for i in range(len(data)):
        try:
            conn.sendall(data[i:i + 1])
        except OSError:
            return True
        if closed_within(conn, every):
            return True
    return False
