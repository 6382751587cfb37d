"""A scale model of a Strata cluster: 1,000 nodes x 100 sandboxes on one
object store, for two fleets, fed by per-node figures measured on this
machine (bench/README.md). Nothing here runs a VM: it multiplies and
simulates, and says what each number rests on.

    .venv/bin/python bench/cluster_model.py [--nodes 1000] [--per-node 100] [--gateways 2] [--json FILE]

Fleets (rates per sandbox slot):
    rl     RL rollouts: an episode lives 120 s (create from a template, run, kill);
           1 in 10 episodes forks 8 children from a checkpoint snapshot
    chat   agent chat: a session lives 1 h, active 10 min at a time then paused
           until the user's next turn (6 pauses and resumes an hour)

Reports: object-store requests per second by source, bytes fetched per start,
start time p50/p99 against the warm-pool size (an event simulation of one
node's pool), the cache hit rate of placements by Strata's scheduler
(`api.gateway.Cluster.schedule`, the real code) against random placement,
and GC duration and request cost. The model, its inputs and its limits are
in bench/README.md next to the tables.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Per-node inputs, measured here (bench/README.md; TCG guests, a local store, SeaweedFS on loopback).
MEASURED = {
    "restore_cold_s": 0.711,    # create from a snapshot template, empty chunk cache (--measure replaces
    "restore_warm_s": 0.398,    # these four with this machine's figures; these are its run of 2026-12-04)
    "pool_take_s": 0.02,        # a warm sandbox: vCPU resume (0.4 ms) + record update + HTTP (bench/api_load.py)
    "start_fetch_mib": 81.9,    # chunk bytes such a cold create fetches (the cache's bytes_fetched)
    "start_fetch_objects": 82,  # and chunks (objects read from the store: its insertions)
    "chunk_mib": 0.5,           # mean stored (zstd) chunk a snapshot writes: 1 MiB chunks compress ~2x
    "snapshot_mib": 7.3,        # incremental snapshot of a sandbox that wrote a little (vm_snapshot.py)
    "snapshot_objects": 4,      # its manifests (RAM, disk, state) and the snapshot object
    "fetch_mb_s": 179.0,        # cold buffered read through FUSE (bench/fuse_read.py)
    "gc_mark_objects_s": 8040,  # GC marking on SeaweedFS: 20,100 objects in 2.5 s (bench/gc.py)
    "gc_delete_objects_s": 2580,  # its deletes: 10,050 objects in 3.9 s, 8 DeleteObjects of 1,000 in flight
    "node_record_s": 40.0,      # a node rewrites its record every 40 s (layerstore/nodes.py)
    "gateway_refresh_s": 5.0,   # a gateway re-reads the node records every 5 s (api/gateway.py)
    "placed_ttl_s": 300.0,      # and remembers a sandbox's node 300 s
    "nudge_interval_s": 5.0,    # a node rewrites its record on a change at most every 5 s
}
# S3 list prices (us-east-1, per 1,000 requests): what the request rates cost
PRICE = {"put": 0.005, "get": 0.0004, "list": 0.005, "delete": 0.0}


@dataclass(frozen=True)
class Fleet:
    name: str
    lifetime_s: float       # a sandbox's life from create to kill
    fork_share: float       # creates that are forks (of 8) instead
    pauses_per_hour: float  # pause + resume pairs per sandbox-hour
    templates: int          # distinct templates in use (Zipf popularity)


FLEETS = [Fleet("rl", 120.0, 0.1, 0.0, 20), Fleet("chat", 3600.0, 0.0, 6.0, 200)]


def request_rates(fleet: Fleet, nodes: int, per_node: int, gateways: int, hit: float) -> dict[str, Any]:
    """Store requests per second, cluster-wide, by what sends them."""
    m = MEASURED
    slots = nodes * per_node
    creates = slots / fleet.lifetime_s            # = kills, in steady state
    pauses = slots * fleet.pauses_per_hour / 3600  # = resumes
    fetch_objects = m["start_fetch_objects"]
    snap_chunks = m["snapshot_mib"] / m["chunk_mib"]
    rows = {
        "node records (heartbeats)": {"put": nodes / m["node_record_s"]},
        "placements: create, kill": {"put": creates, "delete": creates},
        "node records on change (create, kill)": {"put": min(2 * creates, nodes / m["nudge_interval_s"])},
        "chunks read by starts (cache misses)": {"get": creates * (1 - fleet.fork_share) * (1 - hit) * fetch_objects},
        "pause: snapshot chunks, manifests, placement": {"put": pauses * (snap_chunks + m["snapshot_objects"] + 1),
                                                          "get": pauses * snap_chunks},  # has_many probes
        "resume: claim, chunks": {"get": pauses * (2 + fetch_objects * (1 - hit)), "put": pauses},
        "gateways: node records": {"list": gateways / m["gateway_refresh_s"],
                                   "get": gateways * nodes / m["gateway_refresh_s"]},
        "gateways: placements (active sandboxes)": {"get": gateways * slots / m["placed_ttl_s"]},
    }
    total = {k: sum(r.get(k, 0.0) for r in rows.values()) for k in PRICE}
    cost = sum(total[k] * PRICE[k] / 1000 for k in PRICE) * 86400
    return {"rows": {name: {k: round(v, 1) for k, v in r.items()} for name, r in rows.items()},
            "total per s": {k: round(v, 1) for k, v in total.items()},
            "requests cost per day (USD)": round(cost, 2),
            "bytes fetched per start (MiB)": round(m["start_fetch_mib"] * (1 - hit), 1),
            "bytes fetched per s (GB)": round(creates * (1 - fleet.fork_share) * (1 - hit)
                                              * m["start_fetch_mib"] * 2**20 / 1e9, 2)}


def start_times(rate: float, pool: int, hit: float, *, seconds: float = 20000, seed: int = 1) -> dict[str, float]:
    """One node's creates of one template: Poisson arrivals at `rate`/s; a warm
    sandbox when the pool has one (refilled one restore at a time, as the
    node's pooler does), else a restore (warm or cold by the cache hit rate,
    plus the cold fetch at the node's read rate)."""
    m = MEASURED
    rng = random.Random(seed)
    cold = m["restore_cold_s"] + m["start_fetch_mib"] * 2**20 / (m["fetch_mb_s"] * 1e6)
    ready, refill_done, t, samples = pool, float("inf"), 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        while refill_done <= t:  # refills that finished before this arrival
            ready += 1
            refill_done = refill_done + m["restore_warm_s"] if ready < pool else float("inf")
        if ready > 0:
            ready -= 1
            samples.append(m["pool_take_s"])
        else:
            samples.append(m["restore_warm_s"] if rng.random() < hit else cold)
        if ready < pool and refill_done == float("inf"):
            refill_done = t + m["restore_warm_s"]
    samples.sort()
    return {"p50_ms": round(samples[len(samples) // 2] * 1e3), "p99_ms": round(samples[int(len(samples) * 0.99)] * 1e3),
            "from pool": round(sum(1 for s in samples if s == m["pool_take_s"]) / len(samples), 3)}


def placement_hit_rate(fleet: Fleet, nodes: int, per_node: int, cache_templates: int, *, policy: str,
                       events: int, seed: int = 2) -> float:
    """Creates and kills on `nodes`, each with an LRU cache of `cache_templates`
    working sets: the share of creates whose template was cached where they
    landed. `strata` ranks with api.gateway.Cluster.schedule itself."""
    from api.gateway import Cluster, Member

    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(fleet.templates)]  # Zipf
    held: list[dict[str, int]] = [{} for _ in range(nodes)]
    count = [0] * nodes
    caches: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(nodes)]
    running: list[tuple[int, str]] = []
    cluster = Cluster(None)  # type: ignore[arg-type]  # the scoring only: members come from this model
    hits = creates = 0
    for _ in range(events):
        if running and (len(running) >= nodes * per_node * 0.9 or rng.random() < 0.5):
            node, template = running.pop(rng.randrange(len(running)))
            held[node][template] -= 1
            count[node] -= 1
            continue
        template = f"t{rng.choices(range(fleet.templates), weights)[0]}"
        if policy == "random":
            free = [i for i in range(nodes) if count[i] < per_node]
            node = rng.choice(free)
        else:
            members = [Member(str(i), "", max=per_node, held=count[i], templates=held[i]) for i in range(nodes)]
            cluster.members = lambda members=members: members  # type: ignore[method-assign]
            node = int(cluster.schedule(template)[0].node)
        creates += 1
        cache = caches[node]
        if template in cache:
            hits += 1
            cache.move_to_end(template)
        else:
            cache[template] = None
            if len(cache) > cache_templates:
                cache.popitem(last=False)
        held[node][template] = held[node].get(template, 0) + 1
        count[node] += 1
        running.append((node, template))
    return hits / creates


def gc_cost(fleet: Fleet, nodes: int, per_node: int) -> dict[str, Any]:
    """A daily GC of the shared store: every object listed, every root's manifests read, the day's garbage deleted."""
    m = MEASURED
    slots = nodes * per_node
    paused_snapshots = slots * min(1.0, fleet.pauses_per_hour / 6)  # one live snapshot per paused sandbox
    snapshot_objects = m["snapshot_objects"] + m["snapshot_mib"] / m["chunk_mib"]
    live = paused_snapshots * snapshot_objects + fleet.templates * 200 + nodes  # templates: ~100 MiB each
    garbage = slots * 24 * fleet.pauses_per_hour * snapshot_objects * 0.9  # superseded pause snapshots
    mark_s, delete_s = (live + garbage) / m["gc_mark_objects_s"], garbage / m["gc_delete_objects_s"]
    requests = {"list": (live + garbage) / 1000, "get": paused_snapshots * m["snapshot_objects"] + nodes,
                "delete": garbage / 1000}
    return {"objects": round(live + garbage), "garbage": round(garbage),
            "duration_min (one GC process)": round((mark_s + delete_s) / 60, 1),
            "GC processes to keep up in a day": max(1, -(-(mark_s + delete_s) // 86400)),
            "requests cost (USD)": round(sum(requests[k] * PRICE[k] / 1000 for k in requests), 2)}


def measure(guest: Path, work: Path, runs: int = 3) -> dict[str, float]:
    """The per-start inputs, measured on a real node: a template snapshotted from a
    running guest, then sandboxes created from it with the chunk cache dropped
    (cold) and not (warm): create time through the API and chunk bytes fetched."""
    import statistics
    import time

    from tests.node_server import NodeServer

    srv = NodeServer(work, guest)
    try:
        srv.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
        srv.start()
        sid = srv.client.post("/sandboxes", json={"templateID": "guest:v1"}).json()["sandboxID"]
        srv.client.post(f"/sandboxes/{sid}/exec", json={"command": "echo ready > /root/state; sync"})
        assert srv.client.post(f"/sandboxes/{sid}/snapshots", json={"name": "model"}).status_code == 201
        srv.client.delete(f"/sandboxes/{sid}")
        cold, warm, fetched = [], [], []
        for _ in range(runs):
            for drop, times in ((True, cold), (False, warm)):
                if drop:
                    srv.admin.post("/admin/cache/drop").raise_for_status()
                stats = srv.client.get("/cache").json()
                before = (stats.get("bytes_fetched", 0), stats.get("insertions", 0))
                started = time.perf_counter()
                r = srv.client.post("/sandboxes", json={"templateID": "model"})
                times.append(time.perf_counter() - started)
                assert r.status_code == 201, r.text
                if drop:
                    stats = srv.client.get("/cache").json()
                    fetched.append((stats.get("bytes_fetched", 0) - before[0], stats.get("insertions", 0) - before[1]))
                srv.client.delete(f"/sandboxes/{r.json()['sandboxID']}")
        return {"restore_cold_s": round(statistics.median(cold), 3), "restore_warm_s": round(statistics.median(warm), 3),
                "start_fetch_mib": round(statistics.median(f[0] for f in fetched) / 2**20, 1),
                "start_fetch_objects": statistics.median(f[1] for f in fetched)}
    finally:
        srv.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--per-node", type=int, default=100)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--cache-templates", type=int, default=8, help="working sets one node's cache holds")
    parser.add_argument("--placement-nodes", type=int, default=50, help="nodes in the placement simulation")
    parser.add_argument("--measure", action="store_true",
                        help="measure the per-start inputs on a real node (TCG guest) instead of the recorded ones")
    parser.add_argument("--guest", default="/var/tmp/strata-guest")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if args.measure:
        import subprocess
        import tempfile

        subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), args.guest], check=True, stdout=subprocess.DEVNULL)
        with tempfile.TemporaryDirectory(prefix="strata-model-", dir="/var/tmp") as tmp:
            MEASURED.update(measure(Path(args.guest), Path(tmp)))
    out: dict[str, Any] = {"inputs": MEASURED}
    for fleet in FLEETS:
        hit = {policy: round(placement_hit_rate(fleet, args.placement_nodes, args.per_node, args.cache_templates,
                                                policy=policy, events=40_000), 3)
               for policy in ("random", "strata")}
        per_node_rate = args.per_node / fleet.lifetime_s
        out[fleet.name] = {
            "cache hit rate of placements": hit,
            "store": request_rates(fleet, args.nodes, args.per_node, args.gateways, hit["strata"]),
            "start time vs warm pool (most popular template)": {
                str(pool): start_times(per_node_rate * 0.3, pool, hit["strata"]) for pool in (0, 1, 2, 4, 8)},
            "gc (daily)": gc_cost(fleet, args.nodes, args.per_node),
        }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
