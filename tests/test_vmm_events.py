"""vmm/events.py: a sandbox's event log is bounded, its lines whole under
concurrent writers, its reader filters and skips what does not parse, and a
failing disk never fails the operation being logged."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from vmm.events import LOG, append, read


def test_events_read_back_filtered_and_limited(tmp_path: Path) -> None:
    append(tmp_path, "info", "booted", image="guest:v1", memory=256)
    append(tmp_path, "warn", "slow")
    events = read(tmp_path)
    assert [(e.level, e.message) for e in events] == [("info", "booted"), ("warn", "slow")]
    assert events[0].fields == {"image": "guest:v1", "memory": "256"}
    assert [e.message for e in read(tmp_path, since=events[1].t)] == ["slow"]
    assert [e.message for e in read(tmp_path, limit=1)] == ["slow"]  # the newest
    assert read(tmp_path, limit=0) == []
    with pytest.raises(AssertionError):
        append(tmp_path, "fatal", "not a level")


def test_the_log_is_bounded_at_twice_its_limit(tmp_path: Path) -> None:
    for i in range(2000):
        append(tmp_path, "info", f"process {i} started", limit=16 << 10)
    sizes = [p.stat().st_size for p in tmp_path.iterdir()]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOG, LOG + ".1"]
    assert all(size <= 16 << 10 for size in sizes)
    messages = [e.message for e in read(tmp_path, limit=100_000)]
    assert messages[-1] == "process 1999 started" and len(messages) < 2000
    numbers = [int(m.split()[1]) for m in messages]
    assert numbers == sorted(numbers) and numbers == list(range(numbers[0], 2000))  # no gap, no repeat


def test_concurrent_writers_interleave_whole_lines(tmp_path: Path) -> None:
    def write(who: int) -> None:
        for i in range(300):
            append(tmp_path, "debug", f"{who}:{i}", limit=16 << 20, payload="x" * 500)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (tmp_path / LOG).read_text().splitlines()
    assert len(lines) == 8 * 300
    assert all(json.loads(line)["fields"]["payload"] == "x" * 500 for line in lines)


def test_hostile_lines_are_skipped(tmp_path: Path) -> None:
    append(tmp_path, "info", "real")
    with open(tmp_path / LOG, "a") as f:
        f.write('not json\n{"t": "soon", "level": "info", "message": "m"}\n[1, 2]\n'
                '{"t": 1, "level": "shout", "message": "m"}\n{"t": 2, "level": "info"}\n'
                '{"t": 3, "level": "info", "message": "ok", "fields": "notadict"}\n\xff\xfe\n')
    assert [e.message for e in read(tmp_path)] == ["real"]


def test_a_failing_disk_never_raises(tmp_path: Path) -> None:
    gone = tmp_path / "removed-workdir"
    append(gone, "info", "lost")  # no directory: nothing written, nothing raised
    assert read(gone) == []
    (tmp_path / LOG).mkdir()  # the log's name taken by a directory
    append(tmp_path, "info", "lost too")
    assert os.path.isdir(tmp_path / LOG)
