"""The real FUSE mount, driven through the `strata` CLI as a user would."""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from fusefs.client import MountClient
from fusefs.daemon import READ_AHEAD_KIB
from tests.conftest import IN_CI, MotoHTTP
from tests.test_fusefs_catalogue import wait_for
from tests.images import MiB, write_image
from tests.test_cli import run

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") and not IN_CI, reason="FUSE not available (/dev/fuse missing)"
)


class Mount:
    """A store plus a running `strata mount` daemon, all under one temp dir."""

    def __init__(self, tmp: Path, *, cache_size: str = "256M", store: str | None = None, env: dict | None = None) -> None:
        self.tmp = tmp
        self.mnt = tmp / "mnt"
        self.mnt.mkdir(exist_ok=True)
        self.env = {"STRATA_STORE": store or str(tmp / "store"), "STRATA_STATE_DIR": str(tmp / "state"),
                    "STRATA_RUN_DIR": str(tmp / "run"), **(env or {})}
        self.cache_size = cache_size
        self.pid: int | None = None

    def strata(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        r = run(list(args), self.env, timeout=timeout)
        if check:
            assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r

    def start(self) -> None:
        r = self.strata("mount", str(self.mnt), "--cache-dir", str(self.tmp / "cache"), "--cache-size",
                        self.cache_size, "--json")
        self.pid = json.loads(r.stdout)["pid"]

    def stop(self) -> None:
        if self.pid is None:
            return
        self.strata("umount", str(self.mnt), check=False)
        try:
            os.kill(self.pid, 0)
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        self.pid = None

    def kill(self) -> None:
        """SIGKILL the daemon and wait until it is gone (its mount stays, dead)."""
        os.kill(self.pid, signal.SIGKILL)
        for _ in range(200):
            try:
                os.kill(self.pid, 0)
                time.sleep(0.05)
            except ProcessLookupError:
                break

    def stats(self) -> dict:
        return json.loads(self.strata("cache", "stats", "--mount", str(self.mnt), "--json").stdout)

    @property
    def client(self) -> MountClient:
        """A typed client of this mount's daemon (its socket under the test's STRATA_RUN_DIR)."""
        return MountClient(self.mnt, run_dir=Path(self.env["STRATA_RUN_DIR"]))

    def image(self, ref: str) -> Path:
        return self.mnt / "images" / ref / "disk.img"


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    m = Mount(tmp_path)
    yield m
    m.stop()


def test_lazy_reads_fetch_only_what_is_read(mount: Mount) -> None:
    content = write_image(mount.tmp / "a.img", "rzrrpzzr")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "lazy:v1")
    mount.start()
    path = mount.image("lazy:v1")
    assert path.stat().st_size == len(content)
    assert mount.stats()["backend_fetches"] == 0  # mounting and stat read manifests only
    with open(path, "rb", buffering=0) as f:
        assert os.pread(f.fileno(), 100, 1 * MiB) == bytes(100)  # a hole: zeros, no fetch
        assert mount.stats()["backend_fetches"] == 0
        assert os.pread(f.fileno(), 4096, 3 * MiB + 10) == content[3 * MiB + 10 : 3 * MiB + 4106]
        fetched = mount.stats()["backend_fetches"]
        assert 1 <= fetched <= 1 + 8  # the chunk read, plus at most the read-ahead window
        assert f.read() == content  # whole file, bit-exact
        assert os.pread(f.fileno(), 10, len(content) + 5) == b""  # past EOF
    assert sorted(os.listdir(mount.mnt)) == ["images", "layers", "sandboxes", "snapshots"]
    assert "lazy:v1" in os.listdir(mount.mnt / "images")


def _direct_reads(path: Path, length: int, count: int) -> bytes:
    """`count` reads of `length` bytes one after the other from the start of
    `path`, as QEMU makes them (O_DIRECT: no kernel read-ahead)."""
    buf = mmap.mmap(-1, length)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return b"".join(buf[: os.preadv(fd, [buf], i * length)] for i in range(count))
    finally:
        os.close(fd)
        buf.close()


