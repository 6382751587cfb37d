"""Garbage collection: delete chunks, packs and layer manifests nothing can reach.

Roots are every ref, every template and every snapshot manifest (snapshots
are deleted explicitly: `DELETE /snapshots/{id}`, or a paused sandbox's
retention running out); their closures (layerstore/reach.py) are marked.
An unmarked object is deleted only when all of these hold:

    - it is older than the grace period (by the store's clock, never a node's), and so is
      every layer manifest that reaches it, so an import or push that just wrote it, or
      reused it in a manifest a ref will name a moment later, is safe;
    - an earlier GC run recorded it as a candidate at least `grace` ago and
      it is still unmarked now (two phases: `gc/candidates`);
    - no live lease exists (a push in flight) when deletion starts, and this
      GC holds the GC lock (layerstore/lease.py);
    - no node sharing the store names it in its record (layerstore/nodes.py),
      and no node's record is stale (then nothing is deleted at all);
    - no node's hold names it (what a node pulled manifests-only reads from
      this store; a hold has no ttl: a node gone for good is let go with
      `--forget-node`, never by time, and the report lists every hold);
    - the roots, marked once more right before deleting, still do not reach
      it.

Deletion removes manifests (then what is kept beside them: working sets
and their chunks stored whole, partial-pull markers) before chunks, so a
GC that dies midway leaves unreferenced chunks, never a manifest naming a
missing one: the store stays valid and the next run finishes the job.
`plan` is pure (reads only); `collect` runs it, then takes the GC lock and
deletes nothing while leases are live. A dry run is the same `collect`
over a `DryRunBackend`, which records the writes (lock, deletions,
candidates) instead of doing them, so it reports what a real run would do
through the real run's code.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .backend import Backend, DryRunBackend
from .chunk import CHUNK_PREFIX, chunk_key
from .errors import CorruptObject, NotFound, StrataError
from .lease import GcLock, expired_leases, live_leases, store_now
from .nodes import cluster_roots, read_holds
from .manifest import MANIFEST_PREFIX, manifest_key
from .pack import PACK_PREFIX, pack_key
from .reach import Closure, Name
from .store import PARTIAL_PREFIX, PREFETCH_PREFIX, SET_CHUNKS_PREFIX, Store
from .volumes import Salvaged, Volumes

CANDIDATES = "gc/candidates"
SWEPT_PREFIXES = (MANIFEST_PREFIX, CHUNK_PREFIX, PACK_PREFIX)
# per-manifest objects deleted with their manifest
SIDE_PREFIXES = (PREFETCH_PREFIX, SET_CHUNKS_PREFIX, PARTIAL_PREFIX)
DEFAULT_GRACE = 24 * 3600.0
DELETE_BATCH = 1000  # keys per delete_many (S3's DeleteObjects limit)
DELETE_WORKERS = 8  # delete_many calls in flight: a store with 100 M dead chunks is 100,000 batches


@dataclass
class Plan:
    now: float
    grace: float
    scanned: int = 0
    marked: int = 0
    sizes: dict[str, int] = field(default_factory=dict)  # every swept object's size
    young: list[str] = field(default_factory=list)  # unmarked, but within the grace period or reached from it
    candidates: dict[str, float] = field(default_factory=dict)  # unmarked and old: key -> first seen
    deletable: list[str] = field(default_factory=list)  # candidates of an earlier run, past the margin
    missing: list[str] = field(default_factory=list)  # objects a root names that are gone (verify reports them)
    quarantined: list[str] = field(default_factory=list)  # malformed volume indexes, kept with what they name


@dataclass
class GcReport:
    scanned: int
    marked: int
    candidates: int
    deletable: int
    deleted: int
    freed_bytes: int
    retained: int
    postponed: str
    missing: list[str]
    dry_run: bool
    seconds: float
    holds: list[dict[str, object]] = field(default_factory=list)  # nodes' holds kept: node, layers, age (s)
    quarantined: list[str] = field(default_factory=list)  # "KEY: why": malformed volume indexes, their layers kept

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def roots(store: Store) -> list[Name]:
    return _roots(store)[0]


def _roots(store: Store) -> tuple[list[Name], list[Salvaged]]:
    """The store's roots, and the volume indexes no reader can parse (salvaged, not roots)."""
    names = [Name("image", str(ref)) for ref, _manifest, _updated in store.list_refs()]
    names += [Name("template", t.name) for t in store.list_templates()]
    names += [Name("snapshot", s) for s in store.list_snapshots()]
    layers, salvaged = Volumes(store.backend).gc_roots()
    return names + [Name("layer", layer) for layer in layers], salvaged


