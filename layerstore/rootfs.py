"""An image's layers applied into a directory, then made into an ext4 disk.

    layer tars, in order  ->  staging tree (BUILD/root)  ->  mkfs.ext4 -d  ->  BUILD/rootfs.ext4

or, when the store already has the disk of a prefix of the image's layers
(an earlier version of the image: same first layers), on top of that disk:

    strata-oci:<chain of layers 1..k>  ->  export, resize2fs  ->  fuse2fs mount
        ->  layers k+1..n applied into it  ->  BUILD/rootfs.ext4

so the new disk keeps the old one's blocks where they were and shares its
chunks (mkfs.ext4 -d lays a whole tree out afresh: one added file then
changed nearly every chunk). Every imported image's full chain is tagged
`strata-oci:<chain id>` for the versions after it, the tag owned by
`STORE_OWNER` and the disk's manifest annotated with the whole chain id
(`oci.chain`). A disk is built on only when both say so: a chain ref that
any other writer made (a team's API upload from before names were reserved,
a bare key, an admin's PUT, a copy from another store) is ignored, since
every later version of the image would carry its writer's files. The
import is then built from the layers alone, and tags the chain afresh.

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

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zstandard

from .errors import CorruptObject, InvalidInput, NotFound, StrataError
from .exporter import export_image
from .importer import ImportResult, import_image
from .oci import Blob, Hashing, Image, open_image
from .refs import STORE_OWNER
from .store import Store
from .tarsafe import HostileTar, TarRefused

log = logging.getLogger("strata.rootfs")

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_SYMLINKS = 40  # as the kernel's ELOOP limit
DEFAULT_MAX_BYTES = 64 << 30
DEFAULT_MAX_ENTRIES = 4_000_000
CHAIN_REF = "strata-oci"  # refs NAME of the disks of layer chains, tagged by chain id
CHAIN_TAG = 32  # hex digits of a chain id kept in its tag
CHAIN_NOTE = "oci.chain"  # annotation: the whole chain id of the layers a disk holds


@dataclass
class Limits:
    max_bytes: int = DEFAULT_MAX_BYTES  # file bytes unpacked over all layers
    max_entries: int = DEFAULT_MAX_ENTRIES
    unpacked: int = 0
    entries: int = 0


def apply_layers(image: Image, root: Path, *, limits: Limits | None = None, skip: int = 0) -> Limits:
    """Unpack the layers of `image` past the first `skip` into `root`, in
    order, each verified."""
    limits = limits or Limits()
    root.mkdir(parents=True, exist_ok=True)
    for blob in image.layers[skip:]:
        with image.source.open(blob.path) as raw:
            hashing = Hashing(raw)
            try:
                with _TarStream(hashing, blob) as tar:
                    for member in tar:
                        _apply(tar, member, root, blob, limits)
                hashing.drain()  # a digest covers the whole blob, tar padding included
            except TarRefused as exc:
                raise InvalidInput(f"{blob.name}: refused: {exc}") from None
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
        self.tar = HostileTar.open(fileobj=stream, mode=mode)  # type: ignore[call-overload]
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
    if base == ".." or (base.startswith(WHITEOUT) and base[len(WHITEOUT):] in ("", ".", "..")):
        raise CorruptObject(f"{blob.name}: entry {name[:200]!r} names no file of its directory")  # but it, or above
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


def full_chain_ids(image: Image) -> list[str]:
    """For each k, an id of layers 1..k (their digests in order), as OCI's
    ChainID, all 64 hex digits; empty past the first layer whose container
    names no digest."""
    return chains_of([blob.digest for blob in image.layers])


def chains_of(digests: list[str]) -> list[str]:
    """`full_chain_ids` from the layers' digests alone (a registry's manifest
    names them before any layer is fetched)."""
    out, h = [], hashlib.sha256()
    for digest in digests:
        if not digest:
            break
        h.update(digest.encode() + b"\n")
        out.append(h.copy().hexdigest())
    return out


def chain_ids(image: Image) -> list[str]:
    """The chain ids as their tags keep them (`CHAIN_TAG` hex digits)."""
    return [chain[:CHAIN_TAG] for chain in full_chain_ids(image)]


def chain_ref(chain_id: str) -> str:
    """The ref tagging the disk of a chain (a whole id or its tag)."""
    return f"{CHAIN_REF}:{chain_id[:CHAIN_TAG]}"


def trusted_chain(store: Store, chain: str) -> str | None:
    """The manifest of the disk of `chain` (a whole chain id) if the store
    itself tagged it: its ref owned by `STORE_OWNER` (no team's name can be
    that) and its manifest recording this very chain. Else None, and a
    warning when a ref is there: a ref anyone else wrote names a disk of
    their choosing, which an import built on it would pass to every later
    version of the image."""
    ref = chain_ref(chain)
    try:
        manifest_id, owner = store.ref_entry(ref)
        noted = store.get_layer(manifest_id).annotations.get(CHAIN_NOTE) if owner == STORE_OWNER else None
    except NotFound:
        return None
    except CorruptObject as exc:
        log.warning("%s: not built on: %s", ref, exc)
        return None
    if noted != chain:
        why = f"owner {owner!r}, not the store" if owner != STORE_OWNER else "its disk is of another chain"
        log.warning("%s: not built on: the store did not tag it (%s); building from the layers", ref, why)
        return None
    return manifest_id


def _trusted_prefix(store: Store, chains: list[str]) -> tuple[int, str]:
    """(k, manifest id) of the longest prefix of layers 1..k whose disk the
    store itself tagged ((0, ""): none)."""
    for k in range(len(chains), 0, -1):
        manifest_id = trusted_chain(store, chains[k - 1])
        if manifest_id is not None:
            return k, manifest_id
    return 0, ""


def known_layers(store: Store, digests: list[str]) -> int:
    """How many of the first layers (by digest, in order) an import would
    take from a disk the store itself tagged rather than read: their blobs
    need not be fetched (`import_oci`'s `absent`)."""
    return _trusted_prefix(store, chains_of(digests))[0]


def _reuse(store: Store, chains: list[str], disk: Path) -> int:
    """Export to `disk` the disk of the longest known prefix of the layers;
    how many layers it holds (0: none, nothing written). The export resolves
    the ref again, so what it exported is checked to be what was trusted."""
    known, manifest_id = _trusted_prefix(store, chains)
    if not known:
        return 0
    exported = export_image(store, chain_ref(chains[known - 1]), disk)
    if exported.manifest_id != manifest_id:
        log.warning("%s moved while it was exported: building from the layers", chain_ref(chains[known - 1]))
        disk.unlink(missing_ok=True)
        return 0
    return known


def import_oci(store: Store, path: Path, ref: str | None, *, build_root: Path, size: int | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES, absent: int = 0, source: str | None = None,
               **import_options: Any) -> ImportResult:
    """Import an OCI layout/archive or `docker save` archive as the ext4
    disk image `ref`: layers applied into a private build directory under
    `build_root`, which is removed afterwards whatever happens; on the disk
    of the longest prefix of its layers the store itself tagged, if any
    (module docstring). The image config's Env, WorkingDir, User, Entrypoint
    and Cmd ride along as the layer's `oci.config` annotation, the whole
    chain id as `oci.chain`, `source` (default: the file's name) as
    `source`. The blobs of the first `absent` layers may be missing (a
    registry pull fetched only what the store lacks, `known_layers`): the
    import then fails, naming why, unless it builds on a disk holding at
    least those layers. `import_options` go to `import_image`."""
    image = open_image(path)
    build_root.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="oci-", dir=build_root))
    chains = full_chain_ids(image)
    whole = bool(chains) and len(chains) == len(image.layers)  # every layer has a digest: the disk can be tagged
    try:
        os.chmod(build, 0o700)  # device nodes and setuid files live here until mkfs
        disk = build / "rootfs.ext4"
        _build_disk(store, image, chains, build, disk, Limits(max_bytes=max_bytes), size, absent=absent)
        notes = {"source": source or path.name, "format": "oci", **image.runtime()}
        if whole:
            notes[CHAIN_NOTE] = chains[-1]
        result = import_image(store, disk, ref, annotations=notes, **import_options)
        if whole:
            store.set_ref(chain_ref(chains[-1]), result.manifest_id, owner=STORE_OWNER)
        return result
    finally:
        image.source.close()
        shutil.rmtree(build, ignore_errors=True)


