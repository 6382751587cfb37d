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

API keys are secrets: they come from the environment only
(STRATA_API_KEYS, STRATA_ADMIN_KEYS; comma-separated), never from the file.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} must be at least 1")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return check


def _keys(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in str(text).split(",") if k.strip())
    if any(len(k) < 8 for k in keys):
        raise ValueError("every key must be at least 8 characters")
    return keys


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


@dataclass(frozen=True)
class Field:
    name: str  # config-file key; the variable is STRATA_<NAME>
    parse: Callable[[str], Any]
    default: str | None
    doc: str
    secret: bool = False

    @property
    def env(self) -> str:
        return "STRATA_" + self.name.upper()


FIELDS: tuple[Field, ...] = (
    Field("store", str, None, "the store: a directory (embedded) or s3://BUCKET/PREFIX"),
    Field("remote", str, "", "shared store (s3://...) a node reads chunks from that its store lacks (after a lazy pull)"),
    Field("peers", str, "", "other nodes (http://HOST:PORT,...) asked for a chunk before the remote store"),
    Field("peer_key", str, "", "the API key this node presents to its peers; environment only", secret=True),
    Field("state_dir", str, DEFAULT_STATE_DIR, "per-node state: catalogs, cache, upper layers, sandboxes"),
    Field("mount", str, "", "the node's FUSE mount point (default STATE_DIR/mnt)"),
    Field("cache_dir", str, "", "chunk cache directory (default STATE_DIR/cache)"),
    Field("cache_size", parse_bytes, "10G", "hard cap of the chunk cache"),
    Field("guest_dir", str, "", "guest kernel + initramfs (default STATE_DIR/guest)"),
    Field("vmm", _choice("qemu", "firecracker"), "qemu", "VMM backend"),
    Field("accel", _choice("", "kvm", "tcg"), "", "force QEMU's accelerator (default: KVM only where it can run a guest)"),
    Field("run_dir", str, "", "control sockets of mounts (default /run/strata as root)"),
    Field("host", str, "127.0.0.1", "address `strata serve` listens on"),
    Field("port", _port, "8080", "port `strata serve` listens on"),
    Field("sandbox_memory", _positive, "256", "guest memory of new sandboxes, MiB"),
    Field("sandbox_timeout", parse_duration, "300s", "TTL of a sandbox created without a timeout"),
    Field("max_timeout", parse_duration, "24h", "longest TTL a request may ask for"),
    Field("max_sandboxes", _positive, "64", "sandboxes (running + paused) one node holds at most"),
    Field("paused_retention", parse_duration, "7d", "how long a paused sandbox is kept before it is reclaimed"),
    Field("max_upload", parse_bytes, "64G", "largest image upload the API accepts"),
    Field("warm_pool", _pool, "", "pre-restored paused sandboxes per template: NAME=N,..."),
    Field("api_keys", _keys, "", "API keys (X-API-Key), comma-separated; environment only", secret=True),
    Field("admin_keys", _keys, "", "admin keys (also API keys), comma-separated; environment only", secret=True),
    Field("s3_endpoint", str, "", "S3 endpoint URL (empty: AWS)"),
    Field("s3_region", str, "", "S3 region"),
    Field("s3_path_style", _choice("true", "false", ""), "", "path-style S3 addressing"),
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
        if key == "s3" and isinstance(value, dict):
            flat.update({f"s3_{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    by_name = {f.name: f for f in FIELDS}
    for key, value in flat.items():
        spec = by_name.get(key)
        if spec is None:
            raise InvalidInput(f"config file {path}: unknown key {key.replace('s3_', 's3.', 1)!r}")
        if spec.secret:
            raise InvalidInput(f"config file {path}: {key} is a secret; set {spec.env} in the environment instead")
        merged.setdefault(spec.env, str(value).lower() if isinstance(value, bool) else str(value))
    return merged


@dataclass(frozen=True)
class NodeConfig:
    """The validated settings of one node (see FIELDS for each one's meaning)."""

    values: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def load(cls, env: Mapping[str, str], **overrides: Any) -> "NodeConfig":
        """Validate the config file + environment (+ command-line overrides)."""
        merged = load_config(env)
        values: dict[str, Any] = {}
        for spec in FIELDS:
            if overrides.get(spec.name) is not None:
                raw = str(overrides[spec.name])
            else:
                raw = merged.get(spec.env, spec.default)
            if raw is None:
                raise InvalidInput(f"config: {spec.name} is required ({spec.env}): {spec.doc}")
            try:
                values[spec.name] = spec.parse(raw)
            except ValueError as exc:
                raise InvalidInput(f"config: {spec.env}: {exc}") from None
        state = Path(os.path.expanduser(values["state_dir"]))
        values["state_dir"] = state
        values["mount"] = Path(values["mount"] or state / "mnt")
        values["cache_dir"] = Path(values["cache_dir"] or state / "cache")
        values["guest_dir"] = Path(values["guest_dir"] or state / "guest")
        values["admin_keys"] = tuple(values["admin_keys"])
        values["api_keys"] = tuple(values["api_keys"]) + values["admin_keys"]
        if values["sandbox_timeout"] > values["max_timeout"]:
            raise InvalidInput("config: STRATA_SANDBOX_TIMEOUT is longer than STRATA_MAX_TIMEOUT")
        return cls(values)

    def env(self) -> dict[str, str]:
        """The settings as environment variables (for child processes)."""
        out = {}
        for spec in FIELDS:
            value = self.values[spec.name]
            if spec.secret or value in ("", None, {}):
                continue
            out[spec.env] = ",".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)
        return out


def config_reference() -> str:
    """The schema as a Markdown table (the README's is generated from it)."""
    rows = ["| file key | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for spec in FIELDS:
        key = spec.name.replace("s3_", "s3.", 1) if spec.name.startswith("s3_") else spec.name
        rows.append(f"| {'(env only)' if spec.secret else key} | `{spec.env}` | {spec.default or '-'} | {spec.doc} |")
    return "\n".join(rows)
