"""Node configuration: one schema, read from a TOML file and the environment.

Every setting has one environment variable and one key in the config file
(`STRATA_CONFIG`, default ~/.config/strata/config.toml); the environment wins.
`NodeConfig.load` validates every field and fails with one line naming the
field, so a node with a typo never starts half-configured.

    # /etc/strata/config.toml
    store = "s3://strata/prod"          # STRATA_STORE
    state_dir = "/var/lib/strata"       # STRATA_STATE_DIR
    cache_size = "200G"                 # STRATA_CACHE_SIZE
    host = "0.0.0.0"                    # STRATA_HOST
    port = 8080                         # STRATA_PORT
    warm_pool = "base=2"                # STRATA_WARM_POOL
    [s3]
    endpoint = "http://seaweedfs:8333"  # STRATA_S3_ENDPOINT
    region = "us-east-1"                # STRATA_S3_REGION
    path_style = true                   # STRATA_S3_PATH_STYLE
    [network]
    pool = "10.201.0.0/16"              # STRATA_NETWORK_POOL

API keys are secrets: they come from the environment only
(STRATA_API_KEYS, STRATA_ADMIN_KEYS; comma-separated), never from the file.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import InvalidInput

DEFAULT_CONFIG = "~/.config/strata/config.toml"
DEFAULT_STATE_DIR = "~/.local/state/strata"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_bytes(text: str) -> int:
    """`1048576`, `64K`, `1M`, `1MiB`, `2G` (powers of 1024) -> bytes."""
    cleaned = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (cleaned[:-1], cleaned[-1]) if cleaned and cleaned[-1] in _UNITS else (cleaned, "")
    try:
        value = int(number)
    except ValueError:
        raise ValueError(f"invalid size {text!r} (examples: 1048576, 64K, 1M, 2G)") from None
    if value < 0:
        raise ValueError(f"invalid size {text!r}: negative")
    return value * _UNITS[unit]


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `24h`, `7d` -> seconds."""
    cleaned = str(text).strip().lower()
    unit = cleaned[-1] if cleaned and cleaned[-1] in _SECONDS else "s"
    number = cleaned[:-1] if cleaned and cleaned[-1] in _SECONDS else cleaned
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"invalid duration {text!r} (examples: 90s, 15m, 24h, 7d)") from None
    if value < 0:
        raise ValueError(f"invalid duration {text!r}: negative")
    return value * _SECONDS[unit]


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError(f"{value} is not a TCP port (1..65535)")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{value} must not be negative")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} must be at least 1")
    return value


def _record_ttl(text: str) -> float:
    value = parse_duration(text)
    if value < 3:
        raise ValueError(f"{text!r} is too short for a node record (renewed every third of it): at least 3s")
    return value


def _flag(text: str) -> bool:
    """`true` or `false`, any case (a TOML boolean reads as one) -> bool."""
    value = str(text).strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"{text!r} is not true or false")
    return value == "true"


