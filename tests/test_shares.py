"""vmm/shares.py: caps per key and in all, checked and counted as one step."""

from __future__ import annotations

import threading

from vmm.shares import Shares


def test_each_key_and_all_keys_are_capped_and_given_back() -> None:
    s = Shares()
    assert s.take("a", each=2, total=3) is None and s.take("a", each=2, total=3) is None
    assert s.take("a", each=2, total=3) == (2, 2)  # a's own cap
    assert s.take("b", each=2, total=3) is None
    assert s.take("c", each=2, total=3) == (0, 3)  # everyone's
    s.give("a")
    assert s.take("c", each=2, total=3) is None
    assert s.take("d") is None  # no caps: always taken
    for key in ("a", "b", "c", "d"):
        s.give(key)
    assert s.take("a", each=1, total=1) is None  # all given back: nothing left counted


def test_concurrent_takers_never_overshoot() -> None:
    s, taken = Shares(), []
    barrier = threading.Barrier(16)

    def taker(key: str) -> None:
        barrier.wait()
        for _ in range(50):
            if s.take(key, each=10, total=25) is None:
                taken.append(key)

    threads = [threading.Thread(target=taker, args=(f"k{i % 4}",)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 25 and max(taken.count(f"k{i}") for i in range(4)) <= 10
