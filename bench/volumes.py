"""Volumes, measured inside a guest: a volume mounted at /mnt/vol (the guest
agent's FUSE mount, each request over the volume port to the node, which
reads and writes the store) next to the same work on the sandbox's root disk
(ext4 on virtio-blk over Strata's FUSE disk layer) and on the guest's /tmp
(tmpfs: the guest's own ceiling), in one run, plus the volume API from the
host for reference:

    seq write    dd 64 MiB of random bytes (from /tmp) with bs=1M, then sync
                 (the mount publishes at close: a new layer + the index)
    seq read     dd the same file to /dev/null, page cache dropped first
    small files  500 files of 4 KiB written one by one, then read back, then removed
    api          Volume.write_file / read_file of the same 64 MiB from the host

    .venv/bin/python bench/volumes.py [--size 64] [--files 500] [--json FILE]

Real QEMU (TCG here) on the guest from vmm/guest/build.sh, a real `strata
serve` (tests/node_server.py), the unchanged `e2b` SDK; all on loopback.
Firecracker has no virtio-serial, so it gets no volume mounts (the port
would have to go over vsock); this bench runs QEMU only.
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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PLACES = {"volume": "/mnt/vol/bench", "root disk": "/root/bench", "tmpfs": "/tmp/bench"}


def guest_seconds(run: Callable[[str], str], command: str) -> float:
    """`command` run in the guest by `run` (which returns its output);
    the seconds it took, timed by the guest itself."""
    out = run(f"s=$(cat /proc/uptime); {command}; e=$(cat /proc/uptime); echo ${{s%% *}} ${{e%% *}}").split()
    return float(out[-1]) - float(out[-2])


def in_guest(sbx: Any, size_mib: int, files: int) -> dict[str, dict[str, float]]:
    sbx.commands.run(f"dd if=/dev/urandom of=/tmp/src bs=1M count={size_mib} 2>/dev/null", timeout=600)

    def run(command: str) -> str:
        return sbx.commands.run(command, timeout=600).stdout
    rows: dict[str, dict[str, float]] = {}
    for place, d in PLACES.items():
        sbx.commands.run(f"mkdir -p {d}")
        f = f"{d}/big"
        write = guest_seconds(run, f"dd if=/tmp/src of={f} bs=1M 2>/dev/null; sync")
        sbx.commands.run("sync; echo 3 > /proc/sys/vm/drop_caches")
        read = guest_seconds(run, f"dd if={f} of=/dev/null bs=1M 2>/dev/null")
        same = sbx.commands.run(f"cmp /tmp/src {f} && echo same").stdout.strip()
        assert same == "same", f"{place}: the file read back differs"
        make = guest_seconds(run, f"mkdir {d}/small && for i in $(seq {files}); do "
                                  f"head -c 4096 /tmp/src > {d}/small/f$i; done; sync")
        sbx.commands.run("sync; echo 3 > /proc/sys/vm/drop_caches")
        cat = guest_seconds(run, f"cat {d}/small/* > /dev/null")
        rm = guest_seconds(run, f"rm -r {d}/small {f}")
        rows[place] = {"write_mb_s": size_mib * 1.048576 / write, "read_mb_s": size_mib * 1.048576 / read,
                       "small_create_per_s": files / make, "small_read_per_s": files / cat,
                       "small_remove_per_s": files / rm}
    return rows


def bench(guest: Path, work: Path, size_mib: int, files: int) -> dict[str, Any]:
    from e2b import Sandbox, Volume

    from tests.node_server import API_KEY, NodeServer

    srv = NodeServer(work, guest, STRATA_MAX_UPLOAD=f"{max(256, 4 * size_mib)}M",
                     STRATA_SANDBOX_MEMORY=str(max(1024, 8 * size_mib)))  # /tmp (tmpfs) holds two copies
    try:
        srv.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
        srv.start()
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_VOLUME_API_URL=srv.url,
                          E2B_API_KEY=API_KEY)
        vol = Volume.create("bench")
        started = time.perf_counter()  # through the API: the SDK has no disk size, and the image's is 64 MiB
        r = srv.client.post("/sandboxes", json={"templateID": "guest:v1", "timeout": 3600,
                                                "diskSizeMB": 4 * size_mib + 256,
                                                "volumeMounts": [{"name": "bench", "path": "/mnt/vol"}]})
        r.raise_for_status()
        created = time.perf_counter() - started
        sbx = Sandbox.connect(r.json()["sandboxID"])
        rows: dict[str, Any] = {"guest": in_guest(sbx, size_mib, files), "create_with_mount_s": created}
        data = os.urandom(size_mib << 20)
        t = time.perf_counter()
        vol.write_file("/api.bin", data)
        w = time.perf_counter() - t
        t = time.perf_counter()
        back = vol.read_file("/api.bin", format="bytes")
        r = time.perf_counter() - t
        assert bytes(back) == data
        rows["api"] = {"write_mb_s": len(data) / w / 1e6, "read_mb_s": len(data) / r / 1e6}
        sbx.kill()
    finally:
        srv.cleanup()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="MiB of the sequential file")
    parser.add_argument("--files", type=int, default=500, help="number of 4 KiB files")
    parser.add_argument("--guest", type=Path, default=Path(os.environ.get("STRATA_GUEST_DIR", "/var/tmp/strata-guest")))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(args.guest)], check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="strata-bench-volumes-", dir="/var/tmp") as tmp:
        rows = bench(args.guest, Path(tmp), args.size, args.files)
    disk = rows["guest"]["root disk"]
    print(f"in the guest (TCG), {args.size} MiB sequential, {args.files} files of 4 KiB; "
          f"create with a mount {rows['create_with_mount_s']:.2f} s")
    print(f"{'where':10} {'write MB/s':>11} {'read MB/s':>10} {'create/s':>9} {'read/s':>8} {'rm/s':>8}"
          "   x root disk (write, read, create, read, rm)")
    for place, r in rows["guest"].items():
        ratio = " ".join(f"{r[k] / disk[k]:5.2f}" for k in r)
        print(f"{place:10} {r['write_mb_s']:11.1f} {r['read_mb_s']:10.1f} {r['small_create_per_s']:9.0f} "
              f"{r['small_read_per_s']:8.0f} {r['small_remove_per_s']:8.0f}   {ratio}")
    print(f"{'api':10} {rows['api']['write_mb_s']:11.1f} {rows['api']['read_mb_s']:10.1f}   (Volume.write_file / "
          "read_file from the host)")
    print("firecracker: no volume mounts (no virtio-serial; the port would need vsock)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
