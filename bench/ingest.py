#!/usr/bin/env python3
"""Ingest benchmark: Strata vs restic, borg and casync on the same raw image.

For every tool, on a fresh repository, the harness times:

* ingest v1  - the mixed image (see ``mkimage.py``),
* ingest v2  - a copy with 1% of its non-zero 1 MiB blocks rewritten,
               into the same repository (measures dedup: stored-bytes growth),
* read v1    - ``strata image export``; for the peers only with ``--restore``.

Each step records wall time, throughput (logical image size / wall time),
user+sys CPU and peak RSS of the child (from ``os.wait4`` rusage, so it is the
tool's own number, not the harness'), and the apparent size of everything in
the tool's repository directory.  ``--repeat N`` re-runs everything on fresh
repositories and the report shows the median of each number.

Usage::

    .venv/bin/python bench/ingest.py                 # 1 GiB image
    .venv/bin/python bench/ingest.py --size 256M --repeat 3 --json out.json

Only the Python standard library is needed; the Strata row is reported as
"not available" while ``.venv/bin/strata`` does not exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mkimage  # noqa: E402  (bench/ is not a package; see sys.path above)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKDIR = Path("/var/tmp/strata-bench")
DEFAULT_TOOLS = ("strata", "restic", "borg", "casync")
STEPS = ("ingest_v1", "ingest_v2", "read_v1")
MiB = 1 << 20


# --------------------------------------------------------------------------
# running and measuring one child process
# --------------------------------------------------------------------------

@dataclass
class Measured:
    """Everything we learn from one child: its rusage is the tool's own cost."""

    cmd: str
    returncode: int
    wall_s: float
    user_s: float
    sys_s: float
    maxrss_bytes: int | None
    stdout: str
    stderr_tail: str
    timed_out: bool = False


def shell_line(cmd: list[str], env_shown: dict[str, str], cwd: Path | None) -> str:
    """Render a command exactly as one could paste it into a shell."""
    prefix = f"cd {shlex.quote(str(cwd))} && " if cwd else ""
    envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in env_shown.items())
    return prefix + (envs + " " if envs else "") + shlex.join(cmd)


GNU_TIME = Path("/usr/bin/time")

# Fallback when GNU time is missing: a small fresh interpreter that spawns the
# tool and reports the tool's own ru_maxrss (KiB) into the file argv[1].
_PY_LAUNCHER = (
    "import os,sys\n"
    "pid=os.posix_spawnp(sys.argv[2],sys.argv[2:],os.environ)\n"
    "_,s,ru=os.wait4(pid,0)\n"
    "open(sys.argv[1],'w').write(str(ru.ru_maxrss))\n"
    "c=os.waitstatus_to_exitcode(s)\n"
    "sys.exit(c if c>=0 else 128-c)\n"
)


def rss_method() -> str:
    """Which launcher measures peak RSS; recorded in the JSON meta."""
    return "gnu-time" if GNU_TIME.is_file() else "python-launcher (floor ~8 MiB)"


def _wrap_for_rss(cmd: list[str], rss_file: Path) -> list[str]:
    """Run ``cmd`` under a small launcher that reports the tool's own peak RSS.

    Why not just ``os.wait4`` on the tool: Linux carries the pre-exec
    ``ru_maxrss`` of a forked/vforked child across ``execve``, so a tool started
    straight from this (large) Python process would inherit the harness' RSS
    as its floor (measured: 216 MiB for ``true``).  GNU time is ~1 MiB, so the
    tool it forks starts from ~1 MiB.
    """
    if GNU_TIME.is_file():
        return [str(GNU_TIME), "-f", "%M", "-o", str(rss_file), *cmd]
    return [sys.executable, "-I", "-S", "-c", _PY_LAUNCHER, str(rss_file), *cmd]


