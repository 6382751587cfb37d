#!/usr/bin/env bash
# The main job on the embedded local store: make an image, import it, inspect
# it, export it, check the round trip bit for bit, verify the store; then
# build the guest, boot a sandbox from its rootfs (served lazily through the
# FUSE mount), snapshot it, fork it and check the forks are independent.
# Run through `bash deploy/setup.sh demo` (which installs everything first).
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=.venv/bin/strata
WORK=${STRATA_DEMO_DIR:-/var/tmp/strata-demo}
export STRATA_STORE=$WORK/store STRATA_STATE_DIR=$WORK/state
export STRATA_GUEST_DIR=${STRATA_GUEST_DIR:-/var/tmp/strata-guest}   # kept: the kernel is downloaded once
SIZE=${STRATA_DEMO_SIZE:-256M}

[ -d "$WORK/state/mnt" ] && $STRATA umount "$WORK/state/mnt" >/dev/null 2>&1 || true
rm -rf "$WORK" && mkdir -p "$WORK"
trap '$STRATA umount "$STRATA_STATE_DIR/mnt" >/dev/null 2>&1 || true' EXIT
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
step $STRATA sandbox demo --forks 2
echo
echo "demo finished: store at $STRATA_STORE"
