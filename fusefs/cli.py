"""CLI commands of the FUSE layer: mount, umount, cache, disk, image record-prefetch.

Every command finds the node's mount the same way: `--mount` (or the
positional MOUNTPOINT of `mount`/`umount`), else the configured `mount`
(STRATA_MOUNT, default STATE_DIR/mnt).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from layerstore.clikit import StoreContext, human_bytes, parse_size
from layerstore.errors import InvalidInput

if TYPE_CHECKING:
    from .client import MountClient


class MountContext(StoreContext, Protocol):
    """What the FUSE commands use of the entry point's context."""

    def mount_client(self, mountpoint: Path | None = None) -> MountClient:
        """The client of the daemon serving `mountpoint` (default: the node's mount)."""


def mount_option() -> argparse.ArgumentParser:
    """`--mount`, the same on every command that talks to the node's mount."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--mount", metavar="DIR", help="the node's mount point (env STRATA_MOUNT; default "
                                                       "$STRATA_STATE_DIR/mnt)")
    return parser


def cmd_mount(args: argparse.Namespace, ctx: MountContext) -> int:
    from .control import MountSettings, make_mountpoint

    settings = MountSettings.from_config(ctx.config, upper_dir=Path(args.upper_dir) if args.upper_dir else None)
    if args.mount is None:  # the node's own mount point is made on first use; a named one must exist
        make_mountpoint(settings.mountpoint)
    if args.foreground:
        from layerstore.logs import configure

        from .daemon import serve

        configure()
        serve(settings, lambda: print(f"serving {settings.mountpoint}; Ctrl-C or `strata umount` to stop", flush=True))
        return 0
    from .client import mount

    info = mount(settings)
    ctx.out.result(info, f"mounted {info['store']} at {info['mountpoint']} (daemon pid {info['pid']}, log "
                         f"{info['log']}, cache {settings.cache_dir} capped at {human_bytes(settings.cache_size)})")
    return 0


def cmd_umount(args: argparse.Namespace, ctx: MountContext) -> int:
    from .client import umount

    info = umount(ctx.config.mount, run_dir=ctx.config.run_dir)
    ctx.out.result(info, f"unmounted {info['mountpoint']}")
    return 0


def cmd_cache_stats(args: argparse.Namespace, ctx: MountContext) -> int:
    """Live counters from the node's mount when one serves (unless --cache-dir
    names a cache to read directly), else the configured cache directory."""
    stats = None if args.cache_dir else _live_stats(ctx, required=args.mount is not None)
    if stats is None:
        stats = _cache_dir_stats(Path(args.cache_dir or ctx.config.cache_dir))

    def text() -> str:
        lines = [f"{k:<16} {human_bytes(v) if k in ('size', 'capacity', 'bytes_fetched', 'bytes_evicted') else v}"
                 for k, v in stats.items()]
        hits = stats.get("hits", 0) + stats.get("memory_hits", 0)
        total = hits + stats.get("misses", 0)
        if total:
            lines.append(f"{'hit ratio':<16} {hits / total:.1%}")
        return "\n".join(lines)

    ctx.out.result(stats, text)
    return 0


def _live_stats(ctx: MountContext, *, required: bool) -> dict[str, Any] | None:
    """The daemon's counters; None when no daemon answers and none was asked for by name."""
    from .protocol import DaemonError

    try:
        reply = ctx.mount_client().stats()
    except DaemonError:
        if required:
            raise
        return None
    return reply.counters()


def _cache_dir_stats(cache_dir: Path) -> dict[str, Any]:
    from .cache import ChunkCache

    if not (cache_dir / "index").exists():
        raise InvalidInput(f"no chunk cache at {cache_dir} and no mount serving: pass --mount or --cache-dir")
    cache = ChunkCache(cache_dir, capacity=1 << 62)
    try:
        stats = cache.snapshot_stats()
    finally:
        cache.close()
    stats.pop("capacity")
    return stats


def cmd_cache_drop(args: argparse.Namespace, ctx: MountContext) -> int:
    reply = ctx.mount_client().cache_drop()
    ctx.out.result(asdict(reply), f"dropped {human_bytes(reply.freed)} of unpinned chunks")
    return 0


def cmd_disk_new(args: argparse.Namespace, ctx: MountContext) -> int:
    reply = ctx.mount_client().create_disk(args.sid, image=None if args.manifest else args.image,
                                           manifest=args.manifest or None)
    ctx.out.result(asdict(reply), f"sandbox disk {reply.path} ({human_bytes(reply.size)}) over {reply.base[:16]}")
    return 0


def cmd_disk_ls(args: argparse.Namespace, ctx: MountContext) -> int:
    rows = [asdict(d) for d in ctx.mount_client().list_disks()]

    def text() -> str:
        if not rows:
            return "no sandbox disks"
        return "\n".join(f"{r['sid']:<24} {human_bytes(r['size']):>10}  dirty {r['dirty_chunks']:>6}  "
                         f"base {r['base'][:16]}  layers {len(r['layers'])}" for r in rows)

    ctx.out.result(rows, text)
    return 0


