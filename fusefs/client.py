"""Talking to a mount daemon: start it, ask it things, stop it.

Used by the CLI (`strata mount`, `strata umount`, `strata layer ...`,
`strata cache stats`) and by later modules (VMM, API) that need sandbox disks.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from layerstore.errors import Conflict, InvalidInput, MissingChunk, NotFound, StrataError

from .control import check_mountpoint, control_socket


class DaemonError(StrataError):
    """The daemon answered with an error, or could not be reached."""


def call(
    mountpoint: str | os.PathLike[str],
    request: dict[str, Any],
    *,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Send one control request to the daemon serving `mountpoint`; return its reply."""
    path = control_socket(mountpoint, env)
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            while True:
                try:
                    s.connect(str(path))
                    break
                except BlockingIOError:  # the listen backlog is full: the daemon is busy, not gone
                    if time.monotonic() > deadline:
                        raise socket.timeout from None
                    time.sleep(0.01)
            s.sendall(json.dumps(request).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                part = s.recv(1 << 16)
                if not part:
                    break
                buf += part
    except (FileNotFoundError, ConnectionRefusedError):
        raise DaemonError(f"no Strata daemon serves {mountpoint} (start one with `strata mount`)") from None
    except (ConnectionResetError, BrokenPipeError):
        raise DaemonError(f"the daemon serving {mountpoint} went away mid-request (see its log)") from None
    except socket.timeout:
        raise DaemonError(f"the daemon serving {mountpoint} did not answer within {timeout:.0f} s") from None
    try:
        reply = json.loads(buf)
    except ValueError:
        raise DaemonError(f"the daemon serving {mountpoint} closed the connection without an answer") from None
    if not reply.get("ok"):
        # the daemon's error class travels as `kind`, so callers can tell a
        # missing sandbox (NotFound) from bad input or a daemon failure
        kind = {"NotFound": NotFound, "InvalidInput": InvalidInput, "MissingChunk": MissingChunk,
                "Conflict": Conflict}.get(
            str(reply.get("kind")), DaemonError)
        raise kind(str(reply.get("error", "unknown error")))
    return reply


def sandbox_layers(mountpoint: str | os.PathLike[str], *, env: dict[str, str] | None = None) -> list[str]:
    """Manifest ids the mount's sandbox disks (and RAM) sit on: their base and
    every layer sealed since. GC must keep them even when no ref names them."""
    rows = call(mountpoint, {"op": "sandbox_list"}, timeout=30, env=env)["sandboxes"]
    return [m for r in rows for m in [r["base"], *r["layers"]]]


def _strata_mounts() -> set[str]:
    """Mount points of Strata FUSE filesystems (fstype fuse.strata) in this namespace."""
    found = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) > 4 and right.split()[:1] == ["fuse.strata"]:
                found.add(fields[4])
    return found


def clear_stale_mount(mountpoint: str | os.PathLike[str]) -> bool:
    """Detach a Strata mount whose daemon is gone (SIGKILL, crash); True if one was cleared.

    A dead FUSE mount answers every access with ENOTCONN ("Transport endpoint
    is not connected") until it is unmounted, and remounting needs it gone.
    Only a Strata mount whose control socket no longer answers is touched.
    """
    path = os.path.abspath(mountpoint)
    if path not in _strata_mounts():
        return False
    try:
        call(path, {"op": "ping"}, timeout=5)
        return False  # a live daemon serves it
    except DaemonError:
        pass
    result = subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True, text=True)
    if result.returncode != 0:
        raise DaemonError(f"{path}: stale FUSE mount could not be detached: {result.stderr.strip()}")
    return True


def mount(
    mountpoint: str | os.PathLike[str],
    *,
    store: str,
    cache_dir: str | os.PathLike[str],
    cache_size: int,
    upper_dir: str | os.PathLike[str] | None = None,
    log_file: str | os.PathLike[str] | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start a background daemon for `mountpoint` and wait until it serves.

    Errors the daemon meets while starting (bad store, mount refused) come
    back as one StrataError line; the daemon's log holds the details.
    """
    clear_stale_mount(mountpoint)
    mp = check_mountpoint(Path(mountpoint))
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_file) if log_file else cache_dir / "daemon.log"
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "fusefs.daemon", str(mp), "--store", store, "--cache-dir", str(cache_dir),
           "--cache-size", str(cache_size), "--ready-fd", str(write_fd)]
    if upper_dir:
        cmd += ["--upper-dir", str(upper_dir)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(write_fd,),
                                start_new_session=True, cwd="/", env=env)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    with os.fdopen(read_fd) as ready:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.terminate()
                raise DaemonError(f"mount daemon did not become ready within {timeout:.0f} s (log: {log_path})")
            readable, _, _ = select.select([ready], [], [], min(left, 0.5))
            if readable:
                line = ready.readline().strip()
                break
            if proc.poll() is not None:
                line = ""
                break
    if line != "ready":
        proc.wait(timeout=10)
        message = line.removeprefix("error: ") if line else f"mount daemon exited with status {proc.returncode} (log: {log_path})"
        raise DaemonError(message)
    reply = call(mp, {"op": "ping"}, timeout=10, env=env)
    return {"mountpoint": str(mp), "pid": proc.pid, "log": str(log_path), "store": reply["store"]}


def umount(mountpoint: str | os.PathLike[str], *, timeout: float = 30.0) -> dict[str, Any]:
    """Ask the daemon to unmount and exit; fall back to fusermount3 if none answers."""
    mp = Path(mountpoint).resolve()
    try:
        pid = call(mp, {"op": "ping"}, timeout=10)["pid"]
        call(mp, {"op": "shutdown"}, timeout=10)
    except DaemonError:
        if clear_stale_mount(mp):
            return {"mountpoint": str(mp), "method": "stale mount detached"}
        if not os.path.ismount(mp):
            raise InvalidInput(f"{mp} is not a Strata mount") from None
        result = subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True, text=True)
        if result.returncode != 0:
            raise DaemonError(f"fusermount3 -u {mp} failed: {result.stderr.strip()}") from None
        return {"mountpoint": str(mp), "method": "fusermount3"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise DaemonError(f"daemon {pid} still running {timeout:.0f} s after shutdown was requested")
    return {"mountpoint": str(mp), "method": "daemon", "pid": pid}
