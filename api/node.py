"""One node's API service: its services, each with one job, wired by
api/compose.py, and the background work that keeps them going.

    lifecycle   api/lifecycle.py    create, kill, pause, resume, fork, snapshot,
                                    exec; the node's capacity, each team's quota
    lifetimes   api/lifetimes.py    what happens when a sandbox's time is up
    pools       api/pools.py        warm pools of pre-restored sandboxes
    cluster     api/cluster.py      the node's record, placements, takeovers
    access      api/access.py       data-plane and port tokens
    catalog     api/catalog.py      snapshots, templates, images, chunks
    maintenance api/maintenance.py  GC, push, pull, the hold in the remote
    builds      api/builds.py       template builds
    volumes     api/volumes.py      a team's persistent file trees (E2B's volumes)

Everything persistent is in the sandbox records (vmm/registry.py) and the
store, so a restarted node lists its paused sandboxes and resumes them.
The HTTP layer (api/app.py, api/routes/) calls one action per request; the
listings E2B shows and the mount's cache are answered here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

from fusefs.protocol import MountStats
from layerstore.config import NodeConfig
from layerstore.errors import StrataError
from vmm.domain_gate import DomainGate
from vmm.network import Network
from vmm.registry import SandboxRecord
from vmm.resolver import Resolver
from vmm.sandbox import Sandboxes

from . import listing
from . import models as m
from .access import Access
from .builds import BUILD, LEGACY_BUILD_KEY, Builds
from .catalog import Catalog
from .cluster import Membership
from .exceptions import Capacity
from .lifecycle import Lifecycle
from .lifetimes import Lifetimes
from .maintenance import Maintenance
from .metrics import Metrics
from .pools import LEGACY_POOL_KEY, POOL, WarmPools
from .sources import Source
from .supervisor import MountSupervisor
from .envd import Watchers
from .teams import ADMIN, Caller
from .uploads import reap as reap_uploads
from .volumes import TeamVolumes

log = logging.getLogger("strata.api")
HOLD_EVERY = 600.0  # seconds between rewrites of this node's hold in its remote (deletes shrink it)


__all__ = ["Capacity", "Node", "Source"]  # Source: api/sources.py, Capacity: api/exceptions.py


class Node:
    """The node's services (put together by api/compose.py) and its
    background work: reconcile at start, the reaper, the pool filler and
    the hold rewriter, the network's resolver and gate."""

    def __init__(self, config: NodeConfig, boxes: Sandboxes, metrics: Metrics, *, catalog: Catalog,
                 cluster: Membership, maintenance: Maintenance, supervisor: MountSupervisor, watchers: Watchers,
                 lifetimes: Lifetimes, pools: WarmPools, lifecycle: Lifecycle, access: Access, builds: Builds,
                 volumes: TeamVolumes, hold_stale: threading.Event, network: Network | None = None) -> None:
        """`hold_stale` is set when a name is deleted (the catalog's `deleted`): the hold is rewritten then;
        `network` is the node's sandbox networks (the VMs' too), whose resolver and gate the node runs."""
        self.config = config
        self.store = boxes.store
        self.boxes = boxes
        self.metrics = metrics
        self.catalog, self.cluster, self.maintenance, self.supervisor = catalog, cluster, maintenance, supervisor
        self.watchers, self.lifetimes, self.pools, self.lifecycle = watchers, lifetimes, pools, lifecycle
        self.access, self.builds, self.volumes = access, builds, volumes
        self.node_id = cluster.node_id
        self._hold_stale = hold_stale
        self._network = network
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._resolver: Resolver | None = None
        self._gate: DomainGate | None = None

    # background work ---------------------------------------------------------------
    def start(self) -> None:
        """Reconcile with what survived a restart, then start the reaper and pool threads."""
        self._reap_leftovers()
        network = self._network
        if network is not None:  # before any VM starts: theirs need the node's side
            network.prepare()
        self.cluster.start()
        for sid in self.boxes.finish_interrupted():
            log.warning("sandbox %s: recovered from an operation interrupted by a restart", sid)
        for record in self.boxes.records():
            record = self._with_kind(record)
            if record.kind == BUILD:  # a build the restart interrupted: it is forgotten
                log.info("removing %s, the sandbox of an interrupted template build", record.sid)
                self.metrics.quietly(self.boxes.kill, record.sid)
                continue
            template = record.template if record.kind == POOL else None
            if template is not None and template not in self.config.warm_pool:
                log.info("warm pool %s is no longer configured: removing %s", template, record.sid)
                self.metrics.quietly(self.boxes.kill, record.sid)
                continue
            if record.state in ("running", "paused") and not self.boxes.alive(record.sid):
                self._vm_gone(record)
            elif record.state == "suspended" and template is None:
                self.cluster.still_ours(record)
        if network is not None:
            for sid in self.boxes.reconcile_network():
                log.info("removed the network of sandbox %s, whose VM is gone", sid)
            self._resolver = Resolver(network, port=self.config.network_dns_port, hosts=self.config.network_hosts,
                                      upstream=list(self.config.network_upstream_dns) or None)
            self._resolver.start()
            self._gate = DomainGate(network, self._resolver.lookup, port=self.config.network_gate_port)
            self._gate.start()
        for name, target in (("reaper", self._reaper), ("pooler", partial(self.pools.run, self._stop)),
                             ("holder", self._holder)):
            thread = threading.Thread(target=target, name=f"strata-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _with_kind(self, record: SandboxRecord) -> SandboxRecord:
        """`record` with its kind, from the metadata key a Strata before
        kinds marked a pool's or build's sandbox with (the key then dropped)."""
        legacy = {LEGACY_POOL_KEY: POOL, LEGACY_BUILD_KEY: BUILD}
        found = [key for key in legacy if key in record.metadata]
        if not found:
            return record
        metadata = {k: v for k, v in record.metadata.items() if k not in legacy}
        return self.boxes.update(record.sid, kind=legacy[found[0]], metadata=metadata)

    def _reap_leftovers(self) -> None:
        """Files a killed server or writer left: partial uploads, store temp files."""
        try:
            uploads = reap_uploads(Path(self.config.state_dir) / "uploads") + reap_uploads(self.builds.files)
            tmp = self.store.reap_tmp()
        except (OSError, StrataError) as exc:
            log.error("removing leftover temp files: %s", exc)
            return
        if uploads or tmp:
            log.info("removed %d partial upload(s) and %d store temp file(s) left by a crash", uploads, tmp)

    def _vm_gone(self, record: SandboxRecord) -> None:
        """A sandbox whose VM did not survive (host restart, or this service
        killed between a pause's snapshot and its record): back to its last
        snapshot, paused, if it has one (nothing committed is lost); else removed."""
        if record.last_snapshot is not None:
            log.warning("sandbox %s: its VM is gone; paused at its last snapshot %s", record.sid, record.last_snapshot)
            self.metrics.quietly(self.boxes.back_to_snapshot, record.sid,
                                 "its VM was gone when the node started: paused at its last snapshot")
            self.cluster.paused(record.sid)
            return
        log.warning("sandbox %s: its VM is gone (host restarted?) and it has no snapshot; removing it", record.sid)
        self.metrics.quietly(self.boxes.kill, record.sid)
        self.cluster.unplaced(record.sid)

    def stop(self) -> None:
        self.cluster.stop()
        self._stop.set()
        self._hold_stale.set()  # wakes the holder, which sees the stop
        if self._resolver is not None:
            self._resolver.stop()
        if self._gate is not None:
            self._gate.stop()
        for thread in self._threads:
            thread.join(timeout=30)
        self.lifetimes.close()

    def _reaper(self) -> None:
        moved_check = time.monotonic() + 30
        while not self._stop.wait(1.0):
            if time.monotonic() >= moved_check:
                moved_check = time.monotonic() + 30
                self.cluster.forget_moved()
                self._quietly_os(self.builds.reap_uploads, time.time())
            try:
                self.supervisor.check(time.time())
            except (OSError, StrataError) as exc:  # never let the reaper thread die
                log.error("checking the mount daemon: %s", exc)
            self.lifetimes.reap(time.time())
            try:
                self.boxes.rotate_logs(limit=self.config.console_log_limit)
            except (OSError, StrataError) as exc:  # a full disk, a record being rewritten: next second
                log.error("rotating console logs: %s", exc)

    def _holder(self) -> None:
        """Rewrites the node's hold in its remote at start, after deletes and
        every HOLD_EVERY (commands on this node's store delete too)."""
        while not self._stop.is_set():
            self._hold_stale.clear()
            try:
                self.maintenance.refresh_hold()
            except (OSError, StrataError) as exc:  # a remote down: it keeps more than needed until next time
                log.warning("rewriting this node's hold in its remote: %s", exc)
            self._hold_stale.wait(HOLD_EVERY)

    def _quietly_os(self, action: object, *args: object) -> None:
        """`action(*args)`, an OSError logged (a full or failing disk: next time)."""
        try:
            action(*args)  # type: ignore[operator]
        except OSError as exc:
            log.error("%s: %s", getattr(action, "__name__", action), exc)

    @property
    def domain(self) -> str | None:
        """The domain of sandbox hosts ({port}-{id}.{domain}), None when not configured."""
        return self.config.domain or None

    # what E2B's API shows of sandboxes ------------------------------------------------------
    def _disk_mb(self, record: SandboxRecord) -> int:
        """The sandbox disk's size as the mount shows it (0 once paused: the VM's disk is gone)."""
        if record.state == "suspended":
            return 0
        try:
            return os.stat(self.boxes.paths.sandbox(record.sid)).st_size >> 20
        except OSError:
            return 0

    def list_sandboxes(self, caller: Caller, *, metadata: dict[str, str],
                       states: frozenset[str]) -> list[m.ListedSandbox]:
        """E2B's GET /sandboxes: the caller's selected sandboxes in registry order, unpaged."""
        rows = listing.select(self.lifecycle.records(caller), metadata=metadata, states=states)
        names = self.volumes.names(rows)
        return [m.ListedSandbox.of(r, disk_mb=self._disk_mb(r), volume_names=names) for r in rows]

    def list_sandboxes_page(self, caller: Caller, *, metadata: dict[str, str], states: frozenset[str], order: str,
                            limit: int, token: str | None, started_after: float | None = None,
                            template: str | None = None) -> tuple[list[m.ListedSandbox], str | None]:
        """E2B's GET /v2/sandboxes: one page by start time, and the next page's token."""
        chosen = listing.select(self.lifecycle.records(caller), metadata=metadata, states=states,
                                started_after=started_after, template=template)
        rows, next_token = listing.page(chosen, order=order, limit=limit, token=token)
        names = self.volumes.names(rows)
        return [m.ListedSandbox.of(r, disk_mb=self._disk_mb(r), volume_names=names) for r in rows], next_token

    def sandbox_detail(self, caller: Caller, sid: str) -> m.SandboxDetail:
        record = self.lifecycle.record(sid, caller)
        return m.SandboxDetail.of(record, disk_mb=self._disk_mb(record), address=self.boxes.address(record),
                                  volume_names=self.volumes.names([record]))

    def all_records(self) -> list[dict]:
        """Every sandbox record, warm pool included, as the VMM layer keeps it (for operators)."""
        return self.boxes.list()

    # the mount daemon: health and chunk cache (fusefs.client.MountClient) ------------------------
    def mount_ping(self) -> None:
        self.boxes.client.ping()

    def cache_stats(self) -> MountStats:
        return self.boxes.client.stats()

    def cache_drop(self) -> dict:
        return asdict(self.boxes.client.cache_drop())

    def pin(self, image: str) -> dict:
        return asdict(self.boxes.client.pin(image))

    def unpin(self, image: str) -> dict:
        return asdict(self.boxes.client.unpin(image))

    def cache_summary(self) -> m.CacheStats:
        """The chunk cache's counters, where fetched chunks came from, and memory hits."""
        reply = self.cache_stats()
        return m.CacheStats.model_validate({**reply.counters(), "sources": reply.sources})

    def health(self, caller: Caller = ADMIN) -> m.Health:
        """Degraded when the mount daemon does not answer: sandboxes cannot start or resume."""
        try:
            self.mount_ping()
            mounted = True
        except StrataError:
            mounted = False
        watch = self.supervisor.health
        return m.Health(status="ok" if mounted else "degraded", store=self.store.describe(), mount=mounted,
                        sandboxes=len(self.lifecycle.records(caller)), mount_state=watch.state, mount_restarts=watch.restarts,
                        mount_last_restart=m.timestamp(watch.last_restart) if watch.last_restart else None)
