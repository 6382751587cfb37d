"""The E2B data plane, measured: the unchanged `e2b` SDK against `strata serve`
(HTTP + Connect + the node's agent connection + virtio-serial + the guest
agent), next to the same work through Strata's own paths, in one run:

    sdk            e2b SDK: commands.run("true"); files.write/read
    api-exec       POST /sandboxes/{id}/exec (Strata's endpoint; one request, one reply)
    cli-exec       `strata sandbox exec SID true` (a new process each time, attaching to the VM)
    agent-no-vm    the guest agent binary on a pseudo-terminal on the host, driven by
                   vmm/agent.py: the protocol's floor, with no VM, virtio or HTTP
    code-interp    e2b_code_interpreter: run_code("1+1") in code-interpreter-v1 (the node's
                   port proxy, the sandbox's network, the guest's Jupyter kernel); and the
                   same POST /execute sent straight to the node, without the SDK

So "VMM time apart": agent-no-vm is what the agent and its protocol cost;
sdk minus agent-no-vm is the VM (TCG here, so slow) plus HTTP and Connect.

    .venv/bin/python bench/envd.py [--runs 50] [--big 100] [--what all|envd|code-interpreter] [--json FILE]

The code interpreter needs sandbox networks, so its node runs in a network
namespace of its own (tests/netns.py: root, ip, nft) and builds the template
with `strata template code-interpreter` (mmdebstrap once, then cached).

Real QEMU (TCG here) on the guest from vmm/guest/build.sh, through a real
FUSE mount, with the NodeServer the API tests use; everything on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def timed(fn: Callable[[], Any], runs: int) -> dict[str, float]:
    fn()  # warm up: connections, caches
    ms = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1e3)
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "mean_ms": statistics.fmean(ms)}


def throughput(fn: Callable[[], Any], size: int) -> dict[str, float]:
    t = time.perf_counter()
    fn()
    s = time.perf_counter() - t
    return {"seconds": s, "mb_per_s": size / s / 1e6}


def bench_node(guest: Path, work: Path, runs: int, big: int) -> dict[str, Any]:
    from e2b import Sandbox

    from tests.node_server import API_KEY, NodeServer

    srv = NodeServer(work, guest)
    rows: dict[str, Any] = {}
    try:
        srv.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
        srv.start()
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=API_KEY)
        sbx = Sandbox.create(template="guest:v1", timeout=3600)
        rows["sdk commands.run(true)"] = timed(lambda: sbx.commands.run("true"), runs)
        rows["api-exec true"] = timed(lambda: srv.client.post(f"/sandboxes/{sbx.sandbox_id}/exec",
                                                              json={"command": "true"}).raise_for_status(), runs)
        small, large = os.urandom(1 << 20), os.urandom(big << 20)
        rows["sdk files.write 1 MiB"] = timed(lambda: sbx.files.write("/tmp/small", small), max(runs // 5, 3))
        rows["sdk files.read 1 MiB"] = timed(lambda: sbx.files.read("/tmp/small", format="bytes"),
                                             max(runs // 5, 3))
        rows[f"sdk files.write {big} MiB"] = throughput(lambda: sbx.files.write("/tmp/large", large), len(large))
        got: list[bytes] = []
        rows[f"sdk files.read {big} MiB"] = throughput(
            lambda: got.append(bytes(sbx.files.read("/tmp/large", format="bytes"))), len(large))
        assert got[0] == large, "the large file came back different"
        sid = sbx.sandbox_id
        srv.stop()  # the CLI attaches to the VM itself: one process holds a VM's agent at a time
        rows["cli-exec true"] = timed(lambda: srv.strata("sandbox", "exec", sid, "true"), max(runs // 5, 3))
    finally:
        srv.cleanup()
    return rows


def bench_code_interpreter(guest: Path, work: Path, runs: int) -> dict[str, Any]:
    import httpx

    from tests.netns import Forward, Lab, start_sdk_runtime
    from tests.node_server import API_KEY, NodeServer

    lab = Lab(f"b{os.getpid() % 10000}")
    rows: dict[str, Any] = {}
    srv = forward = None
    try:
        lab.add_node("node")
        start_sdk_runtime()  # the SDK's HTTP threads outside the lab; it goes in through `forward`
        forward = Forward(lab, "hub")
        with lab.inside("hub"):
            srv = NodeServer(work, guest, host=lab.addrs["node"],
                             prefix=("nsenter", f"--net=/run/netns/{lab.nodes['node']}", "--"),
                             STRATA_NETWORK_ENABLED="true", STRATA_NETWORK_POOL="10.201.0.0/28",
                             STRATA_SANDBOX_MEMORY="512")
            srv.start()
            srv.strata("template", "code-interpreter")
            forward.target = (lab.addrs["node"], srv.port)
            url = f"http://127.0.0.1:{forward.port}"
            os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=API_KEY)
            from e2b_code_interpreter import Sandbox

            sbx = Sandbox.create(timeout=3600)
            assert sbx.run_code("1+1").text == "2"
            rows["code-interp sdk run_code(1+1)"] = timed(lambda: sbx.run_code("1+1"), runs)
            headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
            with httpx.Client(timeout=60) as client:
                rows["code-interp POST /execute direct"] = timed(lambda: client.post(
                    f"{srv.url}/execute", json={"code": "1+1"}, headers=headers).raise_for_status(), runs)
            sbx.kill()
    finally:
        if forward is not None:
            forward.close()
        if srv is not None:
            with lab.inside("hub"):
                srv.cleanup()
        lab.destroy()
    return rows


def bench_agent(guest: Path, work: Path, runs: int, big: int) -> dict[str, Any]:
    from tests.test_vmm_agent import agent_on_pty

    rows: dict[str, Any] = {}
    with agent_on_pty(guest / "strata-agent") as agent:
        rows["agent-no-vm run(true)"] = timed(lambda: agent.run("true"), runs)
        large = os.urandom(big << 20)
        path = str(work / "large")
        rows[f"agent-no-vm write {big} MiB"] = throughput(lambda: agent.write_file(path, [large]), len(large))
        rows[f"agent-no-vm read {big} MiB"] = throughput(lambda: b"".join(agent.read_file(path)), len(large))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="round trips per latency row")
    parser.add_argument("--big", type=int, default=100, help="MiB of the large file")
    parser.add_argument("--guest", type=Path, default=Path(os.environ.get("STRATA_GUEST_DIR", "/var/tmp/strata-guest")))
    parser.add_argument("--what", choices=("all", "envd", "code-interpreter"), default="all")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(args.guest)], check=True,
                   stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="strata-bench-envd-", dir="/var/tmp") as tmp:
        rows = {**bench_agent(args.guest, Path(tmp), args.runs, args.big)}
        if args.what in ("all", "envd"):
            rows.update(bench_node(args.guest, Path(tmp) / "node", args.runs, args.big))
        if args.what in ("all", "code-interpreter"):
            rows.update(bench_code_interpreter(args.guest, Path(tmp) / "code-interpreter", args.runs))
    floor = rows["agent-no-vm run(true)"]["p50_ms"]
    print(f"{'what':34} {'p50 ms':>9} {'p99 ms':>9} {'MB/s':>8}  x agent-no-vm p50")
    for name, r in rows.items():
        if "p50_ms" in r:
            print(f"{name:34} {r['p50_ms']:9.2f} {r['p99_ms']:9.2f} {'':>8}  {r['p50_ms'] / floor:6.1f}x")
        else:
            print(f"{name:34} {'':>9} {'':>9} {r['mb_per_s']:8.1f}  ({r['seconds']:.2f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
