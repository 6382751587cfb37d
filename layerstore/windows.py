"""Work in windows, the next one always started before the last is settled.

An import hashes chunks and an export fetches them a window at a time (a
window bounds memory). Settling a window (waiting for it, then checking,
queueing uploads or starting writeback) left the pool idle until the next
window was submitted; with the next window already running, the pool never
waits for the caller. Memory then holds two windows instead of one.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

W = TypeVar("W")
S = TypeVar("S")


def one_ahead(windows: Iterable[W], start: Callable[[W], S]) -> Iterator[tuple[W, S]]:
    """Each window with what `start` began for it, yielded once the next
    window has been started too (the last one when there is no next).
    A caller that stops early leaves at most one window started unseen."""
    pending: tuple[W, S] | None = None
    for window in windows:
        started = (window, start(window))
        if pending is not None:
            yield pending
        pending = started
    if pending is not None:
        yield pending
