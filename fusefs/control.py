"""Where a mount's control socket lives, and checks on mount points.

Kept apart from daemon.py so the CLI's client side imports neither pyfuse3
nor trio (a `strata layer seal` should not pay for them at start-up).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from layerstore.errors import InvalidInput


def run_dir(env: dict[str, str] | None = None) -> Path:
    """Where control sockets live (STRATA_RUN_DIR, else /run/strata as root)."""
    env = dict(os.environ if env is None else env)
    if env.get("STRATA_RUN_DIR"):
        return Path(env["STRATA_RUN_DIR"])
    if os.geteuid() == 0:
        return Path("/run/strata")
    return Path(env.get("XDG_RUNTIME_DIR") or f"/tmp/strata-{os.getuid()}") / "strata"


def control_socket(mountpoint: str | os.PathLike[str], env: dict[str, str] | None = None) -> Path:
    """The control socket of the daemon serving `mountpoint` (by its real path)."""
    real = os.path.realpath(mountpoint)
    return run_dir(env) / f"mount-{hashlib.blake2b(real.encode(), digest_size=8).hexdigest()}.sock"


def check_mountpoint(mountpoint: Path) -> Path:
    if not mountpoint.exists():
        raise InvalidInput(f"mount point {mountpoint} does not exist")
    if not mountpoint.is_dir():
        raise InvalidInput(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise InvalidInput(f"{mountpoint} is already a mount point (strata umount it first)")
    return mountpoint.resolve()