def _read_rss_kib(rss_file: Path) -> int | None:
    """Last line of the launcher's report (GNU time prefixes exit-status notes)."""
    try:
        lines = rss_file.read_text().split()
        return int(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def run_measured(cmd: list[str], env_extra: dict[str, str], log_dir: Path,
                 timeout: float, cwd: Path | None = None, echo: bool = True) -> Measured:
    """Run ``cmd``; time it here, take CPU from ``os.wait4``, peak RSS from the launcher.

    CPU from wait4 of the launcher includes the tool (its reaped child), and
    the launcher's own CPU is negligible.  stdout/stderr go to files, not
    pipes, so a chatty tool cannot block on a full pipe while we sit in wait4.
    """
    line = shell_line(cmd, env_extra, cwd)
    if echo:
        print(f"$ {line}", flush=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / "last.stdout", log_dir / "last.stderr"
    rss_path = log_dir / "last.maxrss"
    rss_path.unlink(missing_ok=True)
    env = {**os.environ, **env_extra}
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(_wrap_for_rss(cmd, rss_path), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                start_new_session=True)
        killer = threading.Timer(timeout, _kill_group, (proc.pid,))
        killer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from reaping again
    rss_kib = _read_rss_kib(rss_path)
    stderr = err_path.read_text(errors="replace")
    if wall >= timeout:
        stderr += f"\nkilled after --timeout {timeout:g}s"
    return Measured(line, proc.returncode, wall, ru.ru_utime, ru.ru_stime,
                    rss_kib * 1024 if rss_kib is not None else None,
                    out_path.read_text(errors="replace"), stderr[-2000:],
                    timed_out=wall >= timeout)


def _kill_group(pid: int) -> None:
    """Timeout handler: kill the child's whole session (it was started in its own)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tree_bytes(path: Path) -> int:
    """Apparent size of all regular files under ``path`` (what a copy would move)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            total += st.st_size
    return total


def files_equal(a: Path, b: Path) -> bool:
    """Compare two files 1 MiB at a time (C-level bytes compare, no byte loop)."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb", buffering=0) as fa, open(b, "rb", buffering=0) as fb:
        while True:
            x, y = fa.read(MiB), fb.read(MiB)
            if x != y:
                return False
            if not x:
                return True


def warm(path: Path) -> float:
    """Read ``path`` once so every tool starts with the image in page cache."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * MiB):
            pass
    return time.perf_counter() - t0


# --------------------------------------------------------------------------
# tools
# --------------------------------------------------------------------------

ReadSpec = tuple[list[str], Path, "Path | None"]
"""(command, file it produces, working directory) for reading an image back."""


@dataclass
class Ctx:
    """Inputs shared by all tools in one repeat."""

    v1: Path
    v2: Path
    logical: int
    timeout: float
    restore: bool
    strata_bin: Path
    strata_import_args: list[str] = field(default_factory=list)


class Tool:
    """One backup/store tool: how to set up a repo, ingest and read back.

    ``dir`` is a per-tool scratch directory; ``repo(dir)`` is the part of it
    counted as stored bytes (caches and restore targets live outside it).
    """

    name = "?"

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx

    def missing(self) -> str | None:
        """Why the tool cannot run here, or None."""
        return None if shutil.which(self.binary()) else f"{self.binary()} not found"

    def binary(self) -> str:
        """Executable looked up on PATH (the name by default)."""
        return self.name

    def env(self, d: Path) -> dict[str, str]:
        """Extra environment; shown in the printed command lines."""
        return {}

    def repo(self, d: Path) -> Path:
        """Directory whose apparent size counts as stored bytes."""
        return d / "repo"

    def setup(self, d: Path) -> list[list[str]]:
        """Untimed commands that create an empty repository."""
        return []

    def ingest(self, d: Path, image: Path, tag: str) -> list[str]:
        """The timed command that stores ``image`` under ``tag``."""
        raise NotImplementedError

    def read(self, d: Path, tag: str, image: Path, out_dir: Path) -> ReadSpec | None:
        """How to read ``tag`` back into ``out_dir``, or None if the tool cannot."""
        return None

    def version(self) -> str:
        """First line of ``--version``, recorded so numbers can be traced to releases."""
        try:
            r = subprocess.run([self.binary(), "--version"], capture_output=True, text=True, timeout=30)
            return (r.stdout or r.stderr).strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            return "unknown"


class Strata(Tool):
    """The system under test; its CLI prints one JSON object per command."""

    name = "strata"

    def binary(self) -> str:
        return str(self.ctx.strata_bin)

    def missing(self) -> str | None:
        b = self.ctx.strata_bin
        return None if b.is_file() and os.access(b, os.X_OK) else f"{b} not found"

    def repo(self, d: Path) -> Path:
        return d / "store"

    def ingest(self, d: Path, image: Path, tag: str) -> list[str]:
        return [self.binary(), "--store", str(self.repo(d)), "image", "import",
                str(image), f"bench:{tag}", "--json", *self.ctx.strata_import_args]

    def version(self) -> str:
        """The CLI has no --version; the git commit of the checkout identifies it."""
        git = ["git", "-C", str(REPO_ROOT)]
        try:
            head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=30).stdout.strip() or "no commit"
            dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown"
        return f"git {head}{' + uncommitted changes' if dirty else ''}"

    def read(self, d: Path, tag: str, image: Path, out_dir: Path) -> ReadSpec:
        out = out_dir / f"{tag}.img"
        return ([self.binary(), "--store", str(self.repo(d)), "image", "export",
                 f"bench:{tag}", str(out), "--json"], out, None)


class Restic(Tool):
    """restic with repository format 2 (zstd 'auto' compression), no cache."""

    name = "restic"

    def env(self, d: Path) -> dict[str, str]:
        return {"RESTIC_PASSWORD": "bench", "XDG_CACHE_HOME": str(d / "xdg-cache")}

    def setup(self, d: Path) -> list[list[str]]:
        return [["restic", "-r", str(self.repo(d)), "init", "-q"]]

    def ingest(self, d: Path, image: Path, tag: str) -> list[str]:
        return ["restic", "-r", str(self.repo(d)), "--no-cache", "backup", "-q",
                "--tag", tag, str(image)]

    def read(self, d: Path, tag: str, image: Path, out_dir: Path) -> ReadSpec:
        cmd = ["restic", "-r", str(self.repo(d)), "--no-cache", "restore", "latest",
               "--tag", tag, "--target", str(out_dir)]
        return cmd, out_dir / str(image).lstrip("/"), None

    def version(self) -> str:
        r = subprocess.run(["restic", "version"], capture_output=True, text=True)
        return r.stdout.strip()


class Borg(Tool):
    """borg 1.x, unencrypted repo, zstd level 3, default buzhash chunker."""

    name = "borg"
    create_opts: tuple[str, ...] = ("--compression", "zstd,3")

    def binary(self) -> str:
        return "borg"

    def env(self, d: Path) -> dict[str, str]:
        return {"BORG_BASE_DIR": str(d / "base"),
                "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
                "BORG_RELOCATED_REPO_ACCESS_IS_OK": "yes"}

    def setup(self, d: Path) -> list[list[str]]:
        return [["borg", "init", "--encryption", "none", str(self.repo(d))]]

    def ingest(self, d: Path, image: Path, tag: str) -> list[str]:
        return ["borg", "create", *self.create_opts, f"{self.repo(d)}::{tag}", str(image)]

    def read(self, d: Path, tag: str, image: Path, out_dir: Path) -> ReadSpec:
        cmd = ["borg", "extract", "--sparse", f"{self.repo(d)}::{tag}"]
        return cmd, out_dir / str(image).lstrip("/"), out_dir


class BorgFixed(Borg):
    """borg with Strata-like fixed 1 MiB chunks and hole detection (not default).

    Useful to separate "chunking strategy" from "implementation speed" when
    comparing with Strata, which also cuts fixed 1 MiB chunks.
    """

    name = "borg-fixed"
    create_opts = ("--compression", "zstd,3", "--chunker-params", "fixed,1048576", "--sparse")


class Casync(Tool):
    """casync blob index into a local chunk store (zstd, 64 KiB average chunks)."""

    name = "casync"

    def repo(self, d: Path) -> Path:
        return d / "repo"  # holds store.castr/ and the *.caibx indexes

    def setup(self, d: Path) -> list[list[str]]:
        self.repo(d).mkdir(parents=True, exist_ok=True)
        return []

    def ingest(self, d: Path, image: Path, tag: str) -> list[str]:
        r = self.repo(d)
        return ["casync", "make", f"--store={r / 'store.castr'}", str(r / f"{tag}.caibx"), str(image)]

    def read(self, d: Path, tag: str, image: Path, out_dir: Path) -> ReadSpec:
        r = self.repo(d)
        out = out_dir / f"{tag}.img"
        return (["casync", "extract", f"--store={r / 'store.castr'}", str(r / f"{tag}.caibx"),
                 str(out)], out, None)


TOOLS: dict[str, type[Tool]] = {t.name: t for t in (Strata, Restic, Borg, BorgFixed, Casync)}


# --------------------------------------------------------------------------
# one repeat of one tool
# --------------------------------------------------------------------------

@dataclass
class StepResult:
    """Numbers for one (tool, step, repeat)."""

    tool: str
    step: str
    repeat: int
    status: str = "ok"            # ok | not available | failed | skipped
    error: str | None = None
    command: str | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    sync_s: float | None = None   # writeback the tool left dirty, timed after it exited
    maxrss_bytes: int | None = None
    logical_bytes: int | None = None
    stored_bytes: int | None = None
    growth_bytes: int | None = None
    verified: bool | None = None
    wall_spread: float | None = None  # (max - min) / median of wall_s over repeats
    tool_json: Any = None

    @property
    def mib_s(self) -> float | None:
        if self.wall_s and self.logical_bytes:
            return self.logical_bytes / MiB / self.wall_s
        return None


def _parse_json(text: str) -> Any:
    """Strata prints one JSON object; keep it verbatim in the report if it parses."""
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return json.loads(text.splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return None


def _timed_step(tool: Tool, d: Path, name: str, repeat: int, cmd: list[str],
                cwd: Path | None = None) -> StepResult:
    """Run one measured command, then flush writeback (untimed, reported as sync_s)."""
    ctx = tool.ctx
    m = run_measured(cmd, tool.env(d), d / "logs" / name, ctx.timeout, cwd)
    t0 = time.perf_counter()
    os.sync()
    res = StepResult(tool.name, name, repeat, command=m.cmd, wall_s=m.wall_s,
                     cpu_s=m.user_s + m.sys_s, sync_s=time.perf_counter() - t0,
                     maxrss_bytes=m.maxrss_bytes, logical_bytes=ctx.logical)
    if tool.name == "strata":
        res.tool_json = _parse_json(m.stdout)
    if m.returncode != 0:
        res.status, res.error = "failed", f"exit {m.returncode}: {m.stderr_tail.strip()[-500:]}"
    return res


def run_tool(tool: Tool, d: Path, repeat: int) -> list[StepResult]:
    """Fresh repo, ingest v1, ingest v2, optionally read v1 back and verify it."""
    ctx = tool.ctx
    why = tool.missing()
    if why:
        return [StepResult(tool.name, s, repeat, "not available", why) for s in STEPS]
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for cmd in tool.setup(d):
        m = run_measured(cmd, tool.env(d), d / "logs" / "setup", ctx.timeout)
        if m.returncode != 0:
            err = f"setup exit {m.returncode}: {m.stderr_tail.strip()[-500:]}"
            return [StepResult(tool.name, s, repeat, "failed", err) for s in STEPS]

    results: list[StepResult] = []
    previous = 0
    for step, image, tag in (("ingest_v1", ctx.v1, "v1"), ("ingest_v2", ctx.v2, "v2")):
        r = _timed_step(tool, d, step, repeat, tool.ingest(d, image, tag))
        r.stored_bytes = tree_bytes(tool.repo(d))
        r.growth_bytes = r.stored_bytes - previous
        previous = r.stored_bytes
        results.append(r)
        if r.status != "ok":
            results += [StepResult(tool.name, s, repeat, "skipped", f"{step} failed")
                        for s in STEPS[len(results):]]
            return results
    results.append(_read_step(tool, d, repeat))
    return results


def _read_step(tool: Tool, d: Path, repeat: int) -> StepResult:
    """Export/restore v1 and check it is byte-identical to the input image."""
    ctx = tool.ctx
    wanted = tool.name == "strata" or ctx.restore
    out_dir = d / "readback"
    spec = tool.read(d, "v1", ctx.v1, out_dir) if wanted else None
    if spec is None:
        return StepResult(tool.name, "read_v1", repeat, "skipped", "use --restore")
    cmd, produced, cwd = spec
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    r = _timed_step(tool, d, "read_v1", repeat, cmd, cwd)
    if r.status == "ok":
        r.verified = produced.is_file() and files_equal(produced, ctx.v1)
        if not r.verified:
            r.status, r.error = "failed", f"read-back {produced} differs from {ctx.v1}"
    shutil.rmtree(out_dir, ignore_errors=True)
    return r


# --------------------------------------------------------------------------
# aggregation and report
# --------------------------------------------------------------------------

NUMERIC = ("wall_s", "cpu_s", "sync_s", "maxrss_bytes", "stored_bytes", "growth_bytes")


def summarize(results: list[Any], numeric: tuple[str, ...] = NUMERIC) -> dict[tuple[str, str], Any]:
    """Median of each `numeric` field over repeats; a step counts only if all repeats ran ok.

    Works for any step-result dataclass with tool, step, repeat, status,
    verified, wall_s and wall_spread (bench/transfer.py uses it too); the
    other fields are taken from the first repeat.
    """
    grouped: dict[tuple[str, str], list[Any]] = {}
    for r in results:
        grouped.setdefault((r.tool, r.step), []).append(r)
    summary: dict[tuple[str, str], Any] = {}
    for key, rs in grouped.items():
        bad = [r for r in rs if r.status != "ok"]
        if bad:
            summary[key] = bad[0]
            continue
        med = dataclasses.replace(rs[0], repeat=-1, wall_spread=None,
                                  verified=all(r.verified for r in rs) if rs[0].verified is not None else None)
        for f in numeric:
            vals = [getattr(r, f) for r in rs if getattr(r, f) is not None]
            if vals:
                setattr(med, f, statistics.median(vals))
        walls = [r.wall_s for r in rs if r.wall_s is not None]
        if len(walls) > 1 and med.wall_s:
            med.wall_spread = (max(walls) - min(walls)) / med.wall_s
        summary[key] = med
    return summary


def _ingest_metrics(step: str) -> dict[str, str]:
    metrics = {"time": "wall_s", "rss": "maxrss_bytes",
               "stored": "growth_bytes" if step == "ingest_v2" else "stored_bytes"}
    if step == "read_v1":
        del metrics["stored"]
    return metrics


def ratios(summary: dict[tuple[str, str], Any], tools: list[str], *,
           steps: tuple[str, ...] = STEPS,
           metrics: Callable[[str], dict[str, str]] = _ingest_metrics) -> list[dict[str, Any]]:
    """peer/strata ratios of each step's `metrics` (label -> field; >1 = the peer takes or uses more)."""
    out: list[dict[str, Any]] = []
    for step in steps:
        base = summary.get(("strata", step))
        if not base or base.status != "ok":
            continue
        for tool in tools:
            peer = summary.get((tool, step))
            if tool == "strata" or not peer or peer.status != "ok":
                continue
            for label, f in metrics(step).items():
                a, b = getattr(peer, f), getattr(base, f)
                if a is not None and b:
                    out.append({"tool": tool, "step": step, "metric": label, "ratio": a / b})
    return out


INGEST_VS_RESTIC = 3.0  # issue 36: ingest 3x restic's speed in the same run ...
STORED_VS_RESTIC = 1.05  # ... storing about what restic stores (at most 5% more)


def targets(summary: dict[tuple[str, str], Any]) -> list[tuple[str, bool | None]]:
    """Issue 36's ingest targets, each ok (True), missed (False) or not measured (None)."""
    def ok(tool: str, step: str) -> Any:
        r = summary.get((tool, step))
        return r if r is not None and r.status == "ok" else None

    strata, restic, export = ok("strata", "ingest_v1"), ok("restic", "ingest_v1"), ok("strata", "read_v1")
    both = strata is not None and restic is not None
    return [
        (f"ingest v1 at least {INGEST_VS_RESTIC:g}x restic's speed",
         restic.wall_s >= INGEST_VS_RESTIC * strata.wall_s if both else None),
        (f"stored v1 at most {STORED_VS_RESTIC:g}x restic's",
         strata.stored_bytes <= STORED_VS_RESTIC * restic.stored_bytes if both else None),
        ("export v1 at least as fast as ingest v1",
         export.wall_s <= strata.wall_s if strata is not None and export is not None else None),
    ]


def _last_line(text: str | None, limit: int = 100) -> str:
    """Last non-empty line of an error, where tools put the actual message."""
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


def fmt_mib(n: float | None, spec: str = ".1f") -> str:
    return "-" if n is None else format(n / MiB, spec)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(summary: dict[tuple[str, str], StepResult], tools: list[str],
          rat: list[dict[str, Any]]) -> str:
    """Aligned plain-text table, one row per (tool, step)."""
    time_ratio = {(r["tool"], r["step"]): r["ratio"] for r in rat if r["metric"] == "time"}
    head = ["tool", "step", "time s", "spread", "MiB/s", "cpu s", "sync s", "peak RSS MiB",
            "stored MiB", "growth MiB", "stored/logical", "time vs strata"]
    rows = [head]
    for tool in tools:
        for step in STEPS:
            r = summary.get((tool, step))
            if r is None:
                continue
            if r.status != "ok":
                rows.append([tool, step, f"{r.status}: {_last_line(r.error)}"])
                continue
            stored_ratio = (r.stored_bytes / r.logical_bytes
                            if r.stored_bytes is not None and r.logical_bytes and step == "ingest_v1" else None)
            tr = time_ratio.get((tool, step))
            spread = "-" if r.wall_spread is None else f"{r.wall_spread * 100:.0f}%"
            rows.append([tool, step, fmt(r.wall_s, ".2f"), spread, fmt(r.mib_s, ".0f"), fmt(r.cpu_s, ".2f"),
                         fmt(r.sync_s, ".2f"), fmt_mib(r.maxrss_bytes), fmt_mib(r.stored_bytes),
                         fmt_mib(r.growth_bytes), fmt(stored_ratio, ".3f"),
                         "-" if tr is None else f"{tr:.2f}x"])
    return align(rows)


def align(rows: list[list[str]]) -> str:
    """Left-align tool/step, right-align numbers; short rows are status messages."""
    full = [r for r in rows if len(r) == len(rows[0])]
    widths = [max(len(r[i]) for r in full) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [f"{c:<{widths[i]}}" if i < 2 else f"{c:>{widths[i]}}" for i, c in enumerate(r)]
        if len(r) < len(rows[0]):
            cells = cells[:2] + [r[2]]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def ratio_lines(rat: list[dict[str, Any]]) -> list[str]:
    """One line per (peer, metric): "restic/strata time = 2.30x ingest_v1, ..."."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for r in rat:
        grouped.setdefault((r["tool"], r["metric"]), []).append(f"{r['ratio']:.2f}x {r['step']}")
    labels = {"time": "time  ", "stored": "stored", "rss": "rss   "}
    tools = list(dict.fromkeys(r["tool"] for r in rat))
    width = max((len(t) for t in tools), default=0)
    return [f"{tool + '/strata':<{width + 7}} {labels[metric]} = {', '.join(grouped[(tool, metric)])}"
            for tool in tools for metric in labels if (tool, metric) in grouped]


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------

def prepare_images(workdir: Path, size: int, seed: int, pct: float, regen: bool) -> dict[str, Any]:
    """Create (or reuse, keyed by size/seed/pct) the v1 and changed v2 images."""
    img_dir = workdir / "images"
    v1 = img_dir / f"mixed-{size}-s{seed}.img"
    v2 = img_dir / f"mixed-{size}-s{seed}-changed{pct:g}.img"
    info: dict[str, Any] = {"v1": str(v1), "v2": str(v2)}
    if regen or not v1.exists():
        print(f"# generating {v1}", flush=True)
        info["v1_info"] = asdict(mkimage.make_image(v1, size, seed))
    if regen or not v2.exists():
        print(f"# generating {v2}", flush=True)
        info["v2_info"] = asdict(mkimage.make_changed(v1, v2, pct, seed))
    for key in ("v1", "v2"):
        p = Path(info[key])
        info[f"{key}_apparent_bytes"] = p.stat().st_size
        info[f"{key}_allocated_bytes"] = p.stat().st_blocks * 512
    return info


def meta(args: argparse.Namespace, tools: list[Tool]) -> dict[str, Any]:
    """Environment facts that make numbers comparable across machines."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "versions": {t.name: (t.version() if not t.missing() else "not available") for t in tools},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rss_method": rss_method(),
        "page_cache": "input images read once before the first tool; not dropped between tools",
    }


def tool_names(text: str, known: Any) -> list[str]:
    """The --tools list, or exit naming the unknown ones (shared by the benchmarks)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown tool(s): {unknown}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Strata ingest benchmark vs restic/borg/casync.")
    p.add_argument("--size", default="1G", help="image size (default 1G); e.g. 256M for a quick try")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--change-pct", type=float, default=1.0,
                   help="percent of non-zero blocks rewritten in v2 (default 1)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--repeat", type=int, default=1, help="runs per tool; medians reported")
    p.add_argument("--tools", default=",".join(DEFAULT_TOOLS),
                   help=f"comma list from {','.join(TOOLS)} (default {','.join(DEFAULT_TOOLS)})")
    p.add_argument("--restore", action="store_true",
                   help="also time restic restore / borg extract / casync extract of v1")
    p.add_argument("--strata", type=Path, default=REPO_ROOT / ".venv" / "bin" / "strata",
                   help="strata executable (default .venv/bin/strata)")
    p.add_argument("--strata-import-args", default="", metavar="ARGS",
                   help="extra args for strata image import, e.g. '--level 3' to match borg")
    p.add_argument("--json", type=Path, metavar="FILE", help="write all numbers to FILE")
    p.add_argument("--timeout", type=float, default=3600, help="per-command timeout, seconds")
    p.add_argument("--regen", action="store_true", help="regenerate images even if cached")
    return p.parse_args(argv)


def set_aside_runs(workdir: Path) -> tuple[Path, Path | None]:
    """This invocation's runs directory, and the last one's, moved aside to
    be deleted after every measurement (None if there was none).

    Nothing is deleted before or between measurements: on ext4 without a
    journal (this host's root), the inode allocator skips every inode freed
    in the last minute or more, one buffer lookup each, so a file created
    just after a repository of ~800 files was deleted cost far more: a
    1 GiB Strata import (one file per chunk) went 1.4 -> 2.2 s with the
    system time doubling over four delete-then-import rounds, whichever
    store layout wrote the files. restic's few pack files hardly notice.
    The last runs stay on disk until the next invocation ends (or look at
    them: they are the repositories just measured)."""
    runs = workdir / "runs"
    earlier = None
    if runs.exists():
        earlier = workdir / f"runs.old-{os.getpid()}"
        runs.rename(earlier)
    return runs, earlier


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = mkimage.parse_size(args.size)
    names = tool_names(args.tools, TOOLS)
    args.workdir.mkdir(parents=True, exist_ok=True)
    images = prepare_images(args.workdir, size, args.seed, args.change_pct, args.regen)
    v1, v2 = Path(images["v1"]), Path(images["v2"])
    images["warm_read_s"] = warm(v1) + warm(v2)
    strata_bin = args.strata.resolve() if args.strata.exists() else args.strata
    ctx = Ctx(v1, v2, v1.stat().st_size, args.timeout, args.restore, strata_bin,
              shlex.split(args.strata_import_args))
    tools = [TOOLS[n](ctx) for n in names]
    info = meta(args, tools)

    runs, earlier = set_aside_runs(args.workdir)
    results: list[StepResult] = []
    for rep in range(args.repeat):
        for tool in tools:
            print(f"# repeat {rep + 1}/{args.repeat}: {tool.name}", flush=True)
            results += run_tool(tool, runs / str(rep + 1) / tool.name, rep)
    if earlier is not None:  # only now: see set_aside_runs
        shutil.rmtree(earlier, ignore_errors=True)

    summary = summarize(results)
    rat = ratios(summary, names)
    print()
    print(f"image: {v1} ({ctx.logical / MiB:.0f} MiB logical, "
          f"{images['v1_allocated_bytes'] / MiB:.0f} MiB allocated); "
          f"v2 = {args.change_pct:g}% of non-zero blocks rewritten; "
          f"median of {args.repeat} run(s); cpus={os.cpu_count()}")
    print(table(summary, names, rat))
    print()
    print("\n".join(ratio_lines(rat)) if rat else "ratios vs strata: n/a (strata not available or failed)")
    checks = targets(summary)
    print("\nTargets (medians)")
    for name, met in checks:
        print(f"  {name:45} {'n/a (not run)' if met is None else 'ok' if met else 'MISSED'}")
    if args.json:
        doc = {"meta": info, "images": images, "targets": {name: met for name, met in checks},
               "summary": [{**asdict(r), "mib_s": r.mib_s} for r in summary.values()],
               "ratios": rat, "runs": [{**asdict(r), "mib_s": r.mib_s} for r in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if all(r.status in ("ok", "not available", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