def mark(store: Store, extra: Iterable[Name] = ()) -> tuple[set[str], list[str], list[Salvaged]]:
    """Keys of every object a root reaches, the layer manifests the
    store's own roots need but are missing (damage: `collect` refuses to run
    past it), and the malformed volume indexes. What `extra` roots name may
    live in another store (a node's own layers in its record on a shared
    store), and what a malformed index seems to name may be no layer at all:
    their missing objects are not damage."""
    closure = Closure()
    names, salvaged = _roots(store)
    for name in names:
        try:
            closure.add(store, name, strict=False)
        except NotFound:  # a template naming a deleted image: nothing to keep for it
            closure.missing.append(f"{name.kind} {name.value}")
    # a missing layer manifest is lost data; a dangling template or a deleted parent snapshot is not
    damage = [m for m in closure.missing if m.startswith("manifest ")]
    for name in [*extra, *(Name("layer", layer) for bad in salvaged for layer in bad.layers)]:
        try:
            closure.add(store, name, strict=False)
        except NotFound:
            pass
    return _keys(closure), damage, salvaged


def _keys(closure: Closure) -> set[str]:
    keys = {manifest_key(m) for m in closure.layers}
    keys |= {chunk_key(d) for d in closure.chunks}
    return keys | {pack_key(p) for p in closure.packs}


def _young_reach(store: Store, young_manifests: Iterable[str]) -> set[str]:
    """What layer manifests within the grace period reach: a manifest just imported is named by
    a ref only a moment later (an upload publishes its ref after the import's lease), and the
    old chunks it reuses must outlive that moment as the manifest does."""
    closure = Closure()
    for key in young_manifests:
        try:
            closure.add(store, Name("layer", key.removeprefix(MANIFEST_PREFIX)), strict=False)
        except (NotFound, CorruptObject):
            continue  # gone since the listing, or unreadable: it keeps nothing
    return _keys(closure)


def _read_candidates(store: Store) -> dict[str, float]:
    try:
        data = json.loads(store.backend.get(CANDIDATES))
        return {str(k): float(v) for k, v in data.items()}
    except NotFound:
        return {}
    except (ValueError, TypeError, AttributeError):
        return {}  # a torn record only delays deletion by one run


def plan(store: Store, *, grace: float = DEFAULT_GRACE, now: float | None = None,
         extra_roots: Iterable[Name] = ()) -> Plan:
    """What a GC would do now (reads only, but for one tiny object that reads the store's clock)."""
    now = store_now(store.backend) if now is None else now
    result = Plan(now=now, grace=grace)
    listed = [info for prefix in SWEPT_PREFIXES for info in store.backend.list(prefix)]
    marked, result.missing, salvaged = mark(store, extra_roots)
    result.quarantined = [f"{bad.key}: {bad.reason}" for bad in salvaged]
    previous = _read_candidates(store)
    result.scanned = len(listed)
    kept_young = _young_reach(store, [info.key for info in listed if info.key.startswith(MANIFEST_PREFIX)
                                      and info.key not in marked and info.modified > now - grace])
    for info in listed:
        result.sizes[info.key] = info.size
        if info.key in marked:
            result.marked += 1
        elif info.modified > now - grace or info.key in kept_young:
            result.young.append(info.key)
        else:
            first_seen = previous.get(info.key, now)
            result.candidates[info.key] = first_seen
            if info.key in previous and first_seen <= now - grace:
                result.deletable.append(info.key)
    return result


def collect(
    store: Store,
    *,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
    extra_roots: Iterable[Name] = (),
    now: float | None = None,
    progress: Callable[[int], None] | None = None,
    own_node: str | None = None,
    forget_nodes: Iterable[str] = (),
    allow_missing: bool = False,
    delete_workers: int = DELETE_WORKERS,
) -> GcReport:
    """Run one GC: plan, then record candidates and delete what may go.

    Every node sharing the store adds the roots of its record (layerstore/
    nodes.py); a stale record stops the GC before anything is deleted,
    unless that node is in `forget_nodes` (its record is then removed).
    `own_node`'s record is skipped: the caller passes its live roots in
    `extra_roots`. With `dry_run` every write (the lock, deletions, the
    candidate record, expired leases, forgotten nodes) is only recorded.

    A store whose refs, templates or snapshots need missing layer manifests
    is damaged, and deleting from it could make it worse (as
    restic's prune, GC refuses): `strata verify` names the damage;
    `allow_missing` collects anyway, keeping all that is still reachable.
    """
    started = time.monotonic()
    forget_nodes = list(forget_nodes)
    cluster = dict(forget_nodes=forget_nodes, own=own_node, dry_run=dry_run)
    extra = [*extra_roots, *cluster_roots(store.backend, **cluster)]  # type: ignore[arg-type]
    p = plan(store, grace=grace, now=now, extra_roots=extra)
    if p.missing and not allow_missing and not dry_run:
        raise StrataError(f"{store.describe()} is damaged: its roots name {len(p.missing)} missing object(s), e.g. "
                          f"{p.missing[0]}; nothing was deleted (`strata verify` names what is lost; "
                          "`strata gc --allow-missing` collects anyway, keeping all that is still reachable)")
    backend: Backend = DryRunBackend(store.backend) if dry_run else store.backend
    deleted, freed, postponed = _sweep(store, backend, p, list(extra_roots), progress,
                                       lambda: cluster_roots(store.backend, own=own_node,
                                                             forget_nodes=forget_nodes, dry_run=True),
                                       workers=max(1, delete_workers))
    holds = [{"node": h.node, "layers": len(h.roots), "age": h.age}
             for h in read_holds(store.backend) if h.node not in forget_nodes]
    return GcReport(scanned=p.scanned, marked=p.marked, candidates=len(p.candidates),
                    deletable=len(p.deletable), deleted=0 if dry_run else deleted, freed_bytes=0 if dry_run else freed,
                    retained=len(p.young), postponed=postponed, missing=p.missing, dry_run=dry_run,
                    seconds=time.monotonic() - started, holds=holds, quarantined=p.quarantined)


