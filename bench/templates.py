"""E2B-style templates, measured: a template build split into boot, steps,
start/ready command and snapshot; then sandbox creation from the built
template (a restore of the running VM) with a cold chunk cache (after
POST /admin/cache/drop) and a warm one, next to a boot of the same image;
and what the first build and a rebuild with the same steps add to the store.

    .venv/bin/python bench/templates.py [--runs 5] [--json FILE]

Real QEMU (TCG here) through a real FUSE mount and `strata serve` on
loopback (the NodeServer the API tests use).
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def create_ms(srv: Any, template: str) -> float:
    started = time.perf_counter()
    r = srv.client.post("/sandboxes", json={"templateID": template, "timeout": 600})
    took = (time.perf_counter() - started) * 1e3
    r.raise_for_status()
    assert srv.client.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204
    return took


def main() -> int:
    from tests.node_server import NodeServer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="creates per row")
    parser.add_argument("--guest", type=Path, default=Path(os.environ.get("STRATA_GUEST_DIR", "/var/tmp/strata-guest")))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(args.guest)], check=True, stdout=subprocess.DEVNULL)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-tpl-", dir="/var/tmp") as tmp:
        srv = NodeServer(Path(tmp), args.guest)
        try:
            srv.strata("image", "import", str(args.guest / "rootfs.ext4"), "guest:v1")
            srv.start()
            store_bytes = lambda: sum(f.stat().st_size for f in (Path(tmp) / "store").rglob("*") if f.is_file())
            steps = ("--from", "guest:v1", "--env", "STAGE=bench", "--run",
                     "head -c 8000000 /dev/urandom > /root/data; sync", "--start", "echo up > /tmp/up; sleep 100000",
                     "--ready", "test -f /tmp/up", "--json")
            before = store_bytes()
            built = json.loads(srv.strata("template", "build", "bench", *steps).stdout)
            rows["build"] = built["timings"]
            rows["first build stored (bytes)"] = store_bytes() - before
            before = store_bytes()
            srv.strata("template", "build", "bench", *steps)  # the same steps again: a rebuild
            rows["rebuild stored (bytes)"] = store_bytes() - before
            cold = []
            for _ in range(args.runs):
                srv.admin.post("/admin/cache/drop").raise_for_status()
                cold.append(create_ms(srv, "bench"))
            rows["create from template, cold cache (ms)"] = statistics.median(cold)
            rows["create from template, warm cache (ms)"] = statistics.median(
                create_ms(srv, "bench") for _ in range(args.runs))
            rows["create by booting the image (ms)"] = statistics.median(
                create_ms(srv, "guest:v1") for _ in range(args.runs))
        finally:
            srv.cleanup()
    print("template build: " + ", ".join(f"{k} {v:.2f} s" for k, v in rows["build"].items()))
    for name, value in rows.items():
        if name != "build":
            print(f"{name:40} {value:9.0f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