def _build_disk(store: Store, image: Image, chains: list[str], build: Path, disk: Path, limits: Limits,
                size: int | None, *, absent: int = 0) -> None:
    """The ext4 disk of all the image's layers, on the longest trusted prefix's disk if any."""
    try:
        known = _reuse(store, chains, disk) if size is None else 0
        if known < absent:
            raise StrataError(f"the store's disk of the image's first {absent} layers (their blobs were not "
                              "fetched) is gone or no longer the store's own: run the pull again")
        if known:
            more = _layers_bytes(image, known)
            if _free_bytes(disk) < more + more // 4 + (16 << 20):  # growing moves metadata: only when needed
                _grow(disk, more)
            if known < len(image.layers):  # (a mount alone rewrites the superblock)
                with _mounted(disk, build / "mnt") as root:
                    apply_layers(image, root, limits=limits, skip=known)
        else:
            apply_layers(image, build / "root", limits=limits)
            make_ext4(build / "root", disk, size=size)
    except OSError as exc:
        raise StrataError(f"building the disk in {build.parent} failed: {exc.strerror or exc} (it needs room "
                          "for the unpacked layers and the disk made of them)") from None


def _layers_bytes(image: Image, skip: int) -> int:
    """Bytes the layers past `skip` unpack to (a pass over their tar headers)."""
    total = 0
    for blob in image.layers[skip:]:
        with image.source.open(blob.path) as raw, _TarStream(Hashing(raw), blob) as tar:
            total += sum(max(m.size, 4096) for m in tar)
    return total


