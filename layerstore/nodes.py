"""Node records: what every node sharing a store needs kept, for GC on any of them.

    nodes/<node id>   {"node": "<id>", "ttl": 120, "token": "<uuid>",
                       "roots": [{"kind": "layer", "value": "<manifest id>"},
                                 {"kind": "snapshot", "value": "<snapshot id>"},
                                 {"kind": "image", "value": "NAME:TAG"}, ...],
                       "about": {"url": "http://10.0.0.5:8080",      (where a gateway reaches it)
                                 "max": 64, "held": 3,               (sandboxes: its limit, its count)
                                 "pools": {"base": 2},               (warm sandboxes ready, by template)
                                 "templates": {"base": 3}}}          (its sandboxes by template: cached chunks)

A node (`strata serve`) rewrites its record every ttl/3 seconds with the
roots only it knows: the layers its sandboxes' disks and RAM sit on, the
snapshots they were restored from or wake from, the images it pulled
manifests-only (their chunks stay in this store). GC of the store marks
from every live record. A record whose node stopped renewing it (by the
store's clock, layerstore/lease.py) may still describe sandboxes that
need objects, so GC refuses to delete anything and names the node; an
operator who drained that node removes its record with `strata gc
--forget-node ID`. A node that comes back simply publishes again.

The same records are the cluster's membership: a gateway (api/gateway.py)
routes to the live nodes' URLs and places sandboxes by their `about`.

Holds: what a node reads lazily from its remote, kept without a heartbeat.

    holds/<node id>   {"node": "<id>", "roots": [{"kind": "layer", "value": "<manifest id>"}, ...]}

A manifests-only pull leaves every chunk in the remote, and the node reads
them from there for as long as its store names the pulled layers, whether
or not `strata serve` runs. So such a pull writes this node's holds into
the remote (`Holds.refresh`): the layers its store reaches that a lazy pull
published and no full pull has completed (`lazy_roots`; layers, not names:
the remote's ref may be moved or removed, the exact manifests this node
pulled may not). Unlike a node record a hold has no ttl: it cannot go
stale, because a node that is merely off still needs its images when it
comes back. (Not the node record itself: `strata serve` rewrites that
from its own roots every ttl/3, and a CLI writing it too would race with
it; and a record left unrenewed stops every GC of the store, which after a
CLI pull would be two minutes later.) Every later CLI pull, `image rm`
and `gc` of the node rewrites it from the node's store (so a removed image
or a `pull --full` releases its chunks); a hold left empty is removed. GC of the remote marks every
hold, its own node's too; a hold it cannot read stops it (fail closed). A
node gone for good keeps its chunks until an operator runs `strata gc
--forget-node ID`, which removes its record and its hold: `strata gc` lists
the holds and their age so that such a node is seen, never guessed at.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .backend import Backend, ObjectInfo
from .errors import BackendError, InvalidInput, NotFound, StrataError
from .lease import is_live, store_now
from .reach import Closure, Name

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)

NODE_PREFIX = "nodes/"
HOLD_PREFIX = "holds/"
NODE_TTL = 120.0
NUDGE_INTERVAL = 5.0  # seconds between the record writes nudges cause, at least
_NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_KINDS = ("image", "snapshot", "template", "layer")


def node_id_of(state_dir: Path) -> str:
    """This node's id: made once (host name and 8 random hex digits) and kept in STATE_DIR/node-id."""
    path = state_dir / "node-id"
    try:
        return check_node_id(path.read_text().strip())
    except FileNotFoundError:
        pass
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:100] or "node"
    node_id = f"{host}-{secrets.token_hex(4)}"
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f".node-id.{os.getpid()}"
    tmp.write_text(node_id + "\n")
    try:
        os.link(tmp, path)  # two processes starting at once agree on the first one's id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return check_node_id(path.read_text().strip())


def existing_node_id(state_dir: Path) -> str | None:
    """This state directory's node id if a node (`strata serve`) ever ran on it,
    or it ever pulled lazily (its hold in the remote is under this id)."""
    try:
        return check_node_id((state_dir / "node-id").read_text().strip())
    except (OSError, InvalidInput):
        return None


def check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id) or node_id in (".", ".."):
        raise InvalidInput(f"invalid node id {node_id!r} (letters, digits, . _ -)")
    return node_id


@dataclass(frozen=True)
class NodeView:
    """One node as a GC sees it."""

    node: str
    live: bool
    age: float  # seconds since its last renewal, by the store's clock
    roots: tuple[Name, ...]
    about: dict[str, Any] = field(default_factory=dict)  # what the node says of itself (url, capacity)


