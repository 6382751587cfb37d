"""The typed control protocol between clients (CLI, VMM, API) and a mount daemon.

Every operation is one frozen request dataclass answered by one frozen reply
dataclass; the daemon dispatches on the request class, the client gets the
reply class back. Typed messages replace the ad-hoc `{"op": ...}` dicts so
that a misspelt field is an error at the caller, not a `None` in the daemon.

Wire format, over the unix socket `control_socket(mountpoint, run_dir)`: one
JSON object per line each way, one reply per request, in order; a line is at
most MAX_LINE (64 KiB).

    client -> daemon   {"v": 1, "op": "create_disk", "sid": "sb1", "image": "base:v1", "manifest": null}
                         |        |                   '-- the request's fields by name (those with a
                         |        |                       default may be left out)
                         |        '-- the request class's name in snake_case (CreateDisk)
                         '-- PROTOCOL_VERSION: a daemon refuses any other, naming both
    daemon -> client   {"ok": true, "sid": "sb1", "base": "9f2c...", "size": 4194304, ...}
                                    '-- the reply's fields by name (nested dataclasses as objects)
                       {"ok": false, "error": "sandbox sb1 not found", "kind": "NotFound"}
                                              '-- one line fit for a user   '-- error class name

Decoding is strict both ways: an unknown op, a missing, extra or ill-typed
field is InvalidInput with a one-line message naming it (a malformed reply is
a DaemonError). `kind` is the nearest class in ERROR_KINDS (every StrataError
of layerstore/errors.py, plus DaemonError) so the client raises the class the
daemon raised; an unknown kind becomes DaemonError.

Imports neither pyfuse3 nor trio: the CLI imports this module, and a
`strata layer seal` should not pay for them at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from layerstore import errors
from layerstore.errors import InvalidInput, StrataError

log = logging.getLogger("strata.fusefs")

PROTOCOL_VERSION = 1
MAX_LINE = 1 << 16


class DaemonError(StrataError):
    """The daemon answered with an error of its own (a bug, a bad reply), or could not be reached."""


# replies ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """Base of every reply."""


@dataclass(frozen=True)
class Pong(Reply):
    pid: int
    mountpoint: str
    store: str  # Store.describe() of the store the mount serves
    uptime: float  # seconds


@dataclass(frozen=True)
class MountStats(Reply):
    cache: dict[str, int]  # fusefs.cache.CacheStats as a dict
    fetches: int  # chunks fetched from the store
    memory_hits: int
    sources: dict[str, int]  # where fetched chunks came from: local, peer, remote, peer_rejected
    disks: int
    open_files: int

    def counters(self) -> dict[str, int]:
        """The cache's counters with the daemon's own, as `strata cache stats`,
        `GET /cache` and the node's metrics report them."""
        return {**self.cache, "memory_hits": self.memory_hits, "backend_fetches": self.fetches}


@dataclass(frozen=True)
class SealState(Reply):
    """How a disk's last seal is doing: publishing, done (with its manifest) or failed."""

    state: str
    manifest: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class DiskInfo(Reply):
    """A sandbox disk: a copy-on-write upper layer over `base` and the layers sealed since."""

    sid: str
    base: str
    size: int
    dirty_chunks: int
    layers: list[str]
    last_seal: SealState | None
    path: str  # the disk image on the mount: MOUNT/sandboxes/SID/disk.img


@dataclass(frozen=True)
class DiskList(Reply):
    disks: list[DiskInfo]


@dataclass(frozen=True)
class DiskRemoved(Reply):
    sid: str


@dataclass(frozen=True)
class Sealed(Reply):
    sid: str
    dirty_chunks: int
    switch_ms: float  # how long writers were held while the upper layer switched
    manifest: str | None  # the new layer; None unless the request waited for its publication


@dataclass(frozen=True)
class PrefetchRecorded(Reply):
    image: str
    manifest: str
    chunks: int


@dataclass(frozen=True)
class PrefetchStarted(Reply):
    manifest: str


@dataclass(frozen=True)
class CacheDropped(Reply):
    freed: int  # bytes


@dataclass(frozen=True)
class Pinned(Reply):
    image: str
    chunks: int
    cached: int


@dataclass(frozen=True)
class Unpinned(Reply):
    image: str


