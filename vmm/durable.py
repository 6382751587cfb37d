"""Files a VM's state lives in, written so a crash never leaves them torn.

Sandbox records (registry.py) and the backends' notes (vm.json) are small
JSON files that other processes read at any moment and that must survive a
host crash: each is replaced whole, never written in place.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_durably(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably: a unique temp file
    (two writers never share one), fsynced, renamed over `path`, then the
    directory fsynced so the rename itself survives a crash. A reader sees
    the old content or the new, never a torn file."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
