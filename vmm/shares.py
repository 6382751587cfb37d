"""Shares of a bounded resource, counted per key: the resolver's queries and
the domain gate's connections per sandbox (vmm/resolver.py,
vmm/domain_gate.py), the API's long requests per team (api/limits.py).

One sandbox or team must not take what the others need, so each holder has
a cap of its own and all of them together one more; the check and the count
happen under one lock, so concurrent takers cannot overshoot either."""

from __future__ import annotations

import threading
from collections import Counter


class Shares:
    """How many each key holds; `take` before the work, `give` after it."""

    def __init__(self) -> None:
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, key: str, *, each: int | None = None, total: int | None = None) -> tuple[int, int] | None:
        """One more for `key` unless it holds `each` already or all keys
        together hold `total` (None: no such cap). None if taken; refused,
        what `key` and all keys held then, so the caller can say which cap."""
        with self._lock:
            held, together = self._held[key], sum(self._held.values())
            if (each is not None and held >= each) or (total is not None and together >= total):
                return held, together
            self._held[key] = held + 1
        return None

    def give(self, key: str) -> None:
        """Give back one of `key`'s."""
        with self._lock:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