def _forget(store: Store, p: Plan, batch: list[str]) -> int:
    """Drop deleted manifests from the catalog (a cache: forgetting is always safe); their bytes."""
    for key in batch:
        if key.startswith(MANIFEST_PREFIX):
            store.forget_layer(key.removeprefix(MANIFEST_PREFIX))
    return sum(p.sizes.get(key, 0) for key in batch)


def _delete(store: Store, backend: Backend, p: Plan, doomed: list[str], lock: GcLock,
            progress: Callable[[int], None] | None, *, workers: int) -> tuple[int, int]:
    """Delete `doomed`, `workers` batches at a time, renewing the lock before each wave; (deleted, freed).

    Manifests first: a crash midway leaves orphan chunks, never a manifest
    without its chunks. What is kept beside a manifest (its working set, its
    partial-pull marker) goes with it, uncounted."""
    deleted = freed = 0
    manifests = sorted(k for k in doomed if k.startswith(MANIFEST_PREFIX))
    chunks = sorted(k for k in doomed if not k.startswith(MANIFEST_PREFIX))
    side = [prefix + key.removeprefix(MANIFEST_PREFIX) for key in manifests for prefix in SIDE_PREFIXES]
    with ThreadPoolExecutor(workers) as pool:
        for kind in (manifests, side, chunks):
            batches = [kind[i:i + DELETE_BATCH] for i in range(0, len(kind), DELETE_BATCH)]
            for wave in range(0, len(batches), workers):
                lock.renew()  # still ours? (a GC that lost its lock deletes nothing more)
                group = batches[wave:wave + workers]
                list(pool.map(backend.delete_many, group))  # every batch done (or raised) before the next wave
                if kind is side:
                    continue  # not swept objects: not counted
                for batch in group:
                    freed += _forget(store, p, batch)
                    deleted += len(batch)
                    if progress is not None:
                        progress(len(batch))
    return deleted, freed


def _sweep(store: Store, backend: Backend, p: Plan, extra: list[Name],
           progress: Callable[[int], None] | None,
           cluster: Callable[[], list[Name]], *, workers: int) -> tuple[int, int, str]:
    """Under the GC lock: delete what `p` found deletable and is still unmarked; (deleted, freed, postponed)."""
    postponed = ""
    lock = GcLock(backend)
    other = lock.acquire()
    if other is not None:
        raise StrataError(f"another GC ({other.get('holder', '?')}) is running on {store.describe()}")
    try:
        now = store_now(store.backend)
        leases = live_leases(backend, now=now)
        if leases:
            postponed = f"{len(leases)} live lease(s), e.g. {next(iter(leases.values())).get('what', '?')}"
            doomed: list[str] = []
        else:
            again, _missing, _salvaged = mark(store, [*extra, *cluster()])  # re-check right before deleting
            # a GC that finished since this one planned took what it deleted off the candidates
            still = _read_candidates(store)
            doomed = [k for k in p.deletable if k not in again and k in still]
        deleted, freed = _delete(store, backend, p, doomed, lock, progress, workers=workers)
        gone = set(doomed)
        remaining = {k: v for k, v in p.candidates.items() if k not in gone}
        backend.put(CANDIDATES, json.dumps(remaining, sort_keys=True).encode())
        for key in expired_leases(backend, now=now):  # their holders died
            backend.delete(key)
    finally:
        lock.release()
    return deleted, freed, postponed
