"""OCI image versions in the store: what a second version costs.

Two synthetic OCI images (tests/oci_images.py): v1 = one layer of N MiB of
random files plus a small tree; v2 = v1's layer plus one small layer (a new
file, a whiteout, a rewritten file). Side by side, in one run:

    layered   `strata image import v2` after v1: built on v1's disk (fuse2fs)
    afresh    the same import with `--size` (forces mkfs.ext4 -d of the whole tree,
              what every import did before)

Reported: chunks and bytes v2 adds to the store, and the import's wall time (layers applied, disk made, chunked). The
ratio afresh/layered is what building on the parent's disk saves.

    .venv/bin/python bench/oci.py [--mib 256] [--json FILE]
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
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
