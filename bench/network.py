"""Sandbox networks: what they cost and how fast they carry.

In namespaces this bench makes (a hub bridge, a node, a web host and a
plain client namespace; nothing else is touched):
- guest -> web host: a 32 MiB download and 30 sequential small requests
  (connection setup), with no rules, and with 200 deny CIDRs + an allow
  rule in the way; the same busybox wget from a plain namespace (no VM, no
  rules) beside them;
- the network's share of boot and restore: sandboxes booted and restored
  with and without one, and Network.attach + detach on their own.

The guest is emulated (TCG) here: its numbers are CPU-bound and say more
about relative costs (rules on vs off) than about line rate.

    .venv/bin/python bench/network.py [--json FILE]     (root; iproute2, nftables)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.netns import Lab  # noqa: E402

BIG_MIB = 32
SMALL_REQUESTS = 30


def outer(args: argparse.Namespace) -> int:
    """Make the namespaces and the web host, then run `inner` in the node's namespace."""
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    (work / "www").mkdir(parents=True)
    with open(work / "www" / "big", "wb") as f:
        f.write(os.urandom(BIG_MIB << 20))
    (work / "www" / "small").write_text("ok")
    lab = Lab(f"b{os.getpid() % 10000}")
    web = None
    try:
        for name in ("node", "web", "plain"):
            lab.add_node(name)
        web = subprocess.Popen([*lab.prefix("web"), sys.executable, "-m", "http.server", "--bind", lab.addrs["web"],
                                "--directory", str(work / "www"), "8000"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        time.sleep(1)
        url = f"http://{lab.addrs['web']}:8000"
        plain = {"download_mb_s": _plain_download(lab, url), "request_ms": _plain_requests(lab, url)}
        result = subprocess.run([*lab.prefix("node"), sys.executable, __file__, "--inner", "--workdir", str(work),
                                 "--guest", args.guest, "--url", url], capture_output=True, text=True)
        if result.returncode != 0:
            print(result.stderr, file=sys.stderr)
            return 1
        out = {"plain_namespace": plain, **json.loads(result.stdout)}
    finally:
        if web is not None:
            web.kill()
        lab.destroy()
    _report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def _plain_download(lab: Lab, url: str) -> float:
    started = time.monotonic()
    subprocess.run([*lab.prefix("plain"), "busybox", "wget", "-q", "-O", "/dev/null", f"{url}/big"], check=True)
    return BIG_MIB * 1.048576 / (time.monotonic() - started)


def _plain_requests(lab: Lab, url: str) -> float:
    loop = f"for i in $(seq {SMALL_REQUESTS}); do busybox wget -q -O /dev/null {url}/small; done"
    started = time.monotonic()
    subprocess.run([*lab.prefix("plain"), "sh", "-c", loop], check=True)
    return (time.monotonic() - started) * 1e3 / SMALL_REQUESTS


def inner(args: argparse.Namespace) -> int:
    """In the node's namespace: sandboxes with and without a network."""
    from layerstore.store import open_store
    from tests.test_fusefs_mount import Mount
    from vmm.accel import detect
    from vmm.egress import Egress
    from vmm.network import Network
    from vmm.qemu import QemuBackend
    from vmm.sandbox import Sandboxes

    work, guest = Path(args.workdir), Path(args.guest)
    (work / "node").mkdir(exist_ok=True)
    m = Mount(work / "node", cache_size="1G")
    m.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    m.start()
    store = open_store(str(work / "node" / "store"))
    network = Network(work / "node" / "net")
    with_net = Sandboxes(store, m.client, QemuBackend(accel=detect()), guest_dir=guest, work_root=work / "vms-net",
                         network=network)
    without = Sandboxes(store, m.client, QemuBackend(accel=detect()), guest_dir=guest, work_root=work / "vms-plain")
    out: dict[str, object] = {}
    try:
        for label, tag, boxes in (("with_network", "net", with_net), ("without_network", "bare", without)):
            boots, restores = [], []
            for i in range(3):
                boots.append(boxes.boot("guest:v1", sid=f"{tag}{i}").timings["boot"])
            snapshot = boxes.snapshot(f"{tag}0")
            for i in range(3):
                restores.append(boxes.restore(snapshot, sid=f"{tag}r{i}").timings["restore"])
            out[label] = {"boot_s": statistics.median(boots), "restore_ms": statistics.median(restores) * 1e3}
        attach = []
        for _ in range(20):
            started = time.monotonic()
            network.attach("bench-probe", Egress())
            network.detach("bench-probe")
            attach.append((time.monotonic() - started) * 1e3)
        out["attach_detach_ms"] = statistics.median(attach)
        sid = "net0"
        many = [f"10.{i}.0.0/16" for i in range(100, 200)] + [f"172.20.{i}.0/24" for i in range(100)]
        rules = {"rules_off": Egress(), "rules_on": Egress.parse(False, [args.url.split("//")[1].split(":")[0]], many)}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in rules}
        _guest_transfers(with_net, sid, args.url)  # warm up: the guest's page cache, TCP, wget's pages
        for _ in range(5):  # alternate, so drift in a noisy machine hits both alike
            for name, egress in rules.items():
                with_net.set_egress(sid, egress)
                runs[name].append(_guest_transfers(with_net, sid, args.url))
        for name, samples in runs.items():
            out[name] = {**{key: statistics.median(s[key] for s in samples) for key in samples[0]},
                         "samples": samples}
    finally:
        for boxes in (with_net, without):
            for record in boxes.registry.all():
                boxes.kill(record.sid)
        m.stop()
    print(json.dumps(out))
    return 0


def _guest_transfers(boxes, sid: str, url: str) -> dict[str, float]:  # noqa: ANN001
    agent = boxes.agent(sid)
    started = time.monotonic()
    result = agent.run(f"wget -q -O /dev/null {url}/big", timeout=600)
    took = time.monotonic() - started
    assert result.exit_code == 0, result.output
    loop = f"for i in $(seq {SMALL_REQUESTS}); do wget -q -O /dev/null {url}/small || exit 1; done"
    started = time.monotonic()
    result = agent.run(loop, timeout=600)
    assert result.exit_code == 0, result.output
    return {"download_mb_s": BIG_MIB * 1.048576 / took,
            "request_ms": (time.monotonic() - started) * 1e3 / SMALL_REQUESTS}


def _report(out: dict) -> None:
    plain, off, on = out["plain_namespace"], out["rules_off"], out["rules_on"]
    print(f"{'':<34}{'download MB/s':>14}{'per request ms':>16}")
    for label, row in (("plain namespace (no VM)", plain), ("guest, no rules", off),
                       ("guest, 200 deny CIDRs + allow", on)):
        print(f"{label:<34}{row['download_mb_s']:>14.1f}{row['request_ms']:>16.1f}")
    print(f"rules on / off: download {on['download_mb_s'] / off['download_mb_s']:.2f}x, "
          f"request {on['request_ms'] / off['request_ms']:.2f}x")
    w, wo = out["with_network"], out["without_network"]
    print(f"boot {w['boot_s']:.2f} s with a network vs {wo['boot_s']:.2f} s without; restore {w['restore_ms']:.0f} "
          f"vs {wo['restore_ms']:.0f} ms; attach + detach alone {out['attach_detach_ms']:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/strata-bench-net")
    parser.add_argument("--guest", default="/var/tmp/strata-guest")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    return inner(args) if args.inner else outer(args)


if __name__ == "__main__":
    sys.exit(main())
