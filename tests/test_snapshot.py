"""Snapshot manifests: canonical, verified, published only when complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerstore.digest import digest_bytes
from layerstore.errors import CorruptObject, InvalidInput, NotFound
from layerstore.importer import import_image
from layerstore.snapshot import Snapshot, parse_snapshot, snapshot_key
from layerstore.store import Store
from layerstore.verify import verify_store
from tests.images import write_image


def _layers(store: Store, tmp_path: Path) -> dict[str, str]:
    ids = {}
    for i, role in enumerate(("disk", "memory", "state", "kernel", "initrd")):
        write_image(tmp_path / f"{role}.img", "rz", seed=i)
        ids[role] = import_image(store, tmp_path / f"{role}.img").manifest_id
    return ids


def _snap(ids: dict[str, str], parent: str | None = None) -> Snapshot:
    return Snapshot(
        layers={"disk": ids["disk"], "memory": ids["memory"], "state": ids["state"]},
        vm={"backend": "qemu", "cmdline": "console=ttyS0", "cpus": 1, "memory_mib": 256,
            "kernel": ids["kernel"], "initrd": ids["initrd"]},
        parent=parent,
        annotations={"sandbox": "sb1"},
    )


def test_publish_load_chain_and_verify(store: Store, tmp_path: Path) -> None:
    ids = _layers(store, tmp_path)
    first = store.put_snapshot(_snap(ids))
    second = store.put_snapshot(_snap(ids, parent=first))
    assert store.get_snapshot(second).parent == first
    assert store.get_snapshot(first) == _snap(ids)
    assert store.list_snapshots() == sorted([first, second])
    assert verify_store(store).ok


def test_incomplete_snapshots_are_refused(store: Store, tmp_path: Path) -> None:
    ids = _layers(store, tmp_path)
    with pytest.raises(NotFound, match="layer manifest"):
        store.put_snapshot(_snap({**ids, "memory": "ab" * 32}))
    with pytest.raises(NotFound, match="parent snapshot"):
        store.put_snapshot(_snap(ids, parent="cd" * 32))
    assert store.list_snapshots() == []
    with pytest.raises(NotFound):
        store.get_snapshot("ef" * 32)


def test_bad_snapshots_do_not_encode() -> None:
    good = {"disk": "11" * 32, "memory": "22" * 32, "state": "33" * 32, "kernel": "44" * 32, "initrd": "55" * 32}
    bad_cases = [
        Snapshot(layers={"disk": good["disk"]}, vm=_snap(good).vm),
        Snapshot(layers=_snap(good).layers, vm={**_snap(good).vm, "cpus": 0}),
        Snapshot(layers=_snap(good).layers, vm={**_snap(good).vm, "kernel": "../x"}),
        Snapshot(layers=_snap(good).layers, vm={**_snap(good).vm, "extra": 1}),
        Snapshot(layers=_snap(good).layers, vm=_snap(good).vm, parent="nope"),
    ]
    for snap in bad_cases:
        with pytest.raises(InvalidInput):
            snap.encode()


def test_corrupt_or_tampered_snapshot_is_refused_and_reported(store: Store, tmp_path: Path) -> None:
    ids = _layers(store, tmp_path)
    snapshot_id = store.put_snapshot(_snap(ids))
    blob = store.backend.get(snapshot_key(snapshot_id))
    tampered = blob.replace(b'"memory_mib":256', b'"memory_mib":512')
    store.backend.put(snapshot_key(snapshot_id), tampered)
    with pytest.raises(CorruptObject, match="hashes to"):
        store.get_snapshot(snapshot_id)
    report = verify_store(store)
    assert not report.ok and any(snapshot_id in m for m in report.bad_manifests)
    body = json.loads(blob)
    body["extra"] = True
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptObject, match="unknown fields"):
        parse_snapshot(digest_bytes(raw), raw)


def test_snapshot_naming_deleted_layer_is_reported(store: Store, tmp_path: Path) -> None:
    ids = _layers(store, tmp_path)
    snapshot_id = store.put_snapshot(_snap(ids))
    store.backend.delete(f"manifests/{ids['memory']}")
    report = verify_store(store)
    assert any(snapshot_id in m and ids["memory"] in m for m in report.bad_manifests)
