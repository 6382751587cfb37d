#!/usr/bin/env python3
"""GC benchmark: time and peak memory of `layerstore.gc.collect` over a big store.

Builds a store of N synthetic chunks quickly (no image import): each chunk is
4 KiB of seeded pseudo-random bytes followed by zeros up to the layer chunk
size (64 KiB), so it is a valid chunk of a valid layer but stores only
~4 KiB.  The chunks are split over L layer manifests (100 by default, of
N/L chunks each, no chunk shared) and every other layer gets a ref, so half
of the chunks and manifests are garbage.  Then, each in its own child process
(wall time, CPU and peak RSS of that process alone, like bench/ingest.py):

* baseline - import layerstore and open the store; nothing else (RSS floor)
* list     - list every chunks/ and manifests/ object once (what any GC must do)
* gc run 1 - collect(grace=0, now=T):   marks, records the garbage as candidates
* gc run 2 - collect(grace=0, now=T+1): deletes the candidates still unmarked
* gc run 3 - collect(grace=0, now=T+2): steady state, nothing left to delete

After run 2 the surviving keys are compared with the expected live set.

Usage::

    .venv/bin/python bench/gc.py                          # 100,000 chunks, local directory store
    .venv/bin/python bench/gc.py --chunks 5000 --repeat 3 --json /tmp/gc.json
    .venv/bin/python bench/gc.py --store s3               # 20,000 chunks on a SeaweedFS server
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO_ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(REPO_ROOT))

DEFAULT_WORKDIR = Path("/var/tmp/strata-bench-gc")
BUCKET = "gc-bench"
MiB = 1 << 20
RUNS = ("baseline", "list", "gc run 1", "gc run 2", "gc run 3")


# --------------------------------------------------------------------------
# child: one measured action in a fresh process
# --------------------------------------------------------------------------

def _store_options() -> dict[str, Any]:
    """How `strata` would open a store in this environment (the node's config)."""
    from layerstore.config import NodeConfig

    return NodeConfig.load(os.environ, require_store=False).store_options()


def child(action: str, spec: str, now: float, grace: float, delete_workers: int) -> int:
    """Run one action on the store and print one JSON object (stdout)."""
    from layerstore import gc as sgc
    from layerstore.store import open_store

    out: dict[str, Any] = {"action": action}
    with open_store(spec, **_store_options()) as store:
        t0 = time.monotonic()
        if action == "list":
            n = size = 0
            for prefix in sgc.SWEPT_PREFIXES:
                for info in store.backend.list(prefix):
                    n += 1
                    size += info.size
            out.update(scanned=n, listed_bytes=size)
        elif action == "collect":
            out.update(sgc.collect(store, grace=grace, now=now, delete_workers=delete_workers).as_dict())
            out["missing"] = len(out["missing"])
        out["seconds"] = time.monotonic() - t0
    out["self_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(out))
    return 0


# --------------------------------------------------------------------------
# building the store
# --------------------------------------------------------------------------

def chunk_data(seed: int, i: int, payload: int, chunk_size: int) -> bytes:
    """Chunk i: `payload` unique pseudo-random bytes, then zeros up to `chunk_size`."""
    head = hashlib.shake_256(f"strata-gc-bench:{seed}:{i}".encode()).digest(payload)
    return head + bytes(chunk_size - payload)


def build(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """Write the chunks (thread pool), then the layers, refs on every other one."""
    from layerstore.digest import digest_bytes
    from layerstore.localdir import LocalDirBackend
    from layerstore.manifest import Layer
    from layerstore.store import open_store

    t0 = time.monotonic()
    # setup only: a local store skips per-object fsync and syncs once at the end
    backend = None if spec.startswith("s3://") else LocalDirBackend(spec, fsync=False)
    with open_store(spec, **_store_options(), backend=backend) as store:
        def one(i: int) -> tuple[str, int]:
            data = chunk_data(args.seed, i, args.payload, args.chunk_size)
            digest = digest_bytes(data)
            return digest, store.write_chunk(digest, data)

        with ThreadPoolExecutor(args.workers) as pool:
            written = list(pool.map(one, range(args.chunks), chunksize=64))
        digests = [d for d, _ in written]
        t_chunks = time.monotonic() - t0
        per = -(-args.chunks // args.layers)
        live_layers = live_chunks = 0
        layer_ids: list[str] = []
        for n in range(args.layers):
            mine = digests[n * per:(n + 1) * per]
            if not mine:
                break
            layer = Layer(size=len(mine) * args.chunk_size, chunk_size=args.chunk_size,
                          chunks=dict(enumerate(mine)), annotations={"bench": "gc", "layer": str(n)})
            layer_ids.append(store.put_layer(layer))
            if n % 2 == 0:
                store.set_ref(f"gcbench-{n:04d}:live", layer_ids[-1])
                live_layers += 1
                live_chunks += len(mine)
    if backend is not None:
        os.sync()
    return {"chunks": args.chunks, "layers": len(layer_ids), "live_layers": live_layers,
            "live_chunks": live_chunks, "stored_bytes": sum(s for _, s in written),
            "chunks_seconds": t_chunks, "seconds": time.monotonic() - t0,
            "chunks_per_s": args.chunks / t_chunks if t_chunks else None}


def surviving(spec: str) -> dict[str, int]:
    """Objects left under chunks/ and manifests/ (checked against the live set after run 2)."""
    from layerstore.chunk import CHUNK_PREFIX
    from layerstore.manifest import MANIFEST_PREFIX
    from layerstore.store import open_store

    with open_store(spec, **_store_options()) as store:
        return {p: sum(1 for _ in store.backend.list(p)) for p in (CHUNK_PREFIX, MANIFEST_PREFIX)}


# --------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------

@dataclass
class RunResult:
    run: str
    repeat: int
    status: str = "ok"
    error: str | None = None
    command: str | None = None
    wall_s: float | None = None  # the child process, interpreter start included
    gc_s: float | None = None  # inside the child: collect() / the listing alone
    cpu_s: float | None = None
    maxrss_bytes: int | None = None
    scanned: int | None = None
    marked: int | None = None
    candidates: int | None = None
    deleted: int | None = None
    freed_bytes: int | None = None
    wall_spread: float | None = None

    @property
    def chunks_per_s(self) -> float | None:
        return self.scanned / self.gc_s if self.scanned and self.gc_s else None


def measure(run: str, rep: int, spec: str, now: float, args: argparse.Namespace, log: Path) -> RunResult:
    import ingest  # run_measured: peak RSS of the child alone, through GNU time

    action = {"baseline": "baseline", "list": "list"}.get(run, "collect")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", action, "--spec", spec,
           "--now", repr(now), "--grace", "0", "--delete-workers", str(args.delete_workers)]
    m = ingest.run_measured(cmd, {}, log / run.replace(" ", "-"), args.timeout)
    r = RunResult(run, rep, command=m.cmd, wall_s=m.wall_s, cpu_s=m.user_s + m.sys_s, maxrss_bytes=m.maxrss_bytes)
    doc = ingest._parse_json(m.stdout)
    if m.returncode != 0 or not isinstance(doc, dict):
        r.status, r.error = "failed", f"exit {m.returncode}: {m.stderr_tail.strip()[-500:]}"
        return r
    r.gc_s = doc.get("seconds")
    for f in ("scanned", "marked", "candidates", "deleted", "freed_bytes"):
        setattr(r, f, doc.get(f))
    return r


def one_repeat(rep: int, spec: str, args: argparse.Namespace, log: Path) -> tuple[list[RunResult], dict[str, Any]]:
    print(f"# repeat {rep + 1}/{args.repeat}: building {args.chunks} chunks in {spec}", flush=True)
    built = build(spec, args)
    print(f"# built {built['chunks']} chunks ({built['stored_bytes'] / MiB:.0f} MiB stored) and "
          f"{built['layers']} layers ({built['live_layers']} with a ref) in {built['seconds']:.1f} s", flush=True)
    now = time.time() + 1  # every object is older than this; grace 0
    results: list[RunResult] = []
    for run in RUNS:
        when = now + {"gc run 2": 1, "gc run 3": 2}.get(run, 0)
        r = measure(run, rep, spec, when, args, log)
        results.append(r)
        if r.status != "ok":
            break
    left = surviving(spec)
    dead_manifests = built["layers"] - built["live_layers"]
    expect = {"chunks/": built["live_chunks"], "manifests/": built["live_layers"]}
    built["surviving"], built["expected"] = left, expect
    check = results[3] if len(results) > 3 else None
    if check is not None and check.status == "ok":
        want_deleted = args.chunks - built["live_chunks"] + dead_manifests
        if left != expect or check.deleted != want_deleted:
            check.status = "failed"
            check.error = f"after run 2: {left} left, {check.deleted} deleted; expected {expect}, {want_deleted}"
    return results, built


def summarize(results: list[RunResult]) -> dict[str, RunResult]:
    grouped: dict[str, list[RunResult]] = {}
    for r in results:
        grouped.setdefault(r.run, []).append(r)
    out: dict[str, RunResult] = {}
    for run, rs in grouped.items():
        bad = [r for r in rs if r.status != "ok"]
        if bad:
            out[run] = bad[0]
            continue
        med = RunResult(run, -1, command=rs[0].command)
        for f in ("wall_s", "gc_s", "cpu_s", "maxrss_bytes", "scanned", "marked", "candidates", "deleted",
                  "freed_bytes"):
            vals = [getattr(r, f) for r in rs if getattr(r, f) is not None]
            if vals:
                setattr(med, f, statistics.median(vals))
        walls = [r.wall_s for r in rs if r.wall_s]
        if len(walls) > 1 and med.wall_s:
            med.wall_spread = (max(walls) - min(walls)) / med.wall_s
        out[run] = med
    return out


def table(summary: dict[str, RunResult]) -> str:
    import ingest  # fmt (lazy, like measure(): the --child GC process stays lean)
    base = summary.get("baseline")
    floor = base.maxrss_bytes if base and base.status == "ok" else None
    lst = summary.get("list")
    list_s = lst.gc_s if lst and lst.status == "ok" else None
    head = ["run", "wall s", "spread", "gc s", "cpu s", "scanned", "marked", "candidates", "deleted",
            "freed MiB", "peak RSS MiB", "over baseline MiB", "chunks/s", "vs list"]
    rows = [head]
    for run in RUNS:
        r = summary.get(run)
        if r is None:
            continue
        if r.status != "ok":
            lines = [ln for ln in (r.error or "").splitlines() if ln.strip()]
            rows.append([run, f"{r.status}: {lines[-1][:120] if lines else ''}"])
            continue
        over = (r.maxrss_bytes - floor) / MiB if r.maxrss_bytes is not None and floor is not None else None
        vs = r.gc_s / list_s if run.startswith("gc") and r.gc_s and list_s else None
        rows.append([run, ingest.fmt(r.wall_s, ".2f"), "-" if r.wall_spread is None else f"{r.wall_spread * 100:.0f}%",
                     ingest.fmt(r.gc_s, ".2f"), ingest.fmt(r.cpu_s, ".2f"), ingest.fmt(r.scanned, ".0f"), ingest.fmt(r.marked, ".0f"),
                     ingest.fmt(r.candidates, ".0f"), ingest.fmt(r.deleted, ".0f"),
                     ingest.fmt(r.freed_bytes / MiB if r.freed_bytes is not None else None, ".1f"),
                     ingest.fmt(r.maxrss_bytes / MiB if r.maxrss_bytes else None, ".0f"),
                     ingest.fmt(over, ".0f") if run != "baseline" else "-", ingest.fmt(r.chunks_per_s, ".0f"),
                     "-" if vs is None else f"{vs:.2f}x"])
    full = [r for r in rows if len(r) == len(head)]
    widths = [max(len(r[i]) for r in full) for i in range(len(head))]
    lines = []
    for r in rows:
        cells = [f"{c:<{widths[i]}}" if i == 0 else f"{c:>{widths[i]}}" for i, c in enumerate(r)]
        lines.append("  ".join(cells if len(r) == len(head) else [cells[0], r[1]]).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Strata GC time and peak RSS over a store of many chunks.")
    p.add_argument("--store", choices=("local", "s3"), default="local",
                   help="local directory store, or a SeaweedFS S3 server started for the run")
    p.add_argument("--chunks", type=int, help="chunk objects to create (default 100000 local, 20000 s3)")
    p.add_argument("--layers", type=int, default=100, help="layer manifests; every other one gets a ref")
    p.add_argument("--payload", type=int, default=4096, help="random bytes per chunk (default 4096)")
    p.add_argument("--chunk-size", type=int, default=64 << 10, help="layer chunk size; zeros pad the payload")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=8, help="threads writing chunks while building")
    p.add_argument("--delete-workers", type=int, default=8, help="DeleteObjects calls GC keeps in flight")
    p.add_argument("--repeat", type=int, default=1, help="fresh store per repeat; medians reported")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--json", type=Path, metavar="FILE", help="write all numbers to FILE")
    p.add_argument("--timeout", type=float, default=1800, help="per-run timeout, seconds")
    p.add_argument("--keep", action="store_true", help="keep WORKDIR/run (store, server data, logs)")
    p.add_argument("--child", choices=("baseline", "list", "collect"), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--now", type=float, help=argparse.SUPPRESS)
    p.add_argument("--grace", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chunks is None:
        args.chunks = 100_000 if args.store == "local" else 20_000
    if not 0 < args.payload <= args.chunk_size:
        p.error("--payload must be between 1 and --chunk-size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.child, args.spec, args.now, args.grace, args.delete_workers)
    import ingest  # run_measured in measure(); rss_method for the JSON

    run = args.workdir / "run"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    for var in ("STRATA_STORE", "STRATA_REMOTE", "STRATA_CONFIG"):
        os.environ.pop(var, None)
    os.environ["STRATA_STATE_DIR"] = str(run / "state")  # S3 catalogs go here, not to ~
    server = None
    results: list[RunResult] = []
    builds: list[dict[str, Any]] = []
    try:
        if args.store == "s3":
            from tests.seaweedfs_server import SeaweedFS

            server = SeaweedFS(run / "seaweedfs").start()
            server.create_bucket(BUCKET)
            os.environ.update({"STRATA_S3_ENDPOINT": server.endpoint, "AWS_ACCESS_KEY_ID": server.access_key,
                               "AWS_SECRET_ACCESS_KEY": server.secret_key, "AWS_REGION": server.region})
            print(f"# SeaweedFS at {server.endpoint} (up in {server.startup_seconds:.1f} s)", flush=True)
        for rep in range(args.repeat):
            spec = f"s3://{BUCKET}/r{rep}" if server else str(run / f"store-{rep}")
            rs, built = one_repeat(rep, spec, args, run / "logs" / f"r{rep}")
            results += rs
            builds.append(built)
            if not args.keep and not server:
                shutil.rmtree(spec, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)

    summary = summarize(results)
    b = builds[0] if builds else {}
    print()
    print(f"store: {args.store}, {args.chunks} chunks of {args.payload} random bytes (+ zeros to "
          f"{args.chunk_size >> 10} KiB), {b.get('layers')} layers, {b.get('live_layers')} with a ref "
          f"({b.get('live_chunks')} live chunks); grace 0; median of {args.repeat} run(s); cpus={os.cpu_count()}")
    if b:
        print(f"build: {statistics.median(x['seconds'] for x in builds):.1f} s "
              f"({statistics.median(x['chunks_per_s'] for x in builds):.0f} chunks/s written); "
              f"after run 2: {b['surviving']} left, expected {b['expected']}")
    print(table(summary))
    if args.json:
        doc = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
                        "platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": sys.version.split()[0], "rss_method": ingest.rss_method(),
                        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}},
               "builds": builds,
               "summary": [{**asdict(r), "chunks_per_s": r.chunks_per_s} for r in summary.values()],
               "runs": [{**asdict(r), "chunks_per_s": r.chunks_per_s} for r in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
