#!/usr/bin/env bash
# build.sh OUTDIR -- build the Strata guest into OUTDIR:
#   vmlinuz            Debian's cloud kernel (its .deb is cached in OUTDIR)
#   initramfs.cpio.gz  busybox + virtio modules + the agent (built from agent/);
#                      /init brings the network up, starts the agent and
#                      switch_roots to /dev/vda
#   rootfs.ext4        64 MiB ext4 (mke2fs -d, no mount/loop/root needed)
# Idempotent; the only network use is apt. Outputs are reproducible (fixed
# timestamps, UUID and hash seed) so identical builds dedup in the chunk store.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUTDIR" >&2; exit 2; }
mkdir -p "$1"; OUT=$(cd "$1" && pwd)
# One build per OUTDIR at a time (test sessions and benches share one, and two
# at once work in the same files): a second waits for the first to finish,
# then rebuilds the same bytes (the outputs are reproducible).
exec 9>"$OUT/.build.lock"; flock 9
FILES=$(cd "$(dirname "$0")" && pwd)/files
EPOCH=${SOURCE_DATE_EPOCH:-1700000000}
ROOTFS_SIZE=${ROOTFS_SIZE:-64M}
export LC_ALL=C

# Host tools (Debian package names).
missing=()
for t in busybox:busybox-static mke2fs:e2fsprogs cpio:cpio xz:xz-utils gzip:gzip dpkg:dpkg go:golang-go; do
    command -v "${t%%:*}" >/dev/null || missing+=("${t#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null; apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
BUSYBOX=$(command -v busybox)
file "$BUSYBOX" 2>/dev/null | grep -q dynamic && { echo "need a static busybox (busybox-static)" >&2; exit 1; }

# --- kernel: download the .deb once, unpack once per .deb -------------------
deb=$(ls "$OUT"/linux-image-*-cloud-amd64_*_amd64.deb 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$deb" ]; then
    # linux-image-cloud-amd64 is a metapackage: download what it points to.
    kpkg() { apt-cache depends linux-image-cloud-amd64 2>/dev/null |
             awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
    pkg=$(kpkg); [ -n "$pkg" ] || { apt-get update -q >/dev/null; pkg=$(kpkg); }
    [ -n "$pkg" ] || { echo "cannot resolve linux-image-cloud-amd64" >&2; exit 1; }
    (cd "$OUT" && apt-get download -q -o APT::Sandbox::User=root "$pkg" >/dev/null)
    deb=$(ls "$OUT"/linux-image-*-cloud-amd64_*_amd64.deb | sort -V | tail -1)
fi
K=$OUT/.kernel
if [ "$(cat "$K/.from" 2>/dev/null)" != "$(basename "$deb")" ]; then
    rm -rf "$K"; dpkg -x "$deb" "$K"; basename "$deb" >"$K/.from"
fi
KVER=$(ls "$K/lib/modules" | head -1)
install -m 0644 "$K/boot/vmlinuz-$KVER" "$OUT/vmlinuz"

# --- busybox tree shared by the initramfs and the rootfs ---------------------
# Symlinks are made from --list-full (not --install, which would point them at
# the host's busybox path).
bbtree() {
    local t=$1 p
    mkdir -p "$t"/{bin,sbin,usr/bin,usr/sbin,etc/init.d,dev,proc,sys,tmp,run,root,mnt,var}
    install -m 0755 "$BUSYBOX" "$t/bin/busybox"
    for p in $("$BUSYBOX" --list-full); do
        [ "$p" = bin/busybox ] || ln -sfn /bin/busybox "$t/$p"
    done
    install -m 0755 "$FILES/rcS" "$t/etc/init.d/rcS"
    install -m 0644 "$FILES/inittab" "$t/etc/inittab"
    printf 'root:x:0:0:root:/root:/bin/sh\n' >"$t/etc/passwd"
    printf 'root:x:0:\n' >"$t/etc/group"
    echo strata >"$t/etc/hostname"
    chmod 1777 "$t/tmp"; chmod 0700 "$t/root"
}
stamp() { find "$1" -exec touch -h -d "@$EPOCH" {} +; }

# --- the agent: a static Go binary (stdlib only), reproducible ---------------
AGENT_SRC=$(cd "$(dirname "$0")" && pwd)/agent
(cd "$AGENT_SRC" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOCACHE="$OUT/.gocache" \
    go build -trimpath -ldflags='-s -w -buildid=' -o "$OUT/strata-agent.tmp" .)
mv "$OUT/strata-agent.tmp" "$OUT/strata-agent"

# --- initramfs ---------------------------------------------------------------
I=$OUT/.initramfs; rm -rf "$I"; bbtree "$I"
install -m 0755 "$OUT/strata-agent" "$I/sbin/strata-agent"
install -m 0755 "$FILES/init" "$I/init"; mkdir -p "$I/newroot" "$I/lib/modules"
# insmod order = dependency order (no modprobe/depmod in the initramfs).
# ext4 and its deps (crc16, mbcache, jbd2) are only loaded if not built in.
mods="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk virtio_console"
mods="$mods failover net_failover virtio_net"  # the sandbox network (vmm/network.py)
grep -q '/fuse.ko' "$K/lib/modules/$KVER/modules.builtin" ||
    mods="$mods fuse"  # volume mounts (agent/volfs.go); no dependencies
grep -q '/ext4.ko' "$K/lib/modules/$KVER/modules.builtin" ||
    mods="$mods crc16 crc32c_generic mbcache jbd2 ext4"
: >"$I/lib/modules/load.list"
for m in $mods; do
    f=$(find "$K/lib/modules/$KVER/kernel" -name "$m.ko" -o -name "$m.ko.xz" -o -name "$m.ko.zst" | head -1)
    [ -n "$f" ] || { echo "module $m not found in $KVER" >&2; exit 1; }
    case $f in
        *.xz) xz -dc "$f" >"$I/lib/modules/$m.ko" ;;
        *.zst) zstd -qdc "$f" >"$I/lib/modules/$m.ko" ;;
        *) cp "$f" "$I/lib/modules/$m.ko" ;;
    esac
    echo "$m" >>"$I/lib/modules/load.list"