def cmd_disk_rm(args: argparse.Namespace, ctx: MountContext) -> int:
    reply = ctx.mount_client().remove_disk(args.sid)
    ctx.out.result(asdict(reply), f"removed sandbox disk {args.sid}")
    return 0


def cmd_disk_seal(args: argparse.Namespace, ctx: MountContext) -> int:
    reply = ctx.mount_client().seal(args.sid, wait=args.wait)
    text = f"sealed {reply.dirty_chunks} dirty chunks of {args.sid} in {reply.switch_ms:.1f} ms"
    text += f"; layer {reply.manifest}" if reply.manifest else "; publishing in the background"
    ctx.out.result(asdict(reply), text)
    return 0


def cmd_record_prefetch(args: argparse.Namespace, ctx: MountContext) -> int:
    reply = ctx.mount_client().record_prefetch(args.ref)
    ctx.out.result(asdict(reply), f"recorded {reply.chunks} chunks as the prefetch list of {reply.image}")
    return 0


def register(nouns: Any, verbs: dict[str, Any], common: argparse.ArgumentParser) -> None:
    """Add this package's commands to the `strata` parser (`verbs`: the store's nouns, to extend `image`)."""
    mount = mount_option()
    p = nouns.add_parser("mount", parents=[common], help="serve images and sandbox disks through FUSE")
    p.add_argument("mount", nargs="?", metavar="MOUNTPOINT", help="default: the configured mount (STRATA_MOUNT)")
    p.add_argument("--cache-dir", help="chunk cache directory (env STRATA_CACHE_DIR; default $STRATA_STATE_DIR/cache)")
    p.add_argument("--cache-size", type=parse_size, help="hard cap of the chunk cache (env STRATA_CACHE_SIZE; "
                                                         "default 10G)")
    p.add_argument("--upper-dir", help="where sandbox upper layers live (default $STRATA_STATE_DIR/uppers)")
    p.add_argument("--foreground", action="store_true", help="stay attached instead of starting a daemon")
    p.set_defaults(func=cmd_mount)
    p = nouns.add_parser("umount", parents=[common], help="unmount a Strata mount cleanly")
    p.add_argument("mount", nargs="?", metavar="MOUNTPOINT", help="default: the configured mount (STRATA_MOUNT)")
    p.set_defaults(func=cmd_umount)
    _cache_verbs(nouns, common, mount)
    _disk_verbs(nouns, common, mount)
    p = verbs["image"].add_parser("record-prefetch", parents=[common, mount],
                                  help="save the chunks read so far as the image's prefetch list")
    p.add_argument("ref", metavar="NAME:TAG")
    p.set_defaults(func=cmd_record_prefetch)


def _cache_verbs(nouns: Any, common: argparse.ArgumentParser, mount: argparse.ArgumentParser) -> None:
    cache = nouns.add_parser("cache", help="chunk cache statistics and control")
    verbs = cache.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = verbs.add_parser("stats", parents=[common, mount], help="hits, misses, bytes fetched, evictions, size "
                                                                "(live from the mount when one serves)")
    p.add_argument("--cache-dir", help="read this cache directory directly instead of asking the mount")
    p.set_defaults(func=cmd_cache_stats)
    p = verbs.add_parser("drop", parents=[common, mount],
                         help="evict every unpinned chunk (and the kernel's copy of image and snapshot files)")
    p.set_defaults(func=cmd_cache_drop)


def _disk_verbs(nouns: Any, common: argparse.ArgumentParser, mount: argparse.ArgumentParser) -> None:
    disk = nouns.add_parser("disk", help="sandbox disks: writable upper layers over images")
    verbs = disk.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = verbs.add_parser("new", parents=[common, mount], help="create a sandbox disk over an image")
    p.add_argument("sid", metavar="SID")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image", metavar="NAME:TAG")
    src.add_argument("--manifest", metavar="ID")
    p.set_defaults(func=cmd_disk_new)
    p = verbs.add_parser("ls", parents=[common, mount], help="list sandbox disks")
    p.set_defaults(func=cmd_disk_ls)
    p = verbs.add_parser("rm", parents=[common, mount], help="delete a sandbox disk and its upper layer")
    p.add_argument("sid", metavar="SID")
    p.set_defaults(func=cmd_disk_rm)
    p = verbs.add_parser("seal", parents=[common, mount],
                         help="freeze the upper layer as a new read-only layer (incremental snapshot)")
    p.add_argument("sid", metavar="SID")
    p.add_argument("--wait", action="store_true", help="wait until the layer is published and print its id")
    p.set_defaults(func=cmd_disk_seal)
