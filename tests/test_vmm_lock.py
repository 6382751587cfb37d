"""The per-sandbox file lock (vmm/registry.py `Registry.lock`) and its use by
`Sandboxes`: real processes and threads contend on one sandbox (no VM
needed), then a real QEMU guest (TCG here) is controlled by another process
while this one keeps its handle.

A holder appends "start"/"end" markers to a shared file around its critical
section; serialisation means the markers never interleave. The holder
processes are `python -c` children (PYTHONPATH points at this checkout).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from layerstore.errors import Conflict, NotFound
from tests.conftest import needs_qemu
from tests.test_vmm_qemu import node  # noqa: F401 - the fixture
from vmm.registry import LOCKS, Registry, SandboxRecord
from vmm.sandbox import Sandboxes

ROOT = Path(__file__).resolve().parent.parent

HOLDER = """
import os, sys, time
from pathlib import Path
from vmm.registry import Registry
root, sid, log, rounds, hold = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
reg = Registry(Path(root))
for i in range(rounds):
    with reg.lock(sid, timeout=60):
        with log.open("a") as f:
            f.write(f"start {os.getpid()}\\n")
        if hold < 0:
            print("locked", flush=True)
            time.sleep(3600)
        time.sleep(hold)
        with log.open("a") as f:
            f.write(f"end {os.getpid()}\\n")
"""


def holder(root: Path, sid: str, log: Path, *, rounds: int = 1, hold: float = 0.0) -> subprocess.Popen:
    """A process taking `sid`'s lock `rounds` times (hold < 0: once, forever, printing "locked")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(root), sid, str(log), str(rounds), str(hold)],
                            env=env, stdout=subprocess.PIPE, text=True)


def assert_serialised(log: Path, sections: int) -> None:
    """Every "start P" is followed by "end P": no two critical sections overlapped."""
    lines = log.read_text().splitlines()
    assert len(lines) == 2 * sections
    for start, end in zip(lines[::2], lines[1::2]):
        assert start.split()[0] == "start" and end == "end " + start.split()[1], lines


