"""A sandbox's life as E2B's API sees it: create (from a template, an
image, or a warm pool), kill, pause (a snapshot to the store, the VM freed),
resume (here, or taking over one another node paused), connect, timeouts,
fork, snapshot, exec, logs and metrics.

Each action checks the caller may see the sandbox (another team's is
unknown), then calls one `vmm.Sandboxes` operation, timed (`vmm`: a
latency histogram and the request's Server-Timing). Creates hold places
(`_capacity`) so concurrent ones cannot overshoot the node's limit or a
team's quota, which counts the team's sandboxes on the other live nodes
too (api/cluster.py).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from layerstore.config import NodeConfig
from layerstore.errors import Conflict, InvalidInput, NotFound
from layerstore.store import Store
from layerstore.volumes import Volumes
from vmm.agent import GuestMetrics
from vmm.egress import Egress
from vmm.events import LEVELS, Event
from vmm.registry import SANDBOX, SandboxRecord, new_sid
from vmm.sandbox import MAX_FORKS, Sandboxes

from .builds import BUILD
from .catalog import Catalog
from .cluster import Membership
from .envd import Watchers, new_token
from .exceptions import Capacity
from .idempotency import Idempotency
from .metrics import Metrics
from .pools import POOL, WarmPools
from .sources import Source
from .sources import resolve as resolve_source
from .teams import ADMIN, Caller, check_quota

RESERVED_METADATA = "strata."  # metadata keys only the node sets (a client's would hide its sandbox)


START_WAIT = 120.0  # seconds a start waits for its turn (max_starting) before 429


class Lifecycle:
    def __init__(self, config: NodeConfig, store: Store, boxes: Sandboxes, metrics: Metrics, *,
                 catalog: Catalog, cluster: Membership, pools: WarmPools, watchers: Watchers) -> None:
        self.config = config
        self.store = store
        self.boxes = boxes
        self.metrics = metrics
        self.catalog = catalog
        self.cluster = cluster
        self.pools = pools
        self.watchers = watchers
        self._vmm_time = threading.local()
        self._capacity_lock = threading.Lock()
        # Starts take turns: on few cores, fifty restores at once are each slower
        # than fifty in turn, four at a time (bench/starts.py).
        self._starting = threading.BoundedSemaphore(config.max_starting)
        self._reserved: dict[str, str] = {}  # ids of sandboxes being created -> their team
        self._once = Idempotency(self.records)

    @contextmanager
    def _start_turn(self, *, wait: float = START_WAIT) -> Iterator[None]:
        """Hold one of the node's `max_starting` places while a VM starts;
        Capacity (429) if none frees within `wait` seconds."""
        if not self._starting.acquire(timeout=wait):
            raise Capacity(f"{self.config.max_starting} sandboxes are starting on this node and more wait: "
                           "try again shortly")
        try:
            yield
        finally:
            self._starting.release()

    @contextmanager
    def vmm(self, op: str) -> Iterator[None]:
        """Time a call into the VMM layer: a latency histogram, and the share
        of this request spent there (the API reports it in Server-Timing)."""
        started = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - started
            self.metrics.lifecycle.labels(op).observe(elapsed)
            self._vmm_time.total = getattr(self._vmm_time, "total", 0.0) + elapsed

    def take_vmm_seconds(self) -> float:
        """VMM time accumulated on this thread since the last call (and reset it).
        The API calls it once before and once after each lifecycle request."""
        total = getattr(self._vmm_time, "total", 0.0)
        self._vmm_time.total = 0.0
        return total

    def _ttl(self, timeout: int | None, *, default: bool = True) -> float | None:
        if timeout is None:
            return self.config.sandbox_timeout if default else None
        if not 1 <= timeout <= self.config.max_timeout:
            raise InvalidInput(f"timeout {timeout} s is outside 1..{int(self.config.max_timeout)} s")
        return float(timeout)

    def source(self, template_id: str, caller: Caller = ADMIN) -> Source:
        """What `template_id` starts, as `caller` may see it (api/sources.py)."""
        return resolve_source(self.store, template_id, caller)

    def record(self, sid: str, caller: Caller = ADMIN) -> SandboxRecord:
        """The client-visible sandbox `sid` (ids that cannot exist, and
        another team's sandboxes, are simply unknown)."""
        try:
            record = self.boxes.record(sid)
        except InvalidInput:
            raise NotFound(f"sandbox {sid!r} not found") from None
        except NotFound:
            raise NotFound(f"sandbox {sid} not found") from None
        if record.kind != SANDBOX:
            raise NotFound(f"sandbox {sid} not found")
        caller.check_sees(record.team, f"sandbox {sid} not found")
        return record

    def records(self, caller: Caller = ADMIN) -> list[SandboxRecord]:
        return [r for r in self.boxes.records()
                if r.kind == SANDBOX and caller.sees(r.team)]

    @contextmanager
    def _capacity(self, sids: list[str], caller: Caller = ADMIN) -> Iterator[None]:
        """Hold places for `sids` while they are created, so concurrent
        creates cannot overshoot the node's limit, or the caller's team's,
        between the check and the record. A build's sandbox holds a place
        like any other (only the warm pool's, which a create takes over, do not)."""
        limited = self.config.team_limit(self.config.team_max_sandboxes, caller.team) is not None
        elsewhere = self.cluster.held_elsewhere(caller.team) if limited else 0
        with self._capacity_lock:
            records = [r for r in self.boxes.records() if r.kind != POOL]
            held = {r.sid for r in records} | set(self._reserved)
            if len(held) + len(sids) > self.config.max_sandboxes:
                raise Capacity(f"this node holds {len(held)} sandboxes; the limit is {self.config.max_sandboxes}")
            team = {r.sid for r in records if r.team == caller.team}
            team |= {sid for sid, owner in self._reserved.items() if owner == caller.team}
            check_quota(self.config, caller, setting="team_max_sandboxes", used=len(team) + elsewhere,
                        adding=len(sids))
            self._reserved.update(dict.fromkeys(sids, caller.team))
        try:
            yield
        finally:
            with self._capacity_lock:
                for sid in sids:
                    self._reserved.pop(sid, None)

    def start_build_sandbox(self, source: Source, *, sid: str, build_id: str, team: str) -> SandboxRecord:
        """A template build's sandbox (never listed), within the node's
        capacity and counted among the team's sandboxes."""
        with self._capacity([sid], Caller(team)):
            return self.start_sandbox(source, sid=sid, metadata={}, timeout=None, auto_pause=False, team=team,
                                      kind=BUILD)

    def start_pooled(self, template: str) -> SandboxRecord:
        return self.start_sandbox(self.source(template), sid=new_sid(), metadata={}, timeout=None, auto_pause=False,
                                  kind=POOL)

    def start_sandbox(self, source: Source, *, sid: str, metadata: dict[str, str], timeout: float | None,
                      auto_pause: bool, team: str = ADMIN.team, env: dict[str, str] | None = None,
                      disk_mb: int | None = None, egress: Egress | None = None,
                      public: bool = True, kind: str = SANDBOX, idempotency: str = "") -> SandboxRecord:
        """Boot or restore `source` as sandbox `sid` with the template's (and
        image's) process defaults and a fresh access token; no capacity check
        (create, the warm pool and template builds do their own)."""
        lifetime = {"kind": kind, "idempotency": idempotency, "template": source.template, "end_at": None if timeout is None else time.time() + timeout,
                    "auto_pause": auto_pause, "team": team, "env": env or {}, "access_token": new_token(),
                    "traffic_token": "" if public else new_token()}
        defaults = source.process  # a built template's ENV/WORKDIR/USER, over an image's config
        if source.kind == "image":  # the image config (an OCI import's) applies to every process
            runtime = self.store.runtime(source.target)
            defaults = {"env": {**runtime.env, **defaults.get("env", {})}, "cwd": defaults.get("cwd") or runtime.cwd,
                        "user": defaults.get("user") or runtime.user}
        lifetime.update(env={**defaults.get("env", {}), **(env or {})}, cwd=defaults.get("cwd", ""),
                        user=defaults.get("user", ""))
        if source.kind != "image" and disk_mb:
            raise InvalidInput("diskSizeMB applies to sandboxes booted from an image, not restored from a snapshot")
        if source.kind == "image":
            if disk_mb:
                lifetime["disk_size"] = disk_mb << 20
            with self._start_turn(), self.vmm("create"):
                return self.boxes.boot(source.target, sid=sid, memory_mib=self.config.sandbox_memory,
                                       metadata=metadata, egress=egress or self.egress(), **lifetime).record

        def check_mounts(mounts: dict[str, str]) -> None:
            self._check_volumes(mounts, team, pooled=kind == POOL)
        with self._start_turn(), self.vmm("create"):
            return self.boxes.restore(source.target, sid=sid, metadata=metadata, egress=egress or self.egress(),
                                      check_mounts=check_mounts, **lifetime).record

    def _check_disk_room(self, disk_mb: int) -> None:
        """InvalidInput if a disk of `disk_mb` MiB could not be filled on
        this node: its writes land in upper layers under the state directory."""
        free = shutil.disk_usage(self.config.state_dir).free
        if disk_mb << 20 > free:
            raise InvalidInput(f"diskSizeMB {disk_mb} is more than this node's free space ({free >> 20} MiB)")

    def egress(self, internet: bool | None = None, allow: list[str] | None = None,
               deny: list[str] | None = None) -> Egress:
        """Validated rules of a new sandbox (InvalidInput names a bad one);
        `internet` defaults to the config's network.internet."""
        if internet is None:
            internet = self.config.network_internet
        return Egress.parse(internet, allow or [], deny or [])

    def set_network(self, caller: Caller, sid: str, *, internet: bool | None, allow: list[str],
                    deny: list[str]) -> SandboxRecord:
        """E2B's network update: allowOut and denyOut are replaced; allow_internet_access if given."""
        record = self.record(sid, caller)
        current = Egress.of(record.network)
        rules = Egress.parse(current.internet if internet is None else internet, allow, deny)
        return self.boxes.set_egress(sid, rules)

    # lifecycle ---------------------------------------------------------------------------
    def create_once(self, caller: Caller, key: str, digest: str, template_id: str,
                    **options: Any) -> tuple[SandboxRecord, bool]:
        """`create` under an Idempotency-Key (api/idempotency.py): the sandbox
        this team's earlier create with `key` made, if any (then True)."""
        return self._once.once(caller.team, key, digest,
                               lambda mark: self.create(caller, template_id, idempotency=mark, **options))

    def create(self, caller: Caller, template_id: str, *, timeout: int | None, auto_pause: bool,
               metadata: dict[str, str], env: dict[str, str] | None = None,
               disk_mb: int | None = None, egress: Egress | None = None, public: bool = True,
               idempotency: str = "", volumes: dict[str, str] | None = None) -> SandboxRecord:
        """A new sandbox of `caller`'s from `template_id`, with `volumes`
        ({guest path: volume id}, the team's: TeamVolumes.mounts) mounted;
        one that cannot mount them is killed, nothing half-made stays."""
        ttl = self._ttl(timeout)
        if any(key.startswith(RESERVED_METADATA) for key in metadata):
            raise InvalidInput(f"metadata keys starting with {RESERVED_METADATA} are reserved")
        source = self.source(template_id, caller)
        if disk_mb:
            self._check_disk_room(disk_mb)
        sid = new_sid()
        with self._capacity([sid], caller):
            pooled = None if disk_mb else self.pools.take(template_id)
            if pooled is not None:
                with self.vmm("create"):
                    self.boxes.resume(pooled.sid)
                self.metrics.pool_hits.inc()
                if egress is not None and pooled.network is not None:
                    self.boxes.set_egress(pooled.sid, egress)
                record = self.boxes.update(pooled.sid, metadata=metadata, template=template_id, team=caller.team,
                                           end_at=time.time() + ttl, auto_pause=auto_pause,  # type: ignore[operator]
                                           env={**pooled.env, **(env or {})}, access_token=new_token(),
                                           traffic_token="" if public else new_token(), idempotency=idempotency)
            else:
                record = self.start_sandbox(source, sid=sid, metadata=metadata, timeout=ttl, auto_pause=auto_pause,
                                            team=caller.team, env=env, disk_mb=disk_mb, egress=egress, public=public,
                                            idempotency=idempotency)
            if volumes:
                record = self._mount(record, volumes)
        self.cluster.placed(record.sid)
        return record

    def _mount(self, record: SandboxRecord, volumes: dict[str, str]) -> SandboxRecord:
        try:
            with self.vmm("mount"):
                return self.boxes.mount_volumes(record.sid, volumes)
        except BaseException:
            with self.vmm("kill"):
                self.boxes.kill(record.sid)
            raise

    def _check_volumes(self, mounts: dict[str, str], team: str, *, pooled: bool) -> None:
        """A snapshot whose guest has volumes mounted restores with them
        served: only for the team that owns them, and while they exist;
        never into a warm pool (any team takes from it)."""
        if mounts and pooled:
            raise InvalidInput("this template has volumes mounted: it is not kept in a warm pool")
        volumes = Volumes(self.store.backend)
        for path, volume_id in mounts.items():
            try:
                owner = volumes.get(volume_id).owner
            except NotFound:
                owner = None
            if owner != team:
                raise InvalidInput(f"this template has a volume mounted at {path} that "
                                   f"{'no longer exists' if owner is None else 'belongs to another team'}: "
                                   "build or snapshot it without the mount")

    def kill(self, caller: Caller, sid: str) -> None:
        self.record(sid, caller)
        with self.vmm("kill"):
            self.boxes.kill(sid)
        self.watchers.drop_sandbox(sid)
        self.cluster.unplaced(sid)

    def pause(self, caller: Caller, sid: str) -> str:
        """E2B's pause: snapshot to the store and free the VM (Conflict if
        already paused). Its record goes to the store too, so any node can
        wake it if this one is gone."""
        record = self.record(sid, caller)
        if record.state == "suspended":
            raise Conflict(f"sandbox {sid} is already paused")
        self.catalog.check_snapshot_quota(Caller(record.team))  # a pause keeps a snapshot (the reaper's does not ask)
        with self.vmm("pause"):
            snapshot_id = self.boxes.suspend(sid)
        self.cluster.paused(sid)
        return snapshot_id

    def resume(self, caller: Caller, sid: str, timeout: int | None) -> SandboxRecord:
        """Wake a paused sandbox: one of this node's, or one whose node is gone (taken over)."""
        try:
            record = self.record(sid, caller)
        except NotFound:
            return self._take_over(caller, sid, timeout)
        if record.state != "suspended":
            raise Conflict(f"sandbox {sid} is already running")
        ttl = self._ttl(timeout)
        claimed = self.cluster.claim_own(sid)
        try:
            with self._start_turn(), self.vmm("resume"):
                woken = self.boxes.wake(sid, end_at=time.time() + ttl).record  # type: ignore[operator]
        except BaseException:
            self.cluster.paused(sid)  # paused still: any node may wake it again
            raise
        if claimed:  # the claim already says it runs here
            self.cluster.nudge()
        else:
            self.cluster.placed(sid)
        return woken

    def _take_over(self, caller: Caller, sid: str, timeout: int | None) -> SandboxRecord:
        """Wake here a sandbox another node paused to the store (a gateway sends the
        resume here when that node is gone or full). The conditional claim decides
        if that node wakes it at the same moment; it forgets it when it next looks."""
        seen, record = self.cluster.paused_elsewhere(sid)
        if record.sid != sid or not caller.sees(record.team):
            raise NotFound(f"sandbox {sid} not found")
        ttl = self._ttl(timeout)
        with self._capacity([sid], caller):
            self.cluster.claim_other(sid, seen)
            with self.vmm("resume"):
                woken = self.boxes.adopt(record, end_at=time.time() + ttl).record  # type: ignore[operator]
        self.cluster.placed(sid)
        return woken

    def connect(self, caller: Caller, sid: str, timeout: int | None) -> tuple[SandboxRecord, bool]:
        """Running: extend the TTL if `timeout` reaches further (200). Paused: resume (201)."""
        try:
            record = self.record(sid, caller)
        except NotFound:
            return self._take_over(caller, sid, timeout), True
        if record.state == "suspended":
            return self.resume(caller, sid, timeout), True
        ttl = self._ttl(timeout)
        end = max(record.end_at or 0.0, time.time() + ttl)  # type: ignore[operator]
        if record.state == "paused":  # vCPUs stopped by an operator: continue them
            with self.vmm("resume"):
                self.boxes.resume(sid)
        return self.boxes.update(sid, end_at=end), False

    def set_timeout(self, caller: Caller, sid: str, timeout: int) -> None:
        self.record(sid, caller)
        ttl = self._ttl(timeout)
        self.boxes.update(sid, end_at=time.time() + ttl)  # type: ignore[operator]

    def refresh(self, caller: Caller, sid: str, duration: int | None) -> None:
        record = self.record(sid, caller)
        duration = 60 if duration is None else duration
        if not 0 <= duration <= 3600:
            raise InvalidInput(f"duration {duration} s is outside 0..3600 s")
        self.boxes.update(sid, end_at=max(record.end_at or 0.0, time.time() + duration))

    def fork(self, caller: Caller, sid: str, count: int, timeout: int | None) -> list[SandboxRecord]:
        if not 1 <= count <= MAX_FORKS:
            raise InvalidInput(f"fork count {count} is outside 1..{MAX_FORKS}")
        record = self.record(sid, caller)
        if record.state == "suspended":
            raise Conflict(f"sandbox {sid} is paused: resume it before forking")
        self.catalog.check_snapshot_quota(Caller(record.team))  # the forks restore a snapshot of it, kept
        ttl = self._ttl(timeout)
        names = [new_sid() for _ in range(count)]
        with self._capacity(names, Caller(record.team)), self.vmm("fork"):
            forks = self.boxes.fork(sid, count, names=names, template=record.template, team=record.team,
                                    end_at=time.time() + ttl, auto_pause=record.auto_pause,  # type: ignore[operator]
                                    env=record.env, metadata=dict(record.metadata), cwd=record.cwd,
                                    user=record.user)
        records = [self.boxes.update(f.record.sid, access_token=new_token(),  # one token each
                                     traffic_token=new_token() if record.traffic_token else "") for f in forks]
        for fork in records:
            self.cluster.placed(fork.sid)
        return records

    def snapshot(self, caller: Caller, sid: str, name: str | None) -> tuple[str, list[str]]:
        record = self.record(sid, caller)
        if name is not None:
            name = self.catalog.check_template_free(caller, name)
        self.catalog.check_snapshot_quota(Caller(record.team))
        if record.state == "suspended":
            snapshot_id = record.last_snapshot
            assert snapshot_id is not None
        else:
            with self.vmm("snapshot"):
                snapshot_id = self.boxes.snapshot(sid)
        if name is not None:
            from layerstore.templates import new_template

            self.store.put_template(new_template(name, "snapshot", snapshot_id, owner=record.team))
        return snapshot_id, [name] if name else []

    def exec(self, caller: Caller, sid: str, command: str, timeout: float):  # noqa: ANN201
        self.record(sid, caller)
        if not 1 <= timeout <= 3600:
            raise InvalidInput(f"timeout {timeout} s is outside 1..3600 s")
        with self.vmm("exec"):
            return self.boxes.exec(sid, command, timeout=timeout, max_output=self.config.exec_output_limit)

    def logs(self, caller: Caller, sid: str, *, since: float, limit: int, level: str = "debug",
             search: str = "", backward: bool = False) -> list[Event]:
        """The sandbox's event log from `since` (epoch seconds) on, at least
        `level`, containing `search`; at most `limit`, oldest first (or from
        `since` back, newest first, when `backward`)."""
        self.record(sid, caller)
        if not 0 < limit <= 10_000:
            raise InvalidInput(f"limit {limit} is outside 1..10000")
        floor = LEVELS.index(level)
        rows = [e for e in self.boxes.event_log(sid, limit=0x7FFFFFFF)
                if LEVELS.index(e.level) >= floor and search in e.message]
        if backward:  # from `since` (if given) back in time
            return [e for e in reversed(rows) if not since or e.t <= since][:limit]
        return [e for e in rows if e.t >= since][:limit]

    def metrics_of(self, caller: Caller, sid: str) -> tuple[float, GuestMetrics, dict[str, int]]:
        """One sample of a running sandbox's guest (paused: Conflict), and
        its network's traffic counters since its VM started ({} without one)."""
        record = self.record(sid, caller)
        if record.state == "suspended":
            raise Conflict(f"sandbox {sid} is paused: it has no metrics until resumed")
        return time.time(), self.boxes.agent(sid).metrics(), self.traffic(record)

    def traffic(self, record: SandboxRecord) -> dict[str, int]:
        """Bytes and packets a sandbox's guest sent and received ({}: no network, or gone meanwhile)."""
        if record.network is None or record.state == "suspended":
            return {}
        return self.boxes.traffic(record.sid)
