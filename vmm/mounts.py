"""The volumes mounted in a node's sandboxes: one volume port server
(vmm/volumeport.py) per running VM that has mounts, started with the VM
(boot, restore, wake, fork) or when this process first sees a VM another
process started, stopped with it.

A sandbox's mounts are its record's `volumes` ({guest path: volume id});
which team may mount what is the API's to decide, before it asks. Before a
snapshot, what the guest wrote to files it still has open is published
(`publish`), so a restore, a fork or a wake on another node sees it; what
a VM wrote after its last flush or snapshot is lost if it dies, as on a
crash.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from layerstore.store import Store

from .registry import SandboxRecord
from .volumefs import VolumeFiles
from .volumeport import Replies, VolumePort

log = logging.getLogger("strata.vmm.volumes")

SOCKET = "volumes.sock"  # in the VM's workdir (vmm/qemu.py)
STAGING = "volume-staging"
DEFAULT_MAX_STAGED = 8 << 30  # bytes of files open for writing one sandbox may stage per volume

# (team, bytes) -> raise StrataError if the team may not store that much more
Quota = Callable[[str, int], None]


class VolumeMounts:
    def __init__(self, store: Store, *, quota: Quota | None = None, max_staged: int = DEFAULT_MAX_STAGED) -> None:
        self._store = store
        self.quota = quota  # the API sets it once it can count a team's bytes
        self._max_staged = max_staged
        self._lock = threading.Lock()
        self._ports: dict[str, tuple[VolumePort, dict[str, VolumeFiles]]] = {}
        self._replies: dict[str, Replies] = {}  # kept across a sandbox's VM restarts, dropped at `forget`

    def serve(self, record: SandboxRecord, workdir: Path) -> None:
        """Serve `record`'s mounts on its VM's port (a new VM: any old server is stopped)."""
        self.stop(record.sid)
        if record.volumes:
            self._start(record, workdir)

    def ensure(self, record: SandboxRecord, workdir: Path) -> None:
        """Serve `record`'s mounts unless they already are (a VM that this
        process did not start, or whose server ended); mounts added since
        are served too."""
        if not record.volumes:
            return
        with self._lock:
            held = self._ports.get(record.sid)
        if held is None or not held[0].alive():
            self._start(record, workdir)
            return
        port, files = held
        for volume_id in set(record.volumes.values()) - set(files):
            files[volume_id] = self._files(record, workdir, volume_id)

    @contextmanager
    def quiesced(self, sid: str) -> Iterator[None]:
        """For a snapshot of a paused VM: no volume request runs (those in
        flight finish), what the guest wrote to files it has open is
        published, and the port stays still until the block ends (after
        the capture, and the resume if any)."""
        with self._lock:
            held = self._ports.get(sid)
        if held is None:
            yield
            return
        with held[0].held():
            for files in held[1].values():
                files.publish_all()
            yield

    def stop(self, sid: str) -> None:
        with self._lock:
            held = self._ports.pop(sid, None)
        if held is not None:
            held[0].close()
            for files in held[1].values():
                files.close()

    def forget(self, sid: str) -> None:
        """The sandbox is gone: stop serving and drop what its port remembered."""
        self.stop(sid)
        with self._lock:
            self._replies.pop(sid, None)

    def _start(self, record: SandboxRecord, workdir: Path) -> None:
        with self._lock:
            replies = self._replies.setdefault(record.sid, Replies())
            old = self._ports.get(record.sid)
        files = dict(old[1]) if old is not None else {}  # a port that ended: its staged files go on
        files.update({v: self._files(record, workdir, v) for v in set(record.volumes.values()) - set(files)})
        port = VolumePort(workdir / SOCKET, files, replies, name=record.sid).start()
        with self._lock:
            old = self._ports.pop(record.sid, None)
            self._ports[record.sid] = (port, files)
        if old is not None:
            old[0].close()

    def _files(self, record: SandboxRecord, workdir: Path, volume_id: str) -> VolumeFiles:
        def check(size: int, team: str = record.team) -> None:
            if self.quota is not None:
                self.quota(team, size)
        return VolumeFiles(self._store, volume_id, workdir / STAGING / volume_id, max_staged=self._max_staged,
                           check_stored=check)
