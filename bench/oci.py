"""OCI image versions in the store: what a second version costs.

Two synthetic OCI images (tests/oci_images.py): v1 = one layer of N MiB of
random files plus a small tree; v2 = v1's layer plus one small layer (a new
file, a whiteout, a rewritten file). Side by side, in one run:

    layered   `strata image import v2` after v1: built on v1's disk (fuse2fs)
    afresh    the same import with `--size` (forces mkfs.ext4 -d of the whole tree,
              what every import did before)

Reported: chunks and bytes v2 adds to the store, and the import's wall time (layers applied, disk made, chunked).

Then a real image, the Debian 12 minbase + python3 rootfs the tests build
with mmdebstrap, as a one-layer OCI layout: `strata image import` against
`umoci unpack` + `mkfs.ext4 -d` of the same image (the usual way to make a
VM disk of a container image): wall time, and bytes kept (Strata: stored
chunks; the peer: the ext4 file, allocated blocks). The
ratio afresh/layered is what building on the parent's disk saves.

    .venv/bin/python bench/oci.py [--mib 256] [--no-debian] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def strata_import(store: Path, state: Path, archive: Path, ref: str, *extra: str) -> dict[str, Any]:
    started = time.monotonic()
    r = subprocess.run([str(ROOT / ".venv/bin/strata"), "image", "import", "--json", "--store", str(store),
                        *extra, str(archive), ref], capture_output=True, text=True,
                       env={**os.environ, "STRATA_STATE_DIR": str(state)}, check=True)
    return {**json.loads(r.stdout), "wall": time.monotonic() - started}


def main() -> int:
    from tests.oci_images import layer, write_oci

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="MiB of files in v1's layer")
    parser.add_argument("--no-debian", action="store_true", help="skip the Debian image against umoci")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rng = random.Random(1)
    base = layer([("dir", "etc"), ("file", "etc/hostname", b"bench\n"), ("dir", "usr"), ("dir", "usr/share")]
                 + [("file", f"usr/share/f{i:04d}", rng.randbytes(1 << 20)) for i in range(args.mib)], compress=False)
    update = layer([("file", "etc/motd", b"v2\n"), ("file", "usr/share/.wh.f0003", b""),
                    ("file", "usr/share/f0005", b"rewritten")], compress=False)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-oci-", dir="/var/tmp") as tmp:
        t = Path(tmp)
        v1, v2 = write_oci(t / "v1", [base]), write_oci(t / "v2", [base, update])
        for mode in ("layered", "afresh"):
            store, state = t / mode / "store", t / mode / "state"
            first = strata_import(store, state, v1, "app:v1")
            size = ["--size", str(first["size"])] if mode == "afresh" else []
            second = strata_import(store, state, v2, "app:v2", *size)
            rows[mode] = {"v1_new_chunks": first["new_chunks"], "v1_stored_bytes": first["new_stored_bytes"],
                          "v2_new_chunks": second["new_chunks"], "v2_new_stored_bytes": second["new_stored_bytes"],
                          "v2_data_chunks": second["data_chunks"], "v2_import_s": second["wall"]}
    print(f"{'v2 import':10} {'new chunks':>12} {'new bytes':>14} {'seconds':>8}   (v1: {rows['layered']['v1_new_chunks']} "
          f"chunks, {rows['layered']['v1_stored_bytes']} bytes)")
    for mode, r in rows.items():
        print(f"{mode:10} {r['v2_new_chunks']:>5} of {r['v2_data_chunks']:<5} {r['v2_new_stored_bytes']:>14,} "
              f"{r['v2_import_s']:>8.2f}")
    saved = rows["afresh"]["v2_new_stored_bytes"] / max(rows["layered"]["v2_new_stored_bytes"], 1)
    print(f"afresh / layered new bytes: {saved:.1f}x")
    if not args.no_debian:
        rows["debian"] = debian_rows()
        d = rows["debian"]
        print(f"debian 12 + python3: strata import {d['strata_s']:.1f} s, {d['strata_bytes'] / 1e6:.0f} MB stored; "
              f"umoci unpack + mkfs.ext4 -d {d['umoci_s']:.1f} s, {d['umoci_bytes'] / 1e6:.0f} MB ext4 "
              f"(x{d['umoci_bytes'] / max(d['strata_bytes'], 1):.1f} the bytes)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def debian_rows() -> dict[str, float]:
    """Strata's import of the Debian image against umoci unpack + mkfs.ext4 -d."""
    import shutil

    from tests.oci_images import write_oci
    from tests.test_envd import debian_rootfs

    if shutil.which("umoci") is None:
        raise SystemExit("umoci is not installed (apt-get install umoci), or pass --no-debian")
    with tempfile.TemporaryDirectory(prefix="strata-bench-deb-", dir="/var/tmp") as tmp:
        t = Path(tmp)
        import hashlib

        tar = debian_rootfs().read_bytes()
        config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin:/bin"]},
                  "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]}}
        import gzip

        layout = write_oci(t / "oci", [gzip.compress(tar, compresslevel=1, mtime=0)], config=config)  # as registries serve it
        index = json.loads((layout / "index.json").read_text())
        index["manifests"][0]["annotations"] = {"org.opencontainers.image.ref.name": "latest"}
        (layout / "index.json").write_text(json.dumps(index))
        ours = strata_import(t / "store", t / "state", layout, "debian:12")
        started = time.monotonic()
        r = subprocess.run(["umoci", "unpack", "--image", f"{layout}:latest", str(t / "bundle")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"umoci unpack failed: {r.stderr.strip()[-500:]}")
        subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(t / "bundle" / "rootfs"), str(t / "disk.ext4"),
                        str(ours["size"] // 1024) + "K"], check=True, capture_output=True)
        peer_s = time.monotonic() - started
        return {"strata_s": ours["wall"], "strata_bytes": ours["new_stored_bytes"], "umoci_s": peer_s,
                "umoci_bytes": os.stat(t / "disk.ext4").st_blocks * 512}


if __name__ == "__main__":
    sys.exit(main())
