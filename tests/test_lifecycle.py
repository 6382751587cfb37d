"""api/lifecycle.py without VMs: starts take turns (`max_starting` at once),
and one that finds no turn within its wait is a clear 429 that changes
nothing. Creates, pauses, resumes and forks through real VMs are tested end
to end (tests/test_api.py); bench/starts.py measures why turns pay."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from api.exceptions import Capacity
from api.lifecycle import Lifecycle
from layerstore.config import NodeConfig


def lifecycle(tmp_path: Path, starting: int) -> Lifecycle:
    (tmp_path / "empty.toml").touch()
    config = NodeConfig.load({"STRATA_STATE_DIR": str(tmp_path / "state"), "STRATA_STORE": str(tmp_path / "store"),
                              "STRATA_CONFIG": str(tmp_path / "empty.toml"), "STRATA_MAX_STARTING": str(starting)})
    return Lifecycle(config, None, None, None, catalog=None, cluster=None, pools=None,  # type: ignore[arg-type]
                     watchers=None)


def test_at_most_max_starting_start_at_once(tmp_path: Path) -> None:
    life = lifecycle(tmp_path, 2)
    lock, now, peak = threading.Lock(), [0], [0]

    def start() -> None:
        with life._start_turn():
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
            time.sleep(0.05)
            with lock:
                now[0] -= 1

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 2


def test_a_start_that_gets_no_turn_in_time_is_429_and_frees_nothing(tmp_path: Path) -> None:
    life = lifecycle(tmp_path, 1)
    with life._start_turn():
        with pytest.raises(Capacity, match="1 sandboxes are starting"):
            with life._start_turn(wait=0.1):
                pass
    with life._start_turn(wait=0.1):  # the refused one took no turn, so the turn is free again
        pass
