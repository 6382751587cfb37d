"""Warm pools: per configured template (config `warm_pool`), sandboxes
restored ahead of demand and left with their vCPUs paused, so a create of
that template only continues one (pool hits in the metrics).

A pool sandbox's record has kind POOL (and the pool's template) until a
create takes it; it is never listed, never counted against a team, and the
reaper leaves it alone. A template that fails to start is retried every RETRY seconds,
not in a loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from layerstore.errors import StrataError
from vmm.registry import SANDBOX, SandboxRecord
from vmm.sandbox import Sandboxes

log = logging.getLogger("strata.api")
POOL = "pool"  # the record kind of a warm pool's sandbox
LEGACY_POOL_KEY = "strata.pool"  # how records written before kinds marked one (in their metadata)
RETRY = 30.0  # seconds before a pool whose template failed to start is tried again


class WarmPools:
    def __init__(self, sizes: dict[str, int], boxes: Sandboxes, start: Callable[[str], SandboxRecord], *,
                 failed: Callable[[StrataError], None] = lambda exc: None) -> None:
        """`start(template)` starts one running sandbox of `template` of
        kind POOL; `failed` hears of each start that failed."""
        self._sizes = sizes
        self._boxes = boxes
        self._start = start
        self._failed = failed
        self._lock = threading.Lock()
        self._retry: dict[str, float] = {}  # template -> monotonic time of the next fill attempt

    def members(self, template: str) -> list[SandboxRecord]:
        return [r for r in self._boxes.records() if r.kind == POOL and r.template == template]

    def fill(self, stop: threading.Event | None = None) -> int:
        """Top every configured pool up to its size; returns sandboxes added."""
        added = 0
        for template, size in self._sizes.items():
            if self._retry.get(template, 0.0) > time.monotonic():
                continue  # failed recently (e.g. the template does not exist yet): don't spin
            while not (stop is not None and stop.is_set()) and len(self.members(template)) < size:
                try:
                    self._boxes.pause(self._start(template).sid)
                    added += 1
                except StrataError as exc:
                    log.error("warm pool %s: %s (retrying in %.0f s)", template, exc, RETRY)
                    self._failed(exc)
                    self._retry[template] = time.monotonic() + RETRY
                    break
        return added

    def take(self, template: str) -> SandboxRecord | None:
        """A pooled sandbox of `template` (vCPUs still paused), no longer
        marked as the pool's; None if the pool has none ready."""
        if template not in self._sizes:
            return None
        with self._lock:
            for record in self.members(template):
                if record.state == "paused" and self._boxes.alive(record.sid):
                    return self._boxes.update(record.sid, kind=SANDBOX)
        return None

    def run(self, stop: threading.Event, *, every: float = 2.0) -> None:
        """Keep the pools full until `stop` (the node's pool thread)."""
        while not stop.is_set():
            self.fill(stop)
            stop.wait(every)
