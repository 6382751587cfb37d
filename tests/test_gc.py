"""Garbage collection (layerstore/gc.py): each safety rule has a test, plus a
hypothesis run interleaving imports, pushes, ref and snapshot deletions and
GC runs (some crashing midway) that checks everything still named is intact."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerstore import gc, nodes
from layerstore.errors import BackendUnavailable, Conflict, InvalidInput, StrataError
from layerstore.digest import digest_bytes
from layerstore.pack import encode_entry
from layerstore.reach import Name
from layerstore.exporter import export_image
from layerstore.importer import import_image
from layerstore.lease import GC_LOCK, LEASE_PREFIX, GcLock, Lease, live_leases
from layerstore.localdir import LocalDirBackend
from layerstore.store import Store
from layerstore.templates import new_template
from layerstore.transfer import copy
from layerstore.verify import verify_store
from tests.images import write_image
from tests.test_snapshot import _layers, _snap
from tests.test_transfer import keys, local_store

HOUR = 3600.0


def garbage(store: Store, tmp_path: Path, seed: int = 9) -> set[str]:
    """Import an image, then drop its ref: its manifest and chunks become garbage."""
    write_image(tmp_path / f"g{seed}.img", "rrp", seed=seed)
    manifest = import_image(store, tmp_path / f"g{seed}.img", f"garbage:v{seed}").manifest_id
    store.delete_ref(f"garbage:v{seed}")
    chunks = {f"chunks/{d[:2]}/{d}" for d in store.chunk_map(manifest)[1].values()}
    return chunks | {f"manifests/{manifest}"}


def test_two_phases_and_the_grace_period(store: Store, tmp_path: Path) -> None:
    data = write_image(tmp_path / "keep.img", "rzr", seed=1)
    import_image(store, tmp_path / "keep.img", "keep:v1")
    doomed = garbage(store, tmp_path)
    before = keys(store, "")

    young = gc.collect(store, grace=HOUR)  # everything is younger than an hour
    assert young.deleted == 0 and young.retained == len(doomed) and young.candidates == 0
    later = time.time() + 2 * HOUR  # pretend two hours passed
    first = gc.collect(store, grace=HOUR, now=later)
    assert first.deleted == 0 and first.candidates == len(doomed)  # phase one: recorded only
    assert keys(store, "manifests/") | keys(store, "chunks/") == {k for k in before if k.startswith(("m", "c"))}
    too_soon = gc.collect(store, grace=HOUR, now=later + HOUR / 2)
    assert too_soon.deleted == 0  # recorded less than `grace` ago
    second = gc.collect(store, grace=HOUR, now=later + 2 * HOUR)
    assert second.deleted == len(doomed) and second.freed_bytes > 0
    assert not (doomed & keys(store, ""))
    assert not verify_store(store).errors
    export_image(store, "keep:v1", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == data


def test_a_layers_working_set_goes_with_it(store: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "keep.img", "rr", seed=2)
    kept = import_image(store, tmp_path / "keep.img", "keep:v1").manifest_id
    doomed = garbage(store, tmp_path)
    dead = next(k for k in doomed if k.startswith("manifests/")).removeprefix("manifests/")
    store.put_prefetch(dead, [0, 1])
    store.put_prefetch(kept, [1])
    whole = {digest_bytes(b"w" * 4096): encode_entry(b"w" * 4096, None)}
    store.put_set_chunks(dead, whole)
    store.put_set_chunks(kept, whole)
    later = time.time() + 2 * HOUR
    gc.collect(store, grace=HOUR, now=later)
    assert gc.collect(store, grace=HOUR, now=later + 2 * HOUR).deleted == len(doomed)  # side objects uncounted
    assert store.get_prefetch(dead) is None and store.get_prefetch(kept) == [1]
    assert keys(store, "prefetch/") == {f"prefetch/{kept}"}
    assert store.get_set_chunks(dead) == {} and store.get_set_chunks(kept) == whole
    assert keys(store, "prefetch-chunks/") == {f"prefetch-chunks/{kept}"}


def test_dry_run_changes_nothing(store: Store, tmp_path: Path) -> None:
    doomed = garbage(store, tmp_path)
    gc.collect(store, grace=0, now=time.time() + 10)
    before = {o.key: o.size for o in store.backend.list("")}
    report = gc.collect(store, grace=0, dry_run=True, now=time.time() + 20)
    assert report.dry_run and report.deletable == len(doomed) and report.deleted == 0
    assert {o.key: o.size for o in store.backend.list("")} == before


def test_roots_refs_templates_snapshots_are_kept(tmp_path: Path) -> None:
    store = local_store(tmp_path / "s")
    ids = _layers(store, tmp_path)
    snap = store.put_snapshot(_snap(ids))
    write_image(tmp_path / "t.img", "rp", seed=3)
    import_image(store, tmp_path / "t.img", "tpl-image:v1")
    store.put_template(new_template("t1:v1", "image", "tpl-image:v1"))  # a tagged name is a root too
    store.delete_ref("tpl-image:v1")  # still named by the template
    for i in range(2):
        gc.collect(store, grace=0, now=time.time() + 10 + i)
    assert store.get_snapshot(snap) and not verify_store(store).errors
    assert gc.plan(store, grace=0).candidates == {}  # nothing reachable was ever a candidate
    store.delete_snapshot(snap)
    store.delete_template("t1:v1")
    for i in range(2):
        report = gc.collect(store, grace=0, now=time.time() + 20 + i)
    assert report.deleted > 0 and keys(store, "chunks/") == set() and keys(store, "manifests/") == set()
    store.close()


def test_a_live_lease_postpones_deletion_and_a_stale_one_expires(store: Store, tmp_path: Path) -> None:
    doomed = garbage(store, tmp_path)
    gc.collect(store, grace=0, now=time.time() + 10)
    with Lease(store.backend, "push in progress", ttl=60):
        report = gc.collect(store, grace=0, now=time.time() + 20)
        assert report.deleted == 0 and "push in progress" in report.postponed
    assert doomed <= keys(store, "")
    store.backend.put(f"{LEASE_PREFIX}dead", json.dumps({"holder": "gone:1", "ttl": 0, "token": "dead"}).encode())
    report = gc.collect(store, grace=0, now=time.time() + 30)
    assert report.deleted == len(doomed) and keys(store, LEASE_PREFIX) == set()  # expired: ignored, then removed


def test_a_writer_whose_lease_lapsed_or_vanished_publishes_nothing(store: Store, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with Lease(store.backend, "import", ttl=60) as lease:
        lease.check()  # fresh: fine
        store.backend.delete(lease.key)  # what a GC does to a lease it found expired
        with pytest.raises(StrataError, match="removed as expired"):
            lease.check()
    with Lease(store.backend, "import", ttl=0.4) as lease:
        lease._stop.set()  # renewals stall (a store that refuses them, a stopped process)
        time.sleep(0.4)
        with pytest.raises(StrataError, match="without a renewal"):
            lease.check()
    # an import whose lease is gone before it publishes: no manifest, no ref
    write_image(tmp_path / "img", "rrp")
    image = tmp_path / "img"
    original = Lease.check

    def vanish(lease: Lease) -> None:
        store.backend.delete(lease.key)
        original(lease)

    before = keys(store, "manifests/") | keys(store, "refs/")
    monkeypatch.setattr(Lease, "check", vanish)  # a GC removes the lease just before the import publishes
    with pytest.raises(StrataError, match="nothing was published"):
        import_image(store, image, "app:v1")
    assert keys(store, "manifests/") | keys(store, "refs/") == before


def test_of_gcs_racing_for_the_lock_exactly_one_holds_it(store: Store) -> None:
    if store.kind == "moto":  # type: ignore[attr-defined]
        pytest.skip("moto's in-process S3 model is not thread-safe for concurrent PUTs of one key; local and "
                    "SeaweedFS cover it")
    for _ in range(2):  # a free lock, then a stale one (its holder died: ttl 0) taken over
        locks = [GcLock(store.backend) for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            others = list(pool.map(lambda lock: lock.acquire(), locks))
        winners = [lock for lock, other in zip(locks, others) if other is None]
        assert len(winners) == 1
        winners[0].renew()
        store.backend.put(GC_LOCK, json.dumps({"holder": "died:1", "ttl": 0, "token": "dead"}).encode())


def test_a_gc_another_gc_outran_deletes_nothing_twice(store: Store, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    doomed = garbage(store, tmp_path)
    monkeypatch.setattr(gc, "DELETE_BATCH", 3)  # several waves of parallel batches
    later = time.time() + 2 * HOUR
    gc.collect(store, grace=HOUR, now=later)  # phase one: candidates
    real = gc.plan
    runs = []

    def plan_then_outrun(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        planned = real(*args, **kwargs)
        monkeypatch.setattr(gc, "plan", real)
        runs.append(gc.collect(store, grace=HOUR, now=later + 2 * HOUR, delete_workers=2))  # between plan and sweep
        return planned

    monkeypatch.setattr(gc, "plan", plan_then_outrun)
    late = gc.collect(store, grace=HOUR, now=later + 2 * HOUR)
    assert late.deletable == len(doomed)  # its plan still named them...
    assert late.deleted == 0 and runs[0].deleted == len(doomed)  # ...but the first GC deleted them, once
    assert not (doomed & keys(store, "")) and not verify_store(store).errors


def test_a_gc_that_lost_its_lock_stops_and_leaves_the_winners_lock(store: Store) -> None:
    first = GcLock(store.backend, ttl=0)  # stale the moment it is written: as if its holder hung
    assert first.acquire() is None
    second = GcLock(store.backend)
    assert second.acquire() is None  # took the stale lock over
    with pytest.raises(StrataError, match="lost its lock"):
        first.renew()
    first.release()
    assert json.loads(store.backend.get(GC_LOCK))["token"] == second.token
    assert GcLock(store.backend).acquire() is not None  # second's is live
    second.release()
    assert store.backend.head(GC_LOCK) is None


def test_liveness_is_by_the_stores_clock_not_the_nodes(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    with Lease(store.backend, "push", ttl=60):
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3 * 3600)  # this node's clock runs 3 h fast
        assert len(live_leases(store.backend)) == 1
        report = gc.collect(store, grace=0)
        assert "1 live lease" in report.postponed


def test_every_live_nodes_roots_are_kept_and_a_stale_node_stops_gc(store: Store, tmp_path: Path) -> None:
    doomed = garbage(store, tmp_path)
    manifest = next(k for k in doomed if k.startswith("manifests/")).removeprefix("manifests/")
    nodes.publish(store.backend, "node-b", [Name("layer", manifest)], ttl=60)  # b's sandbox sits on it
    gc.collect(store, grace=0, now=time.time() + 10)
    gc.collect(store, grace=0, now=time.time() + 20)
    assert doomed <= keys(store, "")
    nodes.publish(store.backend, "node-b", [Name("layer", manifest)], ttl=0)  # b stopped renewing: stale
    with pytest.raises(StrataError, match="node node-b .*nothing was deleted.*--forget-node node-b"):
        gc.collect(store, grace=0, now=time.time() + 30)
    assert doomed <= keys(store, "")
    report = gc.collect(store, grace=0, now=time.time() + 40, forget_nodes=["node-b"], dry_run=True)
    assert report.candidates == len(doomed) and keys(store, "nodes/") == {"nodes/node-b"}  # dry: nothing forgotten
    gc.collect(store, grace=0, now=time.time() + 50, forget_nodes=["node-b"])  # forgets, records candidates
    assert keys(store, "nodes/") == set()
    report = gc.collect(store, grace=0, now=time.time() + 60)
    assert report.deleted == len(doomed) and not (doomed & keys(store, ""))


def test_a_node_skips_its_own_record_and_gives_its_live_roots(store: Store, tmp_path: Path) -> None:
    doomed = garbage(store, tmp_path)
    manifest = next(k for k in doomed if k.startswith("manifests/")).removeprefix("manifests/")
    nodes.publish(store.backend, "me", [], ttl=0)  # stale: the node is restarting
    for step in (10, 20):
        gc.collect(store, grace=0, now=time.time() + step, own_node="me", extra_roots=[Name("layer", manifest)])
    assert doomed <= keys(store, "")
    with pytest.raises(InvalidInput, match="invalid node id"):
        nodes.publish(store.backend, "../x", [])


def test_a_push_waits_for_a_gc_that_is_deleting(store: Store) -> None:
    store.backend.put(GC_LOCK, json.dumps({"holder": "other:1", "ttl": 60, "token": "theirs"}).encode())
    with pytest.raises(Exception, match="being garbage-collected"):
        Lease(store.backend, "push", gc_wait=0.2).__enter__()
    assert keys(store, LEASE_PREFIX) == set()
    with pytest.raises(Exception, match="another GC"):
        gc.collect(store, grace=0)


def test_recheck_right_before_deleting(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ref published between the plan and the deletion saves what it names."""
    write_image(tmp_path / "r.img", "rr", seed=4)
    manifest = import_image(store, tmp_path / "r.img", "late:v1").manifest_id
    store.delete_ref("late:v1")
    gc.collect(store, grace=0, now=time.time() + 10)
    calls = []
    real_mark = gc.mark

    def mark_then_publish(s, extra=()):  # noqa: ANN001, ANN202
        result = real_mark(s, extra)
        if not calls:
            store.set_ref("late:v1", manifest)  # a writer names it after the plan was made
        calls.append(1)
        return result

    monkeypatch.setattr(gc, "mark", mark_then_publish)
    report = gc.collect(store, grace=0, now=time.time() + 20)
    assert len(calls) == 2 and report.deleted == 0
    export_image(store, "late:v1", tmp_path / "out.img")
    assert not verify_store(store).errors


