"""fusefs/fs.py's StrataFS driven directly through its FUSE operations (no
kernel in between, so names the kernel would never send reach it too),
over a real Catalogue and local store: the tree's four directories; images,
layers and snapshots resolved on lookup from exact ids only (path tricks,
non-canonical refs and unknown ids are ENOENT and create no node);
read-only files refuse writes (EROFS) while a snapshot's memory may be
mapped privately; a sandbox disk reads and writes within its size (EFBIG
past it, EPERM to resize); an open sandbox is not removed; errors map to
errno, and an unforeseen one is EIO for that request alone
(`contained`). tests/test_fusefs_mount.py covers the same tree through a
real mount."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pyfuse3
import pytest
import trio

from fusefs.cache import ChunkCache
from fusefs.catalogue import Catalogue
from fusefs.fs import StrataFS
from layerstore.chunk import chunk_key
from layerstore.errors import Conflict, InvalidInput, NotFound
from layerstore.importer import import_image
from layerstore.snapshot import Snapshot
from layerstore.store import open_store
from tests.images import MiB, write_image


class World:
    """A store with image base:v1 (3 MiB) and a snapshot, a Catalogue, and the StrataFS over it."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "store"
        self.store = open_store(str(self.root))
        self.content = write_image(tmp_path / "a.img", "rzr", seed=4)
        self.manifest = import_image(self.store, tmp_path / "a.img", "base:v1").manifest_id
        ids = {}
        for i, role in enumerate(("memory", "state", "kernel", "initrd")):
            write_image(tmp_path / f"{role}.img", "r", seed=10 + i)
            ids[role] = import_image(self.store, tmp_path / f"{role}.img").manifest_id
        self.snapshot = self.store.put_snapshot(Snapshot(
            layers={"disk": self.manifest, "memory": ids["memory"], "state": ids["state"]},
            vm={"backend": "qemu", "cmdline": "", "cpus": 1, "memory_mib": 1, "kernel": ids["kernel"],
                "initrd": ids["initrd"]}))
        self.cat = Catalogue(self.store, ChunkCache(tmp_path / "cache", capacity=64 * MiB), tmp_path / "uppers")
        self.fs = StrataFS(self.cat)

    def close(self) -> None:
        self.fs.shutdown()
        self.cat.close()
        self.store.close()

    def call(self, operation: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return trio.run(operation, *args)

    def lookup(self, *names: str) -> pyfuse3.EntryAttributes:
        """The attributes of root/names[0]/names[1]/... looked up one name at a time."""
        attrs = self.call(self.fs.getattr, pyfuse3.ROOT_INODE, None)
        for name in names:
            attrs = self.call(self.fs.lookup, attrs.st_ino, name.encode(), None)
        return attrs

    def refused(self, operation: Callable[..., Awaitable[Any]], *args: Any) -> int:
        """The errno `operation` answers (it must refuse)."""
        with pytest.raises(pyfuse3.FUSEError) as caught:
            self.call(operation, *args)
        return caught.value.errno


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.close()


def test_the_tree_has_four_directories(world: World) -> None:
    root = world.lookup()
    assert root.st_mode & 0o170000 == 0o040000
    dirs = {name: world.lookup(name) for name in ("images", "layers", "snapshots", "sandboxes")}
    assert all(a.st_mode & 0o170000 == 0o040000 for a in dirs.values())
    assert [dirs[n].st_ino for n in dirs] == [world.fs.images.inode, world.fs.layers.inode,
                                              world.fs.snapshots.inode, world.fs.sandboxes.inode]
    assert world.lookup(".").st_ino == world.lookup("..").st_ino == pyfuse3.ROOT_INODE
    assert world.lookup("images", "..").st_ino == pyfuse3.ROOT_INODE
    assert world.refused(world.fs.lookup, pyfuse3.ROOT_INODE, b"nothing", None) == errno.ENOENT
    assert world.refused(world.fs.getattr, 999_999, None) == errno.ENOENT


def test_an_image_is_a_read_only_file_of_its_size(world: World) -> None:
    """images/base:v1/disk.img: mode 0444, the image's size, its bytes; opening it for writing is EROFS."""
    disk = world.lookup("images", "base:v1", "disk.img")
    assert (disk.st_mode & 0o777, disk.st_size) == (0o444, len(world.content))
    assert world.refused(world.fs.open, disk.st_ino, os.O_RDWR, None) == errno.EROFS
    assert world.refused(world.fs.open, disk.st_ino, os.O_RDONLY | os.O_TRUNC, None) == errno.EPERM
    fh = world.call(world.fs.open, disk.st_ino, os.O_RDONLY, None).fh
    assert world.call(world.fs.read, fh, 2 * MiB + 3, 4096) == world.content[2 * MiB + 3: 2 * MiB + 4099]
    assert world.refused(world.fs.write, fh, 0, b"x") == errno.EROFS
    world.call(world.fs.release, fh)
    assert world.refused(world.fs.read, fh, 0, 1) == errno.EBADF  # released
    assert world.fs.open_handles() == 0


@pytest.mark.parametrize("name", ["../../etc/passwd", "base:v1/../base:v1", "base", "base:v1 ", "./base:v1",
                                  "BASE:v1", "nope:v1", "base:v1\x00", ""])
def test_names_that_are_no_image_are_unknown_and_create_nothing(world: World, name: str) -> None:
    before = dict(world.fs.images.children), world.call(world.fs.statfs, None).f_files
    assert world.refused(world.fs.lookup, world.fs.images.inode, name.encode(), None) == errno.ENOENT
    assert (dict(world.fs.images.children), world.call(world.fs.statfs, None).f_files) == before


@pytest.mark.parametrize("directory", ["layers", "snapshots"])
def test_layers_and_snapshots_are_found_by_exact_id_only(world: World, directory: str) -> None:
    wanted = world.manifest if directory == "layers" else world.snapshot
    parent = world.lookup(directory).st_ino
    for name in ("../" + wanted, wanted.upper(), wanted[:-1], "0" * 64, "sha256:" + wanted, wanted + "/.."):
        assert world.refused(world.fs.lookup, parent, name.encode(), None) == errno.ENOENT
    assert world.lookup(directory, wanted, "disk.img").st_size == len(world.content)
    assert list(getattr(world.fs, directory).children) == [wanted]


def test_a_snapshots_memory_may_be_mapped_privately_but_not_written(world: World) -> None:
    """snapshots/<id>/{disk.img,memory,state}: all read-only; only memory
    opens O_RDWR (a VMM's private mapping), and a write through it is EROFS."""
    for name in ("disk.img", "memory", "state"):
        assert world.lookup("snapshots", world.snapshot, name).st_size > 0
    assert world.refused(world.fs.lookup, world.lookup("snapshots", world.snapshot).st_ino, b"kernel",
                         None) == errno.ENOENT
    disk = world.lookup("snapshots", world.snapshot, "disk.img")
    memory = world.lookup("snapshots", world.snapshot, "memory")
    assert memory.st_mode & 0o777 == 0o444
    assert world.refused(world.fs.open, disk.st_ino, os.O_RDWR, None) == errno.EROFS
    fh = world.call(world.fs.open, memory.st_ino, os.O_RDWR, None).fh
    assert world.refused(world.fs.write, fh, 0, b"x") == errno.EROFS
    world.call(world.fs.release, fh)


def test_a_sandbox_disk_reads_and_writes_within_its_size(world: World) -> None:
    world.fs.add_sandbox("sb1", world.cat.create_sandbox("sb1", image="base:v1"))
    disk = world.lookup("sandboxes", "sb1", "disk.img")
    assert (disk.st_mode & 0o777, disk.st_size) == (0o644, len(world.content))
    fh = world.call(world.fs.open, disk.st_ino, os.O_RDWR, None).fh
    assert world.call(world.fs.write, fh, MiB + 7, b"sandbox bytes") == 13
    assert world.call(world.fs.read, fh, MiB, 20) == bytes(7) + b"sandbox bytes"
    assert world.refused(world.fs.write, fh, len(world.content) - 2, b"past") == errno.EFBIG
    world.call(world.fs.flush, fh)
    world.call(world.fs.release, fh)
    assert world.lookup("images", "base:v1", "disk.img").st_size == len(world.content)
    image_fh = world.call(world.fs.open, world.lookup("images", "base:v1", "disk.img").st_ino, os.O_RDONLY, None).fh
    assert world.call(world.fs.read, image_fh, MiB, 20) == bytes(20)  # the image is untouched
    world.call(world.fs.release, image_fh)


def test_a_disk_cannot_be_resized_or_chmodded(world: World) -> None:
    world.fs.add_sandbox("sb1", world.cat.create_sandbox("sb1", image="base:v1"))
    disk = world.lookup("sandboxes", "sb1", "disk.img")
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 1
    for field in ("update_size", "update_mode", "update_uid", "update_gid"):
        # pyfuse3's SetattrFields is read-only outside a request: the same flags as plain attributes
        fields = SimpleNamespace(**{f: f == field for f in ("update_size", "update_mode", "update_uid",
                                                             "update_gid")})
        assert world.refused(world.fs.setattr, disk.st_ino, attr, fields, None, None) == errno.EPERM
    assert world.lookup("sandboxes", "sb1", "disk.img").st_size == len(world.content)


def test_an_open_sandbox_is_not_removed_and_ids_are_unique(world: World) -> None:
    """remove_sandbox while its disk is open is Conflict (it stays); a second
    add of the same id is InvalidInput; after the close it goes, and an unknown id is NotFound."""
    world.fs.add_sandbox("sb1", world.cat.create_sandbox("sb1", image="base:v1"))
    with pytest.raises(InvalidInput, match="already mounted"):
        world.fs.add_sandbox("sb1", world.cat.create_sandbox("sb2", image="base:v1"))
    fh = world.call(world.fs.open, world.lookup("sandboxes", "sb1", "disk.img").st_ino, os.O_RDONLY, None).fh
    with pytest.raises(Conflict, match="sandbox sb1 is open"):
        world.fs.remove_sandbox("sb1")
    assert world.lookup("sandboxes", "sb1", "disk.img").st_size == len(world.content)
    world.call(world.fs.release, fh)
    world.fs.remove_sandbox("sb1")
    assert world.refused(world.fs.lookup, world.fs.sandboxes.inode, b"sb1", None) == errno.ENOENT
    with pytest.raises(NotFound):
        world.fs.remove_sandbox("sb1")


def test_file_operations_that_would_change_the_tree_are_refused(world: World) -> None:
    """The tree changes through the control socket only."""
    fs, images, sandboxes = world.fs, world.fs.images.inode, world.fs.sandboxes.inode
    assert world.refused(fs.create, images, b"new", 0o644, os.O_CREAT, None) == errno.EROFS
    assert world.refused(fs.create, sandboxes, b"new", 0o644, os.O_CREAT, None) == errno.EPERM
    assert world.refused(fs.mkdir, sandboxes, b"x", 0o755, None) == errno.EPERM
    world.lookup("images", "base:v1")
    for operation in (fs.unlink, fs.rmdir):
        assert world.refused(operation, images, b"base:v1", None) == errno.EPERM
    assert world.refused(fs.rename, images, b"base:v1", images, b"other:v1", 0, None) == errno.EPERM
    assert world.refused(fs.opendir, world.lookup("images", "base:v1", "disk.img").st_ino, None) == errno.ENOTDIR
    assert world.refused(fs.open, images, os.O_RDONLY, None) == errno.EISDIR
    assert sorted(world.fs.images.children) == ["base:v1"]


def test_a_corrupt_chunk_is_eio_for_its_read_only(world: World) -> None:
    """Chunk 2's object replaced by garbage: a read of it is EIO; chunk 0 still reads."""
    digest = world.store.get_layer(world.manifest).chunks[2]
    (world.root / "objects" / chunk_key(digest)).write_bytes(b"not a zstd frame")
    fh = world.call(world.fs.open, world.lookup("images", "base:v1", "disk.img").st_ino, os.O_RDONLY, None).fh
    assert world.refused(world.fs.read, fh, 2 * MiB, 4096) == errno.EIO
    assert world.call(world.fs.read, fh, 0, 4096) == world.content[:4096]
    world.call(world.fs.release, fh)


def test_an_unforeseen_failure_is_eio_for_that_request_alone(world: World, caplog: pytest.LogCaptureFixture) -> None:
    """A ref key that is a directory makes the backend fail with an error
    lookup does not expect: EIO, logged with the operation and path; the
    next request is answered."""
    (world.root / "objects" / "refs" / "crash" / "me").mkdir(parents=True)
    with caplog.at_level(logging.ERROR, logger="strata.fusefs"):
        assert world.refused(world.fs.lookup, world.fs.images.inode, b"crash:me", None) == errno.EIO
    assert "lookup /images/crash:me failed; answering EIO" in caplog.text
    assert world.lookup("images", "base:v1", "disk.img").st_size == len(world.content)


def test_statfs_counts_the_tree_and_the_cache(world: World) -> None:
    world.lookup("images", "base:v1")
    stats = world.call(world.fs.statfs, None)
    assert stats.f_files == 7  # root, four directories, base:v1, its disk
    assert stats.f_blocks == 64 * MiB // 4096 and stats.f_bfree <= stats.f_blocks
