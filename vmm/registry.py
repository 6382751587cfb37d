"""Sandbox records: what a node knows about each of its sandboxes, on disk,
and the per-sandbox file lock every process acting on a sandbox takes.

A sandbox outlives the process that booted it (each `strata sandbox` command
is its own process; the API service restarts), so everything needed to find
and control it again is a small JSON file in its work directory:

    WORK_ROOT/<sid>/
        sandbox.json   this record (unique temp file, fsync, rename, fsync
                       of the directory: never half written, survives a crash)
        vm.json        the VMM backend's own note (pid, ...)
        state          device state of the last snapshot (imported as a layer)
        qmp.sock  agent.sock  console.log  qemu.log   (QEMU's files; Firecracker
                       has its own, see vmm/firecracker.py)
    WORK_ROOT/.locks/<sid>   the sandbox's lock file (see `Registry.lock`)

Guest RAM is not here: it is the sandbox's copy-on-write RAM upper layer on
the mount (`sandboxes/<sid>.mem/disk.img`), like its disk (`sandboxes/<sid>`).

Sandbox ids become directory names, so they pass `check_sid` (a strict
alphabet, no '/', no leading '.') before they touch the filesystem; that also
keeps them from ever naming `.locks`.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fusefs.control import check_sid
from layerstore.errors import Conflict, CorruptObject, NotFound

from .durable import fsync_dir, write_durably

RECORD = "sandbox.json"
SANDBOX = "sandbox"  # the default record kind: a client's sandbox (the API names the others)
MAX_FORKS = 100  # sandboxes one fork request may make (here, not in sandbox.py, so the CLI's help needs no store)
LOCKS = ".locks"
# How long an operation waits for another one on the same sandbox. Long
# enough for a pause or a small snapshot, short enough that a CLI command
# behind a long boot or a wedged holder fails with a clear error.
LOCK_TIMEOUT = 60.0


@dataclass
class SandboxRecord:
    """One sandbox. `state` is what we last did to it: running, paused
    (vCPUs stopped, VM in memory) or suspended (snapshotted, VM and upper
    layer gone: costs the node nothing but the record); whether its VM
    process is still alive is asked of the backend. The lifetime fields are
    the API's (TTL, what happens on expiry, since when it sleeps)."""

    sid: str
    backend: str
    source: str  # "image:NAME:TAG" or "snapshot:<id>"
    memory_mib: int
    state: str = "running"
    pid: int | None = None  # of the VM process (the backend checks it is still ours)
    created: float = field(default_factory=time.time)
    last_snapshot: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    template: str = ""
    end_at: float | None = None
    auto_pause: bool = False
    suspended_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # An operation that stops the vCPUs midway (a snapshot) names itself here
    # before it pauses and clears it when the VM is back in `state`. The next
    # holder of the sandbox's lock that finds it set knows that operation's
    # process died midway and puts the VM back (Sandboxes._finish_interrupted).
    operation: str = ""
    team: str = "default"  # the API's owning team (an opaque label to the VMM layer)
    recovered: str = ""  # what recovery did to this sandbox after a failure of the node, and when
    env: dict[str, str] = field(default_factory=dict)  # given to every process the API starts in it
    access_token: str = ""  # the API's data-plane token for this sandbox (opaque to the VMM layer)
    traffic_token: str = ""  # the API's token for the sandbox's ports; "" = they are public
    cwd: str = ""  # default working directory of the processes the API starts (an image's WorkingDir)
    user: str = ""  # default user of those processes (an image's User)
    network: dict | None = None  # egress rules (vmm/egress.py) when the VM has a NIC; None = no network
    idempotency: str = ""  # the API's: the Idempotency-Key (and request digest) of the create that made it
    kind: str = SANDBOX  # the API's: a client's sandbox, a warm pool's, a template build's (opaque here)
    volume_port: bool = False  # the VM has the volume port (vmm/guest/README.md), so it can mount volumes
    volumes: dict[str, str] = field(default_factory=dict)  # mounted volumes: {guest path: volume id}


def new_sid() -> str:
    """A fresh sandbox id: 12 random hex digits (never chosen by a user)."""
    return "sb" + secrets.token_hex(6)