@dataclass(frozen=True)
class ShuttingDown(Reply):
    pid: int  # the daemon's process, to wait for


# requests -----------------------------------------------------------------------------------------
R = TypeVar("R", bound=Reply)


@dataclass(frozen=True)
class Request(Generic[R]):
    """Base of every request; `reply` is the class of its answer."""

    reply: ClassVar[type[Reply]]


@dataclass(frozen=True)
class Ping(Request[Pong]):
    reply = Pong


@dataclass(frozen=True)
class Stats(Request[MountStats]):
    reply = MountStats


@dataclass(frozen=True)
class CreateDisk(Request[DiskInfo]):
    """A new sandbox disk over an image (NAME:TAG) or a layer (manifest id): exactly one of them."""

    reply = DiskInfo
    sid: str
    image: str | None = None
    manifest: str | None = None
    size: int | None = None  # bytes, at least the image's (default: the image's)
    volatile: bool = False  # a VM's RAM: fsync orders writes but never flushes the disk (upper.py)

    def __post_init__(self) -> None:
        if (self.image is None) == (self.manifest is None):
            raise InvalidInput("create_disk: give exactly one of image or manifest")


@dataclass(frozen=True)
class ListDisks(Request[DiskList]):
    reply = DiskList


@dataclass(frozen=True)
class RemoveDisk(Request[DiskRemoved]):
    reply = DiskRemoved
    sid: str


@dataclass(frozen=True)
class Seal(Request[Sealed]):
    """Freeze a disk's upper layer as a new layer; `wait` for its publication."""

    reply = Sealed
    sid: str
    wait: bool = False


@dataclass(frozen=True)
class AwaitSeal(Request[Sealed]):
    """Wait for the publication of a disk's newest seal (one asked for without
    `wait`): a VMM resumes its guest between the seal and the wait."""

    reply = Sealed
    sid: str


@dataclass(frozen=True)
class RecordPrefetch(Request[PrefetchRecorded]):
    """Save the chunks of `image` read so far as its prefetch list."""

    reply = PrefetchRecorded
    image: str


@dataclass(frozen=True)
class Prefetch(Request[PrefetchStarted]):
    """Start fetching a layer's recorded working set, as its first open
    would: a VMM names a snapshot's device state before starting the VM
    that will read it first."""

    reply = PrefetchStarted
    manifest: str


@dataclass(frozen=True)
class CacheDrop(Request[CacheDropped]):
    reply = CacheDropped


@dataclass(frozen=True)
class Pin(Request[Pinned]):
    reply = Pinned
    image: str


@dataclass(frozen=True)
class Unpin(Request[Unpinned]):
    reply = Unpinned
    image: str


@dataclass(frozen=True)
class Shutdown(Request[ShuttingDown]):
    reply = ShuttingDown


REQUESTS: tuple[type[Request[Any]], ...] = (Ping, Stats, CreateDisk, ListDisks, RemoveDisk, Seal, AwaitSeal,
                                            RecordPrefetch, Prefetch, CacheDrop, Pin, Unpin, Shutdown)


