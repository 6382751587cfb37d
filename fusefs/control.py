"""Where a mount's control socket lives, and checks on mount points.

Kept apart from daemon.py so the CLI's client side imports neither pyfuse3
nor trio (a `strata layer seal` should not pay for them at start-up).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from layerstore.errors import InvalidInput


def default_run_dir(*, euid: int, xdg_runtime_dir: str | None) -> Path:
    """Where control sockets live when the config names no run dir: /run/strata
    as root (systemd's RuntimeDirectory), else the user's runtime dir, else a
    per-user directory under /tmp. Pure, so the config can resolve it once and
    hand the result to everything that needs it."""
    if euid == 0:
        return Path("/run/strata")
    return Path(xdg_runtime_dir or f"/tmp/strata-{euid}") / "strata"


def run_dir_from_env(env: Mapping[str, str]) -> Path:
    """The run dir of a config-merged environment: STRATA_RUN_DIR, else
    `default_run_dir` for this process's user."""
    if env.get("STRATA_RUN_DIR"):
        return Path(env["STRATA_RUN_DIR"])
    return default_run_dir(euid=os.geteuid(), xdg_runtime_dir=env.get("XDG_RUNTIME_DIR"))


def control_socket(mountpoint: str | os.PathLike[str], run_dir: Path) -> Path:
    """The control socket of the daemon serving `mountpoint` (by its real path) under `run_dir`."""
    real = os.path.realpath(mountpoint)
    return Path(run_dir) / f"mount-{hashlib.blake2b(real.encode(), digest_size=8).hexdigest()}.sock"


def check_mountpoint(mountpoint: Path) -> Path:
    """`mountpoint`, resolved, if a daemon can mount there (an existing directory, not yet a mount)."""
    if not mountpoint.exists():
        raise InvalidInput(f"mount point {mountpoint} does not exist")
    if not mountpoint.is_dir():
        raise InvalidInput(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise InvalidInput(f"{mountpoint} is already a mount point (strata umount it first)")
    return mountpoint.resolve()
