"""layerstore/windows.py: the next window is started before the last is settled."""

from __future__ import annotations

from layerstore.windows import one_ahead


def test_each_window_is_yielded_only_after_the_next_one_started() -> None:
    started: list[int] = []
    seen = []
    for window, began in one_ahead([1, 2, 3], lambda w: started.append(w) or w * 10):
        seen.append((window, began, list(started)))
    assert seen == [(1, 10, [1, 2]), (2, 20, [1, 2, 3]), (3, 30, [1, 2, 3])]


def test_no_windows_and_one_window() -> None:
    assert list(one_ahead([], lambda w: w)) == []
    assert list(one_ahead(["a"], str.upper)) == [("a", "A")]


def test_stopping_early_leaves_at_most_one_window_started_unseen() -> None:
    started: list[int] = []
    for window, _ in one_ahead(range(100), started.append):
        if window == 4:
            break
    assert started == [0, 1, 2, 3, 4, 5]
