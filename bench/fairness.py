"""Fair sharing under load: team alpha's short requests while team beta holds N long ones.

One run, one real `strata serve` (the NodeServer the API tests use, real
QEMU guests): team alpha runs `--rounds` rounds of `GET /v2/sandboxes`
(list) and `POST /sandboxes/{id}/exec` of `true` (exec) one after the other,
first with the node otherwise idle, then while team beta holds `--streams`
long requests open: envd process streams attached to a `sleep` in beta's
sandboxes (at most 500 a sandbox: the agent takes 512 at once), quiet for
an hour. Beta's limit (team_max_streams) is raised to N, so all of them are
held. Prints alpha's p50/p99 wall time per call in both phases and the
loaded/idle ratios; a call that fails or times out (30 s) fails the run.
Nothing here asserts a time: the ratios are the result.

    .venv/bin/python bench/fairness.py [--streams 600] [--rounds 200] [--json FILE]
    .venv/bin/python bench/fairness.py --quick      # 100 streams, 30 rounds
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ALPHA, BETA = "alpha-bench-key-01", "beta-bench-key-01"
PER_SANDBOX = 500  # streams held on one sandbox (its agent takes 512 requests at once)
CALL_TIMEOUT = 30.0  # s; a call slower than this counts as failed: the node is stuck
MAX_FAILURES = 4  # failed calls after which a phase stops


def percentile(values: list[float], q: float) -> float:
    """Nearest rank (no interpolation)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def measure(alpha: httpx.Client, sid: str, rounds: int) -> dict[str, Any]:
    """`rounds` lists and execs of team alpha, one after the other: their wall times (ms) and failures."""
    times: dict[str, list[float]] = {"list": [], "exec": []}
    failures: list[str] = []
    for _ in range(rounds):
        for op, method, path, body in (("list", "GET", "/v2/sandboxes", None),
                                       ("exec", "POST", f"/sandboxes/{sid}/exec", {"command": "true"})):
            started = time.perf_counter()
            try:
                r = alpha.request(method, path, json=body)
                ok = r.status_code == 200
                detail = f"{op}: {r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                ok, detail = False, f"{op}: {type(exc).__name__}: {exc}"
            times[op].append((time.perf_counter() - started) * 1e3)
            if not ok:
                failures.append(detail)
        if len(failures) >= MAX_FAILURES:
            break  # the node is stuck: more rounds would only wait out more timeouts
    summary = {op: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "count": len(v)}
               for op, v in times.items()}
    return {"summary": summary, "failures": failures}


def hold(server: Any, boxes: list[dict], streams: int) -> Any:
    """Team beta's `streams` quiet process streams, held open on raw sockets."""
    from tests.test_api_teams import Held, stream_request

    held = Held(server.port)
    left = streams
    for box in boxes:
        mine = min(left, PER_SANDBOX)
        start = held.open(stream_request(box, "Start", {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 3600"]}}))
        pid = held.started_pid(start[0])
        held.open(stream_request(box, "Connect", {"process": {"pid": pid}}), mine - 1)
        left -= mine
    held.wait(lambda h: h.count(b'"start"') + h.count(b"resource_exhausted") >= streams, 120)
    started = held.count(b'"start"')
    if started != streams:  # refused, or waiting for a thread: measured all the same
        print(f"warning: {started} of beta's {streams} streams started", file=sys.stderr)
    return held


def setup(server: Any, guest: Path, streams: int) -> tuple[str, list[dict]]:
    """Alpha's sandbox (its id) and beta's sandboxes, each team with its own image."""
    rootfs = (guest / "rootfs.ext4").read_bytes()
    out: dict[str, list[dict]] = {}
    for team, key, count in (("alpha", ALPHA, 1), ("beta", BETA, max(1, math.ceil(streams / PER_SANDBOX)))):
        c = httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=300)
        assert c.put(f"/images/guest:{team}", content=rootfs).status_code == 201
        out[team] = []
        for _ in range(count):
            r = c.post("/sandboxes", json={"templateID": f"guest:{team}", "timeout": 3600})
            assert r.status_code == 201, r.text
            out[team].append(r.json())
    return out["alpha"][0]["sandboxID"], out["beta"]


def report(idle: dict[str, Any], loaded: dict[str, Any], streams: int) -> dict[str, Any]:
    print(f"\nteam alpha, sequential calls; team beta idle vs holding {streams} streams     (ms)")
    print(f"{'call':<6} {'idle p50':>9} {'idle p99':>9} {'load p50':>9} {'load p99':>9} {'p50 x':>7} {'p99 x':>7}")
    ratios = {}
    for op in ("list", "exec"):
        a, b = idle["summary"][op], loaded["summary"][op]
        ratios[op] = {"p50": b["p50_ms"] / a["p50_ms"], "p99": b["p99_ms"] / a["p99_ms"]}
        print(f"{op:<6} {a['p50_ms']:>9.1f} {a['p99_ms']:>9.1f} {b['p50_ms']:>9.1f} {b['p99_ms']:>9.1f} "
              f"{ratios[op]['p50']:>6.2f}x {ratios[op]['p99']:>6.2f}x")
    return ratios


def bench(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], bool]:
    from tests.node_server import ADMIN_KEY, NodeServer

    guest = Path(args.guest)
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(guest)], check=True, capture_output=True)
    server = NodeServer(work, guest, STRATA_API_KEYS=f"alpha:{ALPHA},beta:{BETA}", STRATA_ADMIN_KEYS=f"ops:{ADMIN_KEY}",
                        STRATA_TEAM_MAX_STREAMS=f"beta={args.streams}",
                        STRATA_MAX_STREAMS=str(max(1024, args.streams + 64)), STRATA_SANDBOX_MEMORY="256")
    held = None
    try:
        server.start()
        print("setup: images and sandboxes ...", file=sys.stderr, flush=True)
        sid, boxes = setup(server, guest, args.streams)
        alpha = httpx.Client(base_url=server.url, headers={"X-API-Key": ALPHA}, timeout=CALL_TIMEOUT)
        measure(alpha, sid, 5)  # warm up
        print(f"idle: {args.rounds} rounds ...", file=sys.stderr, flush=True)
        idle = measure(alpha, sid, args.rounds)
        print(f"load: beta holds {args.streams} streams ...", file=sys.stderr, flush=True)
        held = hold(server, boxes, args.streams)
        loaded = measure(alpha, sid, args.rounds)
        ratios = report(idle, loaded, args.streams)
    finally:
        if held is not None:
            held.close()
        server.cleanup()
    failures = idle["failures"] + loaded["failures"]
    for failure in failures[:10]:
        print(f"error: {failure}")
    return {"args": vars(args), "idle": idle, "loaded": loaded, "ratios": ratios}, not failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=600, help="long requests team beta holds (default 600)")
    parser.add_argument("--rounds", type=int, default=200, help="list + exec rounds of team alpha per phase")
    parser.add_argument("--quick", action="store_true", help="smoke run: 100 streams, 30 rounds")
    parser.add_argument("--guest", default="/var/tmp/strata-guest")
    parser.add_argument("--json", metavar="FILE", help="write every number here")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.rounds = 100, 30
    if min(args.streams, args.rounds) < 1:
        parser.error("--streams and --rounds must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="strata-bench-fair-", dir="/var/tmp"))
    out, clean = bench(args, work)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    print("result: OK (every call of alpha's answered)" if clean else "result: FAILED (alpha's calls failed)")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
