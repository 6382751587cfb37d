"""Talking to a mount daemon: start it, ask it things, stop it.

Used by the CLI (`strata mount`, `strata umount`, `strata disk ...`,
`strata cache stats`), the VMM (sandbox disks) and the API. `MountClient`
has one typed method per operation of protocol.py. Every function takes the
run dir holding the control sockets explicitly (the node config's
`run_dir`), never from the environment.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from layerstore.errors import InvalidInput
from layerstore.unixsock import connect_unix

from .control import MountSettings, check_mountpoint, control_socket
from .protocol import (AwaitSeal, CacheDrop, CacheDropped, CreateDisk, DaemonError, DiskInfo, DiskRemoved, ListDisks,
                       MountStats, Pin, Pinned, Ping, Pong, Prefetch, PrefetchRecorded, PrefetchStarted, R,
                       RecordPrefetch, RemoveDisk, Request, Seal, Sealed, Shutdown, ShuttingDown, Stats, Unpin,
                       Unpinned, decode_reply, encode_request)

__all__ = ["DaemonError", "MountClient", "clear_stale_mount", "mount", "umount"]


class MountClient:
    """Typed calls to the daemon serving `mountpoint`, whose socket is under `run_dir`.

    Holds no connection: each call is one short-lived connection, so a client
    is cheap, thread-safe and survives daemon restarts.
    """

    def __init__(self, mountpoint: str | os.PathLike[str], *, run_dir: Path) -> None:
        self.mountpoint = Path(mountpoint)
        self.run_dir = Path(run_dir)

    @property
    def socket_path(self) -> Path:
        return control_socket(self.mountpoint, self.run_dir)

    def request(self, msg: Request[R], *, timeout: float = 600.0) -> R:
        """Send one request and return its typed reply; the daemon's errors are
        raised as their own StrataError class, an unreachable daemon as DaemonError."""
        line = self._exchange(encode_request(msg), timeout)
        if not line:
            raise DaemonError(f"the daemon serving {self.mountpoint} closed the connection without an answer")
        return decode_reply(line, type(msg))

    def _exchange(self, data: bytes, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                while True:
                    try:
                        connect_unix(s, self.socket_path)
                        break
                    except BlockingIOError:  # the listen backlog is full: the daemon is busy, not gone
                        if time.monotonic() > deadline:
                            raise socket.timeout from None
                        time.sleep(0.01)
                s.sendall(data)
                buf = b""
                while not buf.endswith(b"\n"):
                    part = s.recv(1 << 16)
                    if not part:
                        break
                    buf += part
                return buf
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonError(f"no Strata daemon serves {self.mountpoint} (start one with `strata mount`)") from None
        except (ConnectionResetError, BrokenPipeError):
            raise DaemonError(f"the daemon serving {self.mountpoint} went away mid-request (see its log)") from None
        except socket.timeout:
            raise DaemonError(f"the daemon serving {self.mountpoint} did not answer within {timeout:.0f} s") from None

    def ping(self, *, timeout: float = 10.0) -> Pong:
        return self.request(Ping(), timeout=timeout)

    def stats(self, *, timeout: float = 30.0) -> MountStats:
        return self.request(Stats(), timeout=timeout)

    def create_disk(self, sid: str, *, image: str | None = None, manifest: str | None = None,
                    size: int | None = None, volatile: bool = False) -> DiskInfo:
        """A sandbox disk over an image (NAME:TAG) or a layer (manifest id):
        exactly one; `size` bytes (at least the image's) if given; `volatile`
        for a VM's RAM (its fsyncs do not flush the host's disk)."""
        return self.request(CreateDisk(sid, image=image, manifest=manifest, size=size, volatile=volatile))

    def list_disks(self, *, timeout: float = 30.0) -> list[DiskInfo]:
        return self.request(ListDisks(), timeout=timeout).disks

    def remove_disk(self, sid: str) -> DiskRemoved:
        return self.request(RemoveDisk(sid))

    def seal(self, sid: str, *, wait: bool = False, timeout: float = 600.0) -> Sealed:
        return self.request(Seal(sid, wait=wait), timeout=timeout)

    def await_seal(self, sid: str, *, timeout: float = 600.0) -> Sealed:
        """The published manifest of `sid`'s newest seal (one made without `wait`)."""
        return self.request(AwaitSeal(sid), timeout=timeout)

    def record_prefetch(self, image: str) -> PrefetchRecorded:
        return self.request(RecordPrefetch(image))

    def prefetch(self, manifest: str) -> PrefetchStarted:
        """Start fetching layer `manifest`'s recorded working set (returns at once)."""
        return self.request(Prefetch(manifest))

    def cache_drop(self) -> CacheDropped:
        return self.request(CacheDrop())

    def pin(self, image: str) -> Pinned:
        return self.request(Pin(image))

    def unpin(self, image: str) -> Unpinned:
        return self.request(Unpin(image))

    def shutdown(self, *, timeout: float = 10.0) -> ShuttingDown:
        return self.request(Shutdown(), timeout=timeout)

    def disk_layers(self) -> list[str]:
        """Manifest ids the mount's sandbox disks (and RAM) sit on: their base and
        every layer sealed since. GC must keep them even when no ref names them."""
        return [m for d in self.list_disks() for m in [d.base, *d.layers]]


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