def _free_bytes(disk: Path) -> int:
    """Free space in an ext4 image, from its superblock."""
    r = subprocess.run(["dumpe2fs", "-h", str(disk)], capture_output=True, text=True)
    fields = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    try:
        return int(fields["Free blocks"]) * int(fields["Block size"])
    except (KeyError, ValueError):
        return 0


def _grow(disk: Path, more: int) -> None:
    """Give an ext4 image room for `more` bytes of files (plus a quarter and 64 MiB)."""
    size = _round_up(disk.stat().st_size + more + more // 4 + (64 << 20), 1 << 20)
    r = subprocess.run(["resize2fs", "-f", str(disk), f"{size // 1024}K"], capture_output=True, text=True)
    if r.returncode != 0:
        raise StrataError(f"resize2fs failed: {r.stderr.strip() or r.stdout.strip()}")


@contextmanager
def _mounted(disk: Path, mnt: Path) -> Iterator[Path]:
    """The ext4 image mounted read-write with fuse2fs (no kernel mount, no
    loop device), unmounted and flushed to the file on the way out."""
    if shutil.which("fuse2fs") is None:
        raise StrataError("fuse2fs is needed to build on an earlier version's disk (apt-get install fuse2fs)")
    mnt.mkdir()
    proc = subprocess.Popen(["fuse2fs", "-f", "-o", "rw", str(disk), str(mnt)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise StrataError(f"fuse2fs could not mount {disk.name}: {(proc.stderr.read() if proc.stderr else '')[-300:]}")
            time.sleep(0.02)
        yield mnt
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        try:
            proc.wait(timeout=120)  # fuse2fs writes the image out as it exits
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise StrataError("fuse2fs did not finish writing the disk") from None
    if proc.returncode != 0:
        raise StrataError(f"fuse2fs failed: {(proc.stderr.read() if proc.stderr else '')[-300:]}")
