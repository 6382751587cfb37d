"""Unix sockets anywhere. A socket address holds 107 bytes, and Strata puts
sockets in directories that can be deeper: a VM's in its work directory
under the node's state dir, a mount daemon's in the run dir. Both ends reach
such a socket through its directory's /proc/self/fd link, which the kernel
follows like a symlink. (The VMMs bind theirs by relative name: they run in
the work directory.)"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

# sun_path is 108 bytes with its NUL
_MAX_ADDRESS = 107


@contextlib.contextmanager
def _address(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """An address for `path` that fits: itself, or its directory's fd link
    (valid while the context is open). A missing directory is FileNotFoundError."""
    raw = os.fsencode(path)
    if len(raw) <= _MAX_ADDRESS:
        yield raw
        return
    directory, name = os.path.split(raw)
    fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    try:
        yield b"/proc/self/fd/%d/%s" % (fd, name)
    finally:
        os.close(fd)


def connect_unix(sock: socket.socket, path: str | os.PathLike[str]) -> None:
    """Connect `sock` to the unix socket at `path`, however long. Raises what
    `connect` raises (FileNotFoundError for a missing socket or directory)."""
    with _address(path) as address:
        sock.connect(address)


def bind_unix(sock: socket.socket, path: str | os.PathLike[str]) -> None:
    """Bind `sock` to `path`, however long."""
    with _address(path) as address:
        sock.bind(address)