done
stamp "$I"
(cd "$I" && find . -mindepth 1 | sort | cpio -o -H newc -R 0:0 --reproducible --quiet) |
    gzip -9n >"$OUT/initramfs.cpio.gz.tmp"
mv "$OUT/initramfs.cpio.gz.tmp" "$OUT/initramfs.cpio.gz"

# --- rootfs.ext4 -------------------------------------------------------------
R=$OUT/.rootfs; rm -rf "$R"; bbtree "$R"; stamp "$R"
rm -f "$OUT/rootfs.ext4.tmp"
# lazy_itable_init=0: otherwise the guest's ext4lazyinit thread zeroes inode
# tables after boot, burning (TCG-emulated) CPU and dirtying the disk.
E2FSPROGS_FAKE_TIME=$EPOCH mke2fs -q -F -t ext4 -L strata-root \
    -U 5d0c4b6e-8f1a-4c1e-9b1a-57a7a0000001 \
    -E lazy_itable_init=0,lazy_journal_init=0,hash_seed=5d0c4b6e-8f1a-4c1e-9b1a-57a7a0000002,root_owner=0:0 \
    -d "$R" "$OUT/rootfs.ext4.tmp" "$ROOTFS_SIZE" >/dev/null
# mke2fs 1.47.0 -d copies each file's ctime (touch cannot set it) and owner
# (not root when built unprivileged): pin both with debugfs.
(cd "$R" && find . -mindepth 1 | sed 's|^\.||'; echo /; echo /lost+found) |
    sed 's|.*|sif "&" ctime @'"$EPOCH"'\nsif "&" uid 0\nsif "&" gid 0|' |
    E2FSPROGS_FAKE_TIME=$EPOCH debugfs -w -f - "$OUT/rootfs.ext4.tmp" >/dev/null 2>&1
mv "$OUT/rootfs.ext4.tmp" "$OUT/rootfs.ext4"

echo "built $OUT: vmlinuz ($KVER) initramfs.cpio.gz rootfs.ext4 strata-agent"
