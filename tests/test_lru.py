"""The bounded map (layerstore/lru.py) the fetcher, packs and parsed manifests use."""

from __future__ import annotations

from layerstore.lru import Lru


def test_the_least_recently_used_go_first_once_the_weights_pass_the_capacity() -> None:
    lru: Lru[bytes] = Lru(10, len)
    lru.put("a", b"aaaa")
    lru.put("b", b"bbbb")
    assert lru.get("a") == b"aaaa"  # a is now the most recent
    lru.put("c", b"cccc")  # 12 > 10: b, the least recent, goes
    assert lru.get("b") is None and lru.get("a") == b"aaaa" and lru.get("c") == b"cccc"
    lru.put("big", b"x" * 11)  # heavier than the whole capacity: not kept, nothing evicted
    assert lru.get("big") is None and len(lru) == 2
    lru.put("a", b"other")  # a key names one value: the first stays
    assert lru.get("a") == b"aaaa"
    lru.pop("a")
    lru.put("d", b"dddddd")  # room again after the pop: 4 + 6
    assert lru.get("c") == b"cccc" and lru.get("d") == b"dddddd"
    lru.clear()
    assert len(lru) == 0 and lru.get("c") is None
    lru.put("e", b"e" * 10)
    assert lru.get("e") == b"e" * 10


def test_a_look_at_what_is_held_does_not_make_it_recent() -> None:
    lru: Lru[bytes] = Lru(10, len)
    lru.put("a", b"aaaa")
    lru.put("b", b"bbbb")
    assert "a" in lru and "c" not in lru
    lru.put("c", b"cccc")  # "a" is still the oldest: the look above did not move it
    assert "a" not in lru and "b" in lru and "c" in lru
