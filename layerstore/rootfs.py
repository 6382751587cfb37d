"""An image's layers applied into a directory, then made into an ext4 disk.

    layer tars, in order  ->  staging tree (BUILD/root)  ->  mkfs.ext4 -d  ->  BUILD/rootfs.ext4

Each layer is a tar (plain, gzip or zstd) applied the way OCI says: an
entry `.wh.NAME` deletes NAME from the layers below, `.wh..wh..opq` empties
its directory first, everything else is created or replaced with its mode,
owner, mtime and xattrs; symlinks are created as they are, hard links point
inside the tree, device nodes are made (as root).

The tree is hostile input. Entry paths are resolved inside the root, the
way a container runtime does: `..` stops at the root and a symlink met on
the way (`lib -> /usr/lib`, or `x -> /etc`) is followed *within* the root,
never on the host, so nothing is ever written outside BUILD/root. Bytes
unpacked and entries are counted against limits (a tar bomb is an error
naming its layer). Any error leaves the build directory to the caller to
remove; nothing is published before the disk is whole.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zstandard

from .errors import CorruptObject, InvalidInput, StrataError
from .importer import ImportResult, import_image
from .oci import Blob, Hashing, Image, open_image
from .store import Store

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_SYMLINKS = 40  # as the kernel's ELOOP limit
DEFAULT_MAX_BYTES = 64 << 30
DEFAULT_MAX_ENTRIES = 4_000_000


@dataclass
class Limits:
    max_bytes: int = DEFAULT_MAX_BYTES  # file bytes unpacked over all layers
    max_entries: int = DEFAULT_MAX_ENTRIES
    unpacked: int = 0
    entries: int = 0


def apply_layers(image: Image, root: Path, *, limits: Limits | None = None) -> Limits:
    """Unpack every layer of `image` into `root` (an empty directory), in order, each verified."""
    limits = limits or Limits()
    root.mkdir(parents=True, exist_ok=True)
    for blob in image.layers:
        with image.source.open(blob.path) as raw:
            hashing = Hashing(raw)
            try:
                with _TarStream(hashing, blob) as tar:
                    for member in tar:
                        _apply(tar, member, root, blob, limits)
                hashing.drain()  # a digest covers the whole blob, tar padding included
            except (tarfile.TarError, EOFError, zstandard.ZstdError) as exc:
                raise CorruptObject(f"{blob.name}: cannot be unpacked ({exc}); corrupt or truncated") from None
            hashing.check(blob)
    return limits


class _TarStream:
    """The layer as a streamed tar, whatever its compression."""

    def __init__(self, hashing: Hashing, blob: Blob) -> None:
        self.hashing = hashing
        self.blob = blob
        self.tar: tarfile.TarFile | None = None

    def __enter__(self) -> tarfile.TarFile:
        stream: IO[bytes] = self.hashing  # type: ignore[assignment]
        mode = "r|*"
        if "zstd" in self.blob.media_type:
            stream = zstandard.ZstdDecompressor().stream_reader(self.hashing, closefd=False)  # type: ignore[arg-type]
            mode = "r|"
        self.tar = tarfile.open(fileobj=stream, mode=mode)  # type: ignore[call-overload]
        return self.tar

    def __exit__(self, *exc: object) -> None:
        if self.tar is not None:
            self.tar.close()


def _apply(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path, blob: Blob, limits: Limits) -> None:
    limits.entries += 1
    if limits.entries > limits.max_entries:
        raise InvalidInput(f"{blob.name}: more than {limits.max_entries} entries (a tar bomb?)")
    name = _clean(member.name, blob)
    if not name:
        return  # the root itself
    parent_rel, _, base = name.rpartition("/")
    parent = _resolve(root, parent_rel, blob, create=True)
    if base == OPAQUE:
        for child in list(parent.iterdir()):
            _remove(child)
        return
    if base.startswith(WHITEOUT):
        _remove(parent / base[len(WHITEOUT):])
        return
    target = parent / base
    if member.isdir():
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            _remove(target)
        target.mkdir(exist_ok=True)
    else:
        _remove(target)
        _create(tar, member, target, root, blob, limits)
        if member.islnk():
            return  # a hard link shares its target's inode: its own mode and owner would overwrite them
    _attributes(member, target)


def _create(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path, root: Path, blob: Blob,
            limits: Limits) -> None:
    if member.isreg():
        limits.unpacked += member.size
        if limits.unpacked > limits.max_bytes:
            raise InvalidInput(f"{blob.name}: unpacks to more than {limits.max_bytes} bytes (a tar bomb?)")
        source = tar.extractfile(member)
        assert source is not None
        with source, open(target, "xb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    elif member.issym():
        os.symlink(member.linkname, target)  # stored as is; only ever followed inside the root (_resolve)
    elif member.islnk():
        linked = _resolve(root, _clean(member.linkname, blob), blob, create=False)
        if not linked.is_file() or linked.is_symlink():
            raise CorruptObject(f"{blob.name}: hard link {member.name} -> {member.linkname}: no such file in the image")
        os.link(linked, target)
    elif member.ischr() or member.isblk():
        kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
        os.mknod(target, kind | (member.mode & 0o7777), os.makedev(member.devmajor, member.devminor))
    elif member.isfifo():
        os.mkfifo(target, member.mode & 0o7777)
    else:
        raise CorruptObject(f"{blob.name}: {member.name}: unsupported tar entry type {member.type!r}")


def _attributes(member: tarfile.TarInfo, target: Path) -> None:
    if os.geteuid() == 0:
        os.lchown(target, member.uid, member.gid)
    if not member.issym():
        os.chmod(target, member.mode & 0o7777)
    for key, value in (member.pax_headers or {}).items():
        if key.startswith("SCHILY.xattr."):
            try:
                os.setxattr(target, key[len("SCHILY.xattr."):], value.encode("utf-8", "surrogateescape"),
                            follow_symlinks=False)
            except OSError:
                pass  # a namespace this host or ext4 does not take: the file itself still lands
    os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)


def _clean(name: str, blob: Blob) -> str:
    """A tar path relative to the root: leading '/' and './' dropped, NUL refused."""
    if "\0" in name:
        raise CorruptObject(f"{blob.name}: an entry name holds a NUL byte")
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def _resolve(root: Path, rel: str, blob: Blob, *, create: bool) -> Path:
    """`rel` under `root`, every symlink on the way followed inside the root
    ('..' stops at the root). With `create`, missing directories are made."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    current: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if current:
                current.pop()
            continue
        path = root.joinpath(*current, part)
        if path.is_symlink():
            hops += 1
            if hops > MAX_SYMLINKS:
                raise CorruptObject(f"{blob.name}: {rel}: too many levels of symbolic links")
            link = os.readlink(path)
            if link.startswith("/"):
                current = []
            parts = [p for p in link.split("/") if p not in ("", ".")] + parts
            continue
        if not path.exists():
            if not create:
                return path
            path.mkdir(mode=0o755)
        elif parts and not path.is_dir():
            raise CorruptObject(f"{blob.name}: {rel}: {'/'.join(current + [part])} is not a directory")
        current.append(part)
    return root.joinpath(*current)