def test_a_gc_that_crashes_midway_leaves_a_valid_store(tmp_path: Path) -> None:
    class Crashy(LocalDirBackend):
        deletes = 0
        limit = 10 ** 9

        def delete(self, key: str) -> None:
            if key.startswith(("chunks/", "manifests/")):
                Crashy.deletes += 1
                if Crashy.deletes > Crashy.limit:
                    raise BackendUnavailable("power cut (injected)")
            super().delete(key)

    from layerstore.catalog import Catalog

    store = Store(Crashy(tmp_path / "o"), Catalog(tmp_path / "c"))
    data = write_image(tmp_path / "k.img", "rr", seed=5)
    import_image(store, tmp_path / "k.img", "keep:v1")
    doomed = garbage(store, tmp_path, seed=6) | garbage(store, tmp_path, seed=7)
    gc.collect(store, grace=0, now=time.time() + 10)
    Crashy.limit = 3
    with pytest.raises(BackendUnavailable):
        gc.collect(store, grace=0, now=time.time() + 20)
    assert not verify_store(store).errors  # manifests went first: none names a deleted chunk
    assert keys(store, "manifests/") & doomed == set()
    Crashy.limit = 10 ** 9
    store.backend.delete(GC_LOCK)  # what the lock's expiry does for a crashed GC
    gc.collect(store, grace=0, now=time.time() + 30)
    assert not (doomed & keys(store, ""))
    export_image(store, "keep:v1", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == data
    store.close()


OPS = st.lists(st.tuples(st.sampled_from(["import", "push", "delref", "delsnap", "snapshot", "gc", "gc-crash"]),
                         st.integers(0, 3)), min_size=4, max_size=18)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_property_everything_named_survives_any_interleaving(ops: list[tuple[str, int]], tmp_path_factory) -> None:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("prop")
    node, remote = local_store(tmp / "node"), local_store(tmp / "remote")
    clock = [time.time() + 10]
    try:
        for op, n in ops:
            clock[0] += 1
            if op == "import":
                write_image(tmp / f"i{n}.img", "rzp"[: 1 + n % 3] + "r", seed=n)
                import_image(node, tmp / f"i{n}.img", f"img{n}:v1")
            elif op == "push" and f"img{n}:v1" in {str(r) for r, _m, _u in node.list_refs()}:
                copy(node, remote, f"img{n}:v1")
            elif op == "delref":
                for s in (node, remote):
                    if f"img{n}:v1" in {str(r) for r, _m, _u in s.list_refs()}:
                        s.delete_ref(f"img{n}:v1")
            elif op == "snapshot":
                refs = node.list_refs()
                if refs:
                    m = refs[n % len(refs)][1]
                    snap = _snap({"disk": m, "memory": m, "state": m, "kernel": m, "initrd": m})
                    snap_id = node.put_snapshot(snap)
                    copy(node, remote, snap_id)
            elif op == "delsnap":
                for s in (node, remote):
                    snaps = s.list_snapshots()
                    if snaps:
                        s.delete_snapshot(snaps[n % len(snaps)])
            elif op in ("gc", "gc-crash"):
                for s in (node, remote):
                    if op == "gc-crash":  # the process dies after n deletions
                        real, real_many = s.backend.delete, s.backend.delete_many
                        count = [0]

                        def failing(key: str, real=real, count=count) -> None:  # noqa: ANN001
                            count[0] += 1
                            if count[0] > n:
                                raise BackendUnavailable("crash (injected)")
                            real(key)

                        def failing_many(keys, failing=failing) -> None:  # noqa: ANN001
                            for key in keys:
                                failing(key)

                        s.backend.delete, s.backend.delete_many = failing, failing_many  # type: ignore[method-assign]
                        try:
                            gc.collect(s, grace=0, now=clock[0])
                        except BackendUnavailable:
                            real(GC_LOCK)
                        finally:
                            s.backend.delete, s.backend.delete_many = real, real_many  # type: ignore[method-assign]
                    else:
                        gc.collect(s, grace=0, now=clock[0])
        for s in (node, remote):
            report = verify_store(s)
            assert not report.errors, report.errors
            for ref, _m, _u in s.list_refs():  # every named image reads back, every chunk verified
                export_image(s, str(ref), tmp / "check.img")
            for snap_id in s.list_snapshots():
                for layer in s.get_snapshot(snap_id).layer_ids():
                    s.chunk_map(layer)
    finally:
        node.close()
        remote.close()


def test_cli_gc_refuses_while_the_node_has_sandboxes_its_mount_daemon_cannot_name(tmp_path: Path) -> None:
    """`strata gc` adds the layers the node's sandbox disks sit on, which only its mount daemon knows:
    with the daemon gone and sandboxes still recorded, it refuses and deletes nothing."""
    from layerstore.store import open_store
    from tests.test_cli import run
    from vmm.registry import Registry, SandboxRecord

    env = {"STRATA_STORE": str(tmp_path / "store"), "STRATA_STATE_DIR": str(tmp_path / "state"),
           "STRATA_RUN_DIR": str(tmp_path / "run")}
    store = open_store(str(tmp_path / "store"))
    doomed = garbage(store, tmp_path)
    registry = Registry(tmp_path / "state" / "sandboxes")
    registry.save(SandboxRecord("sb1", "qemu", "image:garbage:v9", 256))
    r = run(["gc", "--grace", "0"], env)
    assert r.returncode != 0 and "does not answer" in r.stderr and "sb1" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert doomed <= keys(store, "")
    record = registry.load("sb1")
    record.state = "suspended"  # paused to the store: its snapshot names its layers
    registry.save(record)
    for _ in range(2):  # two phases: candidates, then deletion
        r = run(["gc", "--grace", "0"], env)
        assert r.returncode == 0, r.stderr
    assert not (doomed & keys(store, ""))


def test_a_snapshot_another_nodes_paused_sandbox_wakes_from_cannot_be_deleted(store: Store, tmp_path: Path) -> None:
    from layerstore.inventory import delete_snapshot

    snapshot_id = store.put_snapshot(_snap(_layers(store, tmp_path)))
    nodes.publish(store.backend, "node-c", [Name("snapshot", snapshot_id)])
    with pytest.raises(Conflict, match="node node-c"):
        delete_snapshot(store, snapshot_id, node_users={})
    nodes.forget(store.backend, "node-c")
    delete_snapshot(store, snapshot_id, node_users={})


def test_a_damaged_store_is_not_collected_unless_allowed(store: Store, tmp_path: Path) -> None:
    doomed = garbage(store, tmp_path)
    write_image(tmp_path / "kept.img", "rr", seed=3)
    kept = import_image(store, tmp_path / "kept.img", "kept:v1").manifest_id
    store.backend.delete(f"manifests/{kept}")  # lost: a ref names a manifest that is gone
    store.forget_layer(kept)
    with pytest.raises(StrataError, match=f"damaged.*manifest {kept}.*nothing was deleted"):
        gc.collect(store, grace=0, now=time.time() + 10)
    assert doomed <= keys(store, "")
    assert gc.collect(store, grace=0, now=time.time() + 10, dry_run=True).missing == [f"manifest {kept}"]
    gc.collect(store, grace=0, now=time.time() + 20, allow_missing=True)
    report = gc.collect(store, grace=0, now=time.time() + 30, allow_missing=True)
    assert not (doomed & keys(store, "")) and report.deleted == len(doomed) + 2  # + kept's orphaned chunks


def test_a_node_starts_while_a_store_is_down_and_publishes_once_it_answers(tmp_path: Path) -> None:
    from layerstore.errors import BackendUnavailable as Down

    class Flaky(LocalDirBackend):
        down = True

        def put(self, key: str, data: bytes) -> None:
            if Flaky.down:
                raise Down("store unreachable (injected)")
            super().put(key, data)

    backend = Flaky(tmp_path / "store")
    beat = nodes.Heartbeat([backend], "node-x", lambda: [Name("layer", "a" * 64)], ttl=0.3)
    beat.start()  # does not raise
    try:
        assert isinstance(beat.error, Down) and backend.head("nodes/node-x") is None
        Flaky.down = False
        deadline = time.monotonic() + 5
        while backend.head("nodes/node-x") is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        beat.stop()


def test_a_hold_is_kept_without_a_ttl_even_the_gcs_own_nodes_until_forgotten(store: Store, tmp_path: Path) -> None:
    """A node's hold (what it pulled manifests-only from this store) has no ttl: it is marked however
    old, also when the GC runs as that node (a hold is not its sandboxes' live roots), is listed in
    the report, and goes only with `--forget-node` (a dry run forgets nothing)."""
    doomed = garbage(store, tmp_path)
    manifest = next(k for k in doomed if k.startswith("manifests/")).removeprefix("manifests/")
    nodes.hold(store.backend, "node-b", [Name("layer", manifest)])
    for step in (10, 20, 30 * 24 * HOUR):  # a month later the node may still come back
        report = gc.collect(store, grace=0, now=time.time() + step, own_node="node-b")
    assert doomed <= keys(store, "") and report.deleted == 0
    assert [(h["node"], h["layers"]) for h in report.holds] == [("node-b", 1)]
    dry = gc.collect(store, grace=0, now=time.time() + 40, forget_nodes=["node-b"], dry_run=True)
    assert dry.holds == [] and keys(store, "holds/") == {"holds/node-b"}
    gc.collect(store, grace=0, now=time.time() + 50, forget_nodes=["node-b"])
    assert keys(store, "holds/") == set()
    assert gc.collect(store, grace=0, now=time.time() + 60).deleted == len(doomed)


def test_an_unreadable_hold_stops_gc(store: Store, tmp_path: Path) -> None:
    """What a torn or foreign hold keeps is unknown: nothing is deleted, and the error names the node."""
    doomed = garbage(store, tmp_path)
    store.backend.put("holds/node-t", b'{"roots": [{"kind": "lay')
    for step in (10, 20):
        with pytest.raises(StrataError, match="hold of node node-t .*nothing was deleted.*--forget-node node-t"):
            gc.collect(store, grace=0, now=time.time() + step)
    store.backend.put("holds/node-t", json.dumps({"node": "node-t", "roots": [{"kind": "x", "value": "y"}]}).encode())
    with pytest.raises(StrataError, match="hold of node node-t .*unknown kind"):
        gc.collect(store, grace=0, now=time.time() + 30)
    assert doomed <= keys(store, "")
    nodes.hold(store.backend, "node-t", [])  # the node rewrote it: it reads nothing lazily now
    assert keys(store, "holds/") == set()


def test_a_hold_names_only_what_the_node_reads_lazily(tmp_path: Path) -> None:
    """`lazy_roots`: the partial layers the node's refs, templates and snapshots reach; a layer a
    full pull completed, and one no name reaches any more, are not held."""
    src = local_store(tmp_path / "r")
    node = local_store(tmp_path / "b", remote=LocalDirBackend(tmp_path / "r" / "objects", create=False))
    made = {}
    for seed, ref in ((31, "img:a"), (32, "img:b"), (33, "img:c")):
        write_image(tmp_path / f"{seed}.img", "rp", seed=seed)
        made[ref] = Name("layer", import_image(src, tmp_path / f"{seed}.img", ref).manifest_id)
        copy(src, node, ref, chunks=False)
    snapshot_id = store_snapshot_on(node, made["img:c"].value, tmp_path)
    node.delete_ref("img:c")  # still reached by a snapshot of the node's whose disk sits on it
    copy(src, node, "img:a")  # completed: every chunk is the node's own now
    assert set(nodes.lazy_roots(node)) == {made["img:b"], made["img:c"]}
    node.delete_ref("img:b")
    node.backend.delete(f"snapshots/{snapshot_id}")
    assert nodes.lazy_roots(node) == []
    node.close()
    src.close()


def store_snapshot_on(store: Store, disk: str, tmp_path: Path) -> str:
    """A snapshot in `store` whose disk layer is `disk` (a node's sandbox over a pulled image)."""
    return store.put_snapshot(_snap({**_layers(store, tmp_path), "disk": disk}))


def test_a_malformed_volume_index_is_quarantined_its_layers_kept_and_gc_goes_on(store: Store, tmp_path: Path) -> None:
    """A volume index no reader can parse (a path past MAX_PATH, as a guest's rename once wrote) no
    longer stops GC for the whole store: GC keeps every layer its bytes name, reports it, and
    collects the rest; verify names it."""
    from layerstore.volumes import Volumes

    doomed = garbage(store, tmp_path, seed=3)
    named = garbage(store, tmp_path, seed=4)  # unreferenced but for the malformed index below
    layer = next(k for k in named if k.startswith("manifests/")).removeprefix("manifests/")
    good = Volumes(store.backend).create("good", "alpha")
    bad_key = "volumes/vol" + "0" * 16
    entries = {"d/" + "x" * 5000: {"type": "file", "mode": 0o644, "size": 1, "layer": layer}}
    store.backend.put(bad_key, json.dumps({"v": 1, "name": "bad", "owner": "beta", "created": 1.0,
                                           "token": "0" * 64, "entries": entries}).encode())
    assert [v.id for v in Volumes(store.backend).list()] == [good.id]  # listings leave it out
    first = gc.collect(store, grace=0, now=time.time() + 10)
    second = gc.collect(store, grace=0, now=time.time() + 20)
    assert second.quarantined and second.quarantined[0].startswith(f"{bad_key}: volume vol{'0' * 16} is malformed")
    assert first.quarantined == second.quarantined
    remaining = keys(store, "manifests/") | keys(store, "chunks/")
    assert named <= remaining, "what the malformed index names is kept"
    assert not (doomed - named) & remaining, "the rest of the store is still collected"
    assert any(line.startswith(bad_key) for line in verify_store(store).bad_manifests)


def test_old_chunks_a_young_manifest_reuses_outlive_it_until_its_ref_is_written(store: Store,
                                                                               tmp_path: Path) -> None:
    """An upload imports without a ref (its lease ends), then publishes the ref: a GC between the
    two must not delete the old, long-unreferenced chunks the new manifest reuses, or the ref
    would name a manifest whose chunks are gone."""
    grace = 1.0
    garbage(store, tmp_path, seed=5)  # chunks nothing names
    time.sleep(grace + 0.2)
    gc.collect(store, grace=grace)  # they are candidates now
    time.sleep(grace + 0.2)
    with open(tmp_path / "g5.img", "r+b") as f:  # the same image with its first block changed
        f.write(b"\xff" * 4096)
    young = import_image(store, tmp_path / "g5.img", None).manifest_id  # no ref yet: a moment passes
    report = gc.collect(store, grace=grace)
    store.set_ref("uploaded:v1", young)
    out = tmp_path / "back.img"
    export_image(store, "uploaded:v1", out)
    assert out.read_bytes() == (tmp_path / "g5.img").read_bytes(), report
