#!/usr/bin/env bash
# Install Strata as a systemd service (strata-node.service) on Debian 12 or Ubuntu 24.04.
#
#   sudo bash deploy/install.sh [OPTIONS]            install, or upgrade in place; (re)starts the service
#   sudo bash deploy/install.sh --uninstall          stop and remove the service and the code; keep config + data
#   sudo bash deploy/install.sh --uninstall --purge  ... and delete /etc/strata and the state directory too
#   bash deploy/install.sh --dry-run [OPTIONS]       print every step and every file it would write; change nothing
#   bash deploy/install.sh --root DIR [OPTIONS]      stage: write the files under DIR (DIR/etc/strata/...,
#                                                    DIR/opt/strata, ...), print the system commands instead of
#                                                    running them; needs neither root nor systemd
#
# An install:
#   1. checks: root and systemd; /dev/fuse (required: the node serves images and sandbox disks through a
#      FUSE mount); KVM (optional: without a usable one, QEMU runs the guests under TCG emulation)
#   2. copies this checkout to /opt/strata (keeping /opt/strata/.venv) and runs `deploy/setup.sh install`
#      there: the Debian packages and /opt/strata/.venv, exactly the README's install
#   3. writes /etc/strata/config.toml and /etc/strata/strata.env (mode 0600, freshly generated API keys),
#      each only when absent: a re-run never overwrites them
#   4. validates the config the way `strata serve` will (layerstore.config.NodeConfig.load)
#   5. creates the state directory, builds the guest kernel + rootfs into it (vmm/guest/build.sh)
#   6. writes /etc/systemd/system/strata-node.service, then daemon-reload, enable, restart, and waits for
#      GET /health
# Re-running is safe (idempotent): the code and the unit are refreshed, the config and keys are kept.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/.." && pwd)
UNIT_NAME=strata-node.service
UNIT=/etc/systemd/system/$UNIT_NAME
ETC_DIR=/etc/strata
CONFIG=$ETC_DIR/config.toml
ENV_FILE=$ETC_DIR/strata.env

# Device and sysfs paths, overridable so tests can exercise every branch of the checks.
FUSE_DEV=${INSTALL_FUSE_DEVICE:-/dev/fuse}
KVM_DEV=${INSTALL_KVM_DEVICE:-/dev/kvm}
SYS_MODULE=${INSTALL_SYS_MODULE:-/sys/module}

usage() {
    cat <<'EOF'
usage: bash deploy/install.sh [OPTIONS]
       bash deploy/install.sh --uninstall [--purge] [OPTIONS]

  --dry-run           print the steps and the files; change nothing, run no system command
  --root DIR          stage into DIR: files are written (and removed) under DIR, system commands
                      (apt, pip, systemctl, the guest build) are printed, not run
  --uninstall         stop and disable the service, remove the unit and the code in --code-dir;
                      keep /etc/strata (config, keys) and the state directory (data)
  --purge             with --uninstall: also delete /etc/strata and the state directory
  --store URL         store of a fresh config: a directory or s3://BUCKET/PREFIX
                      (default STATE_DIR/store, the embedded local store)
  --s3-endpoint URL   [s3] endpoint of a fresh config (e.g. http://seaweedfs:8333; none for AWS)
  --s3-region NAME    [s3] region of a fresh config
  --host ADDR         listen address of a fresh config (default 127.0.0.1: this machine only)
  --port N            listen port of a fresh config (default 8080)
  --state-dir DIR     state directory of a fresh config (default /var/lib/strata)
  --code-dir DIR      where the code and its .venv go (default /opt/strata)
  --no-guest          do not build the guest kernel + rootfs
  --no-start          enable the service but do not (re)start it
  -h, --help          this text

The --store/--host/--port/--state-dir/--s3-* options only shape a config.toml written for the first
time; an existing /etc/strata/config.toml is kept as it is (edit it, then systemctl restart strata-node).
S3 credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set when the installer runs are written to
the fresh strata.env; otherwise add them there.
EOF
}

DRY_RUN=0 STAGED=0 ROOT="" UNINSTALL=0 PURGE=0 BUILD_GUEST=1 START=1
STORE="" S3_ENDPOINT="" S3_REGION="" HOST=127.0.0.1 PORT=8080 STATE_DIR=/var/lib/strata CODE_DIR=/opt/strata
STATE_DIR_GIVEN=0

say() { printf '    %s\n' "$*"; }
step() { printf '==> %s\n' "$*"; }
warn() { printf 'install.sh: warning: %s\n' "$*" >&2; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

need_arg() { if [ $# -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value (see --help)"; fi; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --root) need_arg "$@"; ROOT=$2; STAGED=1; shift ;;
        --uninstall) UNINSTALL=1 ;;
        --purge) PURGE=1 ;;
        --store) need_arg "$@"; STORE=$2; shift ;;
        --s3-endpoint) need_arg "$@"; S3_ENDPOINT=$2; shift ;;
        --s3-region) need_arg "$@"; S3_REGION=$2; shift ;;
        --host) need_arg "$@"; HOST=$2; shift ;;
        --port) need_arg "$@"; PORT=$2; shift ;;
        --state-dir) need_arg "$@"; STATE_DIR=$2; STATE_DIR_GIVEN=1; shift ;;
        --code-dir) need_arg "$@"; CODE_DIR=$2; shift ;;
        --no-guest) BUILD_GUEST=0 ;;
        --no-start) START=0 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option $1" ;;
    esac
    shift
