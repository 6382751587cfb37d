"""Sandbox lifetimes: what happens when a sandbox's time is up.

A running sandbox past its end time is paused (E2B's autoPause: a snapshot
to the store, the VM freed) or killed; a paused one past
`paused_retention` is removed with its snapshot's last user. Warm-pool
sandboxes have no lifetime. The node's reaper thread calls `reap` once a
second; a failure on one sandbox is logged and counted, and the others are
still reaped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from layerstore.config import NodeConfig
from vmm.sandbox import Sandboxes

from .cluster import Membership
from .pools import POOL

log = logging.getLogger("strata.api")


class Lifetimes:
    def __init__(self, config: NodeConfig, boxes: Sandboxes, cluster: Membership, *,
                 quietly: Callable[..., None]) -> None:
        """`quietly(action, sid)` runs an action on one sandbox, logging and
        counting its failure (Metrics.quietly): the others are still reaped."""
        self._config = config
        self._boxes = boxes
        self._cluster = cluster
        self._try = quietly

    def reap(self, now: float) -> list[tuple[str, str]]:
        """Apply lifetimes at time `now`; (sandbox, "paused" | "killed" | "reclaimed") for each acted on."""
        done = []
        for record in self._boxes.records():
            if record.kind == POOL:
                continue
            if record.state == "suspended":
                if record.suspended_at is not None and now - record.suspended_at > self._config.paused_retention:
                    self._try(self._boxes.kill, record.sid)
                    done.append((record.sid, "reclaimed"))
            elif record.end_at is not None and now >= record.end_at:
                if record.auto_pause:
                    self._try(self._boxes.suspend, record.sid)
                    self._cluster.paused(record.sid)
                    done.append((record.sid, "paused"))
                else:
                    self._try(self._boxes.kill, record.sid)
                    done.append((record.sid, "killed"))
        for sid, action in done:
            log.info("sandbox %s: timeout reached, %s", sid, action)
            if action != "paused":
                self._cluster.unplaced(sid)
        return done
