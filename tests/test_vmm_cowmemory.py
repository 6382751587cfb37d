"""vmm/cowmemory.py on a real process: a child that maps a file privately,
as QEMU maps a sandbox's RAM, and changes some of its pages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import needs_qemu
from tests.test_vmm_qemu import Node, node  # noqa: F401 (a fixture)
from vmm.backend import VmmError
from vmm.cowmemory import PAGE, CowRam, mapping_address, own_pages, write_back

PAGES = 1024  # 4 MiB
CHILD = r"""
import mmap, os, sys
size = int(sys.argv[2])
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
for line in sys.stdin:  # "read PAGE", "write PAGE BYTE", "same PAGE" (rewrite the page with its own bytes)
    verb, *args = line.split()
    page = int(args[0]) * mmap.PAGESIZE
    if verb == "read":
        m[page]
    elif verb == "write":
        m[page:page + mmap.PAGESIZE] = bytes([int(args[1])]) * mmap.PAGESIZE
    elif verb == "same":
        m[page:page + mmap.PAGESIZE] = m[page:page + mmap.PAGESIZE]
    print("ok", flush=True)
"""


class Child:
    def __init__(self, base: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(base), str(PAGES * PAGE)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def do(self, *commands: str) -> None:
        for command in commands:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline() == "ok\n"

    def memory(self, base: Path) -> bytes:
        """The child's view of the mapping, read while it is stopped."""
        address = mapping_address(self.proc.pid, base, PAGES * PAGE)
        with open(f"/proc/{self.proc.pid}/mem", "rb", buffering=0) as mem:
            mem.seek(address)
            return mem.read(PAGES * PAGE)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, bytes]:
    data = os.urandom(PAGES * PAGE)
    base, target = tmp_path / "base", tmp_path / "target"
    base.write_bytes(data)
    target.write_bytes(data)  # the RAM upper layer starts as the base's bytes
    return base, target, data


@pytest.fixture
def child(files: tuple[Path, Path, bytes]) -> Iterator[Child]:
    c = Child(files[0])
    yield c
    c.proc.kill()
    c.proc.wait()


def test_only_the_pages_a_process_wrote_are_its_own_and_written_back(files: tuple[Path, Path, bytes],
                                                                     child: Child) -> None:
    base, target, data = files
    child.do("read 0", "read 5", "write 7 1", "write 8 2", "write 9 3", "same 100", "write 1023 4")
    pid = child.proc.pid
    assert own_pages(pid, mapping_address(pid, base, PAGES * PAGE), PAGES) == [(7, 3), (100, 1), (1023, 1)]
    os.kill(pid, signal.SIGSTOP)
    try:
        done = write_back(pid, base, target, PAGES * PAGE)
        assert (done.changed, done.written) == (5, 4)  # page 100 is its own copy, but of the same bytes
        assert target.read_bytes() == child.memory(base)
        again = write_back(pid, base, target, PAGES * PAGE)
        assert (again.changed, again.written) == (5, 0)  # nothing new: nothing written
    finally:
        os.kill(pid, signal.SIGCONT)
    assert base.read_bytes() == data  # a private mapping never writes its file
    child.do("write 8 9", "write 500 5")
    os.kill(pid, signal.SIGSTOP)
    try:
        done = write_back(pid, base, target, PAGES * PAGE)
        assert (done.changed, done.written) == (6, 2)
        assert target.read_bytes() == child.memory(base)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_process_that_does_not_map_the_file_or_is_gone_is_a_clear_error(files: tuple[Path, Path, bytes],
                                                                         child: Child, tmp_path: Path) -> None:
    base, target, data = files
    child.do("write 1 1")
    other = tmp_path / "other"
    other.write_bytes(data)
    with pytest.raises(VmmError, match="does not map"):
        write_back(child.proc.pid, other, target, PAGES * PAGE)
    with pytest.raises(VmmError, match="does not map"):  # mapped, but not that size
        write_back(child.proc.pid, base, target, 2 * PAGES * PAGE)
    short = tmp_path / "short"
    short.write_bytes(data[:PAGE])
    with pytest.raises(VmmError, match="short"):  # a target shorter than the RAM changes nothing
        write_back(child.proc.pid, base, short, PAGES * PAGE)
    assert short.read_bytes() == data[:PAGE]
    child.proc.kill()
    child.proc.wait()
    with pytest.raises(VmmError, match="memory map of process"):
        write_back(child.proc.pid, base, target, PAGES * PAGE)
    assert target.read_bytes() == data


# --- sandboxes whose RAM is mapped copy-on-write from one snapshot ------------------------------


def mapping_kib(pid: int, path: Path) -> dict[str, int]:
    """smaps' fields (kB) of the mapping of `path` in process `pid`."""
    fields: dict[str, int] = {}
    inside = False
    wanted = os.path.realpath(path)
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                inside = len(parts) >= 6 and parts[5] == wanted
            elif inside and parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
                fields[parts[0][:-1]] = int(parts[1])
    return fields


