"""A node's part in the cluster (api/cluster.py Membership) on a real store,
without VMs: what its record tells gateways, a paused sandbox published
and taken over by exactly one other node (the old node then forgets it),
and team counts read from the other live nodes' records. Takeovers through
real nodes are tested end to end (tests/test_multinode.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from api.builds import BUILD
from api.cluster import Membership
from api.pools import POOL
from layerstore.errors import Conflict, NotFound
from layerstore.nodes import publish
from layerstore.store import Store, open_store
from tests.test_catalog import node_config
from vmm import placement
from vmm.registry import SandboxRecord


class Boxes:
    """What Membership asks of vmm.Sandboxes here: records, record, forget."""

    def __init__(self, *records: SandboxRecord) -> None:
        self.held = {r.sid: r for r in records}
        self.forgotten: list[str] = []

    def records(self) -> list[SandboxRecord]:
        return list(self.held.values())

    def record(self, sid: str) -> SandboxRecord:
        if sid not in self.held:
            raise NotFound(f"sandbox {sid} not found")
        return self.held[sid]

    def forget(self, sid: str) -> None:
        self.forgotten.append(sid)
        self.held.pop(sid, None)


def record(sid: str, **kw: object) -> SandboxRecord:
    return SandboxRecord(sid=sid, backend="qemu", source="image:guest:v1", memory_mib=256, **kw)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "store"), create=True)


def member(tmp_path: Path, store: Store, node: str, boxes: Boxes) -> Membership:
    (tmp_path / node).mkdir(exist_ok=True)
    config = node_config(tmp_path / node, STRATA_STORE=str(tmp_path / "store"), STRATA_MAX_SANDBOXES="8",
                         STRATA_ADVERTISE_URL=f"http://{node}.test:8080")
    return Membership(config, store, boxes, node_id=node, quietly=lambda action, *args: action(*args))


def test_the_record_counts_sandboxes_pools_templates_and_teams(tmp_path: Path, store: Store) -> None:
    boxes = Boxes(record("sb1", template="base", team="alpha"), record("sb2", template="base", team="beta"),
                  record("sb3", template="web", team="alpha"), record("sbpool", template="base", kind=POOL),
                  record("sbbuild", template="base", team="alpha", kind=BUILD))
    about = member(tmp_path, store, "node-a", boxes).about()
    assert about == {"url": "http://node-a.test:8080", "max": 8, "held": 3, "pools": {"base": 1},
                     "templates": {"base": 2, "web": 1}, "teams": {"alpha": 3, "beta": 1}}


def test_a_paused_sandbox_is_taken_over_by_one_node_and_forgotten_by_its_own(tmp_path: Path, store: Store) -> None:
    a_boxes = Boxes(record("sbnap", state="suspended", last_snapshot="ab" * 32, team="alpha"))
    a = member(tmp_path, store, "node-a", a_boxes)
    b, c = (member(tmp_path, store, n, Boxes()) for n in ("node-b", "node-c"))
    with pytest.raises(NotFound):
        b.paused_elsewhere("sbnap")  # not published yet
    a.placed("sbnap")
    a.paused("sbnap")
    with pytest.raises(NotFound):
        a.paused_elsewhere("sbnap")  # its own is not "elsewhere"
    seen_b, rec = b.paused_elsewhere("sbnap")
    seen_c, _ = c.paused_elsewhere("sbnap")
    assert rec == a_boxes.held["sbnap"]
    b.claim_other("sbnap", seen_b)
    with pytest.raises(Conflict):
        c.claim_other("sbnap", seen_c)  # it read the placement before b's claim: loses
    assert placement.placed(store.backend, "sbnap") == "node-b"
    with pytest.raises(NotFound, match="taken over by node node-b"):
        a.claim_own("sbnap")
    assert a_boxes.forgotten == ["sbnap"]


def test_claim_own_marks_a_wake_so_no_other_node_takes_it(tmp_path: Path, store: Store) -> None:
    a = member(tmp_path, store, "node-a", Boxes(record("sbnap", state="suspended", team="alpha")))
    b = member(tmp_path, store, "node-b", Boxes())
    assert a.claim_own("sbnap") is False  # no placement: nothing to claim
    a.paused("sbnap")
    seen, _ = b.paused_elsewhere("sbnap")
    assert a.claim_own("sbnap") is True
    with pytest.raises(Conflict):
        b.claim_other("sbnap", seen)


def test_team_counts_come_from_other_live_nodes(tmp_path: Path, store: Store) -> None:
    a = member(tmp_path, store, "node-a", Boxes())
    publish(store.backend, "node-a", [], about={"teams": {"alpha": 50}})  # its own: not "elsewhere"
    publish(store.backend, "node-b", [], about={"teams": {"alpha": 2, "beta": 1}})
    publish(store.backend, "node-c", [], about={"teams": {"alpha": 3, "bogus": "x"}})
    publish(store.backend, "node-dead", [], ttl=0, about={"teams": {"alpha": 100}})  # not live
    assert a.held_elsewhere("alpha") == 5 and a.held_elsewhere("beta") == 1 and a.held_elsewhere("gamma") == 0


def test_a_sandbox_moved_elsewhere_is_forgotten_by_the_periodic_check(tmp_path: Path, store: Store) -> None:
    a_boxes = Boxes(record("sbgone", state="suspended"), record("sbmine", state="suspended"),
                    dataclasses.replace(record("sbrun"), state="running"))
    a = member(tmp_path, store, "node-a", a_boxes)
    for sid in ("sbgone", "sbmine"):
        a.paused(sid)
    b = member(tmp_path, store, "node-b", Boxes())
    b.claim_other("sbgone", b.paused_elsewhere("sbgone")[0])
    a.forget_moved()
    assert a_boxes.forgotten == ["sbgone"] and sorted(a_boxes.held) == ["sbmine", "sbrun"]