def clear_stale_mount(mountpoint: str | os.PathLike[str], *, run_dir: Path) -> bool:
    """Detach a Strata mount whose daemon is gone (SIGKILL, crash); True if one was cleared.

    A dead FUSE mount answers every access with ENOTCONN ("Transport endpoint
    is not connected") until it is unmounted, and remounting needs it gone.
    Only a Strata mount whose control socket no longer answers is touched.
    """
    path = os.path.abspath(mountpoint)
    if path not in _strata_mounts():
        return False
    try:
        MountClient(path, run_dir=run_dir).ping(timeout=5)
        return False  # a live daemon serves it
    except DaemonError:
        pass
    result = subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True, text=True)
    if result.returncode != 0:
        raise DaemonError(f"{path}: stale FUSE mount could not be detached: {result.stderr.strip()}")
    return True


def mount(settings: MountSettings, *, log_file: str | os.PathLike[str] | None = None,
          timeout: float = 60.0) -> dict[str, Any]:
    """Start a background daemon with `settings` and wait until it serves.

    The settings go to the daemon on its stdin (control.MountSettings); it
    inherits this process's environment only for what boto3 reads itself
    (AWS credentials). Errors the daemon meets while starting (bad store,
    mount refused) come back as one StrataError line; its log has details.
    """
    clear_stale_mount(settings.mountpoint, run_dir=settings.run_dir)
    mp = check_mountpoint(Path(settings.mountpoint))
    settings = replace(settings, mountpoint=mp)
    settings.cache_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_file) if log_file else settings.cache_dir / "daemon.log"
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "fusefs.daemon", "--ready-fd", str(write_fd)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(write_fd,),
                                start_new_session=True, cwd="/")
    os.close(write_fd)
    assert proc.stdin is not None
    with proc.stdin:
        proc.stdin.write(settings.to_json())
    line = _wait_ready(proc, read_fd, timeout=timeout, log_path=log_path)
    if line != "ready":
        proc.wait(timeout=10)
        message = line.removeprefix("error: ") if line else f"mount daemon exited with status {proc.returncode} (log: {log_path})"
        raise DaemonError(message)
    pong = MountClient(mp, run_dir=settings.run_dir).ping()
    return {"mountpoint": str(mp), "pid": proc.pid, "log": str(log_path), "store": pong.store}


def _wait_ready(proc: subprocess.Popen, read_fd: int, *, timeout: float, log_path: Path) -> str:
    """The daemon's first line on its ready pipe ("ready" or "error: ..."), "" if it exited first."""
    deadline = time.monotonic() + timeout
    with os.fdopen(read_fd) as ready:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.terminate()
                raise DaemonError(f"mount daemon did not become ready within {timeout:.0f} s (log: {log_path})")
            readable, _, _ = select.select([ready], [], [], min(left, 0.5))
            if readable:
                return ready.readline().strip()
            if proc.poll() is not None:
                return ""


def umount(mountpoint: str | os.PathLike[str], *, run_dir: Path, timeout: float = 30.0) -> dict[str, Any]:
    """Ask the daemon to unmount and exit; fall back to fusermount3 if none answers."""
    mp = Path(mountpoint).resolve()
    try:
        pid = MountClient(mp, run_dir=run_dir).shutdown().pid
    except DaemonError:
        if clear_stale_mount(mp, run_dir=run_dir):
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
