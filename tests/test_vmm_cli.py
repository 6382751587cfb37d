"""`strata sandbox ...` end to end: every command is its own process, so the
sandbox must be found again from its record and its VM re-attached each time.
Real TCG guests on a real FUSE mount; also the README's main command (demo)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import needs_qemu
from tests.test_fusefs_mount import Mount


@pytest.fixture
def node(tmp_path: Path, guest: Path):  # noqa: ANN201
    m = Mount(tmp_path, cache_size="512M", env={"STRATA_GUEST_DIR": str(guest), "STRATA_MOUNT": str(tmp_path / "mnt")})
    m.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    yield m
    m.strata("sandbox", "kill", "--all", check=False)
    m.strata("umount", str(m.mnt), check=False)  # the mount `sandbox boot` started
    subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], capture_output=True)
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "state")], capture_output=True).stdout == b""


def j(m: Mount, *args: str) -> dict:
    return json.loads(m.strata("sandbox", *args, "--json").stdout)


def sids(m: Mount) -> list[str]:
    return [r["sid"] for r in j(m, "ls")]


@needs_qemu
def test_lifecycle_across_processes(node: Mount, tmp_path: Path) -> None:
    m = node
    booted = j(m, "boot", "guest:v1", "--id", "box")  # starts the mount on first use
    assert booted["sid"] == "box" and booted["state"] == "running"
    pid = booted["pid"]
    r = m.strata("sandbox", "exec", "box", "--", "echo parent > /root/who; sync; cat /root/who")
    assert r.stdout.strip() == "parent"
    assert m.strata("sandbox", "exec", "box", "--", "exit 7", check=False).returncode == 7
    r = m.strata("sandbox", "exec", "box", "--", "sh", "-c", "echo a; echo b; echo c")  # several words: argv
    assert r.stdout == "a\nb\nc\n"
    r = m.strata("sandbox", "exec", "box", "--", "printf", "[%s]", "a b", "$HOME", "it's", ";", "*")
    assert r.stdout.rstrip("\n") == "[a b][$HOME][it's][;][*]"
    assert m.stats()["pinned"] > 0  # the running VM's disk pins its chunks

    assert j(m, "pause", "box")["state"] == "paused"
    assert [(r["sid"], r["state"], r["alive"]) for r in j(m, "ls")] == [("box", "paused", True)]
    assert j(m, "resume", "box")["state"] == "running"

    snap = j(m, "snapshot", "box")
    assert set(snap["timings_ms"]) == {"precopy", "paused", "capture", "seal", "publish"}
    assert snap["timings_ms"]["precopy"] > 0  # the guest was running: RAM written back and sealed before the pause

    forked = j(m, "fork", "box", "-n", "2")
    names = [f["sid"] for f in forked["forks"]]
    assert names == ["box-fork1", "box-fork2"]
    for name in names:
        m.strata("sandbox", "exec", name, "--", f"echo {name} > /root/who; sync")
    for name in names:
        assert m.strata("sandbox", "exec", name, "--", "cat /root/who").stdout.strip() == name
    assert m.strata("sandbox", "exec", "box", "--", "cat /root/who").stdout.strip() == "parent"
    assert sorted(sids(m)) == ["box", "box-fork1", "box-fork2"]
    assert j(m, "ls")[0]["pid"] == pid  # the same VM all along

    killed = j(m, "kill", "--all")
    assert sorted(killed["killed"]) == ["box", "box-fork1", "box-fork2"]
    assert sids(m) == []
    assert json.loads(m.strata("disk", "ls", "--mount", str(m.mnt), "--json").stdout) == []
    assert m.stats()["pinned"] == 0  # killing released the cache pins
    assert not list((tmp_path / "state" / "sandboxes").iterdir())


@needs_qemu
def test_bad_input_changes_nothing(node: Mount) -> None:
    m = node
    for args, message in (
        (("boot", "nope:v1"), "nope:v1 not found"),
        (("boot", "guest:v1", "--id", "../etc"), "invalid sandbox id"),
        (("exec", "ghost", "--", "true"), "no sandbox ghost"),
        (("kill", "ghost"), "no sandbox ghost"),
        (("pause", "ghost"), "no sandbox ghost"),
        (("restore", "0" * 64), "not found"),
        (("kill",), "--all"),
    ):
        r = m.strata("sandbox", *args, check=False)
        # exec passes the guest's code through, so its own failures use 255 (ssh's convention), never 1
        assert r.returncode == (255 if args[0] == "exec" else 1), (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("strata: error:") and message in lines[0], (args, lines)
    j(m, "boot", "guest:v1", "--id", "one")
    for count in ("0", "101"):
        r = m.strata("sandbox", "fork", "one", "-n", count, check=False)
        assert r.returncode == 1 and "between 1 and 100" in r.stderr
    r = m.strata("sandbox", "boot", "guest:v1", "--id", "one", check=False)
    assert r.returncode == 1 and "already exists" in r.stderr
    assert sids(m) == ["one"]


@needs_qemu
def test_a_dead_vm_is_listed_and_killable(node: Mount) -> None:
    """A VM that died under us (host OOM, crash) shows as DEAD and `kill` still cleans up."""
    m = node
    pid = j(m, "boot", "guest:v1", "--id", "doomed")["pid"]
    subprocess.run(["kill", "-9", str(pid)], check=True)
    for _ in range(100):
        if not j(m, "ls")[0]["alive"]:
            break
    assert j(m, "ls")[0]["alive"] is False
    r = m.strata("sandbox", "exec", "doomed", "--", "true", check=False)
    assert r.returncode == 255 and "no longer running" in r.stderr  # exec: strata's own failure
    j(m, "kill", "doomed")
    assert sids(m) == []


@needs_qemu
def test_demo_main_command(node: Mount) -> None:
    """The README's main command: build/import the guest, boot, snapshot, fork 2, check isolation."""
    out = j(node, "demo")
    assert out["ok"] is True
    assert [s["step"] for s in out["steps"]] == ["import", "boot", "snapshot", "fork", "check", "cleanup"]
    assert sids(node) == []
