"""Keep the node's mount daemon alive, and its sandboxes with it.

Every sandbox's disk and RAM are files on the node's FUSE mount; the daemon
behind it is one process. If it dies (SIGKILL, the OOM killer), the mount
answers ENOTCONN and every VM on it has lost its files. Once a second (on
the node's reaper thread) the supervisor asks the daemon for a ping and,
when that fails, whether the mount point is dead (ENOTCONN, or no longer a
mount); only then, so a daemon that is merely busy is never replaced, it:

  1. mounts a new daemon on the same mount point (the dead mount is detached
     lazily; the sandboxes' upper layers live on local disk and the new
     daemon loads them again, with every write the old one took);
  2. recovers each sandbox that was running or vCPU-paused: its VM is
     stopped and the guest cold-booted on its disk (`recovered` in its
     record says when and why: processes and unsynced writes are lost). A
     sandbox whose disk is gone goes back to its last snapshot, paused to
     the store, or, without one, is killed. Sandboxes paused to the store
     need nothing: their state is in the store.

Restarts back off; more than `MAX_RESTARTS` within `WINDOW` seconds and the
supervisor stops trying and reports the mount `failed` (an operator looks).
`/health` shows the state, the restart count and the last restart.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fusefs.client import DaemonError, mount
from fusefs.control import MountSettings
from layerstore.config import NodeConfig
from layerstore.errors import StrataError
from vmm.registry import SandboxRecord
from vmm.sandbox import Sandboxes

log = logging.getLogger("strata.api")

MAX_RESTARTS = 5
WINDOW = 600.0  # seconds


@dataclass
class MountHealth:
    state: str = "ok"  # ok | restarting | failed
    restarts: int = 0
    last_restart: float | None = None
    last_error: str = ""
    recent: list[float] = field(default_factory=list)


class MountSupervisor:
    def __init__(self, config: NodeConfig, boxes: Sandboxes, *,
                 disposable: Callable[[SandboxRecord], bool] = lambda _r: False) -> None:
        """`disposable` names sandboxes to remove rather than recover (the warm pool's: it refills)."""
        self.config = config
        self.boxes = boxes
        self.disposable = disposable
        self.health = MountHealth()
        self._next_try = 0.0

    def check(self, now: float) -> bool:
        """One look at the daemon; restart it if it is dead. True if it was restarted."""
        if self.health.state == "failed" or now < self._next_try:
            return False
        try:
            self.boxes.client.ping(timeout=5)
            self.health.state = "ok"
            return False
        except DaemonError as exc:
            if not _mount_is_dead(Path(self.config.mount)):
                return False  # slow, not dead: never start a second daemon on a live mount
            self.health.last_error = str(exc)
        return self._restart(now)

    def _restart(self, now: float) -> bool:
        self.health.recent = [t for t in self.health.recent if now - t < WINDOW] + [now]
        if len(self.health.recent) > MAX_RESTARTS:
            self.health.state = "failed"
            log.error("mount daemon died %d times in %.0f s: not restarting it again (%s)", len(self.health.recent),
                      WINDOW, self.health.last_error)
            return False
        self.health.state = "restarting"
        log.error("the mount daemon of %s is gone (%s): starting a new one", self.config.mount,
                  self.health.last_error)
        try:
            mount(MountSettings.from_config(self.config))
        except StrataError as exc:
            self.health.last_error = str(exc)
            self._next_try = now + 2.0 ** len(self.health.recent)
            log.error("restarting the mount daemon failed: %s (next try in %.0f s)", exc, self._next_try - now)
            return False
        self.health.state, self.health.restarts, self.health.last_restart = "ok", self.health.restarts + 1, now
        self.recover_sandboxes()
        return True

    def recover_sandboxes(self) -> list[tuple[str, str]]:
        """Bring every sandbox that had a VM back onto the new mount; returns (sid, what was done)."""
        done = [(r.sid, self._recover(r)) for r in self.boxes.records() if r.state in ("running", "paused")]
        for sid, what in done:
            log.warning("sandbox %s: %s after the mount daemon restarted", sid, what)
        return done

    def _recover(self, record: SandboxRecord) -> str:
        sid = record.sid
        if not self.disposable(record):
            try:
                self.boxes.reboot_on_disk(sid, "the node's mount daemon died; the guest was rebooted on its disk "
                                               "(processes and unsynced writes lost)")
                return "rebooted on its disk"
            except StrataError as exc:
                log.error("sandbox %s: reboot after the mount restart failed: %s", sid, exc)
        try:
            if record.last_snapshot is not None and not self.disposable(record):
                self.boxes.back_to_snapshot(sid, "the node's mount daemon died and the disk was lost: "
                                                 "paused at its last snapshot")
                return "paused at its last snapshot"
            self.boxes.kill(sid)
            return "removed (a warm pool refills itself)" if self.disposable(record) else \
                "killed (no disk, no snapshot)"
        except StrataError as exc:
            log.error("sandbox %s: could not recover it: %s", sid, exc)
            return f"left as it was: {exc}"


def _mount_is_dead(mountpoint: Path) -> bool:
    """ENOTCONN from the mount point, or no mount there at all."""
    try:
        os.stat(mountpoint)
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO)
    return not os.path.ismount(mountpoint)