def md5(vm: object, path: str) -> str:
    return vm.agent.run(f"md5sum {path}").output.split()[0]  # type: ignore[attr-defined]


@needs_qemu
def test_forks_share_the_pages_none_changed_and_snapshots_and_pauses_stay_exact(node: Callable[..., Node]) -> None:
    n = node(memory_mib=128)
    boxes = n.boxes
    parent = boxes.boot("guest:v1", sid="p")
    parent.vm.agent.run("dd if=/dev/urandom of=/tmp/big bs=1M count=8 2>/dev/null")
    big = md5(parent.vm, "/tmp/big")
    forks = boxes.fork("p", 3)

    # every fork maps the fork snapshot's memory layer, and holds most of what it touched in common
    base = n.mount.mnt / "layers" / n.store.get_snapshot(boxes.registry.load("p").last_snapshot).layers["memory"] / "disk.img"
    for f in forks:
        shared = mapping_kib(f.vm.pid, base)
        assert shared, f"fork {f.sid} does not map {base}"
        assert shared["Shared_Clean"] > 4096 and shared["Shared_Clean"] > shared["Anonymous"], shared

    # each fork's kernel was given its own randomness: they read different /dev/urandom bytes
    randoms = {f.vm.agent.run("head -c 32 /dev/urandom | md5sum").output for f in forks}
    assert len(randoms) == 3

    # each fork's writes are its own; the parent's later writes show in none
    own = {}
    for f in forks:
        f.vm.agent.run(f"(echo {f.sid}; dd if=/dev/urandom bs=1M count=4 2>/dev/null) > /tmp/own")
        own[f.sid] = md5(f.vm, "/tmp/own")
    assert len(set(own.values())) == 3
    parent.vm.agent.run("dd if=/dev/urandom of=/tmp/big bs=1M count=8 2>/dev/null")
    assert md5(parent.vm, "/tmp/big") != big
    for f in forks:
        assert md5(f.vm, "/tmp/big") == big and md5(f.vm, "/tmp/own") == own[f.sid]

    # a running fork's snapshots are exact: the first, and the next (only what changed written again)
    first, second, third = forks
    f1 = first.sid
    snap = boxes.snapshot(f1)
    copy = boxes.restore(snap, sid="copy1")
    assert md5(copy.vm, "/tmp/own") == own[f1] and md5(copy.vm, "/tmp/big") == big
    first.vm.agent.run("dd if=/dev/urandom of=/tmp/more bs=1M count=2 2>/dev/null")
    more = md5(first.vm, "/tmp/more")
    again = boxes.restore(boxes.snapshot(f1), sid="copy2")
    assert md5(again.vm, "/tmp/more") == more and md5(again.vm, "/tmp/own") == own[f1]
    assert md5(again.vm, "/tmp/big") == big

    # a fork paused to the store and woken is exact, its processes still running
    second.vm.agent.run("(i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done) >/dev/null 2>&1 &")
    time.sleep(0.5)
    boxes.suspend(second.sid)
    woken = boxes.wake(second.sid)
    assert md5(woken.vm, "/tmp/own") == own[second.sid] and md5(woken.vm, "/tmp/big") == big
    count = int(woken.vm.agent.run("cat /tmp/counter").output)
    time.sleep(0.5)
    assert int(woken.vm.agent.run("cat /tmp/counter").output) > count
    assert md5(third.vm, "/tmp/own") == own[third.sid]  # a sibling is untouched by all of it


def test_a_capture_after_a_precopy_compares_with_what_the_precopy_wrote(files: tuple[Path, Path, bytes],
                                                                       child: Child) -> None:
    base, target, data = files
    ram = CowRam(base, target, PAGES * PAGE)
    child.do("write 10 1", "write 11 2", "write 300 3")
    pid = child.proc.pid
    first = ram.write_back(pid, precopy=True)  # the guest runs on
    assert (first.changed, first.written) == (3, 3)
    child.do("write 11 7", "write 12 8", "same 10")  # one page changed again, one new, one rewritten alike
    target_before = target.read_bytes()
    os.kill(pid, signal.SIGSTOP)
    try:
        done = ram.write_back(pid)
        assert (done.changed, done.written) == (4, 2)
        assert target.read_bytes() == child.memory(base)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert target_before != target.read_bytes()
    # what a pre-copy kept is used once: a later write-back reads the file again
    assert ram.write_back(pid).written == 0 and ram._seen == {}


def test_a_failed_precopy_leaves_nothing_a_capture_would_trust(files: tuple[Path, Path, bytes], child: Child,
                                                              tmp_path: Path) -> None:
    base, target, data = files
    short = tmp_path / "short"
    short.write_bytes(data[:PAGE * 20])
    ram = CowRam(base, short, PAGES * PAGE)
    child.do("write 5 1", "write 600 2")  # page 600 is past the short file's end: the write-back fails there
    with pytest.raises(VmmError, match="short"):
        ram.write_back(child.proc.pid, precopy=True)
    assert ram._seen == {}
