"""The gateway, measured: what routing through `strata gateway` adds, and how
its view of the cluster scales with the number of nodes, in one run.

    direct         the E2B SDK and plain HTTP against the node itself
    gateway        the same calls through `strata gateway` in front of it
    scale model    N node records (and placements) in a real store (SeaweedFS
                   when `weed` is installed, else a local directory): the time
                   a gateway takes to re-read the records, place a sandbox and
                   locate one, and the requests per second the cluster sends
                   the store, for N up to 1,000

    .venv/bin/python bench/gateway.py [--runs 200] [--big 64] [--nodes 10,100,1000] [--json FILE]
    .venv/bin/python bench/gateway.py --scale-only

Real QEMU (TCG here) on the guest from vmm/guest/build.sh, the NodeServer the
API tests use, everything on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.envd import throughput, timed  # noqa: E402


def start_gateway(store: Path, work: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    from tests.conftest import free_port

    port = free_port()
    env = {**os.environ, "STRATA_STORE": str(store), "STRATA_CONFIG": str(work / "none.toml")}
    (work / "none.toml").write_text("")
    proc = subprocess.Popen([str(ROOT / ".venv/bin/strata"), "gateway", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(work / "gateway.log", "ab"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the gateway did not see the node: {(work / 'gateway.log').read_text()[-2000:]}")


def stop_gateway(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def bench_routing(guest: Path, work: Path, runs: int, big: int) -> dict[str, Any]:
    import httpx
    from e2b import Sandbox

    from tests.node_server import API_KEY, NodeServer

    srv = NodeServer(work / "node", guest)
    rows: dict[str, Any] = {}
    gateway = None
    try:
        srv.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
        srv.start()
        gateway, gateway_url = start_gateway(work / "node" / "store", work)
        os.environ["E2B_API_KEY"] = API_KEY
        payload, large = os.urandom(1 << 20), os.urandom(big << 20)
        for label, url in (("direct", srv.url), ("gateway", gateway_url)):
            os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url)
            sbx = Sandbox.create(template="guest:v1", timeout=3600)
            client = httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=60)
            try:
                rows[f"{label}: GET /sandboxes/{{id}}"] = timed(
                    lambda: client.get(f"/sandboxes/{sbx.sandbox_id}").raise_for_status(), runs)
                rows[f"{label}: GET /v2/sandboxes"] = timed(lambda: client.get("/v2/sandboxes").raise_for_status(),
                                                            runs)
                rows[f"{label}: sdk commands.run(true)"] = timed(lambda: sbx.commands.run("true"), max(runs // 4, 5))
                rows[f"{label}: sdk files.write 1 MiB"] = timed(lambda: sbx.files.write("/tmp/s", payload),
                                                                max(runs // 10, 3))
                rows[f"{label}: sdk files.write {big} MiB"] = throughput(
                    lambda: sbx.files.write("/tmp/l", large), len(large))
                rows[f"{label}: sdk files.read {big} MiB"] = throughput(
                    lambda: sbx.files.read("/tmp/l", format="bytes"), len(large))
            finally:
                client.close()
                sbx.kill()
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        srv.cleanup()
    return rows


def bench_scale(work: Path, sizes: list[int]) -> dict[str, Any]:
    """Gateway lookups against N node records in a real store."""
    from vmm import placement
    from api.gateway import Cluster
    from layerstore import nodes
    from layerstore.store import open_store
    from tests.seaweedfs_server import SeaweedFS, find_weed

    weed = None
    if find_weed() is not None:
        weed = SeaweedFS(work / "weed").start()
        weed.create_bucket("scale")
        for key, value in {"STRATA_S3_ENDPOINT": weed.endpoint, "AWS_ACCESS_KEY_ID": weed.access_key,
                           "AWS_SECRET_ACCESS_KEY": weed.secret_key, "AWS_REGION": weed.region}.items():
            os.environ[key] = value
    rows: dict[str, Any] = {"store": "seaweedfs" if weed else "local directory"}
    try:
        for n in sizes:
            spec = f"s3://scale/n{n}" if weed else str(work / f"store-{n}")
            store = open_store(spec, s3_endpoint=weed.endpoint if weed else "", create=True,
                               state_dir=work / f"state-{n}")
            backend = store.backend
            for i in range(n):
                nodes.publish(backend, f"node-{i:04d}", [], about={
                    "url": f"http://10.0.{i // 250}.{i % 250 + 1}:8080", "max": 64, "held": i % 64,
                    "pools": {"base": i % 3}, "templates": {"base": i % 5}})
            for i in range(100):
                placement.place(backend, f"sb{i:03d}", f"node-{i % n:04d}")
            cluster = Cluster(backend, refresh=0)
            t = time.perf_counter()
            members = cluster.members()
            read_s = time.perf_counter() - t
            assert len(members) == n
            cluster.refresh = 3600
            t = time.perf_counter()
            for _ in range(100):
                cluster.schedule("base")
            schedule_ms = (time.perf_counter() - t) * 10
            t = time.perf_counter()
            for i in range(100):
                cluster.locate(f"sb{i:03d}")
            locate_ms = (time.perf_counter() - t) * 10
            rows[f"{n} nodes"] = {"read records (one refresh)": round(read_s * 1e3, 1),
                                  "schedule one create": round(schedule_ms, 3),
                                  "locate a sandbox (store read)": round(locate_ms, 2),
                                  "store requests/s: heartbeats": round(n / (nodes.NODE_TTL / 3), 1),
                                  "store requests/s per gateway (5 s refresh)": round((n + 1) / 5, 1)}
            store.close()
    finally:
        if weed is not None:
            weed.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--big", type=int, default=64, help="MiB of the large file write/read")
    parser.add_argument("--nodes", default="10,100,1000", help="node counts of the scale model")
    parser.add_argument("--scale-only", action="store_true", help="only the scale model (no VM)")
    parser.add_argument("--guest", default="/var/tmp/strata-guest")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="strata-bench-gw-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        results: dict[str, Any] = {}
        if not args.scale_only:
            subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), args.guest], check=True,
                           stdout=subprocess.DEVNULL)
            results["routing"] = bench_routing(Path(args.guest), work, args.runs, args.big)
            routing = results["routing"]
            for name in list(routing):
                if name.startswith("gateway: "):
                    base = routing.get("direct: " + name.removeprefix("gateway: "))
                    key = "p50_ms" if "p50_ms" in routing[name] else "mb_per_s"
                    if base:
                        routing[name]["vs direct"] = round(routing[name][key] / base[key], 2)
        results["scale"] = bench_scale(work, [int(n) for n in args.nodes.split(",")])
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
