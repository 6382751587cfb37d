"""Concurrent starts, measured: N `Sandbox.create` at once through the
unchanged `e2b` SDK from a snapshot template, on one node and through
`strata gateway` in front of it, against one create at a time, in one run.

    one at a time   --serial creates, each after the previous one answered
    burst N         N threads call Sandbox.create together (N from --bursts);
                    latency p50/p99 of the creates that succeeded, sandboxes
                    per second (successes / the burst's wall time), and how
                    many the node refused (429: it holds --max sandboxes)
    leftovers       after every phase all sandboxes are killed; then no record,
                    QEMU process or upper layer may be left (a refused create
                    leaves nothing)

    .venv/bin/python bench/starts.py [--bursts 10,50] [--serial 10] [--max 45] [--json FILE]

The node's `max_sandboxes` is set below the largest burst on purpose, so a
burst also shows refusals. Real QEMU (TCG here) on the guest from
vmm/guest/build.sh, the NodeServer the API tests use, all on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.api_load import qemu_processes, sandbox_records, setup, upper_layers  # noqa: E402
from bench.envd import percentile  # noqa: E402
from bench.gateway import start_gateway, stop_gateway  # noqa: E402


def one_create(template: str) -> tuple[float, str | None, str | None]:
    """(seconds, sandbox id or None, error text or None)."""
    from e2b import Sandbox

    started = time.perf_counter()
    try:
        sbx = Sandbox.create(template=template, timeout=600)
        return time.perf_counter() - started, sbx.sandbox_id, None
    except Exception as exc:  # a refusal is a result here, not a failure of the bench
        return time.perf_counter() - started, None, f"{type(exc).__name__}: {exc}"


def burst(template: str, count: int) -> dict[str, Any]:
    started = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(lambda _: one_create(template), range(count)))
    wall = time.perf_counter() - started
    ok = [s for s, sid, _ in results if sid]
    errors = [e for _, sid, e in results if not sid]
    return {"asked": count, "made": len(ok), "refused": sum("429" in e or "limit" in e.lower() for e in errors),
            "failed": [e for e in errors if "429" not in e and "limit" not in e.lower()][:3],
            "p50_s": percentile(ok, 50) if ok else float("nan"), "p99_s": percentile(ok, 99) if ok else float("nan"),
            "per_s": len(ok) / wall, "wall_s": wall, "sids": [sid for _, sid, _ in results if sid]}


def serial(template: str, count: int) -> dict[str, Any]:
    times, sids = [], []
    started = time.perf_counter()
    for _ in range(count):
        took, sid, err = one_create(template)
        assert sid, err
        times.append(took)
        sids.append(sid)
    wall = time.perf_counter() - started
    return {"asked": count, "made": count, "refused": 0, "failed": [], "p50_s": percentile(times, 50),
            "p99_s": percentile(times, 99), "per_s": count / wall, "wall_s": wall, "sids": sids}


def kill_all(sids: list[str]) -> None:
    from e2b import Sandbox

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(Sandbox.kill, sids))


def bench(guest: Path, work: Path, bursts: list[int], serial_count: int, limit: int) -> dict[str, Any]:
    from tests.node_server import API_KEY, NodeServer

    srv = NodeServer(work / "node", guest, STRATA_MAX_SANDBOXES=str(limit))
    rows: dict[str, Any] = {}
    gateway = None
    try:
        setup(srv, guest)  # template "snap": a booted sandbox's snapshot (creates are restores)
        gateway, gateway_url = start_gateway(work / "node" / "store", work)
        os.environ["E2B_API_KEY"] = API_KEY
        for label, url in (("node", srv.url), ("gateway", gateway_url)):
            os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url)
            phases = [("one at a time", lambda: serial("snap", serial_count))]
            phases += [(f"burst {n}", lambda n=n: burst("snap", n)) for n in bursts]
            for name, run in phases:
                row = run()
                kill_all(row.pop("sids"))
                leftovers = {"records": sandbox_records(srv), "qemu": qemu_processes(work),
                             "uppers": upper_layers(srv)}
                row["leftovers"] = {k: v for k, v in leftovers.items() if v}
                rows[f"{label}: {name}"] = row
                print(f"  {label}: {name}: {row['made']}/{row['asked']} made, p50 {row['p50_s']:.2f} s, "
                      f"{row['per_s']:.2f}/s", flush=True)
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        srv.cleanup()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", default="10,50", help="comma-separated burst sizes")
    parser.add_argument("--serial", type=int, default=10, help="creates one at a time (the baseline)")
    parser.add_argument("--max", type=int, default=45, help="the node's max_sandboxes")
    parser.add_argument("--guest", type=Path, default=Path(os.environ.get("STRATA_GUEST_DIR", "/var/tmp/strata-guest")))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(args.guest)], check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="strata-bench-starts-", dir="/var/tmp") as tmp:
        rows = bench(args.guest, Path(tmp), [int(n) for n in args.bursts.split(",")], args.serial, args.max)
    print(f"\n{'phase':28} {'made':>9} {'refused':>8} {'p50 s':>7} {'p99 s':>7} {'per s':>7} {'x serial/s':>10}"
          "  leftovers")
    missed = []
    for label in ("node", "gateway"):
        base = rows[f"{label}: one at a time"]["per_s"]
        for name, r in rows.items():
            if not name.startswith(label):
                continue
            left = ", ".join(f"{k} {len(v)}" for k, v in r["leftovers"].items()) or "none"
            print(f"{name:28} {r['made']:>4}/{r['asked']:<4} {r['refused']:>8} {r['p50_s']:7.2f} {r['p99_s']:7.2f} "
                  f"{r['per_s']:7.2f} {r['per_s'] / base:10.2f}  {left}")
            if r["failed"]:
                print(f"    failed (not refused): {r['failed']}")
                missed.append(f"{name}: failures")
            if r["leftovers"]:
                missed.append(f"{name}: leftovers")
            if r["made"] + r["refused"] != r["asked"]:
                missed.append(f"{name}: {r['asked'] - r['made'] - r['refused']} neither made nor refused")
    print("\nTargets: nothing failed but refusals, nothing left over: " + ("ok" if not missed else
                                                                           "MISSED: " + "; ".join(missed)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
