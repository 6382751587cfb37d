"""Sandboxes: VMs whose disk, memory and state live in Strata's layers.

`Sandboxes` ties the pieces together. The mount daemon (`fusefs`) gives each
sandbox two copy-on-write upper layers: its disk (`sandboxes/<sid>/disk.img`)
and its guest RAM (`sandboxes/<sid>.mem/disk.img`). QEMU maps that RAM
file shared, so guest memory writes land in the RAM upper layer as they
happen; Firecracker writes guest memory into it when it saves state (see
vmm/firecracker.py). A `VmmBackend` runs the VM, the store keeps snapshots,
and a `Registry` keeps one record per sandbox on disk so any later process
(the next CLI command, a restarted API service) can find and control it
again. Every operation on a sandbox holds its file lock (`Registry.lock`)
throughout, so processes and threads acting on one sandbox take turns.

    boot     = disk upper layer over the image, RAM upper layer over an
               all-holes layer of the memory size, then the VM
    snapshot = pre-copy while the guest runs -> pause -> capture (device
               state, dirty RAM written back, both upper layers sealed) ->
               resume, if it was running -> publish (state file imported as
               a layer, snapshot manifest; parent: the previous snapshot).
               The steps are vmm/snapshotting.py's; the pause, the resume
               and the record are this module's
    restore  = disk and RAM upper layers over the snapshot's disk and memory
               layers (chunks fetched lazily as the VM touches them), device
               state streamed from snapshots/<id>/state on the mount; a
               restored sandbox snapshots incrementally like a booted one
    suspend  = snapshot, then stop the VM and drop both upper layers (only
               the record remains); wake = restore under the same id
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from fusefs.client import MountClient
from fusefs.paths import MountPaths
from layerstore import inventory
from layerstore.errors import Conflict, InvalidInput, MissingChunk, NotFound, StrataError
from layerstore.importer import import_image
from layerstore.refs import parse_ref
from layerstore.snapshot import Snapshot
from layerstore.store import Store

from . import events
from .agent import DEFAULT_MAX_OUTPUT, Agent, RunResult
from .backend import DEFAULT_CMDLINE, Vm, VmmBackend, VmSpec
from .egress import Egress
from .network import Network
from .registry import MAX_FORKS, LOCK_TIMEOUT, Registry, SandboxRecord, new_sid
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


class Sandboxes:
    """Boot, pause, snapshot, restore, fork and kill the sandboxes of one node.

    Safe to share between threads and to use from many processes at once (a
    CLI command next to `strata serve`): every operation that touches a
    sandbox's VM or record holds that sandbox's file lock (`Registry.lock`)
    throughout, so operations on one sandbox are serialised node-wide and
    different sandboxes proceed in parallel. One waits at most
    `lock_timeout` seconds for another, then fails with Conflict ("busy").
    """

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
        self._boot_layers: dict[str, str] = {}
        self._boot_signatures: dict[str, tuple[int, int, int] | None] = {}  # of the files imported as those layers
        self._held = threading.local()  # .sids: the sandbox locks the current thread holds
        self._guard = threading.Lock()  # the boot-layer cache
        self.snapshots = Snapshotting(store, client, backend.name, self._boot_layer)  # the snapshot pipeline

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

    def _boot_layer(self, name: str) -> str:
        """Kernel and initrd as layers (imported once; identical bytes dedup)."""
        with self._guard:
            signature = _signature(self.guest_dir / name)
            if name not in self._boot_layers or self._boot_signatures.get(name) != signature:
                # a ref keeps the layer from GC between snapshots that name it
                ref = "strata-boot:" + name.replace(".", "-")
                self._boot_layers[name] = import_image(self.store, self.guest_dir / name, ref).manifest_id
                self._boot_signatures[name] = signature
            return self._boot_layers[name]

    def _boot_file(self, name: str, layer: str) -> Path:
        """A snapshot's kernel or initrd (`layer`) for QEMU: the node's own
        file when it is that very layer (imported from it, unchanged since),
        read from the local disk; else the layer on the mount, whose first
        read on a node fetches the whole file through FUSE while the restore
        waits."""
        path = self.guest_dir / name
        with self._guard:
            same = self._boot_layers.get(name) == layer and self._boot_signatures.get(name) == _signature(path)
        return path if same else self.paths.layer(layer)

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
            spec = self._with_network(spec, record)
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
        took = record.timings["restore" if spec.incoming else "boot"] = time.monotonic() - started  # network too
        record.pid = vm.pid
        self.registry.save(record)
        self._vms[record.sid] = vm
        what = "resumed" if keep_record else "restored" if spec.incoming else "booted"
        events.append(work, "info", f"{what} from {record.source}", seconds=f"{took:.3f}")
        return Sandbox(record, vm, work)

    def boot(self, image: str, *, sid: str | None = None, memory_mib: int | None = None,
             metadata: dict[str, str] | None = None, disk_size: int | None = None, egress: Egress | None = None,
             **lifetime: object) -> Sandbox:
        """A new sandbox: a copy-on-write disk over `image` (NAME:TAG), booted;
        returns once the guest agent answers. `disk_size` bytes make the disk
        larger than the image; the guest agent grows the root filesystem
        into it at boot. On a node with networking the guest gets a NIC
        whose traffic `egress` rules (default: everything but what the node
        blocks)."""
        ref = parse_ref(image)
        self.store.resolve(ref)  # unknown image: NotFound before anything is created
        sid = self._new_sid(sid)
        with self._locked(sid):
            self._claim(sid)
            memory = memory_mib or self.memory_mib
            record = SandboxRecord(sid, self.backend.name, f"image:{ref}", memory, metadata=dict(metadata or {}),
                                   network=self._rules(egress, nic=self.network is not None),
                                   **lifetime)  # type: ignore[arg-type]
            work = self.registry.workdir(sid)
            self.registry.save(record)
            return self._start(record, VmSpec(
                kernel=self.guest_dir / "vmlinuz", initrd=self.guest_dir / "initramfs.cpio.gz",
                disk=self.paths.sandbox(sid), workdir=work, memory_mib=memory,
                cmdline=DEFAULT_CMDLINE, memory_file=self._memory_path(sid)),
                {"image": str(ref), **({"size": disk_size} if disk_size else {})}, self._zero_memory(memory))

    def reboot_on_disk(self, sid: str, reason: str) -> Sandbox:
        """Cold-boot a sandbox whose VM lost its files (the mount daemon died):
        the VM is stopped, its RAM layer dropped, and the guest booted again
        on the disk the new mount daemon still holds, like a machine after a
        power cut: synced files are there, processes and unsynced writes
        are not. The record says so (`recovered`)."""
        with self._locked(sid):
            record = self.registry.load(sid)
            vm = self._vms.pop(sid, None)
            if vm is not None:
                vm.kill()
            self.backend.destroy(self.registry.workdir(sid))
            disks = {d.sid for d in self.client.list_disks()}
            if sid not in disks:
                raise Conflict(f"sandbox {sid}: its disk is gone from the mount")
            if memory_sid(sid) in disks:
                self.client.remove_disk(memory_sid(sid))
            kernel, initrd = self._boot_files(record)
            spec = VmSpec(kernel=kernel, initrd=initrd, disk=self.paths.sandbox(sid),
                          workdir=self.registry.workdir(sid), memory_mib=record.memory_mib, cmdline=DEFAULT_CMDLINE,
                          memory_file=self._memory_path(sid))
            self.client.create_disk(memory_sid(sid), manifest=self._zero_memory(record.memory_mib), volatile=True)
            started = time.monotonic()
            if record.network is not None:
                self._network().detach(sid)  # the old VM's: a cold boot starts from a fresh network
            spec = self._with_network(spec, record)
            vm = self.backend.start(spec)
            record.state, record.operation, record.pid = "running", "", vm.pid
            record.timings["reboot"] = time.monotonic() - started
            record.recovered = _note(reason)
            self.registry.save(record)
            self._vms[sid] = vm
            events.append(self.registry.workdir(sid), "warn", f"cold-booted on its disk: {reason}")
            return Sandbox(record, vm, self.registry.workdir(sid))

    def back_to_snapshot(self, sid: str, reason: str) -> None:
        """Stop a sandbox whose VM lost its files and record it paused to the
        store at its last snapshot (resuming restores that)."""
        with self._locked(sid):
            record = self.registry.load(sid)
            if record.last_snapshot is None:
                raise Conflict(f"sandbox {sid} has no snapshot to go back to")
            self._stop(sid)
            record.state, record.pid, record.operation, record.suspended_at = "suspended", None, "", time.time()
            record.recovered = _note(reason)
            self.registry.save(record)
            events.append(self.registry.workdir(sid), "warn", f"stopped at its last snapshot: {reason}")

    def _boot_files(self, record: SandboxRecord) -> tuple[Path, Path]:
        """Kernel and initrd to cold-boot `record`: its snapshot's, if it came from one."""
        if record.source.startswith("snapshot:"):
            try:
                snap = self.store.get_snapshot(record.source.split(":", 1)[1])
                return (self._boot_file("vmlinuz", str(snap.vm["kernel"])),
                        self._boot_file("initramfs.cpio.gz", str(snap.vm["initrd"])))
            except StrataError:  # deleted since: the node's own guest boots the same disk
                pass
        return self.guest_dir / "vmlinuz", self.guest_dir / "initramfs.cpio.gz"

    def pause(self, sid: str) -> Sandbox:
        """Stop the vCPUs (memory and disk stay as they are)."""
        return self._set_vcpus(sid, "pause", "paused")

    def resume(self, sid: str) -> Sandbox:
        """Continue the vCPUs, or wake a sandbox suspended to the store."""
        with self._locked(sid):  # the state read and the action are one operation
            if self.registry.load(sid).state == "suspended":
                return self.wake(sid)
            return self._set_vcpus(sid, "resume", "running")

    def _set_vcpus(self, sid: str, action: str, state: str) -> Sandbox:
        """vm.pause() or vm.resume(), timed, with the new state recorded."""
        with self._locked(sid):
            sandbox = self.get(sid)
            started = time.monotonic()
            getattr(sandbox.vm, action)()
            sandbox.record.state = state
            sandbox.record.timings[action] = time.monotonic() - started
            self.registry.save(sandbox.record)
            return sandbox

    def snapshot(self, sid: str, *, resume: bool | None = None, implicit: str = "") -> str:
        """Snapshot `sid` into the store; returns the snapshot id.

        The sandbox ends as it was (running or paused) unless `resume` says
        otherwise. Incremental: the seals of the RAM and disk upper layers
        hold only the chunks dirtied since the previous snapshot.

        A snapshot someone asked for is kept until deleted. One taken for
        the sandbox's own sake (`implicit` says why: "pause", "fork") is
        deleted once nothing needs it (`_drop_if_unused`): when the
        sandbox's next snapshot supersedes it, or the sandbox is killed.
        """
        with self._locked(sid):
            return self._snapshot(sid, resume, implicit=implicit)

    def _snapshot(self, sid: str, resume: bool | None, *, implicit: str = "") -> str:
        """The pipeline's steps (`self.snapshots`) around the pause. The record
        names the operation until it ends, so a process that dies midway
        leaves the next lock holder enough to put the VM back
        (`_finish_interrupted`); after a step that fails, the record says
        what the VM is (`_after_failed_snapshot`)."""
        sandbox = self.get(sid)
        record = sandbox.record
        running = record.state == "running"
        if resume is None:
            resume = running
        record.operation = "snapshot"
        self.registry.save(record)
        try:
            timings = self.snapshots.precopy(sid) if running else {"precopy": 0.0}
        except BaseException:  # nothing paused yet: the sandbox runs on as it was
            record.operation = ""
            self.registry.save(record)
            raise
        # Hang up on the agent first: the guest then stops writing to its
        # port (a snapshot taken with guest output in flight restored with a
        # port that took no more input), and streams re-attach after.
        sandbox.vm.agent.close()
        paused = time.monotonic()
        sandbox.vm.pause()
        try:
            timings.update(self.snapshots.capture(sid, sandbox.vm, sandbox.workdir))
            if resume:  # the sealed generations are frozen: the guest writes to new ones while they publish
                sandbox.vm.resume()
            timings["paused"] = time.monotonic() - paused
            snapshot_id = self.snapshots.publish(record, sandbox.workdir, implicit, timings)
        except BaseException:
            self._after_failed_snapshot(sandbox, resume)
            raise
        previous, record.last_snapshot = record.last_snapshot, snapshot_id
        record.state = "running" if resume else "paused"
        record.operation = ""
        record.timings.update(timings)
        self.registry.save(record)
        events.append(sandbox.workdir, "info", f"snapshot {snapshot_id}", why=implicit or "asked")
        self._drop_if_unused(previous)
        return snapshot_id

    def _drop_if_unused(self, snapshot_id: str | None) -> None:
        """Delete `snapshot_id` if a sandbox took it for its own sake and
        nothing needs it any more: not its sandbox (whose way back it is
        while it is that record's last snapshot), no template, no other
        record (restored from it, or waking from it). Its layers stay while
        a running sandbox sits on them (GC's node roots); GC reclaims the
        rest. A store that fails here fails nothing else: the caller's work
        is done, and the snapshot is merely kept."""
        if snapshot_id is None:
            return
        try:
            notes = self.store.get_snapshot(snapshot_id).annotations
            if not notes.get("implicit") or inventory.template_users(self.store).get(snapshot_id):
                return
            source = f"snapshot:{snapshot_id}"
            if any(r.last_snapshot == snapshot_id or r.source == source for r in self.registry.all()):
                return
            self.store.delete_snapshot(snapshot_id)
        except NotFound:  # deleted already
            return
        except StrataError as exc:
            log.warning("kept snapshot %s, which nothing may need any more: %s", snapshot_id, exc)
            return
        log.info("deleted snapshot %s of sandbox %s (%s): nothing needs it any more", snapshot_id,
                 notes.get("sandbox"), notes["implicit"])

    def _after_failed_snapshot(self, sandbox: Sandbox, resume: bool) -> None:
        """A snapshot failed after the pause: give the guest its vCPUs back if
        it was running, and record what it really is, so the record never says
        running about a VM left paused (the snapshot's error still propagates)."""
        record = sandbox.record
        record.state, record.operation = "paused", ""
        if resume:
            try:
                sandbox.vm.resume()
                record.state = "running"
            except StrataError as exc:
                log.error("sandbox %s: resuming after a failed snapshot: %s", sandbox.sid, exc)
        log.error("sandbox %s: snapshot failed; the sandbox is %s", sandbox.sid, record.state)
        self.registry.save(record)

    def restore(self, snapshot_id: str, *, sid: str | None = None, metadata: dict[str, str] | None = None,
                egress: Egress | None = None, **lifetime: object) -> Sandbox:
        """A new sandbox started from a snapshot, its RAM and disk served
        lazily; with a NIC (and `egress` rules) if the snapshot's VM had one."""
        snap = self.store.get_snapshot(snapshot_id)
        self._check_complete(snapshot_id, snap)
        sid = self._new_sid(sid)
        with self._locked(sid):
            self._claim(sid)
            memory = int(snap.vm["memory_mib"])  # type: ignore[arg-type]
            record = SandboxRecord(sid, self.backend.name, f"snapshot:{snapshot_id}", memory,
                                   last_snapshot=snapshot_id, metadata=dict(metadata or {}),
                                   network=self._rules(egress, nic=bool(snap.vm.get("nic"))),
                                   **lifetime)  # type: ignore[arg-type]
            work = self.registry.workdir(sid)
            self.registry.save(record)
            return self._start(record, self._restore_spec(snapshot_id, snap, work), {"manifest": snap.layers["disk"]},
                               snap.layers["memory"], state_layer=snap.layers["state"])

    def _restore_spec(self, snapshot_id: str, snap: Snapshot, work: Path) -> VmSpec:
        return VmSpec(
            kernel=self._boot_file("vmlinuz", str(snap.vm["kernel"])),
            initrd=self._boot_file("initramfs.cpio.gz", str(snap.vm["initrd"])),
            disk=self.paths.sandbox(work.name), workdir=work,
            memory_mib=int(snap.vm["memory_mib"]), cmdline=str(snap.vm["cmdline"]),  # type: ignore[arg-type]
            memory_file=self._memory_path(work.name), incoming=self.paths.snapshot(snapshot_id, "state"))

    def suspend(self, sid: str) -> str:
        """Snapshot, then stop the VM and drop its upper layers: the sandbox
        keeps its id and record but costs the node no memory or disk until
        `wake`. Returns the snapshot id."""
        with self._locked(sid):
            record = self.registry.load(sid)
            if record.state == "suspended":
                raise Conflict(f"sandbox {sid} is already paused")
            snapshot_id = self._snapshot(sid, resume=False, implicit="pause")
            self._stop(sid)
            record = self.registry.load(sid)
            record.state, record.pid, record.suspended_at = "suspended", None, time.time()
            self.registry.save(record)
            events.append(self.registry.workdir(sid), "info", f"paused to the store at snapshot {snapshot_id}")
            return snapshot_id

    def wake(self, sid: str, **lifetime: object) -> Sandbox:
        """Restore a suspended sandbox from its snapshot, under the same id."""
        with self._locked(sid):
            record = self.registry.load(sid)
            if record.state != "suspended" or record.last_snapshot is None:
                raise Conflict(f"sandbox {sid} is not paused")
            snap = self.store.get_snapshot(record.last_snapshot)
            self._check_complete(record.last_snapshot, snap)
            record.state, record.suspended_at = "running", None
            for key, value in lifetime.items():
                setattr(record, key, value)
            work = self.registry.workdir(sid)
            (work / "state").unlink(missing_ok=True)  # left over from before the suspend
            try:
                return self._start(record, self._restore_spec(record.last_snapshot, snap, work),
                                   {"manifest": snap.layers["disk"]}, snap.layers["memory"], keep_record=True,
                                   state_layer=snap.layers["state"])
            except BaseException:
                record.state, record.suspended_at = "suspended", time.time()
                self.registry.save(record)
                raise

    def adopt(self, record: SandboxRecord, **lifetime: object) -> Sandbox:
        """Take in a sandbox another node paused to the shared store (its
        record as that node published it) and wake it here under the same id.
        If waking fails the record stays here, paused: it is this node's now."""
        if record.state != "suspended" or record.last_snapshot is None:
            raise Conflict(f"sandbox {record.sid} is not paused to the store")
        with self._locked(record.sid):
            self._claim(record.sid)
            record.pid, record.operation = None, ""
            self.registry.save(record)
            events.append(self.registry.workdir(record.sid), "info", "taken over from another node")
            return self.wake(record.sid, **lifetime)

    def forget(self, sid: str) -> None:
        """Drop the record of a paused sandbox another node took over: its
        snapshot is that node's now, so nothing in the store is touched."""
        with self._locked(sid):
            if self.registry.load(sid).state != "suspended":
                raise Conflict(f"sandbox {sid} is not paused: only a paused sandbox moves between nodes")
            self.registry.remove(sid)

    def _check_complete(self, snapshot_id: str, snap: Snapshot) -> None:
        """Refuse to start a VM whose memory or disk could fault on a missing chunk.

        Guest memory pages in lazily: a chunk missing from the store would
        surface as a crash mid-run. One batched existence check up front
        turns that into a clear error before anything starts.
        """
        digests: set[str] = set()
        packs: set[str] = set()
        for layer_id in snap.layer_ids():
            chunks, more = self.store.read_needs(layer_id)
            digests |= chunks
            packs |= more
        missing = self.store.missing_chunks(digests) | {f"pack {p}" for p in self.store.missing_packs(packs)}
        if missing:
            raise MissingChunk(
                f"snapshot {snapshot_id} cannot be restored: {len(missing)} chunk(s) or pack(s) missing from "
                f"{self.store.describe()} (e.g. {sorted(missing)[0]})"
            )

    def fork(self, sid: str, count: int, *, names: list[str] | None = None, workers: int | None = None,
             **lifetime: object) -> list[Sandbox]:
        """Snapshot `sid` once (it keeps running), then restore `count`
        independent sandboxes from it, each with its own upper layer
        (named `names`, default SID-fork1..N), `workers` at a time (default:
        twice the host's cores, at most 8: a restore waits on the VMM and the
        guest as much as it computes). One that fails kills the others."""
        if not 1 <= count <= MAX_FORKS:
            raise InvalidInput(f"fork count {count} must be between 1 and {MAX_FORKS}")
        self.registry.load(sid)  # NotFound before anything happens
        names = names or [f"{sid}-fork{i + 1}" for i in range(count)]
        taken = [n for n in names if self.registry.exists(n)]
        if taken:
            raise InvalidInput(f"sandbox {taken[0]} already exists")
        snapshot_id = self.snapshot(sid, implicit="fork")
        parent = self.registry.load(sid).network
        egress = Egress.of(parent) if parent else None
        workers = workers or min(8, 2 * (os.cpu_count() or 1))
        with ThreadPoolExecutor(min(workers, len(names)), thread_name_prefix="strata-fork") as pool:
            futures = [pool.submit(self.restore, snapshot_id, sid=name, egress=egress, **lifetime) for name in names]
        forks = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for fork in forks:
                self.kill(fork.sid)
            raise failed[0]  # type: ignore[misc]
        return forks

    def kill(self, sid: str) -> None:
        """Stop the VM (even one nobody can attach to), drop the upper layers
        (their sealed layers stay in the store when a snapshot names them) and
        the work directory. Closing the disk and RAM files releases the
        mount's cache pins."""
        with self._locked(sid):
            record = self.registry.load(sid)  # NotFound for an unknown id
            self._stop(sid)
            self.registry.remove(sid)  # releasing the lock then removes its file too
            self._drop_if_unused(record.last_snapshot)
            if record.source.startswith("snapshot:"):  # a fork's: its origin may be unneeded now
                self._drop_if_unused(record.source.split(":", 1)[1])

    def _stop(self, sid: str) -> None:
        """Stop the VM (if any) and remove the disk and RAM upper layers (if any)."""
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

    def set_egress(self, sid: str, egress: Egress) -> SandboxRecord:
        """Change a sandbox's egress rules; a running VM's apply at its next packet."""
        with self._locked(sid):
            record = self.registry.load(sid)
            if record.network is None:
                raise Conflict(f"sandbox {sid} has no network (it was started on a node without one)")
            if self.network is not None and record.state != "suspended":
                self.network.update(sid, egress)
            record.network = egress.as_record()
            self.registry.save(record)
            events.append(self.registry.workdir(sid), "info", f"egress rules changed: {egress.as_record()}")
            return record

    def reconcile_network(self) -> list[str]:
        """Remove the networks of sandboxes whose VM is gone (kill, crash, a
        node that died midway); returns their ids."""
        if self.network is None:
            return []
        live = {r.sid for r in self.registry.all()
                if r.state != "suspended" and self.backend.is_running(self.registry.workdir(r.sid))}
        return self.network.reconcile(live)

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

    def _zero_memory(self, memory_mib: int) -> str:
        """The layer a booted VM's RAM starts from: all holes (costs nothing to store)."""
        name = f"zero-{memory_mib}M"
        with self._guard:
            if name not in self._boot_layers:
                with tempfile.NamedTemporaryFile(dir=self.registry.root, prefix=".zero-") as f:
                    f.truncate(memory_mib << 20)
                    self._boot_layers[name] = import_image(self.store, f.name, f"strata-boot:{name}").manifest_id
            return self._boot_layers[name]


def _note(reason: str) -> str:
    """A record's `recovered` text: when (UTC) and what was done."""
    return f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {reason}"


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or rewritten: inode, size, mtime."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
