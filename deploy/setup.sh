#!/usr/bin/env bash
# One entry point for setting Strata up on a fresh Debian 12 machine.
#
#   bash deploy/setup.sh demo    install everything, then run the demo on the embedded local store
#   bash deploy/setup.sh test    install everything, then run the whole test suite
#   bash deploy/setup.sh install install only (apt packages + .venv with the project)
#   bash deploy/setup.sh bench   install everything plus the benchmark peers (restic, borg, casync, rclone)
#
# Idempotent: apt runs only for missing packages, pip only installs what changed.
# Needs root (or sudo) for apt-get; everything else stays inside the checkout.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=${1:-install}

APT_PACKAGES=(fuse3 libfuse3-dev pkg-config qemu-system-x86 busybox-static e2fsprogs cpio xz-utils iproute2 nftables util-linux
              python3 python3-venv python3-dev gcc golang-go fuse2fs)
BENCH_PACKAGES=(restic borgbackup casync rclone)
TEST_PACKAGES=(shellcheck systemd nodejs mmdebstrap docker-registry skopeo apache2-utils)   # lint deploy/install.sh, check the unit it renders; E2B's JS SDK test; a real registry to pull from

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    log "installing Debian packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

venv_install() {
    local python=${PYTHON:-python3}
    if [ ! -x .venv/bin/python ]; then
        log "creating .venv with $($python --version)"
        "$python" -m venv .venv
    fi
    log "installing Strata and its test dependencies into .venv"
    # pip's build chatter goes to a log, shown only if the install fails
    if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e ".[test]"; } \
            > .venv/pip-install.log 2>&1; then
        cat .venv/pip-install.log >&2
        echo "setup: pip install failed (log above, also in .venv/pip-install.log)" >&2
        exit 1
    fi
    [ -x .venv/bin/strata ] || { echo "setup: .venv/bin/strata missing after install" >&2; exit 1; }
}

install() {
    apt_install "${APT_PACKAGES[@]}"
    venv_install
}

case "$MODE" in
    install) install ;;
    demo)
        install
        exec bash "$ROOT/deploy/demo.sh"
        ;;
    test)
        install
        apt_install "${TEST_PACKAGES[@]}"
        command -v npm >/dev/null || apt_install npm   # some nodejs builds carry their own npm
        log "running the test suite"
        set +e
        .venv/bin/python -m pytest -q --durations=15 "${@:2}"  # the slowest tests: the suite has a time budget
        rc=$?
        set -e
        # pytest exits 5 when no test ran: that is a failure here, never a pass.
        exit $rc
        ;;
    bench)
        install
        apt_install "${BENCH_PACKAGES[@]}"
        ;;
    *)
        echo "usage: bash deploy/setup.sh install|demo|test|bench" >&2
        exit 2
        ;;
esac
