"""The store's commands: `strata image|snapshot|template ...`, `push`,
`pull`, `gc`, `verify`. What every package's commands share (`Output`,
`StoreContext`, exit codes, sizes, common options) is layerstore/clikit.py.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .chunk import DEFAULT_CHUNK_SIZE, DEFAULT_LEVEL
from .clikit import EXIT_PROBLEMS, Output, StoreContext, human_bytes, parse_size
from .errors import InvalidInput, StrataError

if TYPE_CHECKING:  # the store's modules load when a command opens one: `strata --help` stays quick
    from .registry import Credentials
    from .store import Store
    from .transfer import TransferResult


def _store(args: argparse.Namespace, ctx: StoreContext) -> Store:
    """This node's store, for a command that may move chunks in bulk: such a
    command allocates and frees a buffer per chunk, so the heap keeps what
    it freed (layerstore/malloc.py; the process ends with the command), and
    what it writes goes around the page cache (`bulk`)."""
    from .malloc import keep_freed_memory

    keep_freed_memory()
    return ctx.open_store(level=getattr(args, "level", None), bulk=True)


# commands -----------------------------------------------------------------------
def cmd_image_import(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .importer import import_image
    from .oci import is_image

    source = Path(args.file)
    with _store(args, ctx) as store:
        parent = store.resolve(args.parent) if args.parent else None
        options = {"chunk_size": args.chunk_size, "level": args.level, "parent": parent, "workers": args.workers}
        if is_image(source):  # OCI layout / archive or docker save: layers -> ext4 -> chunks
            from .rootfs import import_oci

            with out.status(f"unpacking the layers of {source.name} into an ext4 disk and importing it"):
                res = import_oci(store, source, args.ref, build_root=ctx.config.state_dir / "build",
                                 size=args.size, max_bytes=args.max_unpacked, **options)
        else:
            with out.progress(f"import {source.name}") as (advance, total):
                res = import_image(store, args.file, args.ref, annotations={"source": source.name},
                                   progress=advance, on_total=total, **options)
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


def cmd_image_pull(args: argparse.Namespace, ctx: StoreContext) -> int:
    """An image from an OCI registry: its layers the store has no disk of
    are fetched (a progress bar), then unpacked and imported."""
    from .registry import fetched_image, import_fetched, parse_reference, summary

    out, ref = ctx.out, parse_reference(args.ref)
    name = args.name or ref.default_name()
    credentials = _registry_credentials(args, ctx)
    build_root = ctx.config.state_dir / "build"
    with _store(args, ctx) as store, contextlib.ExitStack() as layout:  # the fetched layout lives until imported
        with out.progress(f"pull {ref}") as (advance, total):
            fetched = layout.enter_context(fetched_image(
                store, ref, build_root=build_root, credentials=credentials, insecure=args.insecure,
                max_bytes=args.max_unpacked, progress=advance, on_total=total))
        with out.status(f"unpacking the layers of {ref} into an ext4 disk and importing it"):
            res = import_fetched(store, fetched, name, build_root=build_root, max_bytes=args.max_unpacked,
                                 chunk_size=args.chunk_size, level=args.level, workers=args.workers)
    out.result({**fetched.as_dict(), **res.as_dict()},
               lambda: f"{summary(fetched)}\npulled {ref} as {res.ref} (manifest {res.manifest_id[:16]}): "
                       f"{human_bytes(res.size)}, new {res.new_chunks} chunks, {human_bytes(res.new_stored_bytes)} "
                       "stored")
    return 0


def _registry_credentials(args: argparse.Namespace, ctx: StoreContext) -> Credentials | None:
    """--username (else config registry_username) and the password from
    stdin (--password-stdin, first line) or STRATA_REGISTRY_PASSWORD; None: anonymous."""
    from .registry import Credentials

    username = args.username or ctx.config.registry_username
    password = sys.stdin.readline().rstrip("\r\n") if args.password_stdin else ctx.config.registry_password
    if args.password_stdin and not username:
        raise InvalidInput("--password-stdin needs --username (or STRATA_REGISTRY_USERNAME)")
    if not username:
        return None
    if not password:
        raise InvalidInput(f"no password for registry user {username!r}: --password-stdin or "
                           "STRATA_REGISTRY_PASSWORD")
    return Credentials(username, password)


def cmd_image_export(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .exporter import export_image

    with _store(args, ctx) as store:
        with out.progress(f"export {args.ref}") as (advance, total):
            res = export_image(store, args.ref, args.out, workers=args.workers, progress=advance, on_total=total)
    out.result(
        res.as_dict(),
        lambda: f"exported {res.ref} to {res.path}: {human_bytes(res.size)}, {res.data_chunks} data chunks, "
        f"{res.seconds:.2f} s ({res.size / max(res.seconds, 1e-9) / 1e6:.0f} MB/s)",
    )
    return 0


def cmd_image_ls(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    with _store(args, ctx) as store:
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


def cmd_image_inspect(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .store import inspect_image

    with _store(args, ctx) as store:
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


def cmd_image_rm(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    with _store(args, ctx) as store:
        manifest_id = store.delete_ref(args.ref)
        _rewrite_hold(ctx, store)  # the remote may collect what only this ref read lazily
    out.result(
        {"ref": args.ref, "manifest": manifest_id, "deleted": True},
        f"removed {args.ref} (manifest {manifest_id[:16]}; its chunks stay until `strata gc`)",
    )
    return 0


def _copy(out: Output, name: str, verb: str,
          run: Callable[[Callable[[int], None], Callable[[int], None]], TransferResult]) -> int:
    """Run a push or pull (`run(progress, on_total)`) under a progress bar; print its result."""
    with out.progress(f"{verb} {name}") as (advance, set_total):
        res = run(advance, set_total)
    out.result(res.as_dict(), f"{verb} {res.name}: {res.chunks_sent} of {res.chunks_total} chunks sent "
                              f"({human_bytes(res.bytes_sent)}), {res.manifests_sent} manifests, "
                              f"{res.snapshots_sent} snapshots, {res.seconds:.2f} s")
    return 0


def _remote(given: str | None, ctx: StoreContext, flag: str) -> str:
    """The other store of a push or pull: `flag`'s value, else the configured remote."""
    spec = given or ctx.config.remote
    if not spec:
        raise InvalidInput(f"no store to copy with: pass {flag} STORE or configure `remote` (STRATA_REMOTE)")
    return spec


