"""Real QEMU guests (TCG here): boot from a FUSE-served sandbox disk, run a
command through the agent, pause/resume, save and restore state, and the
failure paths (missing binary, guest that never answers)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from layerstore.store import Store, open_store
from tests.conftest import guest_spec, needs_qemu
from tests.test_fusefs_mount import Mount
from vmm.accel import detect
from vmm.qemu import QemuBackend, VmmError
from vmm.sandbox import Sandboxes

def confined(pid: int) -> None:
    """QEMU runs under its seccomp filter (-sandbox on)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert status["Seccomp"].strip() == "2", "QEMU runs without its -sandbox seccomp filter"


def test_accel_detection_refuses_pvm_kvm(tmp_path: Path) -> None:
    dev = tmp_path / "kvm"
    dev.write_text("")
    (tmp_path / "mod" / "kvm_pvm").mkdir(parents=True)
    assert detect(dev=str(dev), sys_module=str(tmp_path / "mod")).name == "tcg"
    assert detect(dev=str(tmp_path / "none"), sys_module=str(tmp_path)).name == "tcg"
    assert detect(dev=str(dev), sys_module=str(tmp_path)).name == "kvm"
    assert detect(forced="tcg", dev=str(dev), sys_module=str(tmp_path)).name == "tcg"


@needs_qemu
def test_boot_from_fuse_disk_run_pause_resume(served_disk: tuple[Mount, Path], guest: Path, tmp_path: Path) -> None:
    mount, disk = served_disk
    backend = QemuBackend(accel=detect())
    vm = backend.start(guest_spec(guest, disk, tmp_path / "vm"), ready_timeout=180)
    try:
        r = vm.agent.run("echo hello from $(uname -r); cat /proc/mounts | grep ' / '")
        assert r.exit_code == 0 and "hello from" in r.output and "/dev/vda" in r.output, r.output
        assert vm.agent.run("exit 3").exit_code == 3
        confined(vm.pid)
        vm.pause()
        assert vm.status() == "paused"
        vm.resume()
        assert vm.status() == "running"
        assert vm.agent.run("echo again").output.strip() == "again"
        # the guest writes through the sandbox's copy-on-write layer
        assert vm.agent.run("echo persisted > /root/note && sync").exit_code == 0
    finally:
        vm.kill()
    assert vm.proc.poll() is not None
    stats = mount.stats()
    assert stats["backend_fetches"] > 0  # the boot read chunks lazily through the mount


@needs_qemu
def test_save_and_restore_state(served_disk: tuple[Mount, Path], guest: Path, tmp_path: Path) -> None:
    """Also from work directories too deep for a unix socket address (a node
    whose state dir is deep): QEMU binds its sockets by relative name."""
    _mount, disk = served_disk
    backend = QemuBackend(accel=detect())
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    assert len(str(deep / "vm" / "agent.sock")) > 108
    vm = backend.start(guest_spec(guest, disk, deep / "vm"), ready_timeout=180)
    state = tmp_path / "vm.state"
    try:
        vm.agent.run("(i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done) >/dev/null 2>&1 &")
        time.sleep(1)
        vm.pause()
        vm.save_state(state)
    finally:
        vm.kill()
    assert state.stat().st_size > 0
    restored = backend.start(guest_spec(guest, disk, deep / "vm2", incoming=state), ready_timeout=120)
    try:
        first = int(restored.agent.run("cat /tmp/counter").output)
        time.sleep(0.5)
        restored.agent.close()  # the agent's port takes one host at a time
        attached = backend.attach(deep / "vm2")  # as another process would, by its work directory
        second = int(attached.agent.run("cat /tmp/counter").output)
        assert first > 0 and second > first  # the in-memory process kept running after restore
        assert backend.is_running(deep / "vm2") and attached.status() == "running"
    finally:
        restored.kill()
    assert not backend.is_running(deep / "vm2")


@needs_qemu
def test_missing_binary_and_silent_guest_fail_cleanly(guest: Path, tmp_path: Path) -> None:
    with pytest.raises(VmmError, match="not found"):
        QemuBackend(binary="/nonexistent/qemu", accel=detect()).start(guest_spec(guest, guest / "rootfs.ext4", tmp_path / "a"))
    # a kernel command line that panics at once: the agent never answers
    silent = tmp_path / "disk.img"
    shutil.copy(guest / "rootfs.ext4", silent)
    backend = QemuBackend(accel=detect())
    started = time.monotonic()
    with pytest.raises(VmmError, match="did not answer|exited"):
        backend.start(guest_spec(guest, silent, tmp_path / "b", cmdline="console=ttyS0 init=/nonexistent rdinit=/nonexistent panic=-1"),
                      ready_timeout=15)
    assert time.monotonic() - started < 60
    out = subprocess.run(["pgrep", "-f", str(tmp_path / "b")], capture_output=True, text=True)
    assert out.stdout.strip() == ""  # no QEMU left behind


@dataclass
class Node:
    """One node for sandbox tests: a store, its FUSE mount, and `Sandboxes` over both."""

    mount: Mount
    store: Store
    boxes: Sandboxes


@pytest.fixture
def node(tmp_path: Path, guest: Path) -> Iterator[Callable[..., Node]]:
    """Factory (so each test picks the guest's memory size); tears down every VM, the mount and the store."""
    made: list[Node] = []

    def make(memory_mib: int = 256) -> Node:
        m = Mount(tmp_path, cache_size="512M")
        m.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
        m.start()
        store = open_store(str(tmp_path / "store"))
        boxes = Sandboxes(store, m.client, QemuBackend(accel=detect()), guest_dir=guest, work_root=tmp_path / "work",
                          memory_mib=memory_mib)
        made.append(Node(m, store, boxes))
        return made[-1]

    yield make
    for n in made:
        for sid in [r["sid"] for r in n.boxes.list()]:
            n.boxes.kill(sid)
        n.mount.stop()
        n.store.close()


