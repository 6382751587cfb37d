"""The reaper's rules (api/lifetimes.py) without VMs: what is paused, killed
or reclaimed at a given time, what is left alone (warm pools, sandboxes with
time left, a paused one within its retention), and that one sandbox failing
does not stop the others. The VM actions themselves are tested end to end
(tests/test_api.py test_lifetimes); here a small stand-in records them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from api.lifetimes import Lifetimes
from api.pools import POOL
from layerstore.errors import StrataError
from tests.test_catalog import node_config
from vmm.registry import SandboxRecord

NOW = 1_000_000.0


@dataclass
class Boxes:
    """What Lifetimes asks of vmm.Sandboxes: the records, kill and suspend."""
    held: list[SandboxRecord]
    done: list[tuple[str, str]] = field(default_factory=list)
    failing: set[str] = field(default_factory=set)

    def records(self) -> list[SandboxRecord]:
        return list(self.held)

    def kill(self, sid: str) -> None:
        self._act("kill", sid)

    def suspend(self, sid: str) -> None:
        self._act("suspend", sid)

    def _act(self, action: str, sid: str) -> None:
        if sid in self.failing:
            raise StrataError(f"{action} {sid}: the VM is wedged")
        self.done.append((action, sid))


@dataclass
class Cluster:
    """What Lifetimes tells the cluster: paused (still placed here) and unplaced."""
    told: list[tuple[str, str]] = field(default_factory=list)

    def paused(self, sid: str) -> None:
        self.told.append(("paused", sid))

    def unplaced(self, sid: str) -> None:
        self.told.append(("unplaced", sid))


def record(sid: str, **kw: object) -> SandboxRecord:
    return SandboxRecord(sid=sid, backend="qemu", source="image:guest:v1", memory_mib=256, **kw)


def reaper(tmp_path: Path, boxes: Boxes, cluster: Cluster, failures: list) -> Lifetimes:
    config = node_config(tmp_path, STRATA_STORE=str(tmp_path / "store"), STRATA_PAUSED_RETENTION="1h")

    def quietly(action, *args) -> None:  # noqa: ANN001 - Metrics.quietly's shape
        try:
            action(*args)
        except StrataError as exc:
            failures.append(str(exc))

    return Lifetimes(config, boxes, cluster, quietly=quietly)


def test_each_sandbox_gets_what_its_lifetime_says(tmp_path: Path) -> None:
    boxes = Boxes([
        record("sbdue", end_at=NOW - 1),                                  # due, no autoPause: killed
        record("sbnap", end_at=NOW, auto_pause=True),                     # due at exactly now: paused
        record("sblater", end_at=NOW + 60),                               # time left: untouched
        record("sbforever"),                                              # no end: untouched
        record("sbpool", end_at=NOW - 100, kind=POOL),                    # a warm pool's: never reaped
        record("sbold", state="suspended", suspended_at=NOW - 3601),      # past retention: reclaimed
        record("sbrecent", state="suspended", suspended_at=NOW - 3599),   # within it: kept
    ])
    cluster, failures = Cluster(), []
    lifetimes = reaper(tmp_path, boxes, cluster, failures)
    done = lifetimes.reap(NOW)
    assert lifetimes.wait(30)
    assert sorted(done) == [("sbdue", "killed"), ("sbnap", "paused"), ("sbold", "reclaimed")]
    assert sorted(boxes.done) == [("kill", "sbdue"), ("kill", "sbold"), ("suspend", "sbnap")]
    # a paused sandbox stays placed on this node (it wakes here); the removed ones are unplaced
    assert sorted(cluster.told) == [("paused", "sbnap"), ("unplaced", "sbdue"), ("unplaced", "sbold")]
    assert failures == []


def test_one_failure_does_not_stop_the_others(tmp_path: Path) -> None:
    boxes = Boxes([record("sbwedged", end_at=NOW - 1), record("sbfine", end_at=NOW - 1)], failing={"sbwedged"})
    failures: list[str] = []
    lifetimes = reaper(tmp_path, boxes, Cluster(), failures)
    lifetimes.reap(NOW)
    assert lifetimes.wait(30)
    assert boxes.done == [("kill", "sbfine")] and failures == ["kill sbwedged: the VM is wedged"]


@pytest.mark.parametrize("retention", ["0s", "1s"])
def test_retention_is_the_configured_one(tmp_path: Path, retention: str) -> None:
    config = node_config(tmp_path, STRATA_STORE=str(tmp_path / "store"), STRATA_PAUSED_RETENTION=retention)
    boxes = Boxes([record("sbjust", state="suspended", suspended_at=NOW - 0.5)])
    lifetimes = Lifetimes(config, boxes, Cluster(), quietly=lambda action, *args: action(*args))
    lifetimes.reap(NOW)
    assert lifetimes.wait(30)
    assert boxes.done == ([("kill", "sbjust")] if retention == "0s" else [])


def test_a_slow_pause_holds_back_no_other_sandbox_and_runs_once(tmp_path: Path) -> None:
    """A pause is a snapshot to the store: while one takes its time, another sandbox's timeout
    is still applied, and the next reaps do not start the same pause again."""
    import threading

    release = threading.Event()

    class SlowBoxes(Boxes):
        def suspend(self, sid: str) -> None:
            release.wait(30)
            super().suspend(sid)

    boxes = SlowBoxes([record("sbslow", end_at=NOW - 1, auto_pause=True), record("sbdue", end_at=NOW - 1)])
    lifetimes = reaper(tmp_path, boxes, Cluster(), [])
    try:
        assert sorted(lifetimes.reap(NOW)) == [("sbdue", "killed"), ("sbslow", "paused")]
        assert not lifetimes.wait(1)  # the pause is still running...
        assert boxes.done == [("kill", "sbdue")]  # ...and the kill did not wait for it
        assert ("sbslow", "paused") not in lifetimes.reap(NOW + 1)  # still running: not started again
    finally:
        release.set()
        assert lifetimes.wait(30)
        lifetimes.close()
    assert boxes.done.count(("suspend", "sbslow")) == 1