def cmd_push(args: argparse.Namespace, ctx: StoreContext) -> int:
    from .transfer import copy

    with _store(args, ctx) as src, ctx.open_store(_remote(args.to, ctx, "--to"), bulk=True) as dst:
        return _copy(ctx.out, args.name, "pushed",
                     lambda progress, on_total: copy(src, dst, args.name, progress=progress, on_total=on_total))


def cmd_pull(args: argparse.Namespace, ctx: StoreContext) -> int:
    """A lazy pull leaves the chunks in the remote, so it first records this
    node's hold there (layerstore/nodes.py), whoever runs it: the remote's GC
    keeps what this node reads even once the remote's ref is gone and no
    `strata serve` runs here. A full pull rewrites the hold without the
    layers it completed."""
    from .nodes import Holds, node_id_of
    from .transfer import copy, lazy_pull

    source = _remote(args.source, ctx, "--from")
    c = ctx.config
    if not args.full and c.remote != source:
        raise InvalidInput(f"a lazy pull leaves chunks in {source}: this node must read them from there "
                           f"(set STRATA_REMOTE={source}, config `remote`), or pull --full")
    if not args.full and source == c.store:
        raise InvalidInput(f"{source} is this node's own store and its remote: nothing to pull")
    with ctx.open_store(source) as src, _store(args, ctx) as dst:
        if args.full:
            code = _copy(ctx.out, args.name, "pulled",
                         lambda progress, on_total: copy(src, dst, args.name, progress=progress, on_total=on_total))
            _rewrite_hold(ctx, dst)
            return code
        holds = Holds(src.backend, node_id_of(c.state_dir), c.state_dir)
        return _copy(ctx.out, args.name, "pulled",
                     lambda progress, on_total: lazy_pull(src, dst, args.name, holds=holds, prefetch=args.prefetch,
                                                          progress=progress, on_total=on_total))


def _existing_node(ctx: StoreContext) -> str | None:
    from .nodes import existing_node_id

    return existing_node_id(ctx.config.state_dir)


def _rewrite_hold(ctx: StoreContext, store: Store) -> None:
    """Rewrite this node's hold in its remote from `store` (the node's own)
    after it may have lost names. Best effort: a hold left larger than
    needed keeps chunks in the remote, it never loses any, so a remote that
    cannot be written only earns a warning."""
    from .nodes import Holds
    from .store import open_node_backend

    c, node_id = ctx.config, _existing_node(ctx)
    if not c.remote or c.remote == c.store or node_id is None:
        return  # no remote, or this node never ran `serve` nor pulled lazily: it holds nothing
    try:  # the remote's backend alone: a pull has the remote's store (and its catalog) open
        remote = open_node_backend(c, c.remote)
        Holds(remote, node_id, c.state_dir).refresh(store)
    except StrataError as exc:
        sys.stderr.write(f"strata: warning: this node's hold in {c.remote} was not rewritten ({exc}); it keeps "
                         "more there than needed until the next pull, image rm or gc\n")


