"""Sandbox lifetimes: what happens when a sandbox's time is up.

A running sandbox past its end time is paused (E2B's autoPause: a snapshot
to the store, the VM freed) or killed; a paused one past
`paused_retention` is removed with its snapshot's last user. Warm-pool
sandboxes have no lifetime. The node's reaper thread calls `reap` once a
second, which plans (`due`) and hands each action to a few worker threads;
a failure on one sandbox is logged and counted, and the others are still
reaped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from layerstore.config import NodeConfig
from vmm.sandbox import Sandboxes

from .cluster import Membership
from .pools import POOL

log = logging.getLogger("strata.api")


class Lifetimes:
    def __init__(self, config: NodeConfig, boxes: Sandboxes, cluster: Membership, *,
                 quietly: Callable[..., None], workers: int = 4) -> None:
        """`quietly(action, sid)` runs an action on one sandbox, logging and
        counting its failure (Metrics.quietly): the others are still reaped.
        Actions run on `workers` threads: one sandbox's pause (a snapshot to
        the store, seconds or minutes) holds back no other's timeout."""
        self._config = config
        self._boxes = boxes
        self._cluster = cluster
        self._try = quietly
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="strata-reaper")
        self._busy: set[str] = set()  # sandboxes an action is running or queued for
        self._idle = threading.Condition()

    def due(self, now: float) -> list[tuple[str, str]]:
        """(sandbox, "paused" | "killed" | "reclaimed") for each whose lifetime says so at `now`."""
        due = []
        for record in self._boxes.records():
            if record.kind == POOL:
                continue
            if record.state == "suspended":
                if record.suspended_at is not None and now - record.suspended_at > self._config.paused_retention:
                    due.append((record.sid, "reclaimed"))
            elif record.end_at is not None and now >= record.end_at:
                due.append((record.sid, "paused" if record.auto_pause else "killed"))
        return due

    def reap(self, now: float) -> list[tuple[str, str]]:
        """Start what `due(now)` says on the workers, but for a sandbox one is
        still acting on; returns what was started."""
        started = []
        for sid, action in self.due(now):
            with self._idle:
                if sid in self._busy:
                    continue
                self._busy.add(sid)
            self._pool.submit(self._act, sid, action)
            started.append((sid, action))
        return started

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every started action ended within `timeout` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy, timeout)

    def close(self) -> None:
        """Wait for the running actions; start no more."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _act(self, sid: str, action: str) -> None:
        try:
            if action == "paused":
                self._try(self._boxes.suspend, sid)
                self._cluster.paused(sid)
            else:
                self._try(self._boxes.kill, sid)
            log.info("sandbox %s: timeout reached, %s", sid, action)
            if action != "paused":
                self._cluster.unplaced(sid)
        finally:
            with self._idle:
                self._busy.discard(sid)
                self._idle.notify_all()
