"""Choose Strata's default zstd level: throughput and stored bytes per level.

Runs the real import pipeline (layerstore.importer) into a fresh local store
for each level on the same mixed image, so the numbers include hashing,
compression and writes exactly as `strata image import` does them.

    .venv/bin/python bench/levels.py [--size 1G] [--levels -1,1,3,6]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.mkimage import make_image  # noqa: E402
from layerstore.clikit import parse_size  # noqa: E402
from layerstore.importer import import_image  # noqa: E402
from layerstore.store import open_store  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("1G"))
    parser.add_argument("--levels", default="-1,1,3,6")
    parser.add_argument("--workdir", default="/var/tmp/strata-bench-levels")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    image = work / "mixed.img"
    if not image.exists() or image.stat().st_size != args.size:
        make_image(image, args.size, seed=1)
    image.read_bytes() if args.size <= 2 << 30 else None  # warm the page cache for every level alike
    rows = []
    for level in (int(x) for x in args.levels.split(",")):
        store_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"l{level}-"))
        shutil.rmtree(store_dir)
        with open_store(str(store_dir), level=level) as store:
            started = time.monotonic()
            res = import_image(store, image, "bench:v1")
            seconds = time.monotonic() - started
        rows.append({"level": level, "seconds": round(seconds, 3), "mb_s": round(args.size / seconds / 1e6, 1),
                     "stored_bytes": res.new_stored_bytes, "ratio": round(res.new_raw_bytes / res.new_stored_bytes, 3)})
        shutil.rmtree(store_dir)
    print(f"{'level':>5} {'seconds':>8} {'MB/s':>8} {'stored MiB':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['level']:>5} {r['seconds']:>8} {r['mb_s']:>8} {r['stored_bytes'] / 2**20:>11.1f} {r['ratio']:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
