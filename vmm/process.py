"""The VMM process behind a VM, which this process may not be the parent of.

A VM outlives the `strata` process that started it, so the backends find it
again by pid. A pid can be recycled, so "is it still ours" means its command
line still names the VM's socket (`owns`); and "is it gone" after a kill means
every thread of it has exited (`exited`): the command line empties while the
process is still exiting and holding its files, and a thread-group leader
shows "Z" while vCPU threads still run. A killed pid is not reused before it
is reaped, so waiting on it is safe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def rotate_log(path: Path, *, limit: int) -> bool:
    """If `path` is over `limit` bytes, keep its last `limit` bytes as
    `path.1` and empty it in place. The writer keeps its fd (a VMM's
    O_APPEND log goes on at the new end), so what it writes between the
    copy and the truncate is lost: fine for a console log, whose recent
    lines are what matter."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= limit:
                return False
            f.seek(size - limit)
            tail = f.read(limit)
        old = path.with_name(path.name + ".1")
        tmp = path.with_name(path.name + ".1.tmp")
        tmp.write_bytes(tail)
        os.replace(tmp, old)
        os.truncate(path, 0)
        return True
    except FileNotFoundError:  # the sandbox went away meanwhile
        return False


def owns(pid: int, marker: str) -> bool:
    """True if `pid` is still the VMM whose argv holds `marker` (its control
    socket path), not a recycled pid or a zombie."""
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def exited(pid: int) -> bool:
    """True once every thread of `pid` is a zombie or gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"]):
            return False
    return True


def wait_gone(pid: int, timeout: float, *, proc: subprocess.Popen | None = None) -> bool:
    """Wait until `pid` has exited (reaping it if it is our child `proc`); False on timeout."""
    if proc is not None:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + timeout
    while not exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_group(pid: int, *, timeout: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    """SIGKILL the VMM's process group (it runs in a session of its own) and wait it out."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_gone(pid, timeout, proc=proc)