done
[ "$PURGE" = 0 ] || [ "$UNINSTALL" = 1 ] || die "--purge only goes with --uninstall"

# SYSTEM=1: act on this machine for real (run apt, pip, systemctl). Otherwise commands are printed.
SYSTEM=1
{ [ "$DRY_RUN" = 1 ] || [ "$STAGED" = 1 ]; } && SYSTEM=0
if [ "$STAGED" = 1 ]; then
    ROOT=$(realpath -m -- "$ROOT")
    [ "$ROOT" = / ] && ROOT=""
fi

# Paths end up in TOML strings and unit lines: keep them plain.
check_path() {  # OPTION PATH
    [[ $2 =~ ^/[A-Za-z0-9._/+-]*$ ]] || die "$1: $2 is not an absolute path of letters, digits and ._/+-"
    [[ $2 != */../* && $2 != */.. ]] || die "$1: $2 contains '..'"
}
check_path --state-dir "$STATE_DIR"
check_path --code-dir "$CODE_DIR"
STATE_DIR=${STATE_DIR%/} CODE_DIR=${CODE_DIR%/}
# The code directory is emptied (but for .venv) before each copy: never let that be a system directory.
case "${CODE_DIR##*/}" in
    *strata*) ;;
    *) die "--code-dir $CODE_DIR: its last component must contain 'strata' (it is emptied on upgrade)" ;;
