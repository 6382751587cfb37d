"""vmm/registry.py: sandbox records survive processes, refuse path tricks, tolerate old fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerstore.errors import CorruptObject, InvalidInput, NotFound
from vmm.registry import RECORD, Registry, SandboxRecord, new_sid


def test_records_round_trip_and_list_oldest_first(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    a = SandboxRecord("a1", "qemu", "image:x:v1", 256, created=10.0, metadata={"k": "v"})
    b = SandboxRecord(new_sid(), "qemu", "snapshot:" + "0" * 64, 128, created=5.0, end_at=99.0, auto_pause=True)
    reg.save(a)
    reg.save(b)
    assert Registry(tmp_path).load("a1") == a  # a fresh process sees the same record
    assert [r.sid for r in reg.all()] == [b.sid, "a1"]
    reg.remove("a1")
    assert not reg.exists("a1") and [r.sid for r in reg.all()] == [b.sid]
    with pytest.raises(NotFound):
        reg.load("a1")


def test_bad_ids_torn_and_foreign_records(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    for sid in ("../x", ".hidden", "a/b", "", "x" * 65):
        with pytest.raises(InvalidInput):
            reg.workdir(sid)
    reg.save(SandboxRecord("ok", "qemu", "image:x:v1", 256))
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / RECORD).write_text('{"sid": "torn", "back')
    (tmp_path / "stray-file").write_text("not a sandbox")
    old = json.loads((tmp_path / "ok" / RECORD).read_text())
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / RECORD).write_text(json.dumps({**old, "sid": "old", "last_memory": "gone-field"}))
    assert sorted(r.sid for r in reg.all()) == ["ok", "old"]  # the torn one is skipped, the old one read
    with pytest.raises(CorruptObject, match="unreadable"):
        reg.load("torn")
