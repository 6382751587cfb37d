"""Node API under load: a second process drives `strata serve` on loopback.

N concurrent clients (default 50, one HTTP connection each) run a fixed
number of cycles each: create (POST /sandboxes), pause (POST .../pause),
resume (POST .../connect, 201) and kill (DELETE). For every call the client
records its wall time and the VMM time the server reports in
`Server-Timing: vmm;dur=<ms>`; "overhead" = wall - vmm, i.e. everything the
API adds (HTTP, validation, records, queueing for a worker thread, locks).
After the load nothing may be left: no sandbox record, no QEMU process, no
upper layer on the mount and, once the node is cleaned up, no FUSE mount.

Then the warm pool: K sequential creates without a pool, and K with
`--warm-pool TEMPLATE=N` (each taken while the pool is full and idle).

Runs real QEMU (TCG here, KVM where usable) on the guest from
vmm/guest/build.sh, through a real FUSE mount, with the same NodeServer the
API tests use. The load defaults to template "snap" (a snapshot of a booted
sandbox: creates are restores, much faster than boots).

    .venv/bin/python bench/api_load.py [--clients 50] [--cycles 1] [--pool-size 4] [--json FILE]
    .venv/bin/python bench/api_load.py --quick        # smoke run: 4 clients, pool of 2, 2 creates
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from tests.node_server import NodeServer

OPS = ("create", "pause", "resume", "kill")
EXPECTED = {"create": 201, "pause": 204, "resume": 201, "kill": 204}
KEY_ENV = "STRATA_BENCH_API_KEY"  # the load process gets the API key here, not on its command line
REQUEST_TIMEOUT = 900.0  # s; 50 restores at once on 2 TCG cores take a while
SANDBOX_TTL = 600  # s; far beyond the run, so the reaper never interferes


@dataclass
class Call:
    op: str
    status: int  # HTTP status; 0 when no response came back
    wall_ms: float  # measured by the client
    vmm_ms: float | None  # from Server-Timing; None when the response has none
    error: str = ""  # set when the call failed

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def overhead_ms(self) -> float | None:
        return None if self.vmm_ms is None else self.wall_ms - self.vmm_ms


def server_vmm_ms(response: httpx.Response) -> float | None:
    """The `vmm` entry of a Server-Timing header, in ms."""
    for metric in response.headers.get("server-timing", "").split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        if name == "vmm":
            for param in params:
                if param.startswith("dur="):
                    return float(param[4:])
    return None


def check(op: str, response: httpx.Response, wall_ms: float) -> Call:
    call = Call(op, response.status_code, wall_ms, server_vmm_ms(response))
    request = f"{response.request.method} {response.request.url.path}"
    if response.status_code != EXPECTED.get(op, 201):
        call.error = f"{request} -> {response.status_code} {response.text[:300]}"
    elif call.vmm_ms is None:
        call.error = f"{request}: no Server-Timing vmm entry"
    return call


# --- the load process ---------------------------------------------------------------------

async def timed(client: httpx.AsyncClient, op: str, method: str, path: str,
                body: dict[str, Any] | None = None) -> tuple[Call, httpx.Response | None]:
    started = time.perf_counter()
    try:
        response = await client.request(method, path, json=body)
    except httpx.HTTPError as exc:
        wall_ms = (time.perf_counter() - started) * 1e3
        return Call(op, 0, wall_ms, None, f"{method} {path}: {type(exc).__name__}: {exc}"), None
    return check(op, response, (time.perf_counter() - started) * 1e3), response


async def one_cycle(client: httpx.AsyncClient, template: str, calls: list[Call]) -> None:
    """create, pause, resume, kill. A sandbox that was created is always killed,
    so a failed step does not show up as a leak of the benchmark's own making."""
    call, response = await timed(client, "create", "POST", "/sandboxes",
                                 {"templateID": template, "timeout": SANDBOX_TTL})
    calls.append(call)
    if not call.ok or response is None:
        return
    sid = response.json()["sandboxID"]
    try:
        call, _ = await timed(client, "pause", "POST", f"/sandboxes/{sid}/pause")
        calls.append(call)
        if call.ok:
            call, _ = await timed(client, "resume", "POST", f"/sandboxes/{sid}/connect", {"timeout": SANDBOX_TTL})
            calls.append(call)
    finally:
        call, _ = await timed(client, "kill", "DELETE", f"/sandboxes/{sid}")
        calls.append(call)


