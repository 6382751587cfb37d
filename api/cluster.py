"""This node among the others that share its store: its record (heartbeat),
where its sandboxes are (placements), and paused sandboxes moving between
nodes.

Gateways place creates by the records nodes publish every third of
`node_ttl` (`about()`: where to reach the node, how full it is, its pools,
the templates it runs, each team's count for cluster-wide quotas). A
paused sandbox's record goes to the store with its placement, so any node
may wake it when its own is gone; a conditional claim decides who wins
(vmm/placement.py). GC of a store keeps what this node's sandboxes sit on
(`roots()`, in the record).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from layerstore.config import NodeConfig
from layerstore.errors import Conflict, NotFound, StrataError
from layerstore.nodes import Heartbeat, read_nodes
from layerstore.reach import Name
from layerstore.store import Store, open_node_backend
from vmm import placement
from vmm.registry import SandboxRecord, record_of
from vmm.sandbox import Sandboxes

from .builds import BUILD
from .pools import POOL

log = logging.getLogger("strata.api")
TEAMS_TTL = 2.0  # seconds other nodes' team counts are reused for quota checks


class Membership:
    """This node's part in the cluster (api/gateway.py's `Cluster` is the
    gateway's view of all the nodes)."""

    def __init__(self, config: NodeConfig, store: Store, boxes: Sandboxes, *, node_id: str,
                 quietly: Callable[..., None]) -> None:
        """`quietly(action, *args)` runs background work whose failure is logged, not raised (Metrics.quietly)."""
        self._config = config
        self._quietly = quietly
        self._store = store
        self._boxes = boxes
        self.node_id = node_id
        self._heartbeat: Heartbeat | None = None
        self._lock = threading.Lock()
        self._elsewhere: tuple[float, dict[str, int]] = (-TEAMS_TTL, {})  # (read at, team -> sandboxes elsewhere)

    def start(self) -> None:
        """Publish this node's record now and every third of `node_ttl`."""
        self._heartbeat = Heartbeat(self._record_backends(), self.node_id, self.roots, about=self.about,
                                    ttl=self._config.node_ttl)
        self._heartbeat.start()

    def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()  # the record stays: VMs outlive the service (GC sees it go stale)

    def _record_backends(self) -> list:
        """Where this node publishes its record: its store, and its remote (whose GC must keep
        what it pulled manifests-only)."""
        backends = [self._store.backend]
        c = self._config
        if c.remote and c.remote != c.store:
            backends.append(open_node_backend(c, c.remote))
        return backends

    # placements ----------------------------------------------------------------------------
    def placed(self, sid: str) -> None:
        """Tell gateways: the placement record, and a fresh node record soon (one place fewer)."""
        placement.place(self._store.backend, sid, self.node_id)
        self.nudge()

    def unplaced(self, sid: str) -> None:
        placement.unplace(self._store.backend, sid, holder=self.node_id)
        self.nudge()

    def nudge(self) -> None:
        """A fresh node record soon: what gateways place by changed."""
        if self._heartbeat is not None:
            self._heartbeat.nudge()

    def paused(self, sid: str) -> None:
        """Publish a paused sandbox's record with its placement: any node may wake it (`claim_other`)."""
        try:
            record = asdict(self._boxes.record(sid))
        except StrataError:
            return
        placement.place(self._store.backend, sid, self.node_id, record=record)

    def claim_own(self, sid: str) -> bool:
        """Before waking one of this node's paused sandboxes: make sure no other node took it
        over (if one did, this node forgets it: NotFound), and say in the store that it is
        waking here, so none takes it from now on. False if the store has no placement."""
        seen = placement.read(self._store.backend, sid)
        if seen is None:
            return False  # created before placements, or the store lost it: nothing to claim
        if seen.node != self.node_id:
            self._boxes.forget(sid)
            raise NotFound(f"sandbox {sid} was taken over by node {seen.node}")
        if seen.record is not None and not placement.claim(self._store.backend, sid, self.node_id, seen):
            raise Conflict(f"sandbox {sid} changed hands while waking: try again")
        return True

    def paused_elsewhere(self, sid: str) -> tuple[placement.Placement, SandboxRecord]:
        """The placement and record of a sandbox another node paused to the
        store (NotFound if there is none: unknown, running, or this node's)."""
        seen = placement.read(self._store.backend, sid)
        if seen is None or seen.node == self.node_id or seen.record is None:
            raise NotFound(f"sandbox {sid} not found on this node (only a paused sandbox moves between nodes)")
        return seen, record_of(seen.record)

    def claim_other(self, sid: str, seen: placement.Placement) -> None:
        """Take the paused sandbox `seen` over from its node: Conflict if another node claimed it first."""
        if not placement.claim(self._store.backend, sid, self.node_id, seen, record=seen.record):
            raise Conflict(f"sandbox {sid} is being taken over by another node")
        log.info("sandbox %s: taking it over from node %s, which is gone", sid, seen.node)

    def still_ours(self, record: SandboxRecord, *, publish: bool = True) -> None:
        """A paused sandbox another node took over is forgotten here; at start
        (`publish`), one the store has no record of is published. A store
        that fails is logged: the next check asks again."""
        try:
            seen = placement.read(self._store.backend, record.sid)
        except StrataError as exc:
            log.error("sandbox %s: reading its placement: %s", record.sid, exc)
            return
        if seen is not None and seen.node != self.node_id:
            log.warning("sandbox %s: taken over by node %s; forgetting it here", record.sid, seen.node)
            self._quietly(self._boxes.forget, record.sid)
        elif publish and (seen is None or seen.record is None):
            self.paused(record.sid)

    def forget_moved(self) -> None:
        """Forget the paused sandboxes other nodes took over (every 30 s, from the reaper)."""
        for record in self._boxes.records():
            if record.state == "suspended" and record.kind != POOL:
                self.still_ours(record, publish=False)

    # what the record says ------------------------------------------------------------------
    def about(self) -> dict:
        """What this node's record tells gateways (layerstore/nodes.py): where
        to reach it, how full it is, its warm pools and the templates its
        sandboxes run (their chunks are in its cache)."""
        held = 0
        pools: dict[str, int] = {}
        templates: dict[str, int] = {}
        teams: dict[str, int] = {}  # sandboxes each team holds here, builds' too: quotas count the cluster's
        for r in self._boxes.records():
            if r.kind == POOL:
                pools[r.template] = pools.get(r.template, 0) + 1
                continue
            teams[r.team] = teams.get(r.team, 0) + 1
            if r.kind != BUILD:
                held += 1
                templates[r.template] = templates.get(r.template, 0) + 1
        return {"url": self.url, "max": self._config.max_sandboxes, "held": held, "pools": pools,
                "templates": templates, "teams": teams}

    def held_elsewhere(self, team: str) -> int:
        """Sandboxes `team` holds on the other live nodes of this store, as
        their records said at most TEAMS_TTL seconds ago: a team's quota is
        the cluster's, not each node's. A store that fails counts nothing
        (the quota is then per node until it answers)."""
        with self._lock:
            read_at, counts = self._elsewhere
        if time.monotonic() - read_at > TEAMS_TTL:
            counts = {}
            try:
                for view in read_nodes(self._store.backend):
                    if view.live and view.node != self.node_id:
                        for name, n in (view.about.get("teams") or {}).items():
                            counts[str(name)] = counts.get(str(name), 0) + (n if isinstance(n, int) else 0)
            except StrataError as exc:
                log.warning("reading other nodes' records for team quotas: %s", exc)
            with self._lock:
                self._elsewhere = (time.monotonic(), counts)
        return counts.get(team, 0)

    def roots(self) -> list[Name]:
        """What GC of a store this node uses must keep for it beyond the
        store's refs, templates and snapshots: the layers its sandboxes'
        disks and RAM sit on, the snapshots its paused sandboxes wake from,
        and, when it has a remote, the images in its own store (pulled
        manifests-only, their chunks live in the remote; a store's own refs
        are its GC's roots already, and naming them here too would keep a
        removed image until this node's next beat)."""
        names = [Name("layer", m) for m in self._boxes.client.disk_layers()]
        names += [Name("snapshot", s) for s in self._boxes.snapshot_users()]  # paused sandboxes wake from
        if self._config.remote and self._config.remote != self._config.store:
            names += [Name("layer", manifest) for _ref, manifest, _updated in self._store.list_refs()]
        return names

    @property
    def url(self) -> str:
        """Where other nodes and gateways reach this node: config advertise_url, or
        http://HOST:PORT (the host name when listening on every address)."""
        if self._config.advertise_url:
            return self._config.advertise_url
        host = self._config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"http://{f'[{host}]' if ':' in host else host}:{self._config.port}"
