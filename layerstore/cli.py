"""`strata`: the one command-line tool for every part of Strata.

Nouns then verbs (`strata image import FILE NAME:TAG`). Every command takes
`--json` (one JSON document on stdout) and `--store`; failures print one line,
`strata: error: ...`, on stderr and exit non-zero (1 for a failed operation, 2
for bad usage, 3 when `verify` finds problems). Long work shows a progress
bar when stderr is a terminal.

The store comes from `--store`, else STRATA_STORE, else the config file
(STRATA_CONFIG, default ~/.config/strata/config.toml):

    store = "/var/lib/strata/store"        # or "s3://bucket/prefix"
    [s3]
    endpoint = "http://127.0.0.1:8333"     # -> STRATA_S3_ENDPOINT
    region = "us-east-1"                   # -> STRATA_S3_REGION
    path_style = true                      # -> STRATA_S3_PATH_STYLE

Environment variables win over the file; credentials come only from the
environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), never the file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .chunk import DEFAULT_CHUNK_SIZE, DEFAULT_LEVEL
from .config import load_config, parse_bytes
from .errors import InvalidInput, StrataError
from .store import Store, inspect_image, open_store

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PROBLEMS = 3
EXTENSIONS = ("fusefs.cli", "vmm.cli", "api.server")


def parse_size(text: str) -> int:
    """Parse `1048576`, `64K`, `1M`, `1MiB`, `2G` (powers of 1024) into bytes (argparse type)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Output:
    """Where results go: JSON on stdout for scripts, text otherwise; progress on stderr."""

    def __init__(self, *, json_mode: bool) -> None:
        self.json_mode = json_mode
        self.show_progress = not json_mode and sys.stderr.isatty()

    def result(self, data: object, text: str | Callable[[], str]) -> None:
        if self.json_mode:
            json.dump(data, sys.stdout, indent=2, sort_keys=True)
            sys.stdout.write("\n")
        else:
            sys.stdout.write((text() if callable(text) else text) + "\n")

    @contextlib.contextmanager
    def progress(self, description: str) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
        """Yield (advance, set_total) callbacks driving a rich progress bar (or nothing)."""
        if not self.show_progress:
            yield (lambda n: None), (lambda n: None)
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        ) as bar:
            task = bar.add_task(description, total=None)
            yield (lambda n: bar.advance(task, n)), (lambda n: bar.update(task, total=n))


    @contextlib.contextmanager
    def status(self, description: str) -> Iterator[None]:
        """A spinner with `description` on a terminal while a long step runs (else nothing)."""
        if not self.show_progress:
            yield
            return
        from rich.console import Console

        with Console(stderr=True).status(description):
            yield


def _store(args: argparse.Namespace, env: dict[str, str]) -> Store:
    spec = getattr(args, "store", None) or env.get("STRATA_STORE", "")
    level = getattr(args, "level", None) or DEFAULT_LEVEL
    return open_store(spec, env=env, level=level)