async def one_client(url: str, key: str, template: str, cycles: int, calls: list[Call]) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}, timeout=REQUEST_TIMEOUT) as client:
        for _ in range(cycles):
            await one_cycle(client, template, calls)


async def load(url: str, key: str, template: str, clients: int, cycles: int) -> dict[str, Any]:
    calls: list[Call] = []
    started = time.perf_counter()
    await asyncio.gather(*(one_client(url, key, template, cycles, calls) for _ in range(clients)))
    return {"elapsed_s": time.perf_counter() - started, "calls": [asdict(c) for c in calls]}


def client_main(args: argparse.Namespace) -> int:
    """The second process: run the load against `args.client`, print JSON to stdout."""
    key = os.environ.get(KEY_ENV, "")
    if not key:
        print(f"--client needs the API key in ${KEY_ENV}", file=sys.stderr)
        return 2
    result = asyncio.run(load(args.client, key, args.template, args.clients, args.cycles))
    json.dump(result, sys.stdout)
    return 0


# --- statistics and report ----------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest rank (no interpolation): with 20 values, p99 is the largest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(calls: list[Call]) -> dict[str, dict[str, float]]:
    out = {}
    for op in OPS:
        mine = [c for c in calls if c.op == op]
        good = [c for c in mine if c.ok]
        row: dict[str, float] = {"count": len(mine), "errors": len(mine) - len(good)}
        for name, values in (("wall", [c.wall_ms for c in good]), ("vmm", [c.vmm_ms or 0.0 for c in good]),
                             ("overhead", [c.overhead_ms or 0.0 for c in good])):
            row[f"{name}_p50_ms"] = percentile(values, 50)
            row[f"{name}_p99_ms"] = percentile(values, 99)
        out[op] = row
    return out


def print_table(summary: dict[str, dict[str, float]]) -> None:
    columns = [f"{name} {q}" for name in ("wall", "vmm", "overhead") for q in ("p50", "p99")]
    print(f"{'call':<8} {'count':>5} {'errors':>6} " + " ".join(f"{c:>12}" for c in columns) + "   (ms)")
    for op, row in summary.items():
        values = [row[f"{name}_{q}_ms"] for name in ("wall", "vmm", "overhead") for q in ("p50", "p99")]
        print(f"{op:<8} {int(row['count']):>5} {int(row['errors']):>6} " + " ".join(f"{v:>12.1f}" for v in values))


# --- leak checks ----------------------------------------------------------------------------

def sandbox_records(server: NodeServer) -> list[str]:
    """Every record on the node, warm pool included (admin endpoint)."""
    r = server.admin.get("/admin/sandboxes")
    r.raise_for_status()
    return [f"{row['sid']} ({row['state']})" for row in r.json()]


def qemu_processes(tmp: Path) -> list[str]:
    """QEMU processes whose command line names the node's temp dir."""
    r = subprocess.run(["pgrep", "-a", "-f", str(tmp)], capture_output=True, text=True)
    found = []
    for line in r.stdout.splitlines():
        argv = line.split(maxsplit=2)
        if len(argv) > 1 and "qemu" in Path(argv[1]).name:
            found.append(line[:160])
    return found


