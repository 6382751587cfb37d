"""A bounded in-memory map, least recently used out first.

What a process keeps of immutable, content-addressed things it read (chunk
bytes in the mount's fetcher, packs and parsed manifests in a Store): a key
always names the same value, so a cached value is never stale, only absent.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

V = TypeVar("V")


class Lru(Generic[V]):
    """Values by key while their weights add up to at most `capacity`
    (one heavier than that is not kept). Thread-safe."""

    def __init__(self, capacity: int, weight: Callable[[V], int]) -> None:
        self.capacity = capacity
        self._weight = weight
        self._values: OrderedDict[str, V] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: str, value: V) -> None:
        weight = self._weight(value)
        if weight > self.capacity:
            return
        with self._lock:
            if key in self._values:
                return
            self._values[key] = value
            self._total += weight
            while self._total > self.capacity:
                _old, dropped = self._values.popitem(last=False)
                self._total -= self._weight(dropped)

    def pop(self, key: str) -> None:
        with self._lock:
            value = self._values.pop(key, None)
            if value is not None:
                self._total -= self._weight(value)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._total = 0

    def __contains__(self, key: str) -> bool:
        """Held now (a look that leaves the order as it is)."""
        with self._lock:
            return key in self._values

    def __len__(self) -> int:
        return len(self._values)