def cmd_gc(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .config import parse_duration
    from .gc import collect
    from .nodes import existing_node_id

    try:
        grace = parse_duration(args.grace)
    except ValueError as exc:
        raise InvalidInput(f"--grace: {exc}") from None
    with _store(args, ctx) as store:
        extra = ctx.node_roots(store)
        own = existing_node_id(ctx.config.state_dir)  # this node's record: its live roots are `extra`
        with out.progress("deleting") as (advance, _total):
            report = collect(store, grace=grace, dry_run=args.dry_run, extra_roots=extra, progress=advance,
                             own_node=own, forget_nodes=args.forget_node or [], allow_missing=args.allow_missing)
        if not args.dry_run:
            _rewrite_hold(ctx, store)  # what this node's store no longer reaches, its remote may collect
    r = report
    text = (f"scanned {r.scanned}, marked {r.marked}, candidates {r.candidates}, "
            + (f"would delete {r.deletable}" if r.dry_run else f"deleted {r.deleted} ({human_bytes(r.freed_bytes)} freed)")
            + f", retained (younger than grace) {r.retained}, {r.seconds:.2f} s")
    if r.postponed:
        text += f"\ndeletion postponed: {r.postponed}"
    if r.missing:
        text += f"\nroots name {len(r.missing)} missing object(s), e.g. {r.missing[0]} (run `strata verify`)"
    if r.quarantined:
        text += (f"\n{len(r.quarantined)} malformed volume index(es) quarantined, every layer they may name kept: "
                 + "; ".join(r.quarantined[:3]) + " (mend or delete them: `strata verify` lists them)")
    if r.holds:
        text += ("\nkept for nodes that pulled lazily from this store: "
                 + ", ".join(f"{h['node']} ({h['layers']} layers, written {h['age'] / 86400:.1f} d ago)"
                             for h in r.holds)
                 + "; a node gone for good: `strata gc --forget-node NODE`")
    out.result(r.as_dict(), text)
    return 0


def cmd_verify(args: argparse.Namespace, ctx: StoreContext) -> int:
    out = ctx.out
    from .verify import verify_store

    with _store(args, ctx) as store:
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


def cmd_snapshot_ls(args: argparse.Namespace, ctx: StoreContext) -> int:
    from .inventory import list_snapshots

    with _store(args, ctx) as store:
        rows = [{"snapshot": s.snapshot_id, "names": s.names}
                for s in list_snapshots(store, sandbox=args.sandbox, name=args.name)]
    ctx.out.result(rows, lambda: "\n".join(f"{r['snapshot']}  {' '.join(r['names'])}".rstrip() for r in rows)
                   or "no snapshots")
    return 0


def cmd_snapshot_inspect(args: argparse.Namespace, ctx: StoreContext) -> int:
    from .inventory import inspect_snapshot

    with _store(args, ctx) as store:
        d = inspect_snapshot(store, args.id, node_users=ctx.node_snapshot_users())
    data = {"snapshot": d.snapshot_id, "parents": d.parents, "stored_bytes": d.stored_bytes, "vm": d.vm,
            "annotations": d.annotations, "users": d.users,
            "layers": [{"role": x.role, "manifest": x.manifest, "size": x.size, "stored_bytes": x.stored_bytes}
                       for x in d.layers]}
    lines = [f"snapshot       {d.snapshot_id}", f"parents        {len(d.parents)}",
             f"stored bytes   {human_bytes(d.stored_bytes)}", f"used by        {', '.join(d.users) or '-'}"]
    lines += [f"{x.role:<14} {x.manifest[:16]}  {human_bytes(x.size)}, {human_bytes(x.stored_bytes)} stored"
              for x in d.layers]
    ctx.out.result(data, "\n".join(lines))
    return 0


def cmd_snapshot_rm(args: argparse.Namespace, ctx: StoreContext) -> int:
    from .inventory import delete_snapshot

    with _store(args, ctx) as store:
        delete_snapshot(store, args.id, node_users=ctx.node_snapshot_users())
        _rewrite_hold(ctx, store)  # the remote may collect what only this snapshot read lazily
    ctx.out.result({"snapshot": args.id, "deleted": True},
                   f"removed snapshot {args.id} (its layers and chunks stay until `strata gc`)")
    return 0


def _template_row(t: Any) -> dict[str, object]:
    return {"name": t.name, "kind": t.kind, "target": t.target, "created": t.created, "public": t.public}


def cmd_template_ls(args: argparse.Namespace, ctx: StoreContext) -> int:
    with _store(args, ctx) as store:
        rows = [_template_row(t) for t in store.list_templates()]
    ctx.out.result(rows, lambda: "\n".join(f"{r['name']:<24} {r['kind']:<8} {r['target']}" for r in rows)
                   or "no templates")
    return 0


def cmd_template_create(args: argparse.Namespace, ctx: StoreContext) -> int:
    from .templates import new_template

    kind, target = ("image", args.image) if args.image else ("snapshot", args.snapshot)
    template = new_template(args.name, kind, target, public=args.public)
    with _store(args, ctx) as store:
        store.put_template(template)
    ctx.out.result(_template_row(template), f"template {template.name} -> {kind} {template.target}")
    return 0


def cmd_template_rm(args: argparse.Namespace, ctx: StoreContext) -> int:
    with _store(args, ctx) as store:
        template = store.delete_template(args.name)
    ctx.out.result(_template_row(template), f"removed template {template.name} (what it named stays)")
    return 0


# parser -------------------------------------------------------------------------
def register(nouns: Any, common: argparse.ArgumentParser) -> dict[str, Any]:
    """Add the store's nouns and verbs; returns {noun: its verbs} for other packages to extend."""
    image = nouns.add_parser("image", help="import, export, list, inspect and remove images")
    verbs = image.add_subparsers(dest="verb", metavar="VERB", required=True)
    _image_verbs(verbs, common)
    _snapshot_verbs(nouns, common)
    template_verbs = _template_verbs(nouns, common)
    _copy_verbs(nouns, common)
    p = nouns.add_parser("gc", parents=[common], help="delete chunks and manifests no ref, template or snapshot reaches")
    p.add_argument("--grace", default="24h", help="never delete anything younger (default 24h)")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; change nothing")
    p.add_argument("--forget-node", action="append", metavar="NODE",
                   help="remove the record and the hold of a drained node (one that will not come back) "
                        "first; a stale record otherwise stops GC, and a hold keeps that node's lazily pulled "
                        "images' chunks forever (repeatable)")
    p.add_argument("--allow-missing", action="store_true",
                   help="collect even though the store's roots name missing objects (run `strata verify` first)")
    p.set_defaults(func=cmd_gc)
    p = nouns.add_parser("verify", parents=[common], help="re-hash every chunk; report corrupt or missing ones")
    p.add_argument("--workers", type=int, default=None)
    p.set_defaults(func=cmd_verify)
    return {"image": verbs, "template": template_verbs}


def _image_verbs(verbs: Any, common: argparse.ArgumentParser) -> None:
    p = verbs.add_parser("import", parents=[common], help="import a raw disk image, an OCI image or a docker save "
                                                         "archive as NAME:TAG")
    p.add_argument("file", help="raw image (disk image, memory file; read sparsely), or an OCI layout directory, "
                                "OCI archive or `docker save` archive (its layers become an ext4 disk)")
    p.add_argument("ref", metavar="NAME:TAG")
    p.add_argument("--chunk-size", type=parse_size, default=DEFAULT_CHUNK_SIZE, help="power of two, 64K..16M (default 1M)")
    p.add_argument("--level", type=int, default=None, choices=range(-5, 23), metavar="N", help=f"zstd level (default {DEFAULT_LEVEL})")
    p.add_argument("--parent", metavar="NAME:TAG", help="store only chunks that differ from this image")
    p.add_argument("--workers", type=int, default=None, help="hashing threads (default: cores)")
    p.add_argument("--size", type=parse_size, default=None,
                   help="OCI/docker images: the ext4 disk's size (default: its files + 25%% + 64M)")
    p.add_argument("--max-unpacked", type=parse_size, default=64 << 30,
                   help="OCI/docker images: refuse layers unpacking to more than this (default 64G)")
    p.set_defaults(func=cmd_image_import)
    p = verbs.add_parser("pull", parents=[common], help="pull an image from an OCI registry as NAME:TAG (the layers "
                                                       "the store has a disk of are not fetched again)")
    p.add_argument("ref", metavar="REF", help="HOST[:PORT]/REPO[:TAG] or HOST[:PORT]/REPO@sha256:...")
    p.add_argument("--as", dest="name", metavar="NAME:TAG", help="the store's name for it (default: the "
                                                                  "repository's last component and the tag)")
    p.add_argument("--username", help="registry user (env STRATA_REGISTRY_USERNAME)")
    p.add_argument("--password-stdin", action="store_true", help="read the password from stdin's first line "
                                                                 "(else env STRATA_REGISTRY_PASSWORD)")
    p.add_argument("--insecure", action="store_true", help="plain http:// to a registry off loopback (loopback "
                                                          "registries are always plain http)")
    p.add_argument("--chunk-size", type=parse_size, default=DEFAULT_CHUNK_SIZE, help="power of two, 64K..16M "
                                                                                      "(default 1M)")
    p.add_argument("--level", type=int, default=None, choices=range(-5, 23), metavar="N",
                   help=f"zstd level (default {DEFAULT_LEVEL})")
    p.add_argument("--workers", type=int, default=None, help="hashing threads (default: cores)")
    p.add_argument("--max-unpacked", type=parse_size, default=64 << 30,
                   help="refuse layers larger, or unpacking to more, than this (default 64G)")
    p.set_defaults(func=cmd_image_pull)
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


def _snapshot_verbs(nouns: Any, common: argparse.ArgumentParser) -> None:
    snapshot = nouns.add_parser("snapshot", help="list, inspect and remove VM snapshots")
    verbs = snapshot.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = verbs.add_parser("ls", parents=[common], help="list snapshots (and the templates naming them)")
    p.add_argument("--sandbox", metavar="SID", help="only the snapshots of this sandbox")
    p.add_argument("--name", metavar="TEMPLATE", help="only the snapshot this template names")
    p.set_defaults(func=cmd_snapshot_ls)
    p = verbs.add_parser("inspect", parents=[common], help="parents, layers, stored bytes, users")
    p.add_argument("id", metavar="SNAPSHOT_ID")
    p.set_defaults(func=cmd_snapshot_inspect)
    p = verbs.add_parser("rm", parents=[common], help="remove a snapshot (refused while a template or paused "
                                                      "sandbox needs it; data stays until gc)")
    p.add_argument("id", metavar="SNAPSHOT_ID")
    p.set_defaults(func=cmd_snapshot_rm)


def _template_verbs(nouns: Any, common: argparse.ArgumentParser) -> Any:
    template = nouns.add_parser("template", help="names sandboxes are created from (an image or a snapshot)")
    verbs = template.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = verbs.add_parser("ls", parents=[common], help="list templates")
    p.set_defaults(func=cmd_template_ls)
    p = verbs.add_parser("create", parents=[common], help="name an image or a snapshot as a template")
    p.add_argument("name", metavar="NAME")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--image", metavar="NAME:TAG", help="sandboxes boot this image")
    target.add_argument("--snapshot", metavar="SNAPSHOT_ID", help="sandboxes restore this snapshot")
    p.add_argument("--public", action="store_true", help="every team of the API may start it (only its owner, "
                                                          "team default here, may replace or remove it)")
    p.set_defaults(func=cmd_template_create)
    p = verbs.add_parser("rm", parents=[common], help="remove a template (what it names stays)")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_template_rm)
    return verbs


def _copy_verbs(nouns: Any, common: argparse.ArgumentParser) -> None:
    p = nouns.add_parser("push", parents=[common], help="copy an image, snapshot or template to another store")
    p.add_argument("name", metavar="REF", help="NAME:TAG, a snapshot id, or a template name")
    p.add_argument("--to", metavar="STORE", help="destination: a directory or s3://BUCKET/PREFIX "
                                                 "(default: the configured remote, STRATA_REMOTE)")
    p.set_defaults(func=cmd_push)
    p = nouns.add_parser("pull", parents=[common], help="fetch an image, snapshot or template from another store")
    p.add_argument("name", metavar="REF", help="NAME:TAG, a snapshot id, or a template name")
    p.add_argument("--from", dest="source", metavar="STORE", help="source (default: the configured remote, "
                                                                  "STRATA_REMOTE)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--full", action="store_true", help="copy every chunk too (default: manifests only; chunks "
                                                         "load lazily from the remote, which must be STRATA_REMOTE)")
    how.add_argument("--prefetch", action="store_true", help="copy the chunks of the recorded working set "
                                                             "(strata image record-prefetch); the rest loads lazily")
    p.set_defaults(func=cmd_pull)