def op_name(cls: type[Request[Any]]) -> str:
    """The wire name of a request class: CreateDisk -> create_disk."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


OPS: Mapping[str, type[Request[Any]]] = types.MappingProxyType({op_name(c): c for c in REQUESTS})


def _error_classes() -> tuple[type[StrataError], ...]:
    """Every StrataError of layerstore/errors.py (so one added there travels too), and DaemonError."""
    found = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, StrataError)]
    return (*found, DaemonError)


ERROR_KINDS: Mapping[str, type[StrataError]] = types.MappingProxyType({c.__name__: c for c in _error_classes()})


# decoding -----------------------------------------------------------------------------------------
def _check(tp: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) as type `tp`, or InvalidInput naming `where`."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        return _check(inner[0], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise InvalidInput(f"{where} must be a list, got {_show(value)}")
        (item,) = typing.get_args(tp)
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise InvalidInput(f"{where} must be an object, got {_show(value)}")
        _key, item = typing.get_args(tp)
        return {k: _check(item, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _fields(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise InvalidInput(f"{where} must be {_TYPE_NAMES.get(tp, tp.__name__)}, got {_show(value)}")
    return value


_TYPE_NAMES = types.MappingProxyType({str: "a string", int: "an integer", float: "a number", bool: "true or false"})


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fields(cls: type, obj: Any, where: str) -> Any:
    """An instance of dataclass `cls` from a JSON object holding exactly its fields."""
    if not isinstance(obj, dict):
        raise InvalidInput(f"{where} must be an object, got {_show(obj)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(set(obj) - set(known))
    if extra:
        raise InvalidInput(f"{where} has no field {extra[0]!r} (fields: {', '.join(known) or 'none'})")
    values = {}
    for name, f in known.items():
        if name in obj:
            values[name] = _check(hints[name], obj[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InvalidInput(f"{where} lacks field {name!r}")
    return cls(**values)


def _json_object(line: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise InvalidInput(f"malformed {what}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InvalidInput(f"malformed {what}: not a JSON object")
    return obj


# encoding and decoding ----------------------------------------------------------------------------
def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def encode_request(msg: Request[Any]) -> bytes:
    return _line({"v": PROTOCOL_VERSION, "op": op_name(type(msg)), **dataclasses.asdict(msg)})


def decode_request(line: bytes) -> Request[Any]:
    """The request on `line`; InvalidInput (one line, naming the fault) for anything else."""
    obj = _json_object(line, "request")
    version = obj.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:  # not `true` or 1.0, which equal 1
        shown = "no version" if version is None else f"version {_show(version)}"
        raise InvalidInput(f"request has control protocol {shown}; this daemon speaks version {PROTOCOL_VERSION} "
                           "(client and mount daemon must run the same Strata: restart the mount)")
    op = obj.pop("op", None)
    cls = OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise InvalidInput(f"unknown operation {_show(op)} (known: {', '.join(sorted(OPS))})")
    return _fields(cls, obj, op)  # type: ignore[no-any-return]


def encode_reply(reply: Reply) -> bytes:
    return _line({"ok": True, **dataclasses.asdict(reply)})


def error_kind(exc: StrataError) -> str:
    """The nearest class of `exc` a client knows (a subclass defined elsewhere travels as its base)."""
    for cls in type(exc).__mro__:
        if ERROR_KINDS.get(cls.__name__) is cls:
            return cls.__name__
    return DaemonError.__name__


def encode_error(exc: StrataError) -> bytes:
    message = " ".join(str(exc).split()) or type(exc).__name__  # one line, always
    return _line({"ok": False, "error": message, "kind": error_kind(exc)})


def decode_reply(line: bytes, request: type[Request[R]]) -> R:
    """The reply to a `request` on `line`, or the error it carries raised as its own class.

    A reply that does not parse is the daemon's fault: DaemonError.
    """
    try:
        obj = _json_object(line, "reply")
        ok = obj.pop("ok", None)
        if ok is True:
            return _fields(request.reply, obj, op_name(request))  # type: ignore[no-any-return]
        if ok is not False:
            raise InvalidInput("malformed reply: no 'ok'")
    except InvalidInput as exc:
        raise DaemonError(f"bad reply to {op_name(request)}: {exc}") from None
    raise ERROR_KINDS.get(str(obj.get("kind")), DaemonError)(str(obj.get("error") or "unknown error"))


Handlers = Mapping[type[Request[Any]], Callable[[Any], Reply]]


def answer(line: bytes, handlers: Handlers) -> bytes:
    """The reply line to one request line. Never raises: a bad request, a
    failing handler or a bug is answered as an error, so one request never
    takes the daemon down."""
    try:
        if len(line) > MAX_LINE:
            raise InvalidInput(f"request too large ({len(line)} bytes; at most {MAX_LINE})")
        request = decode_request(line)
        handler = handlers.get(type(request))
        if handler is None:
            raise InvalidInput(f"operation {op_name(type(request))} is not served here")
        reply = handler(request)
        if not isinstance(reply, request.reply):
            raise TypeError(f"{op_name(type(request))} handler returned {type(reply).__name__}")
        return encode_reply(reply)
    except StrataError as exc:
        return encode_error(exc)
    except Exception as exc:  # keep the daemon alive; report the bug
        log.exception("control request failed")
        return encode_error(DaemonError(f"internal error: {type(exc).__name__}: {exc}"))