class Registry:
    """The records under one work root (one per node)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def workdir(self, sid: str) -> Path:
        return self.root / check_sid(sid)

    def exists(self, sid: str) -> bool:
        return (self.workdir(sid) / RECORD).exists()

    def save(self, record: SandboxRecord) -> None:
        """Write the record atomically and durably (`write_durably`); a new
        work directory is made durable in the work root too."""
        work = self.workdir(record.sid)
        new_dir = not work.exists()
        work.mkdir(parents=True, exist_ok=True)
        write_durably(work / RECORD, json.dumps(asdict(record), indent=1, sort_keys=True).encode())
        if new_dir:
            fsync_dir(self.root)

    def load(self, sid: str) -> SandboxRecord:
        try:
            data = json.loads((self.workdir(sid) / RECORD).read_text())
        except FileNotFoundError:
            raise NotFound(f"no sandbox {sid}") from None
        except ValueError:
            raise CorruptObject(f"the record of sandbox {sid} is unreadable ({self.workdir(sid) / RECORD})") from None
        return record_of(data)

    def all(self) -> list[SandboxRecord]:
        """Every readable record, oldest first (a torn or foreign directory is skipped)."""
        records = []
        for entry in self.root.iterdir():
            try:
                records.append(record_of(json.loads((entry / RECORD).read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return sorted(records, key=lambda r: (r.created, r.sid))

    def snapshot_users(self) -> dict[str, list[str]]:
        """Snapshot id -> the paused sandboxes that wake from it ("paused sandbox SID"):
        deleting such a snapshot would lose the sandbox."""
        users: dict[str, list[str]] = {}
        for record in self.all():
            if record.state == "suspended" and record.last_snapshot:
                users.setdefault(record.last_snapshot, []).append(f"paused sandbox {record.sid}")
        return users

    def remove(self, sid: str) -> None:
        """Delete the sandbox's work directory (its lock file goes when the
        lock is released: see `lock`)."""
        shutil.rmtree(self.workdir(sid), ignore_errors=True)

    @contextmanager
    def lock(self, sid: str, *, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
        """Hold sandbox `sid` exclusively, across processes and threads.

        Every process acting on a sandbox (CLI commands, `strata serve`)
        takes this for the whole operation, so they never talk to one VM's
        control socket at once nor overwrite each other's record updates.
        It is flock(2) on WORK_ROOT/.locks/<sid>, which lives outside the
        work directory so that removing the sandbox never pulls the file
        from under a waiter. flock belongs to an open file description and
        each call opens the file anew, so threads of one process exclude
        each other too (the lock is not re-entrant: a thread that takes it
        twice waits for itself until `timeout`). The kernel drops it when
        its holder dies, even by SIGKILL; the fd is close-on-exec, so a VMM
        started under the lock does not inherit it.

        The holder's pid and start time are written into the file for the
        Conflict raised after waiting `timeout` seconds. On release, a lock
        whose sandbox has no record (killed, or never created) is unlinked,
        still locked; a waiter that then gets the unlinked file notices it
        is no longer the one at the path and locks the new one.
        """
        path = self.root / LOCKS / check_sid(sid)
        fd = _acquire(path, sid, timeout)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {time.time()}\n".encode(), 0)
            yield
        finally:
            try:
                if not self.exists(sid):
                    _unlink_lock(path)
            finally:
                os.close(fd)


def record_of(data: dict) -> SandboxRecord:
    """A record from its JSON, ignoring fields an older or newer Strata wrote."""
    known = {f.name for f in fields(SandboxRecord)}
    return SandboxRecord(**{k: v for k, v in data.items() if k in known})


def _open_lock(path: Path) -> int:
    """Open (creating) a lock file; its directory may vanish meanwhile as
    the last lock in it is unlinked (`_unlink_lock`), so that is retried."""
    while True:
        try:
            os.mkdir(path.parent)  # not Path.mkdir(exist_ok=True): it raises if the directory goes meanwhile
        except FileExistsError:
            pass
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            continue


def _is_current(fd: int, path: Path) -> bool:
    """Whether `fd` is still the file at `path` (not one unlinked since)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _acquire(path: Path, sid: str, timeout: float) -> int:
    """An fd of the file at `path`, flocked exclusively; Conflict naming the
    holder once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        fd = _open_lock(path)
        try:
            _wait_flock(fd, sid, deadline)
            if _is_current(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its sandbox was removed while we waited: lock the file now at the path


def _wait_flock(fd: int, sid: str, deadline: float) -> None:
    """flock(LOCK_EX) `fd` before `deadline`, polling with a growing pause
    (flock itself cannot time out)."""
    pause = 0.002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Conflict(f"sandbox {sid} is busy: {_holder(fd)}") from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)


def _holder(fd: int) -> str:
    """Who holds the lock, from the note its holder wrote into the file."""
    try:
        pid_text, since_text = os.pread(fd, 100, 0).decode().split()
        pid, since = int(pid_text), float(since_text)
    except (OSError, ValueError):
        return "another process holds it"
    who = "another thread of this process" if pid == os.getpid() else "another process"
    return f"{who} holds it (pid {pid}) for {max(0.0, time.time() - since):.0f} s"


def _unlink_lock(path: Path) -> None:
    """Remove a lock file (its holder calls this), then its directory if that
    was the last one, so a node without sandboxes keeps no lock files."""
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:  # other lock files remain (ENOTEMPTY), or it is already gone
        pass