def publish(backend: Backend, node_id: str, roots: Iterable[Name], *, ttl: float = NODE_TTL,
            about: dict[str, Any] | None = None) -> None:
    """Write (or renew) this node's record."""
    body = {"node": check_node_id(node_id), "ttl": ttl, "token": uuid.uuid4().hex,
            "roots": sorted(({"kind": n.kind, "value": n.value} for n in roots),
                            key=lambda r: (r["kind"], r["value"])), "about": about or {}}
    backend.put(f"{NODE_PREFIX}{node_id}", json.dumps(body, sort_keys=True).encode())


def read_nodes(backend: Backend, *, now: float | None = None) -> list[NodeView]:
    """Every node record, live or not; a torn record counts as a stale node.
    Records are read 16 at a time: a gateway re-reads a thousand of them."""
    now = store_now(backend) if now is None else now
    infos = list(backend.list(NODE_PREFIX))
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(infos)))) as pool:
        views = [v for v in pool.map(lambda info: _view(backend, info, now), infos) if v is not None]
    return sorted(views, key=lambda v: v.node)


def _view(backend: Backend, info: ObjectInfo, now: float) -> NodeView | None:
    node = info.key.removeprefix(NODE_PREFIX)
    try:
        data = json.loads(backend.get(info.key))
        roots = tuple(Name(str(r["kind"]), str(r["value"])) for r in data["roots"] if r["kind"] in _KINDS)
        record = {"ttl": float(data["ttl"])}
        about = data.get("about") if isinstance(data.get("about"), dict) else {}
    except NotFound:
        return None  # forgotten meanwhile
    except (ValueError, KeyError, TypeError):
        roots, record, about = (), {"ttl": 0.0}, {}
    return NodeView(node, is_live(record, info, now), now - info.modified, roots, about)


def forget(backend: Backend, node_id: str) -> bool:
    """Remove a drained node's record and its hold; False if it had neither."""
    keys = [f"{prefix}{check_node_id(node_id)}" for prefix in (NODE_PREFIX, HOLD_PREFIX)]
    found = [key for key in keys if backend.head(key) is not None]
    for key in found:
        backend.delete(key)
    return bool(found)


def cluster_roots(backend: Backend, *, forget_nodes: Iterable[str] = (), own: str | None = None,
                  dry_run: bool = False, now: float | None = None) -> list[Name]:
    """The roots of every live node but `own` (whose caller adds its live
    roots itself), and of every node's hold, `own`'s too (the caller's
    sandboxes are not what a hold keeps); StrataError naming a stale node,
    which GC must not run past (its sandboxes may need what would be
    deleted), or an unreadable hold. `forget_nodes` are removed first (only
    left out, with `dry_run`)."""
    forget_nodes = set(forget_nodes)
    if not dry_run:
        for node_id in forget_nodes:
            forget(backend, node_id)
    now = store_now(backend) if now is None else now
    held = [name for h in read_holds(backend, now=now) if h.node not in forget_nodes for name in h.roots]
    views = [v for v in read_nodes(backend, now=now) if v.node != own and v.node not in forget_nodes]
    stale = [v for v in views if not v.live]
    if stale:
        first = stale[0]
        raise StrataError(f"node {first.node} has not renewed its record in {backend.describe()} for "
                          f"{first.age:.0f} s{f' (and {len(stale) - 1} more)' if len(stale) > 1 else ''}: its "
                          "sandboxes may need objects this GC would delete, so nothing was deleted; bring it "
                          f"back, or drain it and run `strata gc --forget-node {first.node}`")
    return [name for v in views for name in v.roots] + held


# holds ------------------------------------------------------------------------
@dataclass(frozen=True)
class HoldView:
    """One node's hold as a GC sees it."""

    node: str
    age: float  # seconds since the node last wrote it, by the store's clock
    roots: tuple[Name, ...]


def hold(backend: Backend, node_id: str, roots: Iterable[Name]) -> None:
    """Replace `node_id`'s hold in `backend` with `roots`; with none, remove it."""
    key = f"{HOLD_PREFIX}{check_node_id(node_id)}"
    rows = sorted({(n.kind, n.value) for n in roots})
    if not rows:
        backend.delete(key)
        return
    body = {"node": node_id, "roots": [{"kind": kind, "value": value} for kind, value in rows]}
    backend.put(key, json.dumps(body, sort_keys=True).encode())