esac
[ -n "$STORE" ] || STORE=$STATE_DIR/store
for pair in "--store=$STORE" "--host=$HOST" "--s3-endpoint=$S3_ENDPOINT" "--s3-region=$S3_REGION"; do
    case "${pair#*=}" in
        *[\"\\\'[:cntrl:][:space:]]*) die "${pair%%=*}: quotes, backslashes and spaces are not allowed" ;;
    esac
done
if ! [[ $PORT =~ ^[0-9]{1,5}$ ]] || [ "$PORT" -lt 1 ] || [ "$PORT" -gt 65535 ]; then
    die "--port: $PORT is not a TCP port (1..65535)"
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# --- helpers: every change goes through these, so --dry-run and --root hold everywhere ---------------

run() {  # a system command: run it for real only on a real install
    if [ "$SYSTEM" = 1 ]; then
        say "+ $*"
        "$@"
    else
        say "would run: $*"
    fi
}

show_file() {  # FILE: print it indented, API keys masked
    sed -E -e 's/^([A-Z_]*_KEYS)=.+/\1=<generated>/' -e 's/^(AWS_SECRET_ACCESS_KEY)=.+/\1=<hidden>/' \
        -e 's/^/        | /' "$1"
}

install_file() {  # SRC DEST MODE keep|replace
    local src=$1 dest=$2 mode=$3 policy=$4 target=$ROOT$2
    if [ -e "$target" ] && [ "$policy" = keep ]; then
        say "keep $dest (exists; never overwritten)"
        return
    fi
    if [ -e "$target" ] && cmp -s "$src" "$target"; then
        say "unchanged $dest"
        return
    fi
    if [ "$DRY_RUN" = 1 ]; then
        say "would write $dest (mode $mode):"
        show_file "$src"
        return
    fi
    mkdir -p "$(dirname "$target")"
    local tmp
    tmp=$(mktemp "$target.XXXXXX")  # 0600 from the start: a secret is never world-readable
    cat "$src" >"$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$target"
    say "wrote $dest (mode $mode)"
}

make_dir() {  # DIR MODE
    local target=$ROOT$1
    if [ -d "$target" ]; then
        say "exists $1"
    elif [ "$DRY_RUN" = 1 ]; then
        say "would create $1 (mode $2)"
    else
        mkdir -p "$target"
        chmod "$2" "$target"
        say "created $1 (mode $2)"
    fi
}

remove_path() {  # PATH WHAT
    local target=$ROOT$1
    if [ ! -e "$target" ] && [ ! -L "$target" ]; then
        say "absent $1 ($2)"
    elif [ "$DRY_RUN" = 1 ]; then
        say "would remove $1 ($2)"
    else
        rm -rf --one-file-system -- "$target"
        say "removed $1 ($2)"
    fi
}

mounts_under() {  # DIR: mount points at or below DIR (from /proc/self/mountinfo)
    local dir=$1
    [ -r /proc/self/mountinfo ] || return 0
    awk -v d="$dir" '{ m = $5; gsub(/\\040/, " ", m); if (m == d || index(m, d "/") == 1) print m }' \
        /proc/self/mountinfo
}

venv_python() {  # the interpreter that can import layerstore, for validation
    local candidate
    for candidate in "$ROOT$CODE_DIR/.venv/bin/python" "$SRC/.venv/bin/python"; do
        [ -x "$candidate" ] && { echo "$candidate"; return; }
    done
    command -v python3 || true
}

# --- checks --------------------------------------------------------------------------------------------

check_os() {
    local id="" version=""
    if [ -r /etc/os-release ]; then
        # shellcheck disable=SC1091
        id=$(. /etc/os-release && echo "${ID:-}") version=$(. /etc/os-release && echo "${VERSION_ID:-}")
    fi
    case "$id $version" in
        "debian 12"|"ubuntu 24.04") say "OS: $id $version (supported)" ;;
        *) warn "OS '$id $version' is not Debian 12 or Ubuntu 24.04: the install may work, but is untested here" ;;
    esac
}

check_fuse() {
    if [ -c "$FUSE_DEV" ]; then
        say "FUSE: $FUSE_DEV present"
        return
    fi
    if [ "$SYSTEM" = 1 ]; then
        modprobe fuse 2>/dev/null || true
        [ -c "$FUSE_DEV" ] && { say "FUSE: $FUSE_DEV present (after modprobe fuse)"; return; }
        die "$FUSE_DEV is missing: the node serves images and sandbox disks through a FUSE mount (modprobe fuse; in a container: --device /dev/fuse)"
    fi
    warn "$FUSE_DEV is missing here: a real install would stop (the node needs FUSE)"
}

# The same decision as vmm/accel.py: a /dev/kvm that exists is not enough.
check_kvm() {
    if [ ! -e "$KVM_DEV" ]; then
        warn "$KVM_DEV is missing: sandboxes will run under QEMU TCG emulation (slow, but they work)"
    elif [ -e "$SYS_MODULE/kvm_pvm" ]; then
        warn "KVM here is PVM ($SYS_MODULE/kvm_pvm is loaded), which hangs stock guest kernels: sandboxes will run under QEMU TCG emulation (slow, but they work)"
    elif ! { : <>"$KVM_DEV"; } 2>/dev/null; then
        warn "$KVM_DEV cannot be opened read-write (as uid $(id -u)): sandboxes will run under QEMU TCG emulation (slow, but they work)"
    else
        say "KVM: $KVM_DEV usable"
    fi
}

# --- rendered files ------------------------------------------------------------------------------------