# commands -----------------------------------------------------------------------
def cmd_image_import(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    from .importer import import_image

    with _store(args, env) as store:
        parent = store.resolve(args.parent) if args.parent else None
        with out.progress(f"import {Path(args.file).name}") as (advance, total):
            res = import_image(
                store,
                args.file,
                args.ref,
                chunk_size=args.chunk_size,
                level=args.level,
                parent=parent,
                annotations={"source": Path(args.file).name},
                workers=args.workers,
                progress=advance,
                on_total=total,
            )
    out.result(
        res.as_dict(),
        lambda: (
            f"imported {args.file} as {res.ref} (manifest {res.manifest_id[:16]})\n"
            f"  size {human_bytes(res.size)}, {res.data_chunks} data chunks, {res.hole_chunks} holes, "
            f"{res.unique_chunks} unique\n"
            f"  new: {res.new_chunks} chunks, {human_bytes(res.new_raw_bytes)} -> {human_bytes(res.new_stored_bytes)} stored\n"
            f"  {res.seconds:.2f} s, {res.size / max(res.seconds, 1e-9) / 1e6:.0f} MB/s"
        ),
    )
    return 0


def cmd_image_export(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    from .exporter import export_image

    with _store(args, env) as store:
        with out.progress(f"export {args.ref}") as (advance, total):
            res = export_image(store, args.ref, args.out, workers=args.workers, progress=advance, on_total=total)
    out.result(
        res.as_dict(),
        lambda: f"exported {res.ref} to {res.path}: {human_bytes(res.size)}, {res.data_chunks} data chunks, "
        f"{res.seconds:.2f} s ({res.size / max(res.seconds, 1e-9) / 1e6:.0f} MB/s)",
    )
    return 0


def cmd_image_ls(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    with _store(args, env) as store:
        rows = []
        for ref, manifest_id, updated in store.list_refs():
            try:
                size = store.get_layer(manifest_id).size
            except StrataError:
                size = None
            rows.append({"ref": str(ref), "manifest": manifest_id, "size": size, "updated": updated})

    def text() -> str:
        if not rows:
            return "no images"
        width = max(len(r["ref"]) for r in rows)
        lines = [f"{'REF':<{width}}  {'SIZE':>10}  MANIFEST"]
        for r in rows:
            size = human_bytes(r["size"]) if r["size"] is not None else "?"
            lines.append(f"{r['ref']:<{width}}  {size:>10}  {r['manifest'][:16]}")
        return "\n".join(lines)

    out.result(rows, text)
    return 0


def cmd_image_inspect(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    with _store(args, env) as store:
        info = inspect_image(store, args.ref)
    data = info.as_dict()
    out.result(
        data,
        lambda: "\n".join(
            [
                f"ref            {info.ref}",
                f"manifest       {info.manifest_id}",
                f"size           {human_bytes(info.size)} ({info.size} bytes)",
                f"chunk size     {human_bytes(info.chunk_size)}",
                f"layers         {info.layers}",
                f"chunks         {info.chunk_slots} slots: {info.data_chunks} data, {info.hole_chunks} holes, "
                f"{info.unique_chunks} unique",
                f"logical bytes  {human_bytes(info.logical_bytes)}",
                f"stored bytes   {human_bytes(info.stored_bytes)}"
                + (f" ({info.missing_chunks} chunks MISSING)" if info.missing_chunks else ""),
                f"dedup ratio    {info.dedup_ratio:.2f}x (logical / stored)",
            ]
        ),
    )
    return 0


def cmd_image_rm(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    with _store(args, env) as store:
        manifest_id = store.delete_ref(args.ref)
    out.result(
        {"ref": args.ref, "manifest": manifest_id, "deleted": True},
        f"removed {args.ref} (manifest {manifest_id[:16]}; its chunks stay until `strata gc`)",
    )
    return 0


def _copy(src: Store, dst: Store, name: str, out: Output, *, chunks: bool, verb: str, prefetch: bool = False) -> int:
    from .transfer import copy

    with out.progress(f"{verb} {name}") as (advance, set_total):
        res = copy(src, dst, name, chunks=chunks, prefetch=prefetch, progress=advance, on_total=set_total)
    out.result(res.as_dict(), f"{verb} {res.name}: {res.chunks_sent} of {res.chunks_total} chunks sent "
                              f"({human_bytes(res.bytes_sent)}), {res.manifests_sent} manifests, "
                              f"{res.snapshots_sent} snapshots, {res.seconds:.2f} s")
    return 0


def cmd_push(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    with _store(args, env) as src, open_store(args.to, env=env) as dst:
        return _copy(src, dst, args.name, out, chunks=True, verb="pushed")


def cmd_pull(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    local = getattr(args, "store", None) or env.get("STRATA_STORE", "")
    if not args.full and env.get("STRATA_REMOTE") != args.source:
        raise InvalidInput(f"a lazy pull leaves chunks in {args.source}: this node must read them from there "
                           f"(set STRATA_REMOTE={args.source}, config `remote`), or pull --full")
    with open_store(args.source, env=env) as src, open_store(local, env=env) as dst:
        return _copy(src, dst, args.name, out, chunks=args.full, prefetch=args.prefetch, verb="pulled")


def _mount_roots(store: Store, env: dict[str, str]) -> list:
    """Layers running sandboxes sit on (sealed but not yet in any snapshot),
    asked of the node's mount if it serves this store: GC must keep them."""
    from fusefs.client import DaemonError, MountClient
    from fusefs.control import run_dir_from_env

    from .reach import Name
    from .store import state_dir

    mount = MountClient(env.get("STRATA_MOUNT") or str(state_dir(env) / "mnt"), run_dir=run_dir_from_env(env))
    try:
        if mount.ping(timeout=5).store != store.describe():
            return []
        return [Name("layer", m) for m in mount.disk_layers()]
    except DaemonError:
        return []


def cmd_gc(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    from .config import parse_duration
    from .gc import collect

    try:
        grace = parse_duration(args.grace)
    except ValueError as exc:
        raise InvalidInput(f"--grace: {exc}") from None
    with _store(args, env) as store:
        extra = _mount_roots(store, env)
        with out.progress("deleting") as (advance, _total):
            report = collect(store, grace=grace, dry_run=args.dry_run, extra_roots=extra, progress=advance)
    r = report
    text = (f"scanned {r.scanned}, marked {r.marked}, candidates {r.candidates}, "
            + (f"would delete {r.deletable}" if r.dry_run else f"deleted {r.deleted} ({human_bytes(r.freed_bytes)} freed)")
            + f", retained (younger than grace) {r.retained}, {r.seconds:.2f} s")
    if r.postponed:
        text += f"\ndeletion postponed: {r.postponed}"
    if r.missing:
        text += f"\nroots name {len(r.missing)} missing object(s), e.g. {r.missing[0]} (run `strata verify`)"
    out.result(r.as_dict(), text)
    return 0


def cmd_verify(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    from .verify import verify_store

    with _store(args, env) as store:
        with out.progress("verify") as (advance, total):
            report = verify_store(store, workers=args.workers, progress=advance, on_total=total)

    def text() -> str:
        lines = [
            f"{report.refs} refs, {report.manifests} manifests, {report.chunks_checked} chunks "
            f"({human_bytes(report.bytes_checked)}) checked; {report.unreferenced_chunks} unreferenced",
        ]
        lines += [f"PROBLEM: {e}" for e in report.errors]
        lines.append("OK" if report.ok else f"FAILED: {len(report.errors)} problem(s)")
        return "\n".join(lines)

    out.result(report.as_dict(), text)
    if not report.ok:
        sys.stderr.write(f"strata: error: verify found {len(report.errors)} problem(s)\n")
        return EXIT_PROBLEMS
    return 0


# parser -------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=argparse.SUPPRESS, help="store: a directory or s3://BUCKET/PREFIX (env STRATA_STORE)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    parser = argparse.ArgumentParser(prog="strata", description="Content-addressed images and snapshots for microVMs.", parents=[common])
    nouns = parser.add_subparsers(dest="noun", metavar="COMMAND", required=True)

    image = nouns.add_parser("image", help="import, export, list, inspect and remove images")
    verbs = image.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = verbs.add_parser("import", parents=[common], help="import a raw image file as NAME:TAG")
    p.add_argument("file", help="raw image (disk image, memory file); sparse files are read sparsely")
    p.add_argument("ref", metavar="NAME:TAG")
    p.add_argument("--chunk-size", type=parse_size, default=DEFAULT_CHUNK_SIZE, help="power of two, 64K..16M (default 1M)")
    p.add_argument("--level", type=int, default=None, choices=range(-5, 23), metavar="N", help=f"zstd level (default {DEFAULT_LEVEL})")
    p.add_argument("--parent", metavar="NAME:TAG", help="store only chunks that differ from this image")
    p.add_argument("--workers", type=int, default=None, help="hashing threads (default: cores)")
    p.set_defaults(func=cmd_image_import)

    p = verbs.add_parser("export", parents=[common], help="write NAME:TAG to a raw file (bit-exact, sparse)")
    p.add_argument("ref", metavar="NAME:TAG")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--workers", type=int, default=None)
    p.set_defaults(func=cmd_image_export)

    p = verbs.add_parser("ls", parents=[common], help="list images")
    p.set_defaults(func=cmd_image_ls)

    p = verbs.add_parser("inspect", parents=[common], help="size, chunks, stored bytes, dedup ratio")
    p.add_argument("ref", metavar="NAME:TAG")
    p.set_defaults(func=cmd_image_inspect)

    p = verbs.add_parser("rm", parents=[common], help="remove an image ref (data stays until gc)")
    p.add_argument("ref", metavar="NAME:TAG")
    p.set_defaults(func=cmd_image_rm)

    p = nouns.add_parser("push", parents=[common], help="copy an image, snapshot or template to another store")
    p.add_argument("name", metavar="REF", help="NAME:TAG, a snapshot id, or a template name")
    p.add_argument("--to", required=True, metavar="STORE", help="destination: a directory or s3://BUCKET/PREFIX")
    p.set_defaults(func=cmd_push)
    p = nouns.add_parser("pull", parents=[common], help="fetch an image, snapshot or template from another store")
    p.add_argument("name", metavar="REF", help="NAME:TAG, a snapshot id, or a template name")
    p.add_argument("--from", dest="source", required=True, metavar="STORE")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--full", action="store_true", help="copy every chunk too (default: manifests only; chunks "
                                                         "load lazily from --from, set as STRATA_REMOTE)")
    how.add_argument("--prefetch", action="store_true", help="copy the chunks of the recorded working set "
                                                             "(strata image record-prefetch); the rest loads lazily")
    p.set_defaults(func=cmd_pull)
    p = nouns.add_parser("gc", parents=[common], help="delete chunks and manifests no ref, template or snapshot reaches")
    p.add_argument("--grace", default="24h", help="never delete anything younger (default 24h)")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; change nothing")
    p.set_defaults(func=cmd_gc)

    p = nouns.add_parser("verify", parents=[common], help="re-hash every chunk; report corrupt or missing ones")
    p.add_argument("--workers", type=int, default=None)
    p.set_defaults(func=cmd_verify)

    # The other packages add their nouns (mount, cache, layer, ...) here.
    import importlib

    for module in EXTENSIONS:
        importlib.import_module(module).register(nouns, {"image": verbs}, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = Output(json_mode=getattr(args, "json", False))
    try:
        env = load_config(dict(os.environ))
        return args.func(args, env, out)
    except StrataError as exc:
        sys.stderr.write(f"strata: error: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write("strata: interrupted\n")
        return 130
    except BrokenPipeError:
        return EXIT_FAILED
    except Exception as exc:  # a bug: still one line, traceback on demand
        if os.environ.get("STRATA_DEBUG"):
            raise
        sys.stderr.write(f"strata: internal error: {type(exc).__name__}: {exc} (set STRATA_DEBUG=1 for a traceback)\n")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
