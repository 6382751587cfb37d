"""Placement records (vmm/placement.py): what a gateway routes by and what a
node takes a paused sandbox over with; of nodes claiming one at once, one wins."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vmm import placement
from layerstore.backend import Backend
from layerstore.store import open_store


@pytest.fixture
def backend(tmp_path: Path) -> Backend:
    return open_store(str(tmp_path / "store"), create=True).backend


def test_place_read_and_unplace(backend: Backend) -> None:
    assert placement.read(backend, "sb1") is None
    placement.place(backend, "sb1", "node-a")
    seen = placement.read(backend, "sb1")
    assert seen is not None and seen.node == "node-a" and seen.record is None and seen.version
    placement.place(backend, "sb1", "node-a", record={"sid": "sb1", "state": "suspended"})
    assert placement.read(backend, "sb1").record == {"sid": "sb1", "state": "suspended"}
    assert placement.placed(backend, "sb1") == "node-a"
    placement.unplace(backend, "sb1", holder="node-b")  # a node forgets only what names it
    assert placement.placed(backend, "sb1") == "node-a"
    placement.unplace(backend, "sb1", holder="node-a")
    placement.unplace(backend, "sb1")  # twice is harmless
    assert placement.read(backend, "sb1") is None


def test_bad_ids_and_torn_objects_read_as_nowhere(backend: Backend) -> None:
    for bad in ("../x", "", "a/b", "x" * 65):
        assert placement.read(backend, bad) is None
    backend.put("placements/torn", b"{not json")
    assert placement.read(backend, "torn") is None
    backend.put("placements/evil", b'{"node": "../../etc", "record": null}')
    assert placement.read(backend, "evil") is None


def test_of_nodes_claiming_a_paused_sandbox_at_once_exactly_one_wins(backend: Backend) -> None:
    placement.place(backend, "sb2", "gone", record={"sid": "sb2", "state": "suspended"})
    seen = placement.read(backend, "sb2")
    assert seen is not None
    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda i: placement.claim(backend, "sb2", f"node-{i}", seen, record=seen.record),
                             range(8)))
    assert wins.count(True) == 1
    winner = placement.read(backend, "sb2")
    assert winner.node == f"node-{wins.index(True)}" and winner.record == seen.record
    assert not placement.claim(backend, "sb2", "late", seen)  # what it read is no longer there
