"""api/supervisor.py's MountSupervisor over a real mount daemon (FUSE) and a
real Sandboxes registry: a live daemon is left alone; a daemon that does not
answer on a live mount is never replaced (no second daemon); a SIGKILLed
one is replaced on the same mount point and its sandbox disks come back
with their writes; restarts that fail back off and then stop (`failed`);
recovery removes disposable sandboxes, kills those with neither disk nor
snapshot and puts those with a snapshot back to it. (A real guest rebooted
on its disk is tests/test_faults.py's end-to-end case.)"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from api.supervisor import MAX_RESTARTS, MountSupervisor
from fusefs.client import MountClient, mount
from fusefs.control import MountSettings
from fusefs.protocol import DaemonError
from layerstore.config import NodeConfig
from layerstore.errors import NotFound
from layerstore.importer import import_image
from layerstore.store import open_store
from tests.conftest import IN_CI
from tests.images import MiB, write_image
from tests.test_catalog import node_config
from vmm.qemu import QemuBackend
from vmm.registry import SandboxRecord
from vmm.sandbox import Sandboxes

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") and not IN_CI,
                                reason="FUSE not available (/dev/fuse missing)")


class Node:
    """A node's store (image base:v1), its mount daemon and its Sandboxes."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.config: NodeConfig = node_config(tmp_path, STRATA_STORE=str(tmp_path / "store"),
                                              STRATA_CACHE_SIZE="128M", **env)
        self.config.mount.mkdir(parents=True, exist_ok=True)
        self.store = open_store(str(tmp_path / "store"))
        write_image(tmp_path / "a.img", "rzr", seed=7)
        import_image(self.store, tmp_path / "a.img", "base:v1")
        self.client = MountClient(self.config.mount, run_dir=self.config.run_dir)
        self.boxes = Sandboxes(self.store, self.client, QemuBackend(), guest_dir=tmp_path / "guest",
                               work_root=tmp_path / "work")

    def start(self) -> int:
        return mount(MountSettings.from_config(self.config))["pid"]

    def stop(self) -> None:
        """Shut the current daemon down (it is this process's child: reap it), then detach what is left."""
        try:
            reap(self.client.shutdown().pid)
        except DaemonError:
            pass  # none answers: killed, or never started
        subprocess.run(["fusermount3", "-u", "-z", str(self.config.mount)], capture_output=True)
        self.store.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.stop()


def reap(pid: int) -> None:
    """Wait for a daemon this process started to exit (30 s at most)."""
    deadline = time.monotonic() + 30
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
    except ChildProcessError:  # reaped already (subprocess's own cleanup)
        pass


def kill_daemon(pid: int) -> None:
    """SIGKILL the daemon this process started and reap it: its mount stays, dead."""
    os.kill(pid, signal.SIGKILL)
    reap(pid)


def dead_mount_errno(mountpoint: Path) -> int:
    """The errno a stat of a killed daemon's mount point answers, once the
    kernel's cached attributes of the root (1 s) have expired."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.stat(mountpoint)
        except OSError as exc:
            return exc.errno or 0
        time.sleep(0.1)
    return 0


def test_a_live_daemon_is_left_alone(node: Node) -> None:
    pid = node.start()
    supervisor = MountSupervisor(node.config, node.boxes)
    assert supervisor.check(1000.0) is False
    assert (supervisor.health.state, supervisor.health.restarts, supervisor.health.recent) == ("ok", 0, [])
    assert node.client.ping().pid == pid


def test_a_daemon_that_does_not_answer_on_a_live_mount_is_not_replaced(node: Node, tmp_path: Path) -> None:
    """The supervisor's client reaches no daemon (its socket is elsewhere),
    but the mount point still answers: slow or unreachable is not dead, and
    no second daemon is started on the live mount."""
    pid = node.start()
    deaf = Sandboxes(node.store, MountClient(node.config.mount, run_dir=tmp_path / "elsewhere"), QemuBackend(),
                     guest_dir=tmp_path / "guest", work_root=tmp_path / "work")
    supervisor = MountSupervisor(node.config, deaf)
    for now in (1000.0, 2000.0, 3000.0):
        assert supervisor.check(now) is False
    assert (supervisor.health.restarts, supervisor.health.recent, supervisor.health.last_error) == (0, [], "")
    assert node.client.ping().pid == pid  # the same daemon serves the mount


def test_a_killed_daemon_is_replaced_and_its_disks_come_back(node: Node) -> None:
    """SIGKILL: the mount answers ENOTCONN; one check mounts a new daemon on
    the same mount point, which serves the sandbox's disk with its write."""
    pid = node.start()
    node.client.create_disk("sb1", image="base:v1")
    disk = node.config.mount / "sandboxes" / "sb1" / "disk.img"
    with open(disk, "r+b", buffering=0) as f:
        os.pwrite(f.fileno(), b"written before the crash", MiB + 5)
        os.fsync(f.fileno())
    kill_daemon(pid)
    assert dead_mount_errno(node.config.mount) == errno.ENOTCONN
    supervisor = MountSupervisor(node.config, node.boxes)
    assert supervisor.check(1000.0) is True, supervisor.health
    health = supervisor.health
    assert (health.state, health.restarts, health.last_restart) == ("ok", 1, 1000.0)
    assert "no Strata daemon" in health.last_error or "went away" in health.last_error
    assert node.client.ping().pid != pid
    assert [d.sid for d in node.client.list_disks()] == ["sb1"]
    with open(disk, "rb", buffering=0) as f:
        assert os.pread(f.fileno(), 24, MiB + 5) == b"written before the crash"
    assert supervisor.check(1001.0) is False and supervisor.health.restarts == 1