def _choice(*choices: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return check


PLACEHOLDERS = ("REPLACE-ME", "CHANGE-ME")  # what deploy/'s examples put where a key goes


DEFAULT_TEAM = "default"  # the team of a bare KEY, and the owner of anything recorded before teams
TEAM_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def _keys(text: str) -> tuple[tuple[str, str], ...]:
    """`TEAM:KEY,KEY,...` -> ((team, key), ...); a bare KEY is team `default`."""
    entries = []
    for item in (k.strip() for k in str(text).split(",") if k.strip()):
        team, sep, key = item.partition(":")
        if not sep:
            team, key = DEFAULT_TEAM, item
        if not TEAM_RE.fullmatch(team):
            raise ValueError(f"{team!r} is not a team name (TEAM:KEY; a team is 1-32 of a-z, 0-9, '-', '_')")
        if len(key) < 8:
            raise ValueError("every key must be at least 8 characters")
        if any(mark in key.upper() for mark in PLACEHOLDERS):
            raise ValueError("a key is still a placeholder from the examples (REPLACE-ME, CHANGE-ME): "
                             "generate one, e.g. `openssl rand -hex 24`")
        entries.append((team, key))
    return tuple(entries)


def _team_limits(parse: Callable[[str], int], *, every: str = "") -> Callable[[str], dict[str, int]]:
    """`TEAM=N,...,*=N` (`*`: every team not named) -> {team: N}; empty: no
    limit. With `every`, a setting that names no `*` gets `*=every`, so
    naming one team never lifts the limit of the others."""
    def limits(text: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in (p.strip() for p in str(text).split(",") if p.strip()):
            team, sep, value = item.partition("=")
            if not sep or not (team == "*" or TEAM_RE.fullmatch(team)):
                raise ValueError(f"{item!r} is not TEAM=N (or *=N for every other team)")
            out[team] = parse(value.strip())
        if every and "*" not in out:
            out["*"] = parse(every)
        return out

    return limits


def _pool(text: str) -> dict[str, int]:
    pool: dict[str, int] = {}
    for item in (p.strip() for p in str(text).split(",") if p.strip()):
        name, sep, count = item.rpartition("=")
        if not sep or not name:
            raise ValueError(f"{item!r} is not TEMPLATE=N")
        pool[name] = int(count)
        if not 0 <= pool[name] <= 100:
            raise ValueError(f"{item!r}: N must be 0..100")
    return pool


def _list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in str(text).split(",") if item.strip())


def _cidr(text: str) -> str:
    import ipaddress

    try:
        return str(ipaddress.IPv4Network(str(text)))
    except ValueError:
        raise ValueError(f"{text!r} is not an IPv4 network (a.b.c.d/n)") from None


def _cidrs(text: str) -> tuple[str, ...]:
    return tuple(_cidr(item) for item in _list(text))


# what no sandbox reaches by default: "this network", RFC 1918, CGNAT, loopback, link-local (cloud metadata),
# multicast, reserved (vmm/egress.py DEFAULT_BLOCKED is the same list; tests/test_egress.py checks)
BLOCKED = ("0.0.0.0/8,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,127.0.0.0/8,169.254.0.0/16,"
           "224.0.0.0/4,240.0.0.0/4")


def _hosts(text: str) -> dict[str, str]:
    import ipaddress

    hosts = {}
    for item in _list(text):
        name, sep, address = item.partition("=")
        try:
            hosts[name.strip().lower().rstrip(".")] = str(ipaddress.IPv4Address(address.strip()))
        except ValueError:
            raise ValueError(f"{item!r} is not NAME=IPV4") from None
        if not sep or not name.strip():
            raise ValueError(f"{item!r} is not NAME=IPV4")
    return hosts


_REGISTRY_RE = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?(?::[0-9]{1,5})?")


def _registries(text: str) -> tuple[str, ...]:
    """`HOST[:PORT],...` (lowercased) -> a tuple; anything else is refused."""
    out = tuple(item.lower() for item in _list(text))
    for item in out:
        if not _REGISTRY_RE.fullmatch(item) or ":" in item and not 1 <= int(item.rsplit(":", 1)[1]) <= 65535:
            raise ValueError(f"{item!r} is not HOST[:PORT] (a registry, e.g. ghcr.io or 127.0.0.1:5000)")
    return out


def _path(text: str) -> Path:
    return Path(os.path.expanduser(str(text)))


@dataclass(frozen=True)
class Field:
    """One setting: its file key, how its text is parsed, its default and meaning."""

    name: str  # config-file key (s3_x is key x of the [s3] table, network_x of [network]); STRATA_<NAME>
    parse: Callable[[str], Any]
    default: str | None
    doc: str
    secret: bool = False

    @property
    def env(self) -> str:
        return "STRATA_" + self.name.upper()


def _setting(default: str | None, parse: Callable[[str], Any], doc: str, *, secret: bool = False) -> Any:
    """A NodeConfig field: the schema entry rides along as the field's metadata."""
    return field(metadata={"setting": (parse, default, doc, secret)})


def _text(text: str) -> str:
    return str(text)


@dataclass(frozen=True)
class NodeConfig:
    """The validated settings of one node, built once at the top (`strata`'s
    entry point, `strata serve`) from the config file, the environment and
    command-line flags, then passed down: nothing below reads the environment.

    Paths are resolved: `mount`, `cache_dir`, `guest_dir` and `run_dir` are
    never empty (their defaults derive from `state_dir` and the user).
    """

    store: str = _setting(None, _text, "the store: a directory (embedded) or s3://BUCKET/PREFIX")
    remote: str = _setting("", _text, "shared store (s3://...) a node reads chunks from that its store lacks "
                                      "(after a lazy pull); the default of push and pull")
    peers: tuple[str, ...] = _setting("", _list, "other nodes (http://HOST:PORT,...) asked for a chunk before "
                                                 "the remote store")
    peer_key: str = _setting("", _text, "the admin key this node presents to its peers (one of their admin keys); environment only", secret=True)
    state_dir: Path = _setting(DEFAULT_STATE_DIR, _path, "per-node state: catalogs, cache, upper layers, sandboxes")
    mount: Path = _setting("", _text, "the node's FUSE mount point (default STATE_DIR/mnt)")
    cache_dir: Path = _setting("", _text, "chunk cache directory (default STATE_DIR/cache)")
    cache_size: int = _setting("10G", parse_bytes, "hard cap of the chunk cache")
    squash_depth: int = _setting("32", _positive, "a sandbox disk or RAM stack deeper than this after a seal is "
                                                  "squashed into one layer")
    guest_dir: Path = _setting("", _text, "guest kernel + initramfs (default STATE_DIR/guest)")
    vmm: str = _setting("qemu", _choice("qemu", "firecracker"), "VMM backend")
    accel: str = _setting("", _choice("", "kvm", "tcg"), "force QEMU's accelerator (default: KVM only where it "
                                                          "can run a guest)")
    run_dir: Path = _setting("", _text, "control sockets of mounts (default /run/strata as root)")
    host: str = _setting("127.0.0.1", _text, "address `strata serve` listens on")
    domain: str = _setting("", _text, "domain of sandbox hosts, {port}-{id}.DOMAIN (E2B's `domain`; its "
                                      "wildcard DNS reaches this node, or a TLS proxy in front of it)")
    port: int = _setting("8080", _port, "port `strata serve` listens on")
    advertise_url: str = _setting("", _text, "URL gateways and other nodes reach this node at (default "
                                  "http://HOST:PORT, the host name when HOST is 0.0.0.0)")
    node_ttl: float = _setting("120s", _record_ttl, "how long this node's record in the store stays live "
                               "unless renewed (every third of it); a killed node stops GC and is routed "
                               "around once it lapses")
    sandbox_memory: int = _setting("256", _positive, "guest memory of new sandboxes, MiB")
    sandbox_timeout: float = _setting("300s", parse_duration, "TTL of a sandbox created without a timeout")
    max_timeout: float = _setting("24h", parse_duration, "longest TTL a request may ask for")
    max_sandboxes: int = _setting("64", _positive, "sandboxes (running + paused) one node holds at most")
    max_starting: int = _setting("4", _positive, "sandboxes one node starts (boots, restores, resumes) at once; "
                                 "more wait their turn (up to 2 minutes, then 429)")
    paused_retention: float = _setting("7d", parse_duration, "how long a paused sandbox is kept before it is "
                                                             "reclaimed")
    max_upload: int = _setting("64G", parse_bytes, "largest image upload the API accepts")
    registries: tuple[str, ...] = _setting("", _registries, "OCI registries (HOST[:PORT],...) the API may pull a "
                                                            "build's fromImage from; empty: none (`strata image "
                                                            "pull` is not limited)")
    registry_username: str = _setting("", _text, "the user `strata image pull` logs in to registries as (its "
                                                 "--username; the API uses a build's own credentials)")
    registry_password: str = _setting("", _text, "its password (or --password-stdin); environment only",
                                      secret=True)
    exec_output_limit: int = _setting("1M", parse_bytes, "output of one guest command kept (stdout + stderr); "
                                                          "the rest is dropped with a marker")
    console_log_limit: int = _setting("4M", parse_bytes, "size at which a sandbox's console log is rotated "
                                                          "(one previous file kept)")
    warm_pool: dict[str, int] = _setting("", _pool, "pre-restored paused sandboxes per template: NAME=N,...")
    api_keys: tuple[tuple[str, str], ...] = _setting("", _keys, "API keys (X-API-Key), comma-separated, each "
                                                                "TEAM:KEY or KEY (team default); environment "
                                                                "only", secret=True)
    admin_keys: tuple[tuple[str, str], ...] = _setting("", _keys, "admin keys (also API keys; see every team), "
                                                                  "comma-separated, TEAM:KEY or KEY; environment "
                                                                  "only", secret=True)
    team_max_sandboxes: dict[str, int] = _setting("", _team_limits(_positive), "sandboxes (running + paused) a "
                                                                               "team holds at most: TEAM=N,*=N")
    team_max_snapshots: dict[str, int] = _setting("", _team_limits(_positive), "snapshots a team's objects keep "
                                                                               "at most: TEAM=N,*=N")
    team_max_stored: dict[str, int] = _setting("", _team_limits(parse_bytes), "bytes a team's images, "
                                                                              "snapshots and volumes store at "
                                                                              "most: "
                                                                              "TEAM=SIZE,*=SIZE")
    max_streams: int = _setting("1024", _positive, "long requests (execs, data-plane calls and streams, file "
                                                   "transfers, watchers) the node serves at once; more are 429 "
                                                   "(short requests have threads of their own)")
    team_max_streams: dict[str, int] = _setting("*=256", _team_limits(_positive, every="256"),
                                                "long requests a team holds at once: TEAM=N,*=N (a team not "
                                                "named gets *, 256 unless given)")
    network_enabled: bool = _setting("false", _flag, "give sandboxes a network: a namespace each, NAT to the "
                                                     "uplink, egress rules (changes the host's nftables and "
                                                     "forwarding; needs root)")
    network_pool: str = _setting("10.201.0.0/16", _cidr, "addresses of the sandboxes' links, a /30 per "
                                                         "sandbox")
    network_internet: bool = _setting("true", _flag, "allow_internet_access of a sandbox created without it")
    network_blocked: tuple[str, ...] = _setting(BLOCKED, _cidrs, "CIDRs no sandbox reaches, whatever its rules "
                                                         "(allowOut included): private, CGNAT, loopback, "
                                                         "link-local, multicast and reserved ranges; the node's own "
                                                         "addresses and its S3 endpoint's are blocked too, and "
                                                         "the sandbox pool always")
    network_open: tuple[str, ...] = _setting("", _cidrs, "CIDRs carved out of what is blocked (network.blocked, "
                                                         "the node's and the S3 endpoint's addresses): what "
                                                         "sandboxes may reach there if their rules allow, e.g. a "
                                                         "network.hosts address")
    network_dns_port: int = _setting("10053", _port, "port of the node's resolver for its sandboxes")
    network_gate_port: int = _setting("10054", _port, "port of the node's domain gate (Host/SNI checks of web "
                                                      "traffic from sandboxes whose rules allow domains)")
    network_upstream_dns: tuple[str, ...] = _setting("", _list, "servers the resolver asks, IP[:PORT],... "
                                                                "(default: /etc/resolv.conf's)")
    network_hosts: dict[str, str] = _setting("", _hosts, "names the resolver answers itself: NAME=IP,...")
    network_max_connections: int = _setting("0", _count, "connections one sandbox opens at once at most (0: no "
                                                         "limit); more are dropped")
    network_bandwidth: int = _setting("0", parse_bytes, "bytes per second one sandbox sends, and receives, at most "
                                                        "(e.g. 100M; 0: no limit); more are dropped")
    s3_endpoint: str = _setting("", _text, "S3 endpoint URL (empty: AWS)")
    s3_region: str = _setting("", _text, "S3 region")
    s3_path_style: bool = _setting("true", _flag, "path-style S3 addressing (false: virtual-hosted)")

    @classmethod
    def load(cls, env: Mapping[str, str], *, require_store: bool = True, **overrides: Any) -> "NodeConfig":
        """Validate the config file + environment (+ command-line overrides, None = not given).

        `require_store=False` lets commands that need no store (`strata umount`)
        run without one; `open_store` then fails with its own clear line.
        """
        merged = load_config(env)
        values: dict[str, Any] = {}
        for spec in FIELDS:
            if overrides.get(spec.name) is not None:
                raw = str(overrides[spec.name])
            else:
                raw = merged.get(spec.env, spec.default)
            if raw is None:
                if require_store or spec.name != "store":
                    raise InvalidInput(f"config: {spec.name} is required ({spec.env}): {spec.doc}")
                raw = ""
            try:
                values[spec.name] = spec.parse(raw)
            except ValueError as exc:
                raise InvalidInput(f"config: {spec.env}: {exc}") from None
        state = values["state_dir"]
        values["mount"] = Path(values["mount"] or state / "mnt")
        values["cache_dir"] = Path(values["cache_dir"] or state / "cache")
        values["guest_dir"] = Path(values["guest_dir"] or state / "guest")
        values["run_dir"] = Path(values["run_dir"] or default_run_dir(euid=os.geteuid(),
                                                                       xdg_runtime_dir=env.get("XDG_RUNTIME_DIR")))
        values["api_keys"] = values["api_keys"] + values["admin_keys"]
        if values["sandbox_timeout"] > values["max_timeout"]:
            raise InvalidInput("config: STRATA_SANDBOX_TIMEOUT is longer than STRATA_MAX_TIMEOUT")
        return cls(**values)

    def team_limit(self, limits: Mapping[str, int], team: str) -> int | None:
        """A team's entry of one of the team_max_* settings (None: no limit)."""
        return limits.get(team, limits.get("*"))

    @property
    def path_style(self) -> bool:
        """Whether S3 stores are addressed path-style (config s3.path_style)."""
        return self.s3_path_style

    @property
    def values(self) -> dict[str, Any]:
        """Every setting by name (for display: `strata config check`)."""
        return {f.name: getattr(self, f.name) for f in FIELDS}

    def store_options(self, *, own: bool = True) -> dict[str, Any]:
        """How to open a store on this node: the keyword arguments of
        `layerstore.store.open_store` that come from configuration. Only the
        node's own store (`own`) reads through its peers and remote; another
        store (a push target, a pull source, the remote itself) is opened bare."""
        return {"s3_endpoint": self.s3_endpoint, "s3_region": self.s3_region,
                "s3_path_style": self.path_style, "remote": self.remote if own else "",
                "peers": self.peers if own else (), "peer_key": self.peer_key, "state_dir": self.state_dir}

    def env(self) -> dict[str, str]:
        """The settings as environment variables (secrets left out)."""
        out = {}
        for spec in FIELDS:
            value = getattr(self, spec.name)
            if spec.secret or value in ("", None, {}, ()):
                continue
            if isinstance(value, bool):
                out[spec.env] = str(value).lower()
            elif isinstance(value, dict):
                out[spec.env] = ",".join(f"{k}={v}" for k, v in value.items())
            elif isinstance(value, tuple):
                out[spec.env] = ",".join(value)
            else:
                out[spec.env] = str(value)
        return out


TABLES = ("s3", "network")  # [s3] endpoint = ... is the field s3_endpoint
FIELDS: tuple[Field, ...] = tuple(
    Field(f.name, f.metadata["setting"][0], f.metadata["setting"][1], f.metadata["setting"][2],
          f.metadata["setting"][3])
    for f in fields(NodeConfig)
)


def load_config(env: Mapping[str, str]) -> dict[str, str]:
    """Merge the config file under the environment (environment wins).

    Returns the effective environment; unknown keys, secrets in the file and
    unreadable files are errors.
    """
    merged = dict(env)
    path = Path(os.path.expanduser(env.get("STRATA_CONFIG", DEFAULT_CONFIG)))
    if not path.is_file():
        if "STRATA_CONFIG" in env:
            raise InvalidInput(f"config file {path} (from STRATA_CONFIG) does not exist")
        return merged
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidInput(f"config file {path}: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in TABLES and isinstance(value, dict):
            flat.update({f"{key}_{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    by_name = {f.name: f for f in FIELDS}
    for key, value in flat.items():
        spec = by_name.get(key)
        if spec is None:
            raise InvalidInput(f"config file {path}: unknown key {_file_key(key)!r}")
        if spec.secret:
            raise InvalidInput(f"config file {path}: {key} is a secret; set {spec.env} in the environment instead")
        merged.setdefault(spec.env, str(value).lower() if isinstance(value, bool) else str(value))
    return merged


def _file_key(name: str) -> str:
    """`s3_endpoint` -> `s3.endpoint`: a field of a [table] as the file names it."""
    table, _, rest = name.partition("_")
    return f"{table}.{rest}" if table in TABLES and rest else name


def default_run_dir(*, euid: int, xdg_runtime_dir: str | None) -> Path:
    """Where control sockets live when the config names no run dir: /run/strata
    as root (systemd's RuntimeDirectory), else the user's runtime dir, else a
    per-user directory under /tmp."""
    if euid == 0:
        return Path("/run/strata")
    return Path(xdg_runtime_dir or f"/tmp/strata-{euid}") / "strata"


def config_reference() -> str:
    """The schema as a Markdown table (the README's is generated from it)."""
    rows = ["| file key | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for spec in FIELDS:
        key = _file_key(spec.name)
        rows.append(f"| {'(env only)' if spec.secret else key} | `{spec.env}` | {spec.default or '-'} | {spec.doc} |")
    return "\n".join(rows)
