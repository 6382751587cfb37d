"""Reads inside a guest, measured: `dd` of a 512 MiB file on the sandbox's
root disk served by Strata (a real `strata serve`: the disk is a FUSE file
over the image's layers) against the same file on the same image as a local
raw disk (QEMU opens it directly), in one run.

    strata cold   first read after the sandbox starts: chunks come from the
                  store (a local directory here) into the node's chunk cache
    strata warm   the same read again, the guest's page cache dropped: the
                  chunks come from the node's cache
    raw           the local image, read first and again the same way; QEMU
                  opens it with cache=none (O_DIRECT), so neither read is
                  served by the host's page cache

    .venv/bin/python bench/guest_read.py [--size 512] [--json FILE]

Real QEMU (TCG here) on the guest from vmm/guest/build.sh; the image is the
guest's root filesystem grown to hold the file (resize2fs, debugfs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.volumes import guest_seconds  # noqa: E402


def make_image(guest: Path, work: Path, size_mib: int) -> Path:
    """The guest's rootfs grown by `size_mib` + 64 MiB, holding /big (random bytes)."""
    img = work / "big.ext4"
    shutil.copy(guest / "rootfs.ext4", img)
    subprocess.run(["e2fsck", "-fy", str(img)], check=False, capture_output=True)
    subprocess.run(["resize2fs", str(img), f"{size_mib + 128}M"], check=True, capture_output=True)
    src = work / "big.src"
    with open(src, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(1 << 20))
    subprocess.run(["debugfs", "-w", "-R", f"write {src} big", str(img)], check=True, capture_output=True)
    src.unlink()
    return img


def reads(run: Callable[[str], str], size_mib: int) -> dict[str, float]:
    dd = "dd if=/big of=/dev/null bs=1M 2>/dev/null"
    run("sync; echo 3 > /proc/sys/vm/drop_caches")
    first = guest_seconds(run, dd)
    run("echo 3 > /proc/sys/vm/drop_caches")
    again = guest_seconds(run, dd)
    mb = size_mib * 1.048576
    return {"first_mb_s": mb / first, "again_mb_s": mb / again}


def bench(guest: Path, work: Path, size_mib: int) -> dict[str, Any]:
    from e2b import Sandbox

    from tests.node_server import API_KEY, NodeServer
    from vmm.backend import VmSpec
    from vmm.qemu import QemuBackend

    img = make_image(guest, work, size_mib)
    out: dict[str, Any] = {}
    srv = NodeServer(work / "node", guest)
    try:
        srv.strata("image", "import", str(img), "big:v1")
        srv.start()
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=API_KEY)
        sbx = Sandbox.create(template="big:v1", timeout=3600)
        out["strata"] = reads(lambda c: sbx.commands.run(c, timeout=600).stdout, size_mib)
        sbx.kill()
    finally:
        srv.cleanup()
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
    vm_dir = work / "raw-vm"
    vm_dir.mkdir()
    vm = QemuBackend().start(VmSpec(kernel=guest / "vmlinuz", initrd=guest / "initramfs.cpio.gz", disk=img,
                                    workdir=vm_dir, memory_mib=256))
    try:
        out["raw"] = reads(lambda c: vm.agent.run(c, timeout=600).output, size_mib)
    finally:
        vm.kill()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=512, help="MiB of the file read")
    parser.add_argument("--guest", type=Path, default=Path(os.environ.get("STRATA_GUEST_DIR", "/var/tmp/strata-guest")))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(args.guest)], check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="strata-bench-guest-read-", dir="/var/tmp") as tmp:
        out = bench(args.guest, Path(tmp), args.size)
    strata, raw = out["strata"], out["raw"]
    print(f"dd of a {args.size} MiB file inside a TCG guest, MB/s (x the local raw image, same read)")
    print(f"  first read   strata {strata['first_mb_s']:7.1f}   raw {raw['first_mb_s']:7.1f}   "
          f"{strata['first_mb_s'] / raw['first_mb_s']:5.2f}x")
    print(f"  read again   strata {strata['again_mb_s']:7.1f}   raw {raw['again_mb_s']:7.1f}   "
          f"{strata['again_mb_s'] / raw['again_mb_s']:5.2f}x")
    ok = strata["again_mb_s"] / raw["again_mb_s"] >= 0.5
    print(f"Target: strata warm >= 0.5x raw read again: {'ok' if ok else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
