#!/usr/bin/env bash
# One entry point for setting Strata up on a fresh Debian 12 machine.
#
#   bash deploy/setup.sh demo    install everything, then run the demo on the embedded local store
#   bash deploy/setup.sh test    install everything, then run the whole test suite
#   bash deploy/setup.sh install install only (apt packages + .venv with the project)
#   bash deploy/setup.sh bench   install everything plus the benchmark peers (restic, borg, casync, rclone)
#   bash deploy/setup.sh latest  not gating: the SDK checks against the newest e2b releases, in .venv-latest
#
# What pip installs is pinned by deploy/constraints.txt (and npm's e2b by tests/js/package-lock.json),
# so a new release of a dependency changes nothing until those files do; `latest` says what would.
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
    pip_into .venv -c deploy/constraints.txt
}

# pip_into VENV [PIP OPTIONS...]: the project with its test extras into VENV; pip's build chatter goes
# to a log, shown only if the install fails
pip_into() {
    local venv=$1; shift
    if ! { "$venv/bin/python" -m pip install -q --upgrade pip && "$venv/bin/python" -m pip install -q "$@" -e ".[test]"; } \
            > "$venv/pip-install.log" 2>&1; then
        cat "$venv/pip-install.log" >&2
        echo "setup: pip install failed (log above, also in $venv/pip-install.log)" >&2
        exit 1
    fi
    [ -x "$venv/bin/strata" ] || { echo "setup: $venv/bin/strata missing after install" >&2; exit 1; }
}

# The SDK checks (tests that read or drive the e2b SDKs) against the newest releases: pip's without
# constraints in .venv-latest, npm's e2b@latest in its own directory. Not gating: it tells what the
# next bump of the pins will have to mend. Servers the tests start still run .venv's strata.
latest() {
    local python=${PYTHON:-python3}
    [ -x .venv-latest/bin/python ] || "$python" -m venv .venv-latest
    log "installing the newest releases into .venv-latest (no constraints)"
    pip_into .venv-latest --upgrade --upgrade-strategy eager
    local js=${STRATA_JS_SDK_LATEST_DIR:-/var/tmp/strata-js-sdk-latest}
    mkdir -p "$js"
    (cd "$js" && npm install -q --no-audit --no-fund --no-save e2b@latest >/dev/null)
    log "newest against pinned:"
    for pkg in e2b e2b-code-interpreter; do
        printf '  %-22s %-10s pinned %s\n' "$pkg" "$(.venv-latest/bin/python -m pip show "$pkg" | sed -n 's/^Version: //p')" \
            "$(sed -n "s/^$pkg==//p" deploy/constraints.txt)"
    done
    printf '  %-22s %-10s pinned %s\n' "e2b (npm)" "$(node -p "require('$js/node_modules/e2b/package.json').version")" \
        "$(node -p "require('./tests/js/package.json').dependencies.e2b")"
    log "running the SDK checks with the newest SDKs"
    STRATA_JS_SDK_DIR=$js STRATA_JS_SDK_UNPINNED=1 .venv-latest/bin/python -m pytest -q "$@" \
        tests/test_e2b_sdk.py tests/test_e2b_spec.py tests/test_openapi.py tests/test_envd.py tests/test_code_interpreter.py
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
        # two workers (pytest-xdist; STRATA_TEST_WORKERS=0 for one process): a file's tests stay on one,
        # the attack matrix's together (tests/conftest.py); the slowest tests are listed: the suite has a time budget
        .venv/bin/python -m pytest -q -n "${STRATA_TEST_WORKERS:-2}" --dist loadfile --durations=15 "${@:2}"
        rc=$?
        set -e
        # pytest exits 5 when no test ran: that is a failure here, never a pass.
        exit $rc
        ;;
    bench)
        install
        apt_install "${BENCH_PACKAGES[@]}"
        ;;
    latest)
        install
        apt_install "${TEST_PACKAGES[@]}"
        latest "${@:2}"
        ;;
    *)
        echo "usage: bash deploy/setup.sh install|demo|test|bench|latest" >&2
        exit 2
        ;;
esac