def upper_layers(server: NodeServer) -> list[str]:
    """Sandbox disks (disk and RAM upper layers) the node's mount still serves."""
    r = subprocess.run([str(ROOT / ".venv/bin/strata"), "disk", "ls", "--mount", str(server.tmp / "state" / "mnt"),
                        "--json"], env=server.env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return [f"`strata disk ls` failed: {r.stderr.strip()[-300:]}"]
    return [row["sid"] for row in json.loads(r.stdout)]


def fuse_mounts(tmp: Path) -> list[str]:
    """Mount points under the node's temp dir (/proc/mounts escapes spaces as \\040)."""
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return [p for p in points if p.replace("\\040", " ").startswith(str(tmp))]


def report_leaks(phase: str, found: dict[str, list[str]]) -> dict[str, list[str]]:
    for what, items in found.items():
        print(f"{phase:<14} {what:<18} {'OK' if not items else 'LEAK ' + ', '.join(items[:5])}")
    return found


# --- the parent: node, templates, phases ------------------------------------------------------

def setup(server: NodeServer, guest: Path) -> str:
    """guest:v1, template "base" (the image) and template "snap" (a booted sandbox's snapshot)."""
    server.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    server.start()
    r = server.client.post("/templates", json={"name": "base", "image": "guest:v1"})
    assert r.status_code == 201, r.text
    r = server.client.post("/sandboxes", json={"templateID": "base", "timeout": SANDBOX_TTL})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    r = server.client.post(f"/sandboxes/{sid}/snapshots", json={"name": "snap"})
    assert r.status_code == 201, r.text
    assert server.client.delete(f"/sandboxes/{sid}").status_code == 204
    return r.json()["snapshotID"]


def run_load(server: NodeServer, args: argparse.Namespace) -> dict[str, Any]:
    """The load, from a second process; returns its JSON."""
    from tests.node_server import API_KEY

    command = [sys.executable, str(Path(__file__).resolve()), "--client", server.url, "--template", args.template,
               "--clients", str(args.clients), "--cycles", str(args.cycles)]
    r = subprocess.run(command, env={**os.environ, KEY_ENV: API_KEY}, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"load process failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def pool_ready(server: NodeServer) -> list[str]:
    """Pool sandboxes ready to hand out: vCPU-paused, still hidden from clients."""
    return [row["sid"] for row in server.admin.get("/admin/sandboxes").json()
            if row.get("kind") == "pool" and row["state"] == "paused"]


def wait_for_pool(server: NodeServer, size: int, timeout: float = 600.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(ready := pool_ready(server)) < size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm pool: {len(ready)} of {size} sandboxes ready after {timeout:.0f} s")
        time.sleep(0.5)
    return ready


def sequential_creates(server: NodeServer, template: str, count: int, pool_size: int = 0) -> tuple[list[Call], int]:
    """`count` creates one after the other, each killed before the next. With a
    pool, each create waits until the pool is full (and its refill idle), and
    counts as a hit when it got one of the pool's sandboxes. Returns (calls, hits)."""
    calls, hits = [], 0
    for _ in range(count):
        pooled = wait_for_pool(server, pool_size) if pool_size else []
        started = time.perf_counter()
        r = server.client.post("/sandboxes", json={"templateID": template, "timeout": SANDBOX_TTL})
        calls.append(check("create", r, (time.perf_counter() - started) * 1e3))
        if r.status_code == 201:
            sid = r.json()["sandboxID"]
            hits += sid in pooled
            killed = server.client.delete(f"/sandboxes/{sid}")
            if killed.status_code != 204:
                calls.append(check("kill", killed, 0.0))
    return calls, hits


def create_stats(calls: list[Call]) -> dict[str, float]:
    good = [c for c in calls if c.op == "create" and c.ok]
    return {"count": len(good), "errors": sum(not c.ok for c in calls),
            "wall_p50_ms": percentile([c.wall_ms for c in good], 50),
            "vmm_p50_ms": percentile([c.vmm_ms or 0.0 for c in good], 50)}


def bench(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], bool]:
    """Every phase; returns (results, clean) where clean = no errors, no leaks."""
    from tests.node_server import NodeServer

    guest = Path(args.guest)
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(guest)], check=True, capture_output=True)
    max_sandboxes = max(64, args.clients + args.pool_size + 8)
    server = NodeServer(work, guest, STRATA_SANDBOX_MEMORY=str(args.memory), STRATA_MAX_SANDBOXES=str(max_sandboxes))
    out: dict[str, Any] = {"args": vars(args), "workdir": str(work)}
    leaks: dict[str, list[str]] = {}
    failed: list[Call] = []
    try:
        print("setup: import guest:v1, templates base and snap ...", file=sys.stderr, flush=True)
        out["snapshot"] = setup(server, guest)

        print(f"load: {args.clients} clients x {args.cycles} cycles on {args.template!r} ...",
              file=sys.stderr, flush=True)
        result = run_load(server, args)
        calls = [Call(**c) for c in result["calls"]]
        failed += [c for c in calls if not c.ok]
        summary = summarize(calls)
        out["load"] = {"elapsed_s": result["elapsed_s"], "summary": summary, "calls": result["calls"]}
        print(f"\nload: {args.clients} clients x {args.cycles} cycles of create/pause/resume/kill on "
              f"{args.template!r}, {result['elapsed_s']:.1f} s")
        print_table(summary)
        print()
        leaks.update({f"after load: {k}": v for k, v in report_leaks("after load", {
            "sandbox records": sandbox_records(server), "qemu processes": qemu_processes(work),
            "upper layers": upper_layers(server)}).items()})

        print(f"warm pool: {args.creates} creates without a pool ...", file=sys.stderr, flush=True)
        cold, _ = sequential_creates(server, args.template, args.creates)
        server.stop()
        server.start("--warm-pool", f"{args.template}={args.pool_size}")
        print(f"warm pool: {args.creates} creates with a pool of {args.pool_size} ...", file=sys.stderr, flush=True)
        warm, hits = sequential_creates(server, args.template, args.creates, args.pool_size)
        failed += [c for c in cold + warm if not c.ok]
        pool = {"no_pool": create_stats(cold), "pool": create_stats(warm), "pool_hits": hits,
                "ratio": create_stats(cold)["wall_p50_ms"] / create_stats(warm)["wall_p50_ms"]}
        out["warm_pool"] = pool
        print(f"\ncreate {args.template!r}, {args.creates} sequential   p50 wall ms   p50 vmm ms")
        print(f"  without pool                     {pool['no_pool']['wall_p50_ms']:>11.1f}  "
              f"{pool['no_pool']['vmm_p50_ms']:>11.1f}")
        print(f"  warm pool of {args.pool_size:<3}                 {pool['pool']['wall_p50_ms']:>11.1f}  "
              f"{pool['pool']['vmm_p50_ms']:>11.1f}   (pool hits {hits}/{args.creates})")
        print(f"  without / with pool              {pool['ratio']:>11.1f}x")
        print()
    finally:
        server.cleanup()
        leaks.update({f"after cleanup: {k}": v for k, v in report_leaks("after cleanup", {
            "qemu processes": qemu_processes(work), "fuse mounts": fuse_mounts(work)}).items()})
    out["leaks"] = leaks
    out["errors"] = [asdict(c) for c in failed]
    for call in failed[:10]:
        print(f"error: {call.op}: {call.error}")
    if len(failed) > 10:
        print(f"... and {len(failed) - 10} more errors")
    return out, not failed and not any(leaks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients in the load (default 50)")
    parser.add_argument("--cycles", type=int, default=1, help="create/pause/resume/kill cycles per client")
    parser.add_argument("--template", default="snap",
                        help='template of the load and pool ("snap": restore; "base": boot from the image)')
    parser.add_argument("--memory", type=int, default=128, help="guest MiB (STRATA_SANDBOX_MEMORY)")
    parser.add_argument("--pool-size", type=int, default=4, help="warm pool size")
    parser.add_argument("--creates", type=int, default=4, help="sequential creates with and without the pool")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 clients, pool of 2, 2 creates")
    parser.add_argument("--guest", default="/var/tmp/strata-guest")
    parser.add_argument("--workdir", help="an empty or new directory, kept afterwards "
                                          "(default: a temp dir under /var/tmp, removed when all is clean)")
    parser.add_argument("--json", metavar="FILE", help="write every number, call and check here")
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # internal: be the load process
    args = parser.parse_args()
    if args.client:
        return client_main(args)
    if args.quick:
        args.clients, args.pool_size, args.creates = 4, 2, 2
    if min(args.clients, args.cycles, args.pool_size, args.creates) < 1:
        parser.error("--clients, --cycles, --pool-size and --creates must be at least 1")
    if args.workdir:
        work = Path(args.workdir).resolve()
        if work.exists() and any(work.iterdir()):
            parser.error(f"--workdir {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="strata-bench-api-", dir="/var/tmp"))
    out, clean = bench(args, work)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    print("result: OK (no errors, nothing leaked)" if clean else "result: FAILED (errors or leaks above)")
    if not args.workdir and clean:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
