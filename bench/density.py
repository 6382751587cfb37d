"""Density, measured: how many idle sandboxes of one template a node holds
and what each costs the host, in one run.

Sandboxes are started from one snapshot template (256 MiB guests: every one
restores the same snapshot, as forks do) in steps of --step until --count or
until the node refuses (429: `max_sandboxes`), and after each step, once
the fleet has settled for --settle seconds (a guest just restored is busy
for a few seconds) and then idled for --idle seconds:

    host MiB / sandbox   (MemAvailable before the first - MemAvailable now) / count:
                         everything the fleet costs the host, QEMU, the page
                         cache of RAM and disk files, the mount daemon
    PSS MiB / QEMU       the proportional set size of the VM processes
                         (/proc/PID/smaps_rollup: shared pages split between them)
    idle CPU %           the fleet's QEMU CPU time over --idle seconds, % of one core

Then one create past the limit must be a 429 that leaves no record behind.

    .venv/bin/python bench/density.py [--count 100] [--step 20] [--settle 20] [--idle 10] [--json FILE]

Targets (issue 36): 100 idle sandboxes, under 32 MiB of host memory each
beyond what they changed, the idle fleet under 10% of one core. Real QEMU
(TCG here) on the guest from vmm/guest/build.sh, a real `strata serve`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.api_load import sandbox_records, setup  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def qemu_pids(work: Path) -> list[int]:
    r = subprocess.run(["pgrep", "-f", f"qemu-system.*{work}"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            continue
    return total


def measure(work: Path, count: int, baseline: int, idle: float, settle: float) -> dict[str, float]:
    time.sleep(settle)
    pids = qemu_pids(work)
    before = cpu_ticks(pids)
    time.sleep(idle)
    cpu = (cpu_ticks(pids) - before) / TICKS / idle * 100
    return {"count": count, "qemu": len(pids), "host_mib_each": (baseline - mem_available()) / count / 2**20,
            "pss_mib_each": sum(pss(p) for p in pids) / max(len(pids), 1) / 2**20, "idle_cpu_pct": cpu}


def bench(guest: Path, work: Path, count: int, step: int, idle: float, settle: float) -> dict[str, Any]:
    from tests.node_server import NodeServer

    srv = NodeServer(work / "node", guest, STRATA_MAX_SANDBOXES=str(count), STRATA_SANDBOX_TIMEOUT="3600",
                     STRATA_MAX_TIMEOUT="7200")
    rows: list[dict[str, float]] = []
    out: dict[str, Any] = {"rows": rows}
    try:
        setup(srv, guest)  # template "snap": a booted sandbox's snapshot
        time.sleep(2)
        baseline = mem_available()
        made = 0
        while made < count:
            for _ in range(min(step, count - made)):
                r = srv.client.post("/sandboxes", json={"templateID": "snap", "timeout": 3600})
                if r.status_code != 201:
                    out["stopped"] = f"create {made + 1}: {r.status_code} {r.text[:200]}"
                    break
                made += 1
            if "stopped" in out or made == 0:
                break
            rows.append(measure(work, made, baseline, idle, settle))
            print("  " + "  ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()), flush=True)
        before = len(sandbox_records(srv))
        r = srv.client.post("/sandboxes", json={"templateID": "snap"})
        out["past_limit"] = {"status": r.status_code, "message": r.json().get("message", "")[:200],
                             "records_before": before, "records_after": len(sandbox_records(srv))}
    finally:
        srv.cleanup()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100, help="sandboxes to hold (the node's max_sandboxes)")
    parser.add_argument("--step", type=int, default=20, help="sandboxes started between measurements")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds the fleet settles after each step")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds over which idle CPU is measured")
    parser.add_argument("--guest", type=Path, default=Path(os.environ.get("STRATA_GUEST_DIR", "/var/tmp/strata-guest")))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(args.guest)], check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="strata-bench-density-", dir="/var/tmp") as tmp:
        out = bench(args.guest, Path(tmp), args.count, args.step, args.idle, args.settle)
    print(f"\n{'sandboxes':>9} {'host MiB each':>14} {'PSS MiB / QEMU':>15} {'idle CPU % of a core':>21}")
    for r in out["rows"]:
        print(f"{r['count']:9.0f} {r['host_mib_each']:14.1f} {r['pss_mib_each']:15.1f} {r['idle_cpu_pct']:21.1f}")
    if "stopped" in out:
        print(f"stopped early: {out['stopped']}")
    past = out["past_limit"]
    print(f"one more create past max_sandboxes: {past['status']} ({past['message']}); records "
          f"{past['records_before']} -> {past['records_after']}")
    last = out["rows"][-1] if out["rows"] else {"count": 0, "host_mib_each": float("nan"), "idle_cpu_pct": float("nan")}
    checks = [(f"idle sandboxes held (>= {args.count})", last["count"] >= args.count),
              ("host MiB each < 32", last["host_mib_each"] < 32),
              ("idle fleet < 10% of a core", last["idle_cpu_pct"] < 10),
              ("past the limit: 429, no record left", past["status"] == 429
               and past["records_after"] == past["records_before"])]
    print("\nTargets")
    for name, ok in checks:
        print(f"  {name:40} {'ok' if ok else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
