"""Warm pools (api/pools.py) without VMs: filled to their size and no
further, a template that fails to start waits RETRY seconds instead of
spinning, `take` hands out only a paused live member and unmarks it, and
other templates and kinds are never taken. Pool hits through real VMs are
tested end to end (tests/test_api.py test_warm_pool)."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest

from api import pools
from api.pools import POOL, WarmPools
from layerstore.errors import NotFound
from vmm.registry import SANDBOX, SandboxRecord


class Boxes:
    """What WarmPools asks of vmm.Sandboxes: records, pause, alive, update."""

    def __init__(self) -> None:
        self.held: dict[str, SandboxRecord] = {}
        self.dead: set[str] = set()

    def records(self) -> list[SandboxRecord]:
        return list(self.held.values())

    def pause(self, sid: str) -> None:
        self.held[sid] = dataclasses.replace(self.held[sid], state="paused")

    def alive(self, sid: str) -> bool:
        return sid not in self.dead

    def update(self, sid: str, **changes: object) -> SandboxRecord:
        self.held[sid] = dataclasses.replace(self.held[sid], **changes)
        return self.held[sid]


class Starter:
    """start(template): a running sandbox of kind POOL, or NotFound for templates it cannot start."""

    def __init__(self, boxes: Boxes) -> None:
        self.boxes, self.calls, self.ids = boxes, [], itertools.count()

    def __call__(self, template: str) -> SandboxRecord:
        self.calls.append(template)
        if template == "missing":
            raise NotFound("template missing not found")
        record = SandboxRecord(sid=f"sb{next(self.ids)}", backend="qemu", source="image:guest:v1", memory_mib=256,
                               template=template, kind=POOL)
        self.boxes.held[record.sid] = record
        return record


def test_pools_fill_to_their_size_and_no_further() -> None:
    boxes = Boxes()
    start = Starter(boxes)
    warm = WarmPools({"base": 2, "other": 1}, boxes, start)
    assert warm.fill() == 3 and warm.fill() == 0
    assert sorted(start.calls) == ["base", "base", "other"]
    assert all(r.state == "paused" and r.kind == POOL for r in boxes.records())


def test_a_template_that_fails_waits_before_it_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    boxes, failures = Boxes(), []
    start = Starter(boxes)
    warm = WarmPools({"missing": 2}, boxes, start, failed=failures.append)
    clock = [100.0]
    monkeypatch.setattr(pools.time, "monotonic", lambda: clock[0])
    assert warm.fill() == 0 and warm.fill() == 0
    assert start.calls == ["missing"] and len(failures) == 1  # one try, then it waits
    clock[0] += pools.RETRY + 1
    warm.fill()
    assert start.calls == ["missing", "missing"]


def test_take_hands_out_a_paused_live_member_once() -> None:
    boxes = Boxes()
    warm = WarmPools({"base": 2}, boxes, Starter(boxes))
    warm.fill()
    first, second = sorted(boxes.held)
    boxes.dead.add(first)  # its VM died: not handed out
    taken = warm.take("base")
    assert taken is not None and taken.sid == second and taken.kind == SANDBOX
    assert warm.take("base") is None  # the only live one is gone from the pool
    assert warm.take("other") is None  # no such pool
    assert [r.sid for r in warm.members("base")] == [first]


def test_fill_stops_when_told() -> None:
    boxes = Boxes()
    stop = threading.Event()
    stop.set()
    assert WarmPools({"base": 3}, boxes, Starter(boxes)).fill(stop) == 0 and boxes.held == {}