render_config() {
    cat <<EOF
# $CONFIG: configuration of this Strata node (strata-node.service).
# Written once by deploy/install.sh; re-running the installer never overwrites it.
# Every key also has an environment variable, STRATA_<KEY> (s3.endpoint: STRATA_S3_ENDPOINT), which
# wins over this file. API keys and S3 credentials are secrets: they live in $ENV_FILE
# (mode 0600), never here. After an edit: systemctl restart strata-node

# the store: a directory (the embedded local store) or s3://BUCKET/PREFIX
store = "$STORE"
# per-node state: catalogs, chunk cache, sandbox upper layers and records, the guest
state_dir = "$STATE_DIR"
# where \`strata serve\` listens (127.0.0.1: reachable from this machine only)
host = "$HOST"
port = $PORT

# Defaults, uncomment to change:
# cache_size = "10G"          # hard cap of the chunk cache (STATE_DIR/cache)
# vmm = "qemu"                # VMM backend: qemu or firecracker
# sandbox_memory = 256        # guest memory of new sandboxes, MiB
# sandbox_timeout = "300s"    # TTL of a sandbox created without a timeout
# max_timeout = "24h"         # longest TTL a request may ask for
# max_sandboxes = 64          # sandboxes (running + paused) this node holds at most
# paused_retention = "7d"     # how long a paused sandbox is kept before it is reclaimed
# max_upload = "64G"          # largest image upload the API accepts
# warm_pool = ""              # pre-restored paused sandboxes per template: NAME=N,...
# mount = ""                  # FUSE mount point (default STATE_DIR/mnt)
# cache_dir = ""              # chunk cache directory (default STATE_DIR/cache)
# guest_dir = ""              # guest kernel + initramfs (default STATE_DIR/guest)
EOF
    if [[ $STORE == s3://* ]]; then
        printf '\n# the S3-compatible store (credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in %s)\n[s3]\n' "$ENV_FILE"
        if [ -n "$S3_ENDPOINT" ]; then printf 'endpoint = "%s"\n' "$S3_ENDPOINT"; else printf '# endpoint = ""            # empty: AWS\n'; fi
        if [ -n "$S3_REGION" ]; then printf 'region = "%s"\n' "$S3_REGION"; else printf '# region = "us-east-1"\n'; fi
        printf '# path_style = true         # false for virtual-hosted addressing\n'
    else
        printf '\n# for an s3:// store:\n# [s3]\n# endpoint = "http://127.0.0.1:8333"\n# region = "us-east-1"\n# path_style = true\n'
    fi
}

new_key() { od -An -tx1 -N24 /dev/urandom | tr -d ' \n'; }

render_env() {
    cat <<EOF
# $ENV_FILE: secrets of strata-node.service (mode 0600, root only; systemd reads it).
# One KEY=VALUE per line. Written once by deploy/install.sh; re-running it never overwrites this file.
# API keys clients send as X-API-Key: comma-separated, each at least 8 characters.
STRATA_API_KEYS=$(new_key)
# Admin keys (also valid as API keys).
STRATA_ADMIN_KEYS=$(new_key)
# Credentials of an s3:// store.
EOF
    if [ -n "${AWS_ACCESS_KEY_ID:-}" ] && [ -n "${AWS_SECRET_ACCESS_KEY:-}" ]; then
        printf 'AWS_ACCESS_KEY_ID=%s\nAWS_SECRET_ACCESS_KEY=%s\n' "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY"
    else
        printf '#AWS_ACCESS_KEY_ID=\n#AWS_SECRET_ACCESS_KEY=\n'
    fi
}

render_unit() {  # STATE_DIR
    local state=$1 state_lines
    if [[ $state == /var/lib/?* ]]; then
        state_lines="StateDirectory=${state#/var/lib/}
StateDirectoryMode=0750"
    else
        state_lines="# state directory $state: created by deploy/install.sh (StateDirectory= covers /var/lib only)"
    fi
    cat <<EOF
# $UNIT: the Strata node service (\`strata serve\`).
# Rendered by deploy/install.sh, which rewrites it on every run: change it with
# \`systemctl edit strata-node\` (a drop-in), not here.
[Unit]
Description=Strata node service (microVM sandbox image and snapshot store)
Documentation=file://$CODE_DIR/README.md
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
# root: the FUSE mount (mounted allow_other so the VMM can open sandbox disks on it), /dev/kvm, and the
# control sockets in /run/strata all need it.
User=root
Group=root
Environment=STRATA_CONFIG=$CONFIG
# API keys and S3 credentials (mode 0600).
EnvironmentFile=$ENV_FILE
ExecStart=$CODE_DIR/.venv/bin/strata serve
WorkingDirectory=$state
$state_lines
RuntimeDirectory=strata
RuntimeDirectoryPreserve=yes
Restart=on-failure
RestartSec=2s
# QEMU and the FUSE daemon run in sessions of their own, so a signal to the server's process group
# never reaches them. KillMode=mixed: the stop SIGTERM goes to \`strata serve\` alone, which stops
# serving; everything still in the unit's cgroup when it exits (or after TimeoutStopSec) gets SIGKILL,
# so no VM outlives the service: running sandboxes end, paused ones (snapshotted in the store) survive,
# and the next start removes the dead records and clears the dead FUSE mount. (KillMode=process would
# keep VMs running across a restart, which \`strata serve\` supports, but also after a stop.)
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec=90s
# chunk cache files, sandbox disks, QMP/agent sockets: many descriptors; QEMU: many threads.
LimitNOFILE=1048576
TasksMax=infinity
# No PrivateTmp=, ProtectSystem=, ProtectHome=: each gives the service a mount namespace of its own,
# and its FUSE mount would then be invisible to \`strata\` commands run on the host.

[Install]
WantedBy=multi-user.target
EOF
}

# The config check `strata serve` makes at start, run ahead of it. Prints "host<TAB>port<TAB>state_dir
# <TAB>guest_dir<TAB>store" on success; exit 3 = invalid config, 4 = layerstore not importable.
VALIDATE_PY='
import os, sys
try:
    from layerstore.config import NodeConfig
    from layerstore.errors import StrataError
except ImportError as exc:
    print(f"cannot import layerstore ({exc})", file=sys.stderr)
    sys.exit(4)
try:
    c = NodeConfig.load(os.environ)
except StrataError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
print(c.host, c.port, c.state_dir, c.guest_dir, c.store, sep="\t")
'

validate() {  # CONFIG_FILE ENV_FILE -> sets V_HOST V_PORT V_STATE V_GUEST V_STORE
    local config=$1 envfile=$2 python out pythonpath rc=0
    python=$(venv_python)
    V_HOST=$HOST V_PORT=$PORT V_STATE=$STATE_DIR V_GUEST=$STATE_DIR/guest V_STORE=$STORE
    if [ -z "$python" ]; then
        [ "$SYSTEM" = 1 ] && die "no Python to validate the config with"
        warn "no Python here to validate the config with: skipped"
        return
    fi
    # A clean environment: only the service's own (Environment= + EnvironmentFile=), never the caller's.
    pythonpath=$SRC
    [ "$SYSTEM" = 1 ] && pythonpath=$CODE_DIR
    # shellcheck disable=SC2016  # $1..$4 expand in the inner shell
    out=$(env -i PATH="$PATH" HOME=/root PYTHONPATH="$pythonpath" bash -c \
        'cd / && set -a && . "$1" && set +a && export STRATA_CONFIG="$2" && exec "$3" -c "$4"' \
        _ "$envfile" "$config" "$python" "$VALIDATE_PY" 2>"$WORK/validate.err") || rc=$?
    case $rc in
        0) IFS=$'\t' read -r V_HOST V_PORT V_STATE V_GUEST V_STORE <<<"$out"
           say "config OK: store $V_STORE, listening on $V_HOST:$V_PORT, state in $V_STATE" ;;
        3) die "invalid config ($CONFIG + $ENV_FILE): $(cat "$WORK/validate.err")" ;;
        *) [ "$SYSTEM" = 1 ] && die "could not validate the config: $(tail -n 1 "$WORK/validate.err")"
           warn "could not validate the config with $python: $(tail -n 1 "$WORK/validate.err")" ;;
    esac
    check_path state_dir "$V_STATE"
}

