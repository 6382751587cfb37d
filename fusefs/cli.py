"""CLI commands of the FUSE layer: mount, umount, cache, layer, image record-prefetch."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerstore.cli import Output, human_bytes, parse_size
from layerstore.errors import InvalidInput

if TYPE_CHECKING:
    from .client import MountClient

DEFAULT_CACHE_SIZE = "10G"


def _default_cache_dir(env: dict[str, str]) -> str:
    from layerstore.store import state_dir

    return str(state_dir(env) / "cache")


def _run_dir(env: dict[str, str]) -> Path:
    from .control import run_dir_from_env

    return run_dir_from_env(env)


def _client(args: argparse.Namespace, env: dict[str, str]) -> MountClient:
    """The client of the daemon serving `--mount`."""
    from .client import MountClient

    return MountClient(args.mount, run_dir=_run_dir(env))


def cmd_mount(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    from .client import mount

    store = getattr(args, "store", None) or env.get("STRATA_STORE", "")
    if not store:
        raise InvalidInput("no store given: pass --store PATH|s3://BUCKET/PREFIX or set STRATA_STORE")
    cache_dir = args.cache_dir or env.get("STRATA_CACHE_DIR") or _default_cache_dir(env)
    if args.foreground:
        from .daemon import serve

        ns = argparse.Namespace(mountpoint=args.mountpoint, store=store, cache_dir=cache_dir,
                                cache_size=args.cache_size, upper_dir=args.upper_dir, run_dir=_run_dir(env))
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        serve(ns, lambda: print(f"serving {args.mountpoint}; Ctrl-C or `strata umount` to stop", flush=True))
        return 0
    info = mount(args.mountpoint, store=store, cache_dir=cache_dir, cache_size=args.cache_size,
                 upper_dir=args.upper_dir, run_dir=_run_dir(env))
    out.result(info, f"mounted {info['store']} at {info['mountpoint']} (daemon pid {info['pid']}, log {info['log']}, "
                     f"cache {cache_dir} capped at {human_bytes(args.cache_size)})")
    return 0


def cmd_umount(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    from .client import umount

    info = umount(args.mountpoint, run_dir=_run_dir(env))
    out.result(info, f"unmounted {info['mountpoint']}")
    return 0


def cmd_cache_stats(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    if args.mount:
        reply = _client(args, env).stats()
        stats: dict[str, Any] = {**reply.cache, "memory_hits": reply.memory_hits, "backend_fetches": reply.fetches}
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


def cmd_cache_drop(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    reply = _client(args, env).cache_drop()
    out.result(asdict(reply), f"dropped {human_bytes(reply.freed)} of unpinned chunks")
    return 0


def cmd_layer_new(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    reply = _client(args, env).create_disk(args.sid, image=None if args.manifest else args.image,
                                           manifest=args.manifest or None)
    out.result(asdict(reply), f"sandbox disk {reply.path} ({human_bytes(reply.size)}) over {reply.base[:16]}")
    return 0


def cmd_layer_ls(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    rows = [asdict(d) for d in _client(args, env).list_disks()]

    def text() -> str:
        if not rows:
            return "no sandbox disks"
        return "\n".join(f"{r['sid']:<24} {human_bytes(r['size']):>10}  dirty {r['dirty_chunks']:>6}  base {r['base'][:16]}"
                         f"  layers {len(r['layers'])}" for r in rows)

    out.result(rows, text)
    return 0


def cmd_layer_rm(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    reply = _client(args, env).remove_disk(args.sid)
    out.result(asdict(reply), f"removed sandbox disk {args.sid}")
    return 0


def cmd_layer_seal(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    reply = _client(args, env).seal(args.sid, wait=args.wait)
    text = f"sealed {reply.dirty_chunks} dirty chunks of {args.sid} in {reply.switch_ms:.1f} ms"
    text += f"; layer {reply.manifest}" if reply.manifest else "; publishing in the background"
    out.result(asdict(reply), text)
    return 0


def cmd_record_prefetch(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    reply = _client(args, env).record_prefetch(args.ref)
    out.result(asdict(reply), f"recorded {reply.chunks} chunks as the prefetch list of {reply.image}")
    return 0


def register(nouns: Any, verbs: dict[str, Any], common: argparse.ArgumentParser) -> None:
    """Add this package's commands to the `strata` parser."""
    mount_common = argparse.ArgumentParser(add_help=False)
    mount_common.add_argument("--mount", required=True, metavar="MOUNTPOINT", help="mount point of the daemon to ask")

    p = nouns.add_parser("mount", parents=[common], help="serve images and sandbox disks through FUSE")
    p.add_argument("mountpoint")
    p.add_argument("--cache-dir", help="chunk cache directory (env STRATA_CACHE_DIR; default $STRATA_STATE_DIR/cache)")
    p.add_argument("--cache-size", type=parse_size, default=parse_size(DEFAULT_CACHE_SIZE),
                   help=f"hard cap of the chunk cache (default {DEFAULT_CACHE_SIZE})")
    p.add_argument("--upper-dir", help="where sandbox upper layers live (default $STRATA_STATE_DIR/uppers)")
    p.add_argument("--foreground", action="store_true", help="stay attached instead of starting a daemon")
    p.set_defaults(func=cmd_mount)

    p = nouns.add_parser("umount", parents=[common], help="unmount a Strata mount cleanly")
    p.add_argument("mountpoint")
    p.set_defaults(func=cmd_umount)

    cache = nouns.add_parser("cache", help="chunk cache statistics and control")
    cache_verbs = cache.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = cache_verbs.add_parser("stats", parents=[common], help="hits, misses, bytes fetched, evictions, size")
    p.add_argument("--mount", metavar="MOUNTPOINT", help="ask a running daemon (live counters)")
    p.add_argument("--cache-dir", help="read a cache directory directly")
    p.set_defaults(func=cmd_cache_stats)
    p = cache_verbs.add_parser("drop", parents=[common, mount_common], help="evict every unpinned chunk")
    p.set_defaults(func=cmd_cache_drop)

    layer = nouns.add_parser("layer", help="sandbox disks: writable layers over images")
    layer_verbs = layer.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = layer_verbs.add_parser("new", parents=[common, mount_common], help="create a sandbox disk over an image")
    p.add_argument("sid", metavar="SID")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image", metavar="NAME:TAG")
    src.add_argument("--manifest", metavar="ID")
    p.set_defaults(func=cmd_layer_new)
    p = layer_verbs.add_parser("ls", parents=[common, mount_common], help="list sandbox disks")
    p.set_defaults(func=cmd_layer_ls)
    p = layer_verbs.add_parser("rm", parents=[common, mount_common], help="delete a sandbox disk and its upper layer")
    p.add_argument("sid", metavar="SID")
    p.set_defaults(func=cmd_layer_rm)
    p = layer_verbs.add_parser("seal", parents=[common, mount_common],
                               help="freeze the upper layer as a new read-only layer (incremental snapshot)")
    p.add_argument("sid", metavar="SID")
    p.add_argument("--wait", action="store_true", help="wait until the layer is published and print its id")
    p.set_defaults(func=cmd_layer_seal)

    p = verbs["image"].add_parser("record-prefetch", parents=[common, mount_common],
                                  help="save the chunks read so far as the image's prefetch list")
    p.add_argument("ref", metavar="NAME:TAG")
    p.set_defaults(func=cmd_record_prefetch)