def _remove(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def make_ext4(root: Path, out: Path, *, size: int | None = None, label: str = "rootfs") -> int:
    """An ext4 image of the tree at `root` (owners, modes, links, devices,
    xattrs kept by `mkfs.ext4 -d`); sized to the content plus room to grow
    unless `size` says. Returns its size in bytes."""
    used = _tree_bytes(root)
    size = size or _round_up(used + used // 4 + (64 << 20), 1 << 20)
    if size < used:
        raise InvalidInput(f"disk size {size} is smaller than the image's {used} bytes of files")
    with open(out, "wb") as f:
        f.truncate(size)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-L", label, "-E", "root_owner=0:0", "-d", str(root), str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise StrataError(f"mkfs.ext4 failed: {r.stderr.strip() or r.stdout.strip()}")
    return size


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            st = os.lstat(os.path.join(dirpath, name))
            total += max(st.st_blocks * 512, 4096)
    return total


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def import_oci(store: Store, path: Path, ref: str, *, build_root: Path, size: int | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES, **import_options: Any) -> ImportResult:
    """Import an OCI layout/archive or `docker save` archive as the ext4
    disk image `ref`: layers applied into a private build directory under
    `build_root`, which is removed afterwards whatever happens. The image
    config's Env, WorkingDir, User, Entrypoint and Cmd ride along as the
    layer's `oci.config` annotation. `import_options` go to `import_image`."""
    image = open_image(path)
    build_root.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="oci-", dir=build_root))
    try:
        os.chmod(build, 0o700)  # device nodes and setuid files live here until mkfs
        apply_layers(image, build / "root", limits=Limits(max_bytes=max_bytes))
        make_ext4(build / "root", build / "rootfs.ext4", size=size)
        notes = {"source": path.name, "format": "oci", **image.runtime()}
        return import_image(store, build / "rootfs.ext4", ref, annotations=notes, **import_options)
    finally:
        image.source.close()
        shutil.rmtree(build, ignore_errors=True)