wait_healthy() {  # HOST PORT
    local host=$1 python=$CODE_DIR/.venv/bin/python
    case "$host" in 0.0.0.0|::|"") host=127.0.0.1 ;; esac
    [[ $host == *:* ]] && host="[$host]"
    say "waiting for http://$host:$2/health"
    if "$python" - "http://$host:$2/health" <<'EOF'; then
import sys, time, urllib.request
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(1)
EOF
        say "healthy"
    else
        die "$UNIT_NAME did not answer GET /health within 60 s: journalctl -u $UNIT_NAME -n 50"
    fi
}

# --- install -------------------------------------------------------------------------------------------

copy_code() {
    local dest
    dest=$(realpath -m -- "$ROOT$CODE_DIR")
    if [ "$dest" = "$SRC" ]; then
        say "$CODE_DIR is this checkout: nothing to copy"
        return
    fi
    case "$dest/" in "$SRC"/*) die "--code-dir $ROOT$CODE_DIR is inside the checkout $SRC" ;; esac
    case "$SRC/" in "$dest"/*) die "the checkout $SRC is inside --code-dir $ROOT$CODE_DIR" ;; esac
    if [ "$DRY_RUN" = 1 ]; then
        say "would copy $SRC to $CODE_DIR (replacing the code, keeping $CODE_DIR/.venv)"
        return
    fi
    mkdir -p "$dest"
    find "$dest" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf --one-file-system {} +
    tar -C "$SRC" --exclude=.venv --exclude=.git --exclude=__pycache__ --exclude=.pytest_cache \
        --exclude=.hypothesis --exclude=.schemathesis --exclude=.mypy_cache --exclude=.ruff_cache --exclude='*.egg-info' --exclude=bench/out --exclude=vmm/guest/out \
        --exclude='*.img' -cf - . | tar -C "$dest" -xf -
    say "copied $SRC to $CODE_DIR"
}

do_install() {
    if [ "$DRY_RUN" = 1 ]; then
        step "dry run: nothing is changed${ROOT:+ (staging root $ROOT)}"
    elif [ "$STAGED" = 1 ]; then
        step "staging into ${ROOT:-/}: files are written there, system commands are only printed"
    fi

    step "checks"
    check_os
    if [ "$SYSTEM" = 1 ]; then
        [ "$(id -u)" -eq 0 ] || die "run as root (sudo bash deploy/install.sh), or stage with --root DIR / --dry-run"
        [ -d /run/systemd/system ] || die "systemd is not running here: stage the files with --root DIR, or use deploy/Dockerfile"
    fi
    check_fuse
    check_kvm

    step "code and its environment in $CODE_DIR"
    copy_code
    run bash "$CODE_DIR/deploy/setup.sh" install

    step "configuration in $ETC_DIR"
    make_dir "$ETC_DIR" 0755
    render_config >"$WORK/config.toml"
    render_env >"$WORK/strata.env"
    if [ -e "$ROOT$CONFIG" ]; then
        local kept_store
        kept_store=$(sed -nE 's/^store *= *"(.*)".*/\1/p' "$ROOT$CONFIG" | head -n 1)
        [ "$kept_store" = "$STORE" ] || [ -z "$kept_store" ] ||
            say "note: the existing config keeps store = \"$kept_store\" (options shape a fresh config only)"
    fi
    install_file "$WORK/config.toml" "$CONFIG" 0644 keep
    install_file "$WORK/strata.env" "$ENV_FILE" 0600 keep

    step "validate the configuration (as strata serve will)"
    local config=$ROOT$CONFIG envfile=$ROOT$ENV_FILE
    [ -e "$config" ] || config=$WORK/config.toml
    [ -e "$envfile" ] || envfile=$WORK/strata.env
    validate "$config" "$envfile"
    if [ "$STATE_DIR_GIVEN" = 1 ] && [ "$V_STATE" != "$STATE_DIR" ]; then
        say "note: the config's state_dir is $V_STATE (--state-dir shapes a fresh config only)"
    fi
    if [[ $V_STORE == s3://* ]] && ! grep -q '^AWS_ACCESS_KEY_ID=' "$envfile"; then
        warn "the store is $V_STORE but $ENV_FILE sets no AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    fi

    step "state directory $V_STATE"
    make_dir "$V_STATE" 0750
    if [ "$BUILD_GUEST" = 1 ]; then
        run bash "$CODE_DIR/vmm/guest/build.sh" "$V_GUEST"
    else
        say "guest build skipped (--no-guest): sandboxes need a kernel in $V_GUEST"
    fi

    step "systemd unit $UNIT"
    render_unit "$V_STATE" >"$WORK/$UNIT_NAME"
    install_file "$WORK/$UNIT_NAME" "$UNIT" 0644 replace
    run systemctl daemon-reload
    run systemctl enable "$UNIT_NAME"
    if [ "$START" = 1 ]; then
        run systemctl restart "$UNIT_NAME"
        if [ "$SYSTEM" = 1 ]; then wait_healthy "$V_HOST" "$V_PORT"; else say "would wait for GET /health"; fi
    else
        say "not started (--no-start): systemctl start $UNIT_NAME"
    fi

    if [ "$SYSTEM" = 1 ]; then
        step "done: Strata node on http://$V_HOST:$V_PORT (keys in $ENV_FILE; logs: journalctl -u $UNIT_NAME)"
    else
        step "done (${ROOT:+staged in $ROOT; }no system command was run)"
    fi
}

# --- uninstall -----------------------------------------------------------------------------------------

configured_state_dir() {  # the state_dir of the installed config, else --state-dir
    local state="" python
    python=$(command -v python3 || true)
    if [ -r "$ROOT$CONFIG" ] && [ -n "$python" ]; then
        state=$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb")).get("state_dir", ""))' \
            "$ROOT$CONFIG" 2>/dev/null || true)
    fi
    echo "${state:-$STATE_DIR}"
}

do_uninstall() {
    local state mounts
    state=$(configured_state_dir)
    check_path state_dir "$state"
    if [ "$DRY_RUN" = 1 ]; then
        step "dry run: nothing is changed${ROOT:+ (staging root $ROOT)}"
    elif [ "$STAGED" = 1 ]; then
        step "staged uninstall from ${ROOT:-/}: files are removed there, system commands are only printed"
    else
        [ "$(id -u)" -eq 0 ] || die "run as root (sudo bash deploy/install.sh --uninstall), or see it with --dry-run"
        [ -d /run/systemd/system ] || die "systemd is not running here: nothing to uninstall (a staged copy: --root DIR)"
    fi

    step "stop and remove $UNIT_NAME"
    if [ "$SYSTEM" = 1 ]; then
        run systemctl disable --now "$UNIT_NAME" || warn "systemctl disable --now $UNIT_NAME failed (not installed?)"
    else
        run systemctl disable --now "$UNIT_NAME"
    fi
    remove_path "$UNIT" "the unit"
    run systemctl daemon-reload
    if [ "$SYSTEM" = 1 ]; then run systemctl reset-failed "$UNIT_NAME" 2>/dev/null || true; fi

    step "leftover FUSE mounts under $state"
    mounts=$(mounts_under "$ROOT$state")
    if [ -z "$mounts" ]; then
        say "none"
    else
        while IFS= read -r m; do run umount -l "$m"; done <<<"$mounts"
    fi

    step "code in $CODE_DIR"
    if [ "$(realpath -m -- "$ROOT$CODE_DIR")" = "$SRC" ]; then
        say "keep $CODE_DIR (it is this checkout)"
    else
        remove_path "$CODE_DIR" "code and .venv"
    fi

    step "configuration and data"
    if [ "$PURGE" = 1 ]; then
        remove_path "$UNIT.d" "local drop-ins of the unit"
        remove_path "$ETC_DIR" "config and API keys"
        if [ "$SYSTEM" = 1 ] && [ -n "$(mounts_under "$state")" ]; then
            die "$state still has mounts: $(mounts_under "$state" | tr '\n' ' '); not deleting it"
        fi
        case "${state##*/}" in
            *strata*) remove_path "$state" "data: cache, upper layers, sandboxes, a local store" ;;
            *) warn "not deleting state directory $state (its name does not contain 'strata'): delete it yourself" ;;
        esac
    else
        say "keep $ETC_DIR (config and API keys; --purge deletes it)"
        say "keep $state (data: cache, upper layers, sandboxes, a local store; --purge deletes it)"
    fi
    step "done"
}

if [ "$UNINSTALL" = 1 ]; then do_uninstall; else do_install; fi
