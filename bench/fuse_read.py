#!/usr/bin/env python3
"""FUSE read benchmark: Strata's lazy mount vs the raw file vs rclone's VFS cache.

One run measures, side by side (medians over ``--repeat N``, because shared
machines are noisy):

1. sequential 1 MiB reads of the mixed image: raw file, Strata cold (empty
   chunk cache) and warm (chunk cache full), rclone ``--vfs-cache-mode full``
   cold and warm; each buffered and with O_DIRECT.  The page cache is dropped
   before every read, so every row reads its bytes from the disk: the store's
   chunk files for Strata cold, the chunk cache for Strata warm. (On a VM
   the host may still cache them: the raw file is read once, untimed, first,
   so that it does for the raw rows too.)
2. 4 KiB random reads (seeded offsets) on warm caches: p50/p99 latency.
3. seals while another process streams 1 MiB writes into the sandbox, each
   asked both ways: ``strata disk seal`` (its wall includes Python's start)
   and one request on the control socket, as a VMM asks.
4. mount time and open()-to-first-4-KiB latency of a fresh 10 GiB sparse image.

Usage (root: dropping the page cache needs it)::

    .venv/bin/python bench/fuse_read.py [--size 1G] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.mkimage import keystream, make_image, parse_size  # noqa: E402
from fusefs.client import MountClient  # noqa: E402
from layerstore.errors import StrataError  # noqa: E402

BS, PAGE = 1 << 20, 4096
MB = 1e6  # MB/s are decimal megabytes, like the targets
BUSY = "still being published"  # how the daemon refuses a seal while the previous one publishes
STRATA = str(ROOT / ".venv" / "bin" / "strata")
MODES = (("buffered", False), ("direct", True))
COMMANDS: list[str] = []


def note(cmd: str) -> None:
    """Print and keep every command (or in-process I/O) exactly as run, for the JSON too."""
    COMMANDS.append(cmd)
    print(f"$ {cmd}", flush=True)


def sh(cmd: list[str], env: dict[str, str], check: bool = True) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run a command; return it and its wall time, process start included."""
    note(shlex.join(cmd))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if check and p.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return p, wall


def drop_caches() -> None:
    """Evict clean pages, so each read measures where the bytes really live (disk, not RAM)."""
    note("sync; echo 3 > /proc/sys/vm/drop_caches")
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile: p99 of 20 samples is their max, with no interpolation to flatter it."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))] if s else float("nan")


def open_fd(path: Path, direct: bool) -> int:
    return os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))


def seq_read(path: Path, direct: bool, size: int) -> float:
    """Whole file in 1 MiB preadv calls into an mmap (page-aligned, as O_DIRECT needs); MB/s."""
    note(f"python: preadv({path}, bs=1M, {'O_DIRECT' if direct else 'buffered'}) until EOF")
    buf, fd, total = mmap.mmap(-1, BS), open_fd(path, direct), 0
    t0 = time.perf_counter()
    try:
        while (n := os.preadv(fd, [buf], total)) > 0:
            total += n
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    if total != size:
        raise RuntimeError(f"{path}: read {total} bytes, expected {size}")
    return total / dt / MB


def rand_read(path: Path, offsets: list[int], direct: bool,
              expect: list[bytes] | None) -> tuple[dict[str, float], list[bytes]]:
    """Time each 4 KiB pread alone; hash outside the timer to check the bytes against the raw file."""
    note(f"python: {len(offsets)} x preadv({path}, 4K, seeded offsets, {'O_DIRECT' if direct else 'buffered'})")
    buf, fd = mmap.mmap(-1, PAGE), open_fd(path, direct)
    lat: list[float] = []
    got: list[bytes] = []
    try:
        for off in offsets:
            t0 = time.perf_counter_ns()
            os.preadv(fd, [buf], off)
            lat.append((time.perf_counter_ns() - t0) / 1000)
            got.append(hashlib.blake2b(buf, digest_size=8).digest())
    finally:
        os.close(fd)
    bad = sum(a != b for a, b in zip(got, expect)) if expect else 0
    return {"p50_us": pct(lat, 50), "p99_us": pct(lat, 99), "mismatches": bad}, got


