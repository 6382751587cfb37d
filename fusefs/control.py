"""What a mount daemon starts with, where its control socket lives, and
checks on mount points.

Kept apart from daemon.py so the CLI's client side imports neither pyfuse3
nor trio (a `strata layer seal` should not pay for them at start-up).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from layerstore.config import NodeConfig
from layerstore.errors import InvalidInput


@dataclass(frozen=True)
class MountSettings:
    """Everything a mount daemon starts with. It crosses to the daemon
    process as one JSON document on its stdin (never its command line: the
    store options may hold the peer key), so the daemon serves exactly the
    node's configuration, config file included."""

    mountpoint: Path
    store: str
    cache_dir: Path
    cache_size: int
    upper_dir: Path
    run_dir: Path
    store_options: dict[str, Any]  # layerstore.store.open_store keywords (NodeConfig.store_options)
    squash_depth: int = 32

    @classmethod
    def from_config(cls, config: NodeConfig, *, upper_dir: Path | None = None) -> "MountSettings":
        if not config.store:
            raise InvalidInput("no store given: pass --store PATH|s3://BUCKET/PREFIX or set STRATA_STORE")
        return cls(mountpoint=Path(config.mount), store=config.store, cache_dir=Path(config.cache_dir),
                   cache_size=config.cache_size, upper_dir=upper_dir or config.state_dir / "uppers",
                   run_dir=Path(config.run_dir), store_options=config.store_options(),
                   squash_depth=config.squash_depth)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), default=_plain).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "MountSettings":
        try:
            raw = json.loads(data)
            options = dict(raw.pop("store_options"))
            options["peers"] = tuple(options.get("peers", ()))
            if options.get("state_dir") is not None:
                options["state_dir"] = Path(options["state_dir"])
            paths = {k: Path(raw[k]) for k in ("mountpoint", "cache_dir", "upper_dir", "run_dir")}
            return cls(**{**raw, **paths, "store_options": options})
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidInput(f"malformed mount settings: {exc}") from None


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


_SID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_sid(sid: str) -> str:
    """Sandbox ids become directory names (upper layers, mount paths, VM work
    dirs): a strict alphabet, no path tricks. Here, in the light module, so
    the VMM's records check ids without loading the filesystem."""
    if not isinstance(sid, str) or not _SID_RE.fullmatch(sid):
        raise InvalidInput(f"invalid sandbox id {sid!r}: letters, digits, '.', '_', '-', at most 64")
    return sid


def control_socket(mountpoint: str | os.PathLike[str], run_dir: Path) -> Path:
    """The control socket of the daemon serving `mountpoint` (by its real path) under `run_dir`."""
    real = os.path.realpath(mountpoint)
    return Path(run_dir) / f"mount-{hashlib.blake2b(real.encode(), digest_size=8).hexdigest()}.sock"


def make_mountpoint(mountpoint: Path) -> None:
    """Create the node's own mount point on first use. One that exists is left
    alone, even a dead FUSE mount (whose stat fails): `mount` clears that."""
    with contextlib.suppress(OSError):
        mountpoint.mkdir(parents=True)


def check_mountpoint(mountpoint: Path) -> Path:
    """`mountpoint`, resolved, if a daemon can mount there (an existing directory, not yet a mount)."""
    if not mountpoint.exists():
        raise InvalidInput(f"mount point {mountpoint} does not exist")
    if not mountpoint.is_dir():
        raise InvalidInput(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise InvalidInput(f"{mountpoint} is already a mount point (strata umount it first)")
    return mountpoint.resolve()