def test_failed_restarts_back_off_then_stop(tmp_path: Path) -> None:
    """No daemon, no mount, and a store the daemon cannot open: each restart
    fails naming the store; a check before the backoff has passed tries
    nothing; after MAX_RESTARTS the state is `failed` and it never tries again."""
    n = Node(tmp_path)
    n.config = node_config(tmp_path, STRATA_STORE="ftp://nowhere/store", STRATA_CACHE_SIZE="128M")
    try:
        supervisor = MountSupervisor(n.config, n.boxes)
        now = 1000.0
        for attempt in range(1, MAX_RESTARTS + 1):
            assert supervisor.check(now) is False
            assert supervisor.health.state == "restarting" and len(supervisor.health.recent) == attempt
            assert "ftp://nowhere/store" in supervisor.health.last_error
            assert supervisor.check(now + 2.0 ** attempt - 1) is False  # too soon: not tried
            assert len(supervisor.health.recent) == attempt
            now += 2.0 ** attempt
        assert supervisor.check(now) is False
        assert supervisor.health.state == "failed" and supervisor.health.restarts == 0
        recent = list(supervisor.health.recent)
        assert supervisor.check(now + 10_000) is False and supervisor.health.recent == recent
        assert not os.path.ismount(n.config.mount)
    finally:
        n.store.close()


def save(node: Node, sid: str, state: str, last_snapshot: str | None = None, kind: str = "sandbox") -> None:
    node.boxes.registry.save(SandboxRecord(sid, "qemu", "image:base:v1", 256, state=state,
                                           last_snapshot=last_snapshot, kind=kind))


def test_recovery_without_disks(node: Node) -> None:
    """After a restart that lost the disks: a disposable (warm pool) sandbox
    is removed even with a snapshot, one with a snapshot goes back to it
    (suspended, `recovered` says why), one with neither is killed, and a
    suspended one is not touched."""
    node.start()
    snap = "ab" * 32
    save(node, "sbpool", "running", last_snapshot=snap, kind="pool")
    save(node, "sbsnap", "paused", last_snapshot=snap)
    save(node, "sblost", "running")
    save(node, "sbasleep", "suspended", last_snapshot=snap)
    supervisor = MountSupervisor(node.config, node.boxes, disposable=lambda r: r.kind == "pool")
    done = dict(supervisor.recover_sandboxes())
    assert done == {"sbpool": "removed (a warm pool refills itself)", "sbsnap": "paused at its last snapshot",
                    "sblost": "killed (no disk, no snapshot)"}
    assert sorted(r.sid for r in node.boxes.records()) == ["sbasleep", "sbsnap"]
    back = node.boxes.record("sbsnap")
    assert back.state == "suspended" and back.pid is None and "mount daemon died" in back.recovered
    assert node.boxes.record("sbasleep").recovered == ""
    for sid in ("sbpool", "sblost"):
        with pytest.raises(NotFound):
            node.boxes.record(sid)