def make_sparse(path: Path, size: int, data: int, seed: int) -> None:
    """Big sparse disk with `data` bytes in 1 MiB blocks: block 0 (where a boot reads first) + seeded others."""
    blocks = sorted({0, *random.Random(f"sparse:{seed}").sample(range(1, size // BS), data // BS - 1)})
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for b in blocks:
            f.seek(b * BS)
            f.write(keystream(seed, "sparse", b, BS))
        f.truncate(size)
    tmp.rename(path)


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [m for m in (line.split()[4] for line in f) if m == str(path) or m.startswith(f"{path}/")]


def clear_run_dir(run: Path) -> None:
    """rm -rf the run dir, never through a live mount (rclone's is read-write over the image dir)."""
    for mp in mounts_under(run):
        print(f"# leftover mount {mp}: detaching")
        subprocess.run(["fusermount3", "-u", "-z", mp])
    if not mounts_under(run):
        shutil.rmtree(run, ignore_errors=True)


class Mounts:
    """Every mount this run started, so `cleanup` undoes exactly those (by mountpoint, then pid)."""

    def __init__(self, env: dict[str, str], run: Path) -> None:
        self.env, self.run = env, run
        self.strata: dict[Path, int] = {}
        self.rclone: dict[Path, subprocess.Popen[bytes]] = {}

    def strata_mount(self, mp: Path, cache: Path) -> float:
        """`strata mount`; returns its wall time in ms (CLI start to mount serving)."""
        mp.mkdir(parents=True, exist_ok=True)
        p, wall = sh([STRATA, "mount", str(mp), "--cache-dir", str(cache), "--cache-size", "2G", "--json"], self.env)
        self.strata[mp] = json.loads(p.stdout)["pid"]
        return wall * 1000

    def strata_umount(self, mp: Path) -> None:
        pid = self.strata.pop(mp)
        if sh([STRATA, "umount", str(mp), "--json"], self.env, check=False)[0].returncode:
            self._fusermount(mp)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

    def rclone_mount(self, src: Path, mp: Path, cache: Path) -> None:
        """rclone in the foreground under our Popen instead of --daemon: same code path, exact pid."""
        mp.mkdir(parents=True, exist_ok=True)
        cmd = ["rclone", "mount", str(src), str(mp), "--vfs-cache-mode", "full", "--cache-dir", str(cache)]
        note(shlex.join(cmd) + " &")
        with open(self.run / "rclone.log", "ab") as log:
            self.rclone[mp] = proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 30
        while not mounts_under(mp):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rclone mount {mp} did not come up (see {self.run / 'rclone.log'})")
            time.sleep(0.05)

    def rclone_umount(self, mp: Path) -> None:
        proc = self.rclone.pop(mp)
        self._fusermount(mp)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def _fusermount(self, mp: Path) -> None:
        if mounts_under(mp) and sh(["fusermount3", "-u", str(mp)], self.env, check=False)[0].returncode:
            sh(["fusermount3", "-u", "-z", str(mp)], self.env, check=False)

    def cleanup(self) -> None:
        for mp in list(self.strata):
            self.strata_umount(mp)
        for mp in list(self.rclone):
            self.rclone_umount(mp)


# The seal test's writer: 1 MiB blocks, each with a fresh counter in its first
# 8 bytes, until its stdin closes; then it closes the file and prints
# {"bytes": N, "errors": [...]}.
WRITER = """
import json, os, sys, threading
path = sys.argv[1]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
buf, size, off, i, done, errors = bytearray(os.urandom(1 << 20)), os.stat(path).st_size, 0, 0, 0, []
fd = os.open(path, os.O_WRONLY)
while not stop.is_set():
    buf[:8], i = i.to_bytes(8, "little"), i + 1
    try:
        done += os.pwrite(fd, buf, off)
    except OSError as exc:
        errors.append(f"write at {off}: {exc}")
        stop.wait(0.01)
        continue
    off = (off + len(buf)) % size
try:
    os.close(fd)  # flush: the daemon fsyncs the upper layer here
except OSError as exc:
    errors.append(f"close: {exc}")
print(json.dumps({"bytes": done, "errors": errors}))
"""


def seal_test(m: Mounts, mp: Path, ref: str, sid: str, n: int, pause: float) -> dict[str, Any]:
    """Seal n times while another process writes 1 MiB blocks nonstop; it must see no error.

    Each block gets a fresh counter in its first 8 bytes, so every sealed chunk is new
    data the background publisher must really hash, compress and store (the load a
    real VM would put on the daemon while it seals).
    """
    sh([STRATA, "disk", "new", sid, "--image", ref, "--mount", str(mp), "--json"], m.env)
    disk = mp / "sandboxes" / sid / "disk.img"
    # Floor: the same CLI asking the same daemon a trivial question, before any load.
    floor = [sh([STRATA, "disk", "ls", "--mount", str(mp), "--json"], m.env)[1] * 1000 for _ in range(3)]
    # The writer is its own process, as a VM's is: a writer thread in this
    # process made every fork/exec here wait behind its FUSE writes (~250 ms
    # for /bin/true), which the CLI's wall then measured.
    cmd = [sys.executable, "-c", WRITER, str(disk)]
    note(shlex.join(cmd[:2]) + " WRITER " + shlex.quote(str(disk)) + "  # 1 MiB pwrites, sequential, wrapping, until stopped")
    t0 = time.perf_counter()
    writer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # let the writer dirty some chunks first
    switch, wall, request, dirty, busy, failed, bare = [], [], [], [], [], [], []
    client = MountClient(mp, run_dir=Path(m.env["STRATA_RUN_DIR"]))

    def done(reply: dict[str, Any], ms: float, walls: list[float]) -> None:
        switch.append(reply["switch_ms"])
        dirty.append(reply["dirty_chunks"])
        walls.append(ms)

    def refused(error: str) -> None:
        # busy: the previous seal's chunks are not in the store yet
        (busy if BUSY in error else failed).append(error.strip())

    for _ in range(n):
        # the floor under this load: starting any Python process at all
        bare.append(sh([sys.executable, "-c", "pass"], m.env)[1] * 1000)
        p, w = sh([STRATA, "disk", "seal", sid, "--mount", str(mp), "--json"], m.env, check=False)
        if p.returncode == 0:
            done(json.loads(p.stdout), w * 1000, wall)
        else:
            refused(p.stderr)
        time.sleep(pause)
        # the same seal as a VMM asks for it: one request on the control socket
        note(f"MountClient({str(mp)!r}).seal({sid!r})  # in this process")
        t = time.perf_counter()
        try:
            reply = asdict(client.seal(sid))
            done(reply, (time.perf_counter() - t) * 1000, request)
        except StrataError as exc:
            refused(str(exc))
        time.sleep(pause)
    # stop: closing its stdin ends the writer, which closes (flushes) its file and reports
    state = json.loads(writer.communicate(input="", timeout=120)[0])
    t1 = time.perf_counter()  # drain: a last seal --wait, retried while an earlier one still publishes
    while (p := sh([STRATA, "disk", "seal", sid, "--mount", str(mp), "--wait", "--json"], m.env, check=False)[0]
           ).returncode and BUSY in p.stderr and time.perf_counter() - t1 < 300:
        time.sleep(0.2)
    if p.returncode:
        raise RuntimeError(f"final seal --wait failed: {p.stderr.strip()}")
    publish = time.perf_counter() - t1
    sh([STRATA, "disk", "rm", sid, "--mount", str(mp), "--json"], m.env)
    print(f"  -> {len(switch)} seals done, {len(busy)} refused as busy, failed: {failed[:2]}, "
          f"writer errors: {state['errors'][:2]}")
    return {"switch_p50_ms": pct(switch, 50), "switch_p99_ms": pct(switch, 99),
            "request_p50_ms": pct(request, 50), "request_p99_ms": pct(request, 99), "cli_p50_ms": pct(wall, 50),
            "cli_p99_ms": pct(wall, 99), "cli_idle_floor_ms": statistics.median(floor),
            "python_start_loaded_p50_ms": pct(bare, 50),
            "dirty_chunks_p50": statistics.median(dirty) if dirty else 0, "done": len(switch), "busy": len(busy),
            "failed": len(failed), "writer_MBps": state["bytes"] / (t1 - t0) / MB,
            "writer_errors": len(state["errors"]),
            "drain_ms": publish * 1000}


def first_byte(m: Mounts, mp: Path, cache: Path, ref: str, direct: bool, expect: bytes) -> dict[str, float]:
    """Fresh mount (timed with Python already in page cache), then page cache dropped, then open + 4 KiB read."""
    out = {"mount_ms": m.strata_mount(mp, cache)}
    drop_caches()
    path, buf = mp / "images" / ref / "disk.img", mmap.mmap(-1, PAGE)
    note(f"python: t0; fd = open({path}, {'O_DIRECT' if direct else 'buffered'}); t1; preadv(fd, 4K, 0); t2")
    t0 = time.perf_counter()
    fd = open_fd(path, direct)
    t1 = time.perf_counter()
    os.preadv(fd, [buf], 0)
    t2 = time.perf_counter()
    os.close(fd)
    m.strata_umount(mp)
    if bytes(buf) != expect:
        raise RuntimeError("first 4 KiB of the sparse image read back wrong")
    out.update(open_ms=(t1 - t0) * 1000, read_ms=(t2 - t1) * 1000, byte_ms=(t2 - t0) * 1000)
    print(f"  -> first byte {'direct' if direct else 'buffered'}: {out['byte_ms']:.1f} ms (open {out['open_ms']:.1f})")
    return out


def one_repeat(m: Mounts, args: argparse.Namespace, img: Path, r: int) -> dict[str, Any]:
    """Every measurement once; a flat {metric: value} dict, so repeats take the median per key."""
    out: dict[str, Any] = {}
    size, run = img.stat().st_size, m.run
    rng = random.Random(f"rand:{args.seed}")
    offsets = [rng.randrange(size // PAGE) * PAGE for _ in range(args.rand_reads)]
    expect: list[list[bytes]] = []  # hashes of the first (raw, buffered) pass

    def seq(label: str, path: Path, mode: str, direct: bool) -> None:
        drop_caches()
        out[f"seq.{label}.{mode}"] = v = seq_read(path, direct, size)
        print(f"  -> {label} {mode}: {v:.0f} MB/s")

    def rand(label: str, path: Path) -> None:
        for mode, direct in MODES:
            drop_caches()
            res, got = rand_read(path, offsets, direct, expect[0] if expect else None)
            expect.append(got)
            out.update({f"rand.{label}.{mode}.{k}": v for k, v in res.items()})
            print(f"  -> {label} {mode}: p50 {res['p50_us']:.0f} us, p99 {res['p99_us']:.0f} us")

    # The raw file's speed depends on whether the *host* still caches it (this
    # machine is a VM: dropping our page cache leaves the host's): 0.6 to 4.1
    # GB/s between repeats of one run. Strata's warm rows read cache files
    # written a moment before, which the host does cache; so the raw file is
    # read once, untimed, first, and both sides read from the host's cache.
    drop_caches()
    seq_read(img, False, size)
    for mode, direct in MODES:
        seq("raw", img, mode, direct)
    rand("raw", img)
    # Each cold read gets a fresh mount and an empty cache; the buffered one's mount then
    # serves the warm reads, random reads and the seal test.  rclone is run the same way.
    peers = (("strata", run / "mnt-strata"), ("rclone", run / "mnt-rclone"))
    if shutil.which("rclone") is None:
        print("  rclone is not installed: its rows are left out (apt-get install rclone)")
        peers = peers[:1]
    for label, mp in peers:
        for mode, direct in MODES:
            cache, strata = run / f"cache-{label}-{r}-{mode}", label == "strata"
            m.strata_mount(mp, cache) if strata else m.rclone_mount(img.parent, mp, cache)
            path = mp / "images" / args.ref / "disk.img" if strata else mp / img.name
            seq(f"{label}_cold", path, mode, direct)
            if not direct:
                for mode2, direct2 in MODES:
                    seq(f"{label}_warm", path, mode2, direct2)
                rand(label, path)
            if strata and not direct:
                out["strata_cache_stats"] = json.loads(sh([STRATA, "cache", "stats", "--mount", str(mp), "--json"],
                                                          m.env)[0].stdout)
                seal = seal_test(m, mp, args.ref, f"bench{r}", args.seals, args.seal_pause)
                out.update({f"seal.{k}": v for k, v in seal.items()})
            (m.strata_umount if strata else m.rclone_umount)(mp)
            shutil.rmtree(cache, ignore_errors=True)
    head = keystream(args.seed, "sparse", 0, BS)[:PAGE]
    for mode, direct in MODES:
        res = first_byte(m, run / "mnt-first", run / f"cache-first-{r}-{mode}", args.big_ref, direct, head)
        out.update({f"first.{k}.{mode}": v for k, v in res.items()})
        shutil.rmtree(run / f"cache-first-{r}-{mode}", ignore_errors=True)
    return out


def report(med: dict[str, float], repeat: int, big: str) -> list[str]:
    """Print the tables and the target checks; return the names of missed targets."""
    def g(key: str, default: float = float("nan")) -> float:
        return med.get(key, default)
    print(f"\nSequential read, MB/s (10^6 B/s; median of {repeat}; page cache dropped before every read)")
    print(f"{'':<44}{'buffered':>10}{'O_DIRECT':>10}")
    for key, name in (("raw", "raw file"), ("strata_cold", "strata cold (empty cache, store on disk)"),
                      ("strata_warm", "strata warm (chunk cache on disk)"),
                      ("rclone_cold", "rclone cold (empty VFS cache)"),
                      ("rclone_warm", "rclone warm (VFS cache on disk)")):
        print(f"{name:<44}{g(f'seq.{key}.buffered'):>10.0f}{g(f'seq.{key}.direct'):>10.0f}")
    print("\n4 KiB random reads on warm caches, page cache dropped first, us (bytes checked against raw)")
    print(f"{'':<12}{'buf p50':>10}{'buf p99':>10}{'dir p50':>10}{'dir p99':>10}{'mismatch':>10}")
    for t in ("raw", "strata", "rclone"):
        cells = [g(f"rand.{t}.{mo}.{q}_us") for mo, _ in MODES for q in ("p50", "p99")]
        bad = g(f"rand.{t}.buffered.mismatches") + g(f"rand.{t}.direct.mismatches")
        print(f"{t:<12}" + "".join(f"{c:>10.0f}" for c in cells) + f"{bad:>10.0f}")
    print(f"\nSeal while writing ({g('seal.done'):.0f} done, {g('seal.busy'):.0f} refused as busy, "
          f"{g('seal.failed'):.0f} failed): switch_ms p50 {g('seal.switch_p50_ms'):.1f} p99 "
          f"{g('seal.switch_p99_ms'):.1f} | request wall ms p50 {g('seal.request_p50_ms'):.1f} p99 "
          f"{g('seal.request_p99_ms'):.1f} | CLI wall ms p50 {g('seal.cli_p50_ms'):.0f} p99 "
          f"{g('seal.cli_p99_ms'):.0f} (idle `disk ls`: {g('seal.cli_idle_floor_ms'):.0f}; `python -c pass` "
          f"under the same load: p50 {g('seal.python_start_loaded_p50_ms'):.0f})\n"
          f"  dirty chunks p50 {g('seal.dirty_chunks_p50'):.0f} | writer {g('seal.writer_MBps'):.0f} MB/s, "
          f"{g('seal.writer_errors'):.0f} errors | drain (seal --wait until all published) {g('seal.drain_ms'):.0f} ms")
    for mo, _ in MODES:
        print(f"{big} sparse image, {mo:<8}: strata mount {g(f'first.mount_ms.{mo}'):.0f} ms; open "
              f"{g(f'first.open_ms.{mo}'):.1f} ms + first 4 KiB {g(f'first.read_ms.{mo}'):.1f} ms = "
              f"{g(f'first.byte_ms.{mo}'):.1f} ms")
    checks: list[tuple[str, float, str, float]] = []
    for mo, _ in MODES:
        checks += [(f"strata warm / raw ({mo})", g(f"seq.strata_warm.{mo}") / g(f"seq.raw.{mo}"), ">=", 0.5),
                   (f"strata cold MB/s ({mo})", g(f"seq.strata_cold.{mo}"), ">=", 300),
                   (f"first byte ms ({mo})", g(f"first.byte_ms.{mo}"), "<", 50)]
        if f"seq.rclone_cold.{mo}" in med:  # rclone installed
            checks += [(f"strata / rclone cold ({mo})", g(f"seq.strata_cold.{mo}") / g(f"seq.rclone_cold.{mo}"), ">", 1),
                       (f"strata / rclone warm ({mo})", g(f"seq.strata_warm.{mo}") / g(f"seq.rclone_warm.{mo}"), ">", 1)]
    checks += [("seal switch_ms p99", g("seal.switch_p99_ms"), "<", 100),
               ("seal request wall ms p99", g("seal.request_p99_ms"), "<", 100),
               ("writer errors", g("seal.writer_errors"), "<=", 0),
               ("seal failures (not busy refusals)", g("seal.failed"), "<=", 0),
               ("random-read mismatches", sum(v for k, v in med.items() if k.endswith("mismatches")), "<=", 0)]
    print("\nTargets")
    missed = []
    for name, value, op, target in checks:
        ok = {">=": value >= target, ">": value > target, "<": value < target, "<=": value <= target}[op]
        print(f"  {name:<36}{value:>10.2f}  target {op} {target:<6}{'ok' if ok else 'MISSED'}")
        missed += [] if ok else [name]
    return missed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/var/tmp/strata-bench-fuse", help="default /var/tmp/strata-bench-fuse")
    p.add_argument("--size", default="1G", help="mixed image size (default 1G)")
    p.add_argument("--repeat", type=int, default=1, help="runs; every number is the median (default 1)")
    p.add_argument("--rand-reads", type=int, default=5000, help="4 KiB random reads per pass (default 5000)")
    p.add_argument("--seals", type=int, default=20, help="seal attempts while the writer runs (default 20)")
    p.add_argument("--seal-pause", type=float, default=0.1, help="sleep between seals, s (default 0.1)")
    p.add_argument("--big-size", default="10G", help="sparse image of the first-byte test (default 10G)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep WORKDIR/run (store, state, rclone log)")
    p.add_argument("--json", metavar="FILE", help="write every number, the medians and the commands")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("needs root: every read starts by dropping the page cache")
    wd = Path(args.workdir).resolve()
    run, images = wd / "run", wd / "images"
    clear_run_dir(run)
    img = images / f"mixed-{args.size}-seed{args.seed}" / "disk.img"  # alone in its dir: rclone's remote
    big_img = images / f"sparse-{args.big_size}-seed{args.seed}.img"
    for d in (run / "state", run / "rundir", img.parent):
        d.mkdir(parents=True, exist_ok=True)
    (run / "rclone.conf").touch()
    extra = {"STRATA_STORE": str(run / "store"), "STRATA_RUN_DIR": str(run / "rundir"),
             "STRATA_STATE_DIR": str(run / "state"), "RCLONE_CONFIG": str(run / "rclone.conf")}
    env = {**os.environ, **extra}
    print("# env " + " ".join(f"{k}={v}" for k, v in extra.items()))
    if not img.exists():
        note(f"python: bench.mkimage.make_image({img}, {args.size}, seed={args.seed})")
        make_image(img, parse_size(args.size), args.seed)
    if not big_img.exists():
        note(f"python: make_sparse({big_img}, {args.big_size}, 64 MiB in 1 MiB blocks, seed={args.seed})")
        make_sparse(big_img, parse_size(args.big_size), 64 << 20, args.seed)
    args.ref, args.big_ref = "bench:mixed", "bench:sparse"
    sh([STRATA, "image", "import", str(img), args.ref, "--json"], env)
    sh([STRATA, "image", "import", str(big_img), args.big_ref, "--json"], env)
    m, runs, t0 = Mounts(env, run), [], time.perf_counter()
    try:
        for r in range(args.repeat):
            print(f"\n# repeat {r + 1}/{args.repeat}")
            runs.append(one_repeat(m, args, img, r))
    finally:
        m.cleanup()
        if not args.keep:
            clear_run_dir(run)
    med = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, (int, float))}
    missed = report(med, args.repeat, args.big_size)
    print(f"\nmeasured in {time.perf_counter() - t0:.0f} s; {os.cpu_count()} CPUs; kernel {platform.release()}")
    if args.json:
        rclone = (subprocess.run(["rclone", "version"], capture_output=True, text=True).stdout.split("\n")[0]
                  if shutil.which("rclone") else "not installed")
        meta = {"args": vars(args), "cpus": os.cpu_count(), "kernel": platform.release(), "rclone": rclone}
        Path(args.json).write_text(json.dumps({"meta": meta, "median": med, "runs": runs, "missed_targets": missed,
                                               "commands": COMMANDS}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
