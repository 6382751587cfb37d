"""The node's VMs and their records, below what is done to them
(vmm/sandbox.py): the per-sandbox lock, live VM handles, starting a VM
over its upper layers and stopping it, its network card, and what callers
read (records, agents, event logs, addresses).

A sandbox's VM may outlive the process that started it, so a handle is
attached again whenever the one held is gone or no longer the record's
(`get`); every change of a VM or record happens under the sandbox's file
lock (`Registry.lock`), re-entrant per thread, which also finishes what a
process that died holding it left midway (`_finish_interrupted`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from fusefs.client import MountClient
from fusefs.paths import MountPaths
from layerstore.errors import Conflict, InvalidInput, NotFound, StrataError
from layerstore.store import Store

from . import events
from .agent import DEFAULT_MAX_OUTPUT, Agent, AgentError, RunResult
from .backend import Vm, VmmBackend, VmSpec
from .bootfiles import BootFiles
from .egress import Egress
from .mounts import DEFAULT_MAX_STAGED, Quota, VolumeMounts
from .network import Network
from .registry import LOCK_TIMEOUT, Registry, SandboxRecord, new_sid
from .snapshotting import Snapshotting, memory_sid

log = logging.getLogger("strata.vmm")


@dataclass
class Sandbox:
    """A sandbox's record and the handle of its running VM."""

    record: SandboxRecord
    vm: Vm
    workdir: Path

    @property
    def sid(self) -> str:
        return self.record.sid

    @property
    def timings(self) -> dict[str, float]:
        return self.record.timings


