"""What a store holds, as people ask about it: snapshots with their names,
one snapshot in detail, and who still needs a snapshot.

Shared by `strata snapshot ls|inspect|rm` and the API's /snapshots routes so
both answer the same way. Users of a snapshot come from two places: the
store (templates naming it) and the node (paused sandboxes restored from it),
which the caller passes in; `delete_snapshot` refuses while any remain.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .config import DEFAULT_TEAM
from .digest import is_digest
from .errors import Conflict, NotFound, StrataError
from .store import Store

MAX_PARENTS = 1000  # a parent chain longer than this is reported cut, not walked forever


@dataclass(frozen=True)
class SnapshotSummary:
    snapshot_id: str
    names: list[str]  # templates naming it


@dataclass(frozen=True)
class LayerSummary:
    role: str  # disk | memory | state
    manifest: str
    size: int
    stored_bytes: int


@dataclass(frozen=True)
class SnapshotDetail:
    snapshot_id: str
    parents: list[str]  # nearest first
    layers: list[LayerSummary]
    stored_bytes: int  # of every chunk the snapshot reaches, each counted once
    vm: dict[str, object]
    annotations: dict[str, str]
    users: list[str] = field(default_factory=list)

    @property
    def templates(self) -> list[str]:
        return [u.split(" ", 1)[1] for u in self.users if u.startswith("template ")]


def check_snapshot_id(text: str) -> str:
    """A snapshot id from a user: 64 lowercase hex digits, else NotFound (ids that cannot exist are unknown)."""
    if not is_digest(text):
        raise NotFound(f"snapshot {text!r} not found")
    return text


def template_users(store: Store) -> dict[str, list[str]]:
    """Snapshot id -> the templates naming it ("template NAME")."""
    users: dict[str, list[str]] = {}
    for template in store.list_templates():
        if template.kind == "snapshot":
            users.setdefault(template.target, []).append(f"template {template.name}")
    return users


def snapshot_users(store: Store, node_users: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """Everything that still needs each snapshot: templates, what this node
    reports, and the paused sandboxes of every node sharing the store (their
    records, layerstore/nodes.py)."""
    from .nodes import read_nodes

    users = template_users(store)
    for snapshot_id, names in node_users.items():
        users.setdefault(snapshot_id, []).extend(names)
    for view in read_nodes(store.backend, now=0.0):  # liveness does not matter: a stale node may come back
        for name in view.roots:
            if name.kind == "snapshot" and f"node {view.node}" not in users.get(name.value, []):
                users.setdefault(name.value, []).append(f"node {view.node}")
    return users


def list_snapshots(store: Store, *, sandbox: str | None = None, name: str | None = None,
                   team: str | None = None) -> list[SnapshotSummary]:
    """Every snapshot, optionally only those of one sandbox, named by one
    template, or annotated with one team (none: team `default`)."""
    names = {sid: [u.split(" ", 1)[1] for u in users] for sid, users in template_users(store).items()}
    out = []
    for snapshot_id in store.list_snapshots():
        if name is not None and name not in names.get(snapshot_id, []):
            continue
        if sandbox is not None or team is not None:
            notes = _annotations(store, snapshot_id)
            if notes is None or sandbox is not None and notes.get("sandbox") != sandbox:
                continue
            if team is not None and notes.get("team", DEFAULT_TEAM) != team:
                continue
        out.append(SnapshotSummary(snapshot_id, names.get(snapshot_id, [])))
    return out


def _annotations(store: Store, snapshot_id: str) -> Mapping[str, str] | None:
    try:
        return store.get_snapshot(snapshot_id).annotations
    except StrataError:
        return None


def inspect_snapshot(store: Store, snapshot_id: str, *, node_users: Mapping[str, list[str]]) -> SnapshotDetail:
    """A snapshot's parents, layers, stored bytes and users."""
    snap = store.get_snapshot(check_snapshot_id(snapshot_id))
    parents, parent = [], snap.parent
    while parent and len(parents) < MAX_PARENTS:
        parents.append(parent)
        try:
            parent = store.get_snapshot(parent).parent
        except NotFound:
            break
    layers = [LayerSummary(role, layer_id, store.get_layer(layer_id).size, store.stored_bytes([layer_id])[0])
              for role, layer_id in sorted(snap.layers.items())]
    return SnapshotDetail(snapshot_id, parents, layers, store.stored_bytes(snap.layers.values())[0], dict(snap.vm),
                          dict(snap.annotations), snapshot_users(store, node_users).get(snapshot_id, []))


def delete_snapshot(store: Store, snapshot_id: str, *, node_users: Mapping[str, list[str]],
                    with_names: bool = False) -> None:
    """Remove a snapshot manifest unless a template or the node still needs it
    (its layers and chunks stay until GC). `with_names` removes the templates
    naming it too (E2B's snapshot is its template): only a sandbox or another
    node still needing it refuses then."""
    store.get_snapshot(check_snapshot_id(snapshot_id))
    users = snapshot_users(store, node_users).get(snapshot_id, [])
    names = [u.removeprefix("template ") for u in users if with_names and u.startswith("template ")]
    blocking = [u for u in users if not (with_names and u.startswith("template "))]
    if blocking:
        raise Conflict(f"snapshot {snapshot_id} is still used by {', '.join(blocking)}")
    for name in names:
        store.delete_template(name)
    store.delete_snapshot(snapshot_id)