def wait_locked(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"


@pytest.mark.parametrize("with_record", [True, False])
def test_processes_serialise_and_leave_no_lock_file(tmp_path: Path, with_record: bool) -> None:
    """Without a record every release unlinks the lock file while others wait
    on it: they must notice and lock the new file, never two at once."""
    reg = Registry(tmp_path / "work")
    if with_record:
        reg.save(SandboxRecord("box", "qemu", "image:x:v1", 256))
    log = tmp_path / "log"
    procs = [holder(reg.root, "box", log, rounds=15, hold=0.002) for _ in range(4)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    assert_serialised(log, 4 * 15)
    assert (reg.root / LOCKS / "box").exists() == with_record
    if not with_record:
        assert list(reg.root.iterdir()) == []  # no lock file, no .locks directory


def test_sigkilled_holder_releases_and_waiters_time_out_clearly(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "work")
    reg.save(SandboxRecord("box", "qemu", "image:x:v1", 256))
    proc = holder(reg.root, "box", tmp_path / "log", hold=-1)
    try:
        wait_locked(proc)
        pattern = rf"sandbox box is busy: another process holds it \(pid {proc.pid}\) for \d+ s"
        with pytest.raises(Conflict, match=pattern):
            with reg.lock("box", timeout=0.2):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    with reg.lock("box", timeout=30):  # the kernel dropped the dead holder's lock
        pass


def test_threads_of_one_process_serialise(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "work")
    events: list[str] = []
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            for _ in range(20):
                with reg.lock("box", timeout=60):
                    events.append(f"start {name}")
                    time.sleep(0.001)
                    events.append(f"end {name}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    log = tmp_path / "log"
    log.write_text("".join(e + "\n" for e in events))
    assert_serialised(log, 4 * 20)
    assert not (reg.root / LOCKS).exists()


def test_a_thread_waiting_on_itself_times_out_naming_this_process(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "work")
    with reg.lock("box"):
        with pytest.raises(Conflict, match=rf"another thread of this process holds it \(pid {os.getpid()}\)"):
            with reg.lock("box", timeout=0.05):
                pass


def test_save_is_safe_from_many_threads_and_leaves_no_temp_files(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry(tmp_path / "work")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr("vmm.registry.os.fsync", fsync)
    errors: list[BaseException] = []

    def save(n: int) -> None:
        try:
            for i in range(30):
                reg.save(SandboxRecord("box", "qemu", "image:x:v1", 256, metadata={"n": f"{n}-{i}"}))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []  # one shared temp name made concurrent writers fail
    assert reg.load("box").metadata["n"].endswith("-29")
    assert os.listdir(reg.workdir("box")) == ["sandbox.json"]
    assert {"file", "dir"} <= set(synced)


# --- Sandboxes over the lock (a fake VM backend and mount: no QEMU) ---------------------------


class FakeVm:
    """Checks, whenever it is controlled, that its sandbox's lock is held."""

    devices_only = False

    def __init__(self, lock_file: Path, pid: int) -> None:
        self.lock_file = lock_file
        self.pid = pid
        self.calls: list[str] = []
        self.running = True
        self.agent = type("NoAgent", (), {"close": lambda self: None, "reseed": lambda self, seed: None})()

    def _check_locked(self, call: str) -> None:
        fd = os.open(self.lock_file, os.O_RDWR)
        try:
            import fcntl

            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        self.calls.append(call)

    def pause(self) -> None:
        self._check_locked("pause")

    def resume(self) -> None:
        self._check_locked("resume")

    def alive(self) -> bool:
        return self.running

    def sync_memory(self) -> None:
        """RAM in its file already (a shared mapping)."""

    def kill(self) -> None:
        self._check_locked("kill")


class FakeBackend:
    name = "fake"
    volume_port = False
    cow_memory = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.vms: dict[str, FakeVm] = {}

    def attach(self, workdir: Path, *, timeout: float = 5.0) -> FakeVm:
        return self.vms.setdefault(workdir.name, FakeVm(self.root / LOCKS / workdir.name, 4242))

    def is_running(self, workdir: Path) -> bool:
        return workdir.name in self.vms

    def destroy(self, workdir: Path) -> None:
        pass


class FakeMount:
    """The mount daemon's client as far as these tests reach it: no disks."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint

    def remove_disk(self, sid: str) -> None:
        raise NotFound("no upper layer")  # as the mount answers for a sandbox without one


def fake_node(tmp_path: Path, **kw: Any) -> tuple[Sandboxes, FakeBackend]:
    backend = FakeBackend(tmp_path / "work")
    boxes = Sandboxes(None, FakeMount(tmp_path / "mnt"), backend, guest_dir=tmp_path,  # type: ignore[arg-type]
                      work_root=tmp_path / "work", **kw)
    boxes.registry.save(SandboxRecord("box", "fake", "image:x:v1", 256, pid=4242))
    return boxes, backend


def test_sandbox_operations_hold_the_lock_and_kill_leaves_nothing(tmp_path: Path) -> None:
    boxes, backend = fake_node(tmp_path)
    boxes.pause("box")
    assert boxes.registry.load("box").state == "paused"
    boxes.resume("box")  # locks, then _set_vcpus locks again in the same thread
    boxes.update("box", metadata={"k": "v"})
    assert backend.vms["box"].calls == ["pause", "resume"]
    boxes.kill("box")
    assert backend.vms["box"].calls[-1] == "kill"
    assert list(boxes.registry.root.iterdir()) == []  # no work directory, no lock file
    with pytest.raises(NotFound):
        boxes.update("box", metadata={})
    assert list(boxes.registry.root.iterdir()) == []  # a lock taken for a missing sandbox is not kept


def test_another_process_holding_a_sandbox_makes_operations_wait_then_fail(tmp_path: Path) -> None:
    boxes, _ = fake_node(tmp_path, lock_timeout=0.2)
    proc = holder(boxes.registry.root, "box", tmp_path / "log", hold=-1)
    try:
        wait_locked(proc)
        for operation in (lambda: boxes.pause("box"), lambda: boxes.update("box", metadata={}),
                          lambda: boxes.kill("box")):
            with pytest.raises(Conflict, match=rf"sandbox box is busy: another process holds it \(pid {proc.pid}\)"):
                operation()
        assert boxes.registry.load("box").state == "running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    boxes.kill("box")
    assert list(boxes.registry.root.iterdir()) == []


def test_a_waiter_on_a_killed_sandbox_gets_not_found_and_recreation_works(tmp_path: Path) -> None:
    """Thread A kills while B waits for the lock: B then locks the fresh lock
    file, finds no sandbox, and removes that file again; the same id can be
    created anew afterwards."""
    boxes, backend = fake_node(tmp_path)
    started, results = threading.Event(), []
    with boxes.registry.lock("box"):
        def update() -> None:
            started.set()
            try:
                boxes.update("box", metadata={"late": "1"})
                results.append("updated")
            except NotFound:
                results.append("not found")

        waiter = threading.Thread(target=update)
        waiter.start()
        started.wait()
        time.sleep(0.05)  # let it block on the lock (the outcome is the same if it has not yet)
        boxes._stop("box")
        boxes.registry.remove("box")
    waiter.join()
    assert results == ["not found"]
    assert list(boxes.registry.root.iterdir()) == []
    boxes.registry.save(SandboxRecord("box", "fake", "image:x:v1", 256, pid=4242))
    assert boxes.update("box", metadata={"again": "1"}).metadata == {"again": "1"}
    assert re.fullmatch(r"\d+ [\d.]+\n", (boxes.registry.root / LOCKS / "box").read_text())



def test_a_vm_replaced_by_another_process_is_found_again(tmp_path: Path) -> None:
    """This process's cached handle is of a VM another process stopped and
    replaced (suspend, wake): operations and kill use the current VM."""
    boxes, backend = fake_node(tmp_path)
    old = boxes.pause("box").vm
    old.running = False
    new = backend.vms["box"] = FakeVm(old.lock_file, 4343)
    boxes.update("box", pid=4343)
    assert boxes.resume("box").vm is new and new.calls == ["resume"]
    boxes._vms["box"] = old  # a stale handle kill must not trust
    boxes.kill("box")
    assert new.calls == ["resume", "kill"] and old.calls == ["pause"]


# --- a real QEMU sandbox controlled from two processes -------------------------------------------

OTHER_PROCESS = """
import json, sys
from pathlib import Path
from layerstore.store import open_store
from vmm.accel import detect
from vmm.qemu import QemuBackend
from fusefs.client import MountClient
from vmm.sandbox import Sandboxes
a = json.loads(sys.argv[1])
store = open_store(a["store"])
client = MountClient(Path(a["mnt"]), run_dir=Path(a["run_dir"]))
boxes = Sandboxes(store, client, QemuBackend(accel=detect()), guest_dir=Path(a["guest"]), work_root=Path(a["work"]))
boxes.pause("box")
print(boxes.snapshot("box"), flush=True)
store.close()
"""


@needs_qemu
def test_another_process_controls_a_vm_this_one_holds_a_handle_to(tmp_path: Path, node: Any, guest: Path) -> None:
    """The booting process keeps its VM handle (as strata serve does) while
    another process pauses and snapshots the VM; the handle still works after.
    (When handles held their QMP connection, the other process could not
    attach at all.)"""
    n = node()
    sb = n.boxes.boot("guest:v1", sid="box")
    args = {"store": str(tmp_path / "store"), "mnt": str(n.mount.mnt), "guest": str(guest),
            "work": str(n.boxes.registry.root), "run_dir": n.mount.env["STRATA_RUN_DIR"]}
    other = subprocess.run([sys.executable, "-c", OTHER_PROCESS, json.dumps(args)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() in n.store.list_snapshots()
    assert n.boxes.registry.load("box").state == "paused"
    assert sb.vm.status() in ("paused", "postmigrate")  # the same handle, a new QMP connection
    assert n.boxes.resume("box").vm is sb.vm
    assert sb.vm.agent.run("echo alive").output.strip() == "alive"
    n.boxes.kill("box")
    assert list(n.boxes.registry.root.iterdir()) == []