def _resident_pages(files: list[Path]) -> int:
    """Pages of `files` in the page cache (util-linux fincore, mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line) for line in out.split()) // 4096


def _drop_pages(files: list[Path]) -> None:
    os.sync()  # dirty pages (a cache file's short tail is written buffered) are not dropped
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_a_buffered_reader_is_served_around_the_chunk_caches_page_cache(mount: Mount) -> None:
    """A buffered read lands in the FUSE file's page cache, so the chunk
    cache's files are read around theirs (one copy, not two: fusefs/stream.py);
    an O_DIRECT reader (a VMM's disk) keeps the cache files' page cache, which
    its siblings share."""
    content = write_image(mount.tmp / "a.img", "rrrrrrrr", tail=5000)
    mount.strata("image", "import", str(mount.tmp / "a.img"), "warm:v1")
    mount.start()
    path = mount.image("warm:v1")
    assert path.read_bytes() == content  # fetches every chunk into the cache (written behind)
    def cache_files() -> list[Path]:
        return [p for p in (mount.tmp / "cache" / "chunks").rglob("*") if p.is_file()]

    wait_for(lambda: len(cache_files()) == 9)
    cached = cache_files()
    assert len(cached) == 9  # eight chunks and the 5000-byte tail
    mount.stop()  # a new daemon holds no chunk in memory: each read below is the cache file's
    mount.start()
    assert path.read_bytes() == content  # (every entry is re-hashed on its first use after a restart)
    for kind in ("buffered", "direct"):
        _drop_pages([*cached, path])
        assert _resident_pages(cached) == 0
        if kind == "buffered":
            with open(path, "rb") as f:
                assert f.read() == content
            assert _resident_pages(cached) <= 2  # the tail's file, read through the page cache
        else:
            assert _direct_reads(path, MiB, 9)[: len(content)] == content
            assert _resident_pages(cached) >= 8 * MiB // 4096 // 2


def test_an_o_direct_reader_finds_the_next_cached_chunks_paged_in(mount: Mount) -> None:
    """An O_DIRECT reader has one read in flight: after a run of its reads,
    the cache files of the next PAGES_AHEAD cached chunks are paged in
    (posix_fadvise WILLNEED), so its next reads need not wait for the disk;
    those further on are not."""
    from fusefs.fs import PAGES_AHEAD
    from layerstore.digest import digest_bytes

    content = write_image(mount.tmp / "a.img", "rrrrrrrrrr")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "seq:v1")
    mount.start()
    path = mount.image("seq:v1")
    assert path.read_bytes() == content
    files = [mount.tmp / "cache" / "chunks" / d[:2] / d
             for d in (digest_bytes(content[i:i + MiB]) for i in range(0, len(content), MiB))]
    assert wait_for(lambda: all(f.exists() for f in files))
    mount.stop()  # a new daemon holds no chunk in memory
    mount.start()
    _direct_reads(path, MiB, 1)  # re-hashes chunk 0 on its first use after the restart
    _drop_pages([*files, path])
    assert _direct_reads(path, MiB, 3) == content[: 3 * MiB]
    ahead = files[3 : 3 + PAGES_AHEAD]
    assert wait_for(lambda: _resident_pages(ahead) == len(ahead) * MiB // 4096)
    assert _resident_pages(files[3 + PAGES_AHEAD :]) == 0
    _drop_pages(files)  # a new run of reads further back is paged ahead of too
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, MiB)
    try:
        for i in (7, 8):  # a seek, then a run: pages in 9
            assert buf[: os.preadv(fd, [buf], i * MiB)] == content[i * MiB : (i + 1) * MiB]
        for i in (0, 1):  # back to the start
            assert buf[: os.preadv(fd, [buf], i * MiB)] == content[i * MiB : (i + 1) * MiB]
    finally:
        os.close(fd)
        buf.close()
    ahead = files[2 : 2 + PAGES_AHEAD]
    assert wait_for(lambda: _resident_pages(ahead) == len(ahead) * MiB // 4096)


def test_reads_of_a_sandboxs_ram_fetch_nothing_ahead(mount: Mount) -> None:
    """A guest faults its RAM in no order: the mount's read-ahead past a
    run of reads, right for disks, only fetched chunks a restore did not
    need. Reads of a volatile (RAM) layer fetch what they read; a disk's
    read of the same chunk fetches the chunks after it."""
    content = write_image(mount.tmp / "a.img", "rrrrrr")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "ram:v1")
    mount.start()
    mount.client.create_disk("box.mem", image="ram:v1", volatile=True)
    mount.client.create_disk("box", image="ram:v1")
    assert _direct_reads(mount.mnt / "sandboxes" / "box.mem" / "disk.img", MiB // 2, 2) == content[:MiB]
    time.sleep(1)  # what a read-ahead would fetch is fetched in the background
    assert mount.stats()["backend_fetches"] == 1
    assert _direct_reads(mount.mnt / "sandboxes" / "box" / "disk.img", MiB // 2, 2) == content[:MiB]
    deadline = time.monotonic() + 10
    while mount.stats()["backend_fetches"] < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mount.stats()["backend_fetches"] == 6  # chunks 1-5 fetched ahead of the disk's reader


def test_a_packed_layer_reads_through_the_mount_rebuilt_and_verified(mount: Mount) -> None:
    from layerstore.store import open_store
    from tests.test_pack import packed_image

    with open_store(str(mount.tmp / "store")) as store:
        content, _base, _pack = packed_image(store, "packed:v1")
    mount.start()
    with open(mount.image("packed:v1"), "rb", buffering=0) as f:
        assert os.pread(f.fileno(), 8192, 4096) == content[4096:12288]  # a changed page of chunk 0
        assert f.read() == content
    # chunks 0, 1 and 2 once each, and chunk 0's base (read through the cache, so kept for the next rebuild)
    assert mount.stats()["backend_fetches"] == 4


def test_read_ahead_is_set_once_the_mount_says_it_is_ready(mount: Mount) -> None:
    """A restore that starts the moment the mount is up reads its kernel at
    the mount's read-ahead: it must be set before `strata mount` returns,
    not some time after (the kernel default, 128 KiB, is 8 requests a chunk)."""
    if os.geteuid() != 0:
        pytest.skip("setting a mount's read-ahead needs root (sysfs)")
    mount.start()
    with open("/proc/self/mountinfo") as f:
        device = next(line.split()[2] for line in f if line.split()[4] == str(mount.mnt))
    assert Path(f"/sys/class/bdi/{device}/read_ahead_kb").read_text().strip() == str(READ_AHEAD_KIB)


def test_refusals(mount: Mount) -> None:
    write_image(mount.tmp / "a.img", "r")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "ro:v1")
    mount.start()
    with pytest.raises(OSError) as e:
        open(mount.image("ro:v1"), "r+b")
    assert e.value.errno in (errno.EROFS, errno.EACCES)
    for missing in ("images/nope:v1/disk.img", "images/../../etc/passwd", "sandboxes/ghost/disk.img", "nothing"):
        assert not (mount.mnt / missing).exists()
    with pytest.raises(OSError):
        (mount.mnt / "images" / "new-file").write_bytes(b"x")
    with pytest.raises(OSError):
        os.mkdir(mount.mnt / "sandboxes" / "x")
    r = mount.strata("disk", "new", "../evil", "--image", "ro:v1", "--mount", str(mount.mnt), check=False)
    assert r.returncode == 1 and "invalid sandbox id" in r.stderr
    r = mount.strata("disk", "new", "sb", "--image", "nope:v1", "--mount", str(mount.mnt), check=False)
    assert r.returncode == 1 and "not found" in r.stderr


def test_corrupt_chunk_gives_eio_for_its_range_only_and_recovers(mount: Mount) -> None:
    content = write_image(mount.tmp / "a.img", "rrr", seed=9)
    mount.strata("image", "import", str(mount.tmp / "a.img"), "bad:v1")
    victim = sorted((mount.tmp / "store" / "objects" / "chunks").rglob("*"))
    from layerstore.digest import digest_bytes

    second = digest_bytes(content[MiB : 2 * MiB])
    obj = next(p for p in victim if p.name == second)
    good = obj.read_bytes()
    obj.write_bytes(good[:-20] + bytes(20))
    mount.start()
    with open(mount.image("bad:v1"), "rb", buffering=0) as f:
        assert os.pread(f.fileno(), 100, 0) == content[:100]
        with pytest.raises(OSError) as e:
            os.pread(f.fileno(), 100, MiB + 50)
        assert e.value.errno == errno.EIO
        assert os.pread(f.fileno(), 100, 2 * MiB) == content[2 * MiB : 2 * MiB + 100]
        obj.write_bytes(good)  # repaired in the store: the next read succeeds
        assert os.pread(f.fileno(), 100, MiB + 50) == content[MiB + 50 : MiB + 150]
    log = (mount.tmp / "cache" / "daemon.log").read_text()
    assert second in log


def test_sandbox_write_seal_remount(mount: Mount) -> None:
    content = write_image(mount.tmp / "a.img", "rzrp")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "base:v1")
    mount.start()
    m = str(mount.mnt)
    mount.strata("disk", "new", "sb1", "--image", "base:v1", "--mount", m)
    mount.strata("disk", "new", "sb2", "--image", "base:v1", "--mount", m)
    d1 = mount.mnt / "sandboxes" / "sb1" / "disk.img"
    d2 = mount.mnt / "sandboxes" / "sb2" / "disk.img"
    with open(d1, "r+b", buffering=0) as f:
        os.pwrite(f.fileno(), b"written by sb1", MiB + 123)
        os.fsync(f.fileno())
    assert d2.read_bytes() == content  # sb2 does not see sb1's write
    expected = bytearray(content)
    expected[MiB + 123 : MiB + 137] = b"written by sb1"
    assert d1.read_bytes() == bytes(expected)
    sealed = json.loads(mount.strata("disk", "seal", "sb1", "--wait", "--mount", m, "--json").stdout)
    assert sealed["dirty_chunks"] == 1 and len(sealed["manifest"]) == 64
    assert (mount.mnt / "layers" / sealed["manifest"] / "disk.img").read_bytes() == bytes(expected)
    with open(d1, "r+b", buffering=0) as f:  # writes after the seal go to the fresh upper layer
        os.pwrite(f.fileno(), b"after seal", 10)
        os.fsync(f.fileno())
    expected[10:20] = b"after seal"
    mount.strata("umount", m)
    mount.pid = None
    mount.start()
    assert d1.read_bytes() == bytes(expected)
    rows = json.loads(mount.strata("disk", "ls", "--mount", m, "--json").stdout)
    assert {r["sid"]: r["layers"] for r in rows}["sb1"] == [sealed["manifest"]]
    mount.strata("disk", "rm", "sb2", "--mount", m)
    assert not (mount.mnt / "sandboxes" / "sb2").exists()


def test_closing_a_writer_flushes_and_closing_a_reader_does_not(mount: Mount) -> None:
    """A writer's close is as good as an fsync (what SIGKILL of the daemon
    cannot take); a reader's close flushes nothing, not even writes another
    descriptor has open (QEMU closes a read-only one when a VM continues
    after a snapshot: flushing there stalled the guest)."""
    write_image(mount.tmp / "a.img", "rr")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "base:v1")
    mount.start()
    mount.strata("disk", "new", "sb", "--image", "base:v1", "--mount", str(mount.mnt))
    disk = mount.mnt / "sandboxes" / "sb" / "disk.img"
    before = disk.read_bytes()[4096:4102]
    with open(disk, "r+b", buffering=0) as f:
        os.pwrite(f.fileno(), b"closed", 4096)
    writer = open(disk, "r+b", buffering=0)
    os.pwrite(writer.fileno(), b"opened", MiB + 8192)  # another chunk than the closed writer's
    with open(disk, "rb", buffering=0) as reader:
        assert os.pread(reader.fileno(), 6, MiB + 8192) == b"opened"
    mount.kill()
    with pytest.raises(OSError):  # the daemon is gone: this flush reaches no one
        writer.close()
    mount.start()
    data = disk.read_bytes()
    assert data[4096:4102] == b"closed"
    assert data[MiB + 8192:MiB + 8198] != b"opened" and before != b"closed"


def test_sigkill_then_remount_keeps_fsynced_writes(mount: Mount) -> None:
    write_image(mount.tmp / "a.img", "rr")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "base:v1")
    mount.start()
    m = str(mount.mnt)
    mount.strata("disk", "new", "sb", "--image", "base:v1", "--mount", m)
    disk = mount.mnt / "sandboxes" / "sb" / "disk.img"
    with open(disk, "r+b", buffering=0) as f:
        os.pwrite(f.fileno(), b"synced", 4096)
        os.fsync(f.fileno())
    mount.kill()
    with pytest.raises(OSError) as e:
        os.stat(disk)
    assert e.value.errno == errno.ENOTCONN  # the dead mount a crash leaves behind
    mount.start()  # clears the dead mount and mounts again
    with open(disk, "rb") as f:
        f.seek(4096)
        assert f.read(6) == b"synced"


def test_sigterm_unmounts_cleanly(mount: Mount) -> None:
    write_image(mount.tmp / "a.img", "r")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "base:v1")
    mount.start()
    os.kill(mount.pid, signal.SIGTERM)
    for _ in range(100):
        try:
            os.kill(mount.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("daemon ignored SIGTERM")
    assert str(mount.mnt) not in Path("/proc/self/mountinfo").read_text()
    mount.pid = None


def test_backend_going_away_gives_eio_and_cached_data_still_serves(tmp_path: Path) -> None:
    server = MotoHTTP("fuse")
    m = Mount(tmp_path, store="s3://fuse/x", env=server.env)
    try:
        content = write_image(tmp_path / "a.img", "rrrrrrrrrrrrrrrrrrrr", seed=3)
        m.strata("image", "import", str(tmp_path / "a.img"), "remote:v1")
        m.start()
        with open(m.image("remote:v1"), "rb", buffering=0) as f:
            assert os.pread(f.fileno(), 1000, 0) == content[:1000]
            server.stop()
            started = time.monotonic()
            with pytest.raises(OSError) as e:
                os.pread(f.fileno(), 1000, 19 * MiB)
            assert e.value.errno == errno.EIO
            assert time.monotonic() - started < 60  # bounded retries, no hang
            assert os.pread(f.fileno(), 1000, 0) == content[:1000]  # cached data still served
    finally:
        m.stop()
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs for a full cache disk needs root")
def test_full_cache_disk_still_serves_reads(tmp_path: Path) -> None:
    m = Mount(tmp_path, cache_size="64M")
    cache = tmp_path / "cache"
    cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(cache)], check=True)
    try:
        content = write_image(tmp_path / "a.img", "rrrrrrrr", seed=4)
        m.strata("image", "import", str(tmp_path / "a.img"), "full:v1")
        m.start()
        assert m.image("full:v1").read_bytes() == content
        stats = m.stats()
        assert stats["skipped_inserts"] > 0
    finally:
        m.stop()
        subprocess.run(["umount", "-l", str(cache)], check=False)


def test_recorded_prefetch_list_is_fetched_on_open(mount: Mount) -> None:
    content = write_image(mount.tmp / "a.img", "rrrrrrrrrrrrrrrr", seed=8)
    mount.strata("image", "import", str(mount.tmp / "a.img"), "boot:v1")
    mount.start()
    with open(mount.image("boot:v1"), "rb", buffering=0) as f:  # "boot": touch chunks 3 and 12
        os.pread(f.fileno(), 10, 3 * MiB)
        os.pread(f.fileno(), 10, 12 * MiB)
    r = json.loads(mount.strata("image", "record-prefetch", "boot:v1", "--mount", str(mount.mnt), "--json").stdout)
    assert r["chunks"] >= 2
    mount.stop()
    import shutil

    shutil.rmtree(mount.tmp / "cache")
    mount.start()
    assert mount.stats()["backend_fetches"] == 0
    f = open(mount.image("boot:v1"), "rb", buffering=0)  # opening starts the prefetch
    try:
        for _ in range(100):
            if mount.stats()["backend_fetches"] >= 2:
                break
            time.sleep(0.05)
        assert mount.stats()["backend_fetches"] >= 2
        assert mount.stats()["entries"] >= 2
        assert os.pread(f.fileno(), 10, 12 * MiB) == content[12 * MiB : 12 * MiB + 10]
    finally:
        f.close()
    mount.strata("cache", "drop", "--mount", str(mount.mnt))  # a drop: the next open prefetches the set again
    fetched = mount.stats()["backend_fetches"]
    with open(mount.image("boot:v1"), "rb", buffering=0):
        for _ in range(100):
            if mount.stats()["backend_fetches"] >= fetched + 2:
                break
            time.sleep(0.05)
        assert mount.stats()["backend_fetches"] >= fetched + 2


def test_cache_stats_without_a_daemon(mount: Mount) -> None:
    write_image(mount.tmp / "a.img", "rr")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "s:v1")
    mount.start()
    mount.image("s:v1").read_bytes()
    mount.stop()
    r = json.loads(mount.strata("cache", "stats", "--cache-dir", str(mount.tmp / "cache"), "--json").stdout)
    assert r["entries"] == 2 and r["size"] == 2 * MiB
    r = mount.strata("cache", "stats", "--cache-dir", str(mount.tmp / "nope"), check=False)
    assert r.returncode == 1 and "no chunk cache" in r.stderr


def test_snapshot_layers_are_served(mount: Mount) -> None:
    from layerstore.importer import import_image
    from layerstore.snapshot import Snapshot
    from layerstore.store import open_store

    contents = {}
    with open_store(str(mount.tmp / "store")) as store:
        ids = {}
        for i, role in enumerate(("disk", "memory", "state", "kernel", "initrd")):
            contents[role] = write_image(mount.tmp / f"{role}.img", "rz", seed=20 + i)
            ids[role] = import_image(store, mount.tmp / f"{role}.img").manifest_id
        snapshot_id = store.put_snapshot(Snapshot(
            layers={r: ids[r] for r in ("disk", "memory", "state")},
            vm={"backend": "qemu", "cmdline": "x", "cpus": 1, "memory_mib": 128, "kernel": ids["kernel"],
                "initrd": ids["initrd"]}))
    mount.start()
    d = mount.mnt / "snapshots" / snapshot_id
    assert sorted(os.listdir(d)) == ["disk.img", "memory", "state"]
    assert (d / "disk.img").read_bytes() == contents["disk"]
    assert (d / "memory").read_bytes() == contents["memory"]
    assert (d / "state").read_bytes() == contents["state"]
    assert snapshot_id in os.listdir(mount.mnt / "snapshots")
    assert not (mount.mnt / "snapshots" / ("ab" * 32)).exists()
    with pytest.raises(OSError):
        open(d / "state", "r+b")
    with open(d / "memory", "r+b", buffering=0) as f:  # a VMM maps it privately: opening rw is allowed...
        with pytest.raises(OSError) as e:
            f.write(b"x")  # ...but nothing is ever written to it
        assert e.value.errno == errno.EROFS


def test_the_daemon_serves_the_config_file_and_environment(tmp_path: Path) -> None:
    """`strata mount` hands the daemon the node's whole configuration: a
    remote named only in the config file is read through, and the cache cap
    comes from STRATA_CACHE_SIZE when no flag is given."""
    content = write_image(tmp_path / "a.img", "rprp")
    remote = {"STRATA_STORE": str(tmp_path / "remote")}
    assert run(["image", "import", str(tmp_path / "a.img"), "app:v1"], remote).returncode == 0
    config = tmp_path / "config.toml"
    config.write_text(f'store = "{tmp_path / "node"}"\nremote = "{tmp_path / "remote"}"\n'
                      f'state_dir = "{tmp_path / "state"}"\nrun_dir = "{tmp_path / "run"}"\n'
                      f'mount = "{tmp_path / "mnt"}"\n')
    node = {"STRATA_CONFIG": str(config)}
    r = run(["pull", "app:v1", "--json"], node)  # manifests only: the chunks stay in the remote
    assert r.returncode == 0 and json.loads(r.stdout)["chunks_sent"] == 0, r.stderr
    try:
        r = run(["mount", "--json"], {**node, "STRATA_CACHE_SIZE": "3M"})  # the configured mount point, made
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "mnt" / "images" / "app:v1" / "disk.img").read_bytes() == content
        stats = json.loads(run(["cache", "stats", "--json"], node).stdout)
        assert stats["capacity"] == 3 * MiB and stats["backend_fetches"] >= 1
    finally:
        run(["umount"], node)
        subprocess.run(["fusermount3", "-u", "-z", str(tmp_path / "mnt")], capture_output=True)


def test_a_failing_lookup_answers_eio_and_the_daemon_lives(mount: Mount) -> None:
    """A lookup the store cannot answer (here: a ref key that is a directory,
    so the backend fails with a BackendError, not NotFound) is EIO for that
    request only; the daemon keeps serving everything else."""
    content = write_image(mount.tmp / "a.img", "rp")
    mount.strata("image", "import", str(mount.tmp / "a.img"), "ok:v1")
    (mount.tmp / "store" / "objects" / "refs" / "crash" / "me").mkdir(parents=True)
    mount.start()
    with pytest.raises(OSError) as caught:
        os.stat(mount.mnt / "images" / "crash:me")
    assert caught.value.errno == errno.EIO
    assert mount.image("ok:v1").read_bytes() == content  # still serving
    assert mount.client.ping().pid == mount.pid
