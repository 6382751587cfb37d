"""CLI commands of the FUSE layer: mount, umount, cache, disk, image record-prefetch.

Every command finds the node's mount the same way: `--mount` (or the
positional MOUNTPOINT of `mount`/`umount`), else the configured `mount`
(STRATA_MOUNT, default STATE_DIR/mnt).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from layerstore.cli import StoreContext, human_bytes, parse_size
from layerstore.errors import InvalidInput


def mount_option() -> argparse.ArgumentParser:
    """`--mount`, the same on every command that talks to the node's mount."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--mount", metavar="DIR", help="the node's mount point (env STRATA_MOUNT; default "
                                                       "$STRATA_STATE_DIR/mnt)")
    return parser


def cmd_mount(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import mount

    store = getattr(args, "store", None) or env.get("STRATA_STORE", "")
    if not store:
        raise InvalidInput("no store given: pass --store PATH|s3://BUCKET/PREFIX or set STRATA_STORE")
    cache_dir = args.cache_dir or env.get("STRATA_CACHE_DIR") or _default_cache_dir(env)
    if args.foreground:
        from .daemon import serve

        ns = argparse.Namespace(mountpoint=args.mountpoint, store=store, cache_dir=cache_dir,
                                cache_size=args.cache_size, upper_dir=args.upper_dir)
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        serve(ns, lambda: print(f"serving {args.mountpoint}; Ctrl-C or `strata umount` to stop", flush=True))
        return 0
    info = mount(args.mountpoint, store=store, cache_dir=cache_dir, cache_size=args.cache_size,
                 upper_dir=args.upper_dir)
    out.result(info, f"mounted {info['store']} at {info['mountpoint']} (daemon pid {info['pid']}, log {info['log']}, "
                     f"cache {cache_dir} capped at {human_bytes(args.cache_size)})")
    return 0


def cmd_umount(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import umount

    info = umount(args.mountpoint)
    out.result(info, f"unmounted {info['mountpoint']}")
    return 0


def cmd_cache_stats(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import call

    if args.mount:
        reply = call(args.mount, {"op": "stats"})
        stats: dict[str, Any] = {**reply["cache"], "memory_hits": reply["memory_hits"],
                                 "backend_fetches": reply["fetches"]}
    else:
        from .cache import ChunkCache

        cache_dir = Path(args.cache_dir or env.get("STRATA_CACHE_DIR") or _default_cache_dir(env))
        if not (cache_dir / "index").exists():
            raise InvalidInput(f"no chunk cache at {cache_dir}")
        cache = ChunkCache(cache_dir, capacity=1 << 62)
        stats = cache.snapshot_stats()
        cache.close()
        stats.pop("capacity")

    def text() -> str:
        lines = [f"{k:<16} {human_bytes(v) if k in ('size', 'capacity', 'bytes_fetched', 'bytes_evicted') else v}"
                 for k, v in stats.items()]
        hits = stats.get("hits", 0) + stats.get("memory_hits", 0)
        total = hits + stats.get("misses", 0)
        if total:
            lines.append(f"{'hit ratio':<16} {hits / total:.1%}")
        return "\n".join(lines)

    out.result(stats, text)
    return 0


def cmd_cache_drop(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import call

    reply = call(args.mount, {"op": "cache_drop"})
    out.result(reply, f"dropped {human_bytes(reply['freed'])} of unpinned chunks")
    return 0


def cmd_disk_new(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import call

    request = {"op": "sandbox_create", "sid": args.sid}
    if args.manifest:
        request["manifest"] = args.manifest
    else:
        request["image"] = args.image
    reply = call(args.mount, request)
    out.result(reply, f"sandbox disk {reply['path']} ({human_bytes(reply['size'])}) over {reply['base'][:16]}")
    return 0


def cmd_disk_ls(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import call

    rows = call(args.mount, {"op": "sandbox_list"})["sandboxes"]

    def text() -> str:
        if not rows:
            return "no sandbox disks"
        return "\n".join(f"{r['sid']:<24} {human_bytes(r['size']):>10}  dirty {r['dirty_chunks']:>6}  base {r['base'][:16]}"
                         f"  layers {len(r['layers'])}" for r in rows)

    out.result(rows, text)
    return 0


def cmd_disk_rm(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import call

    reply = call(args.mount, {"op": "sandbox_remove", "sid": args.sid})
    out.result(reply, f"removed sandbox disk {args.sid}")
    return 0


def cmd_disk_seal(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import call

    reply = call(args.mount, {"op": "seal", "sid": args.sid, "wait": args.wait})
    text = f"sealed {reply['dirty_chunks']} dirty chunks of {args.sid} in {reply['switch_ms']:.1f} ms"
    text += f"; layer {reply['manifest']}" if "manifest" in reply else "; publishing in the background"
    out.result(reply, text)
    return 0


def cmd_record_prefetch(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .client import call

    reply = call(args.mount, {"op": "record_prefetch", "image": args.ref})
    out.result(reply, f"recorded {reply['chunks']} chunks as the prefetch list of {reply['image']}")
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
    p = verbs.add_parser("drop", parents=[common, mount], help="evict every unpinned chunk")
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
