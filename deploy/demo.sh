#!/usr/bin/env bash
# The main job on the embedded local store: make an image, import it, inspect
# it, export it, check the round trip bit for bit, and verify the store.
# Run through `bash deploy/setup.sh demo` (which installs everything first).
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=.venv/bin/strata
WORK=${STRATA_DEMO_DIR:-/var/tmp/strata-demo}
export STRATA_STORE=$WORK/store
SIZE=${STRATA_DEMO_SIZE:-256M}

rm -rf "$WORK" && mkdir -p "$WORK"
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

echo "Strata demo in $WORK (store: $STRATA_STORE)"
step .venv/bin/python bench/mkimage.py "$WORK/disk.img" --size "$SIZE"
step $STRATA image import "$WORK/disk.img" demo:v1
step $STRATA image ls
step $STRATA image inspect demo:v1
step .venv/bin/python bench/mkimage.py "$WORK/disk-v2.img" --size "$SIZE" --change-from "$WORK/disk.img" --change-pct 1
step $STRATA image import "$WORK/disk-v2.img" demo:v2
step $STRATA image export demo:v1 "$WORK/exported.img"
step cmp "$WORK/disk.img" "$WORK/exported.img"
echo "round trip is bit-exact"
step $STRATA verify
echo
echo "demo finished: store at $STRATA_STORE"