@needs_qemu
def test_snapshot_kill_restore_on_a_fresh_mount(tmp_path: Path, node: Callable[..., Node]) -> None:
    """Write a file and start a counter in the guest, snapshot, kill, then restore
    on a fresh mount with an empty cache: both the file and the process survive."""
    n = node()
    m, store, boxes = n.mount, n.store, n.boxes
    sb = boxes.boot("guest:v1", sid="src")
    assert sb.vm.agent.run("echo kept-on-disk > /root/file && sync").exit_code == 0
    sb.vm.agent.run("(i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done) >/dev/null 2>&1 &")
    time.sleep(1)
    snapshot_id = boxes.snapshot("src", resume=False)
    before = boxes.registry.load("src").timings
    boxes.kill("src")
    assert snapshot_id in store.list_snapshots()
    # a fresh mount with an empty cache, as on another node
    m.stop()
    shutil.rmtree(tmp_path / "cache")
    m.start()
    restored = boxes.restore(snapshot_id, sid="copy")
    assert restored.vm.agent.run("cat /root/file").output.strip() == "kept-on-disk"
    first = int(restored.vm.agent.run("cat /tmp/counter").output)
    time.sleep(0.5)
    assert int(restored.vm.agent.run("cat /tmp/counter").output) > first > 0
    assert set(before) >= {"capture", "seal", "publish"}
    boxes.kill("copy")


@needs_qemu
def test_fork_four_see_the_parent_then_diverge(node: Callable[..., Node]) -> None:
    from layerstore.errors import InvalidInput, StrataError

    boxes = node(memory_mib=128).boxes
    parent = boxes.boot("guest:v1", sid="p")
    parent.vm.agent.run("echo from-parent > /root/shared && sync; echo 42 > /tmp/mem")
    with pytest.raises(InvalidInput):
        boxes.fork("p", 0)
    forks = boxes.fork("p", 4)
    assert [f.sid for f in forks] == ["p-fork1", "p-fork2", "p-fork3", "p-fork4"]
    assert parent.vm.agent.run("echo alive").output.strip() == "alive"  # the source keeps running
    for i, f in enumerate(forks):
        out = f.vm.agent.run("cat /root/shared /tmp/mem").output.split()
        assert out == ["from-parent", "42"], out
        f.vm.agent.run(f"echo fork{i} > /root/own && sync")
    parent.vm.agent.run("echo parent > /root/own && sync")
    for i, f in enumerate(forks):
        assert f.vm.agent.run("cat /root/own").output.strip() == f"fork{i}"
    assert parent.vm.agent.run("cat /root/own").output.strip() == "parent"

    # forks restore in parallel: one that fails takes the others down with it, nothing half made
    real = boxes.restore

    def third_fails(snapshot_id: str, *, sid: str, **kwargs: object):  # noqa: ANN202
        if sid == "q3":
            raise StrataError("no room for q3")
        return real(snapshot_id, sid=sid, **kwargs)

    boxes.restore = third_fails  # type: ignore[method-assign]
    with pytest.raises(StrataError, match="no room for q3"):
        boxes.fork("p", 4, names=["q1", "q2", "q3", "q4"], workers=4)
    boxes.restore = real  # type: ignore[method-assign]
    assert sorted(r["sid"] for r in boxes.list()) == ["p", "p-fork1", "p-fork2", "p-fork3", "p-fork4"]


@needs_qemu
def test_pause_while_writing_loses_nothing_and_missing_chunk_refuses_restore(
    tmp_path: Path, node: Callable[..., Node]
) -> None:
    from layerstore.chunk import chunk_key
    from layerstore.errors import MissingChunk

    n = node(memory_mib=128)
    m, store, boxes = n.mount, n.store, n.boxes
    sb = boxes.boot("guest:v1", sid="w")
    sb.vm.agent.run("(i=0; while [ ! -e /tmp/stop ]; do i=$((i+1)); echo $i >> /root/log; sync; done) "
                    ">/dev/null 2>&1 &")
    time.sleep(1)
    sb.vm.pause()
    time.sleep(1)
    sb.vm.resume()
    time.sleep(1)
    sb.vm.agent.run("touch /tmp/stop; sleep 0.5; sync")
    lines = sb.vm.agent.run("cat /root/log").output.split()
    assert len(lines) > 5 and lines == [str(i) for i in range(1, len(lines) + 1)]  # no write lost or torn

    snapshot_id = boxes.snapshot("w", resume=False)
    boxes.kill("w")
    memory = store.get_snapshot(snapshot_id).layers["memory"]
    # a chunk stored as its own object (one packed over it lives in a pack: the pre-copy's seal stored
    # the RAM whole, the pause's seal packed what changed since)
    named = set(store.chunk_map(memory)[1].values())
    victim = sorted(named - store.local_missing_chunks(named))[0]
    store.backend.delete(chunk_key(victim))
    with pytest.raises(MissingChunk, match=victim):
        boxes.restore(snapshot_id, sid="broken")
    assert "broken" not in [r["sid"] for r in boxes.list()]
    rows = json.loads(m.strata("disk", "ls", "--mount", str(m.mnt), "--json").stdout)
    assert [r["sid"] for r in rows] == []  # no half-created sandbox disk left
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True).stdout == b""