def read_holds(backend: Backend, *, now: float | None = None) -> list[HoldView]:
    """Every node's hold. A hold that cannot be read raises StrataError: what
    it kept is unknown, so a GC must delete nothing (unlike a torn node
    record, which reads as stale and stops GC the same way)."""
    now = store_now(backend) if now is None else now
    views = []
    for info in backend.list(HOLD_PREFIX):
        node = info.key.removeprefix(HOLD_PREFIX)
        try:
            data = json.loads(backend.get(info.key))
            roots = tuple(Name(str(r["kind"]), str(r["value"])) for r in data["roots"])
        except NotFound:
            continue  # removed meanwhile
        except (ValueError, KeyError, TypeError):
            raise _unreadable(backend, node, "is unreadable") from None
        if any(r.kind not in _KINDS for r in roots):
            raise _unreadable(backend, node, "names an unknown kind of root")
        views.append(HoldView(node, now - info.modified, roots))
    return sorted(views, key=lambda v: v.node)


def _unreadable(backend: Backend, node: str, what: str) -> StrataError:
    return StrataError(f"the hold of node {node} in {backend.describe()} {what}, so what it keeps is unknown and "
                       "nothing was deleted; let that node rewrite it (any `strata pull`, `image rm` or `gc` "
                       f"there), or if it is gone for good: `strata gc --forget-node {node}`")


def lazy_roots(store: Store) -> list[Name]:
    """The layers `store`'s refs, templates and snapshots reach that a
    manifests-only pull published and no full pull has completed: the ones
    whose chunks this node reads from its remote (Store.partial_layers)."""
    from .gc import roots  # gc marks from these nodes' records: imported when used

    closure = Closure()
    for name in roots(store):
        try:
            closure.add(store, name, strict=False)
        except NotFound:  # a template naming a removed image: it reaches nothing
            pass
    return [Name("layer", m) for m in sorted(store.partial_layers(closure.layers))]


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """flock(2) `path` for the block: one writer of this node's hold at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class Holds:
    """This node's hold in its remote store, recomputed from its own store.

    Each write is the whole set, computed and written under a lock file in
    the node's state directory: two commands of one node at once must not
    each write a set that lacks the other's newly pulled image (the later
    writer computes after the earlier one's image is in the store)."""

    def __init__(self, remote: Backend, node_id: str, state_dir: Path) -> None:
        self.remote = remote
        self.node_id = check_node_id(node_id)
        self.lock = Path(state_dir) / "holds.lock"

    def refresh(self, store: Store, *, also: Iterable[Name] = ()) -> list[Name]:
        """Write `lazy_roots(store)` and `also` (what a pull is about to
        publish) as this node's hold; the roots written."""
        with _exclusive(self.lock):
            names = sorted({*lazy_roots(store), *also}, key=lambda n: (n.kind, n.value))
            hold(self.remote, self.node_id, names)
        return names


class Heartbeat:
    """Publishes a node's record every ttl/3 on a thread, from `roots()`."""

    def __init__(self, backends: list[Backend], node_id: str, roots: Callable[[], list[Name]], *,
                 ttl: float = NODE_TTL, about: Callable[[], dict[str, Any]] | None = None) -> None:
        self.backends = backends
        self.node_id = check_node_id(node_id)
        self.roots = roots
        self.about = about or dict
        self.ttl = ttl
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._nudged = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        roots, about = self.roots(), self.about()
        for backend in self.backends:
            publish(backend, self.node_id, roots, ttl=self.ttl, about=about)

    def start(self) -> None:
        try:
            self.beat()  # a node's record exists before it serves anything, if the stores answer
        except (BackendError, StrataError) as exc:  # a store down at start must not stop the node: next beat
            self.error = exc
            log.warning("publishing node record %s: %s (retried every %.0f s)", self.node_id, exc, self.ttl / 3)
        self._thread = threading.Thread(target=self._run, name="strata-node-heartbeat", daemon=True)
        self._thread.start()

    def nudge(self) -> None:
        """Publish soon, off the caller's thread (what gateways read changed: a sandbox
        came or went): at once, or `NUDGE_INTERVAL` after the last write if that was
        sooner, so a node creating sandboxes every second writes its record every 5 s."""
        self._nudged.set()

    def _run(self) -> None:
        last = time.monotonic()  # start() has just published
        while True:
            if self._nudged.wait(self.ttl / 3):
                if self._stop.wait(max(0.0, NUDGE_INTERVAL - (time.monotonic() - last))):
                    return
            if self._stop.is_set():
                return
            self._nudged.clear()
            last = time.monotonic()
            try:
                self.beat()
                self.error = None
            except (BackendError, StrataError) as exc:  # try again next beat; GC sees the record go stale
                self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._nudged.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