class Machines:
    """The VMs of one node's sandboxes and their records (vmm/sandbox.py's
    `Sandboxes` is what is done to them). Safe to share between threads and
    processes: see `Sandboxes`."""

    def __init__(
        self,
        store: Store,
        client: MountClient,
        backend: VmmBackend,
        *,
        guest_dir: Path,
        work_root: Path,
        memory_mib: int = 256,
        lock_timeout: float = LOCK_TIMEOUT,
        network: Network | None = None,
        volume_quota: Quota | None = None,
        volume_staging: int = DEFAULT_MAX_STAGED,
    ) -> None:
        self.store = store
        self.client = client  # the mount daemon: sandbox disks, seals, cache
        self.mount = client.mountpoint  # VM specs name files on the mount
        self.paths = MountPaths(self.mount)
        self.backend = backend
        self.guest_dir = guest_dir
        self.registry = Registry(work_root)
        self.memory_mib = memory_mib
        self.lock_timeout = lock_timeout
        self.network = network  # None: sandboxes get no NIC
        self._vms: dict[str, Vm] = {}
        self._held = threading.local()  # .sids: the sandbox locks the current thread holds
        self.boot_files = BootFiles(store, guest_dir, self.paths, scratch=self.registry.root)
        self.volumes = VolumeMounts(store, quota=volume_quota, max_staged=volume_staging)  # mounted in guests
        self.snapshots = Snapshotting(store, client, backend.name, self.boot_files.layer,  # the snapshot pipeline
                                      records=self.registry.all)

    @contextmanager
    def _locked(self, sid: str) -> Iterator[None]:
        """Hold sandbox `sid`'s lock (re-entrant per thread, so a locked
        operation may call another: resume -> wake, suspend -> snapshot)."""
        held: set[str] = self._held.__dict__.setdefault("sids", set())
        if sid in held:
            yield
            return
        with self.registry.lock(sid, timeout=self.lock_timeout):
            held.add(sid)
            try:
                self._finish_interrupted(sid)
                yield
            finally:
                held.discard(sid)

    def _finish_interrupted(self, sid: str) -> None:
        """Called with the sandbox's lock newly taken: if the record names an
        operation, the process that ran it died holding the lock (SIGKILL of
        `strata serve` mid-snapshot, say) and may have left the vCPUs
        stopped while the record says running. Put the VM back in the
        recorded state, so the record never lies. What that operation had
        already published (a sealed layer, a snapshot) stays in the store."""
        if not self.registry.exists(sid):
            return
        record = self.registry.load(sid)
        if not record.operation:
            return
        log.warning("sandbox %s: a %s was interrupted; restoring the VM to %s", sid, record.operation,
                    record.state)
        if record.state == "running" and self.backend.is_running(self.registry.workdir(sid)):
            try:
                vm = self.get(sid).vm
                if vm.status() != "running":
                    vm.resume()
            except StrataError as exc:
                log.error("sandbox %s: resuming after an interrupted %s: %s", sid, record.operation, exc)
                record.state = "paused"
        record.operation = ""
        self.registry.save(record)

    def finish_interrupted(self) -> list[str]:
        """Recover every sandbox whose last operation died midway (at node
        start); returns their ids."""
        found = [r.sid for r in self.registry.all() if r.operation]
        for sid in found:
            with self._locked(sid):
                pass  # taking the lock recovers it
        return found

    def _new_sid(self, sid: str | None) -> str:
        sid = sid or new_sid()
        if len(sid) > 60:  # the RAM layer is <sid>.mem, and mount names stop at 64
            raise InvalidInput(f"sandbox id {sid[:20]}... is longer than 60 characters")
        return sid

    def _claim(self, sid: str) -> None:
        """Refuse an id in use; called under the sid's lock, so two processes
        creating the same id cannot both pass."""
        if self.registry.exists(sid):
            raise InvalidInput(f"sandbox {sid} already exists")

    def get(self, sid: str) -> Sandbox:
        """The sandbox `sid` with a live VM handle (attaching if another process
        started it, or replaced its VM since: suspend and wake, kill and boot).

        Takes no lock itself: the operations below call it under the
        sandbox's lock; a caller using the handle directly (exec through
        `vm.agent`) is not serialised with them.
        """
        record = self.registry.load(sid)
        if record.state == "suspended":
            raise Conflict(f"sandbox {sid} is paused to the store: resume it first")
        vm = self._vms.get(sid)
        if vm is None or not vm.alive() or (record.pid is not None and vm.pid != record.pid):
            if record.backend != self.backend.name:
                raise InvalidInput(f"sandbox {sid} runs on {record.backend}, this node uses {self.backend.name}")
            if vm is not None:
                vm.agent.close()  # a handle of a VM that is gone or not this sandbox's any more
            vm = self._vms[sid] = self.backend.attach(self.registry.workdir(sid))
        self._serve_volumes(record, ensure=True)
        return Sandbox(record, vm, self.registry.workdir(sid))

    def agent(self, sid: str) -> Agent:
        """The guest agent of running sandbox `sid`, shared by every caller
        (it multiplexes). Not under the sandbox's lock: a command may run
        for an hour and pause need not wait; its streams end (AgentGone)
        when the VM stops."""
        return self.get(sid).vm.agent

    def log_event(self, sid: str, level: str, message: str, **fields: object) -> None:
        """Add to the sandbox's event log (vmm/events.py)."""
        events.append(self.registry.workdir(sid), level, message, **fields)

    def event_log(self, sid: str, *, since: float = 0.0, limit: int = 1000) -> list[events.Event]:
        self.registry.load(sid)  # NotFound for an unknown sandbox
        return events.read(self.registry.workdir(sid), since=since, limit=limit)

    def exec(self, sid: str, command: str, *, timeout: float, max_output: int = DEFAULT_MAX_OUTPUT,
             env: dict[str, str] | None = None) -> RunResult:
        """Run `sh -c command` in the guest of `sid`; output past
        `max_output` is dropped with a marker (a guest can print without end)."""
        return self.agent(sid).run(command, timeout=timeout, max_output=max_output, env=env)

    def rotate_logs(self, *, limit: int) -> None:
        """Cap the console logs of running sandboxes (called every second by
        `strata serve`; a guest printing without end fills no disk)."""
        for record in self.registry.all():
            if record.state == "running":
                self.backend.rotate_logs(self.registry.workdir(record.sid), limit=limit)

    def update(self, sid: str, **fields: object) -> SandboxRecord:
        """Change fields of a sandbox's record (metadata, lifetime) under its lock."""
        with self._locked(sid):
            record = self.registry.load(sid)
            for key, value in fields.items():
                if not hasattr(record, key):
                    raise InvalidInput(f"sandbox records have no field {key!r}")
                setattr(record, key, value)
            self.registry.save(record)
            return record

    # what callers read (the API never reaches into the registry, backend or network)
    def records(self) -> list[SandboxRecord]:
        """Every sandbox's record."""
        return self.registry.all()

    def record(self, sid: str) -> SandboxRecord:
        """Sandbox `sid`'s record (NotFound; InvalidInput for an id that cannot be one)."""
        return self.registry.load(sid)

    def snapshot_users(self) -> dict[str, list[str]]:
        """Snapshot id -> the paused sandboxes that wake from it."""
        return self.registry.snapshot_users()

    def alive(self, sid: str) -> bool:
        """Whether sandbox `sid`'s VM process runs (it may outlive this process)."""
        vm = self._vms.get(sid)
        return vm.alive() if vm is not None else self.backend.is_running(self.registry.workdir(sid))

    @property
    def networked(self) -> bool:
        """Whether this node gives sandboxes networks (config network.enabled)."""
        return self.network is not None

    def address(self, record: SandboxRecord) -> str | None:
        """The sandbox's address on the node, None without a network (none
        on the node, none for it, or paused: its link is gone)."""
        if self.network is None or record.network is None or record.state == "suspended":
            return None
        try:
            return self.network.link(record.sid).outside
        except NotFound:  # between a stop and a start
            return None

    def traffic(self, sid: str) -> dict[str, int]:
        """Bytes and packets sandbox `sid`'s guest sent and received since
        its VM started; {} without a network (or paused: its link is gone)."""
        if self.network is None:
            return {}
        try:
            return self.network.counters(sid)
        except StrataError:
            return {}

    def list(self) -> list[dict[str, object]]:
        """Every sandbox's record, with `alive` telling whether its VM process runs."""
        return [{**record.__dict__, "alive": self.alive(record.sid)} for record in self.registry.all()]

    def _start(self, record: SandboxRecord, spec: VmSpec, disk: dict[str, str], memory_layer: str, *,
               keep_record: bool = False, state_layer: str | None = None) -> Sandbox:
        """Create the sandbox's disk (over `disk`: {"image": ...} or
        {"manifest": ...}) and RAM upper layers, start the VM; on failure
        remove all of it (and the record, unless it predates this start: a wake).

        A restore's device state (`state_layer`) is what QEMU reads first:
        its working set is asked for before anything else, so that it is
        not fetched only when QEMU opens the file and waits on it."""
        work = self.registry.workdir(record.sid)
        try:
            if state_layer is not None:
                self.client.prefetch(state_layer)
            self.client.create_disk(record.sid, **disk)
            self.client.create_disk(memory_sid(record.sid), manifest=memory_layer, volatile=True)
            self.registry.save(record)
            started = time.monotonic()
            spec = self._with_network(self._with_memory_base(spec, memory_layer), record)
            vm = self.backend.start(spec)
        except BaseException:
            try:
                if self.network is not None:
                    self.network.detach(record.sid)
                self._remove_uppers(record.sid)
            except StrataError as exc:  # keep the original error; the record stays for a later kill
                log.error("sandbox %s: cleaning up after a failed start: %s", record.sid, exc)
                raise
            if not keep_record:
                self.registry.remove(record.sid)
            raise
        if spec.incoming is not None:
            self._reseed(vm, work)
        took = record.timings["restore" if spec.incoming else "boot"] = time.monotonic() - started  # network too
        record.pid = vm.pid
        self.registry.save(record)
        self._vms[record.sid] = vm
        self._serve_volumes(record)
        what = "resumed" if keep_record else "restored" if spec.incoming else "booted"
        events.append(work, "info", f"{what} from {record.source}", seconds=f"{took:.3f}")
        return Sandbox(record, vm, work)

    @staticmethod
    def _reseed(vm: Vm, work: Path) -> None:
        """Fresh random bytes for a restored guest's kernel: VMs restored from
        one snapshot would otherwise read the same /dev/urandom bytes until
        it reseeds on its own. A guest whose agent predates `reseed` keeps
        the snapshot's state, and its event log says so."""
        try:
            vm.agent.reseed(os.urandom(64))
        except AgentError as exc:
            log.warning("%s: the guest's random number generator was not reseeded: %s", work.name, exc)
            events.append(work, "warn", f"the guest's random number generator was not reseeded: {exc}")

    def _stop(self, sid: str) -> None:
        """Stop the VM (if any) and remove the disk and RAM upper layers (if any)."""
        self.volumes.stop(sid)
        vm = self._vms.pop(sid, None)
        if vm is not None and not vm.alive():  # died, or another process replaced it (suspend, wake)
            vm.agent.close()
            vm = None
        if vm is None and self.backend.is_running(self.registry.workdir(sid)):
            try:
                vm = self.backend.attach(self.registry.workdir(sid))
            except StrataError:
                self.backend.destroy(self.registry.workdir(sid))
        if vm is not None:
            vm.kill()
        if self.network is not None:
            self.network.detach(sid)
        self._remove_uppers(sid)

    def _serve_volumes(self, record: SandboxRecord, *, ensure: bool = False) -> None:
        """Serve the VM's volume port. A failure leaves the guest's mounts
        answering EIO (logged); the next `get` tries again."""
        try:
            if ensure:
                self.volumes.ensure(record, self.registry.workdir(record.sid))
            else:
                self.volumes.serve(record, self.registry.workdir(record.sid))
        except (OSError, StrataError) as exc:
            log.error("sandbox %s: serving its volume mounts: %s", record.sid, exc)

    def _remove_uppers(self, sid: str, *, timeout: float = 10.0) -> None:
        """Remove the disk and RAM upper layers. The kernel tells the mount a
        dead VM's files are closed asynchronously (RAM was a shared mapping),
        so an "is open" refusal right after a kill is waited out briefly."""
        deadline = time.monotonic() + timeout
        for name in (sid, memory_sid(sid)):
            while True:
                try:
                    self.client.remove_disk(name)
                except NotFound:
                    pass
                except Conflict:
                    if time.monotonic() < deadline:
                        time.sleep(0.02)
                        continue
                    raise
                break

    def reconcile_network(self) -> list[str]:
        """Remove the networks of sandboxes whose VM is gone (kill, crash, a
        node that died midway); returns their ids."""
        if self.network is None:
            return []
        live = {r.sid for r in self.registry.all()
                if r.state != "suspended" and self.backend.is_running(self.registry.workdir(r.sid))}
        return self.network.reconcile(live)

    def _with_memory_base(self, spec: VmSpec, memory_layer: str) -> VmSpec:
        """A restore's `spec` with guest RAM mapped copy-on-write from
        `memory_layer` (the snapshot's memory, which its RAM upper layer sits
        on, read-only on the mount), if the backend can: sandboxes restored
        from one snapshot then share the pages none of them changed.

        Not a boot: a booted guest shares nothing with others (it writes
        every page it touches, 110 MiB by its agent's start), and a snapshot
        of copy-on-write RAM reads, during the pause, every page the guest
        wrote since it started (vmm/cowmemory.py: no dirty page tracking
        reaches QEMU's memory from outside), where a shared RAM file's
        write-back handles only the pages dirtied since the pre-copy."""
        if not self.backend.cow_memory or spec.incoming is None:
            return spec
        return replace(spec, memory_base=self.paths.layer(memory_layer))

    def _with_network(self, spec: VmSpec, record: SandboxRecord) -> VmSpec:
        """`spec` with the sandbox's network attached, if its record has one."""
        if record.network is None:
            return spec
        return replace(spec, netns=self._network().attach(record.sid, Egress.of(record.network)).netns)

    def _network(self) -> Network:
        if self.network is None:
            raise Conflict("this VM needs a network card (its snapshot was taken with one) and this node has "
                           "networking off (config network.enabled)")
        return self.network

    @staticmethod
    def _rules(egress: Egress | None, *, nic: bool) -> dict | None:
        """A new record's `network`: None without a NIC."""
        return (egress or Egress()).as_record() if nic else None

    def _memory_path(self, sid: str) -> Path:
        return self.paths.sandbox(memory_sid(sid))
