"""Sandboxes: VMs whose disk, memory and state live in Strata's layers.

`Sandboxes` ties the pieces together. The mount daemon (`fusefs`) gives each
sandbox two copy-on-write upper layers: its disk (`sandboxes/<sid>/disk.img`)
and its guest RAM (`sandboxes/<sid>.mem/disk.img`). A booted QEMU guest
maps that RAM file shared, so its writes land in the RAM layer as they
happen; a restored one maps the layer beneath it copy-on-write, shared by
every sandbox restored from one snapshot, and writes the pages it changed
into the RAM file when it saves state (vmm/cowmemory.py); Firecracker
writes all of guest memory into it then (vmm/firecracker.py). A `VmmBackend` runs the VM, the store keeps snapshots,
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

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from layerstore.errors import Conflict, CorruptObject, InvalidInput, StrataError
from layerstore.refs import parse_ref
from layerstore.snapshot import Snapshot
from layerstore.volumes import is_volume_id

from . import events
from .backend import DEFAULT_CMDLINE, VmSpec
from .egress import Egress
from .machines import Machines, Sandbox
from .registry import MAX_FORKS, SandboxRecord
from .snapshotting import memory_sid

log = logging.getLogger("strata.vmm")
__all__ = ["MAX_FORKS", "Sandbox", "Sandboxes"]  # Sandbox: vmm/machines.py


class Sandboxes(Machines):
    """Boot, pause, snapshot, restore, fork and kill the sandboxes of one node.

    Safe to share between threads and to use from many processes at once (a
    CLI command next to `strata serve`): every operation that touches a
    sandbox's VM or record holds that sandbox's file lock (`Registry.lock`)
    throughout, so operations on one sandbox are serialised node-wide and
    different sandboxes proceed in parallel. One waits at most
    `lock_timeout` seconds for another, then fails with Conflict ("busy").
    The locks, VM handles, starting and stopping are vmm/machines.py's.
    """

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
                                   volume_port=self.backend.volume_port, **lifetime)  # type: ignore[arg-type]
            work = self.registry.workdir(sid)
            self.registry.save(record)
            return self._start(record, VmSpec(
                kernel=self.guest_dir / "vmlinuz", initrd=self.guest_dir / "initramfs.cpio.gz",
                disk=self.paths.sandbox(sid), workdir=work, memory_mib=memory,
                cmdline=DEFAULT_CMDLINE, memory_file=self._memory_path(sid), volume_port=record.volume_port),
                {"image": str(ref), **({"size": disk_size} if disk_size else {})}, self.boot_files.zero_memory(memory))

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
            kernel, initrd = self.boot_files.of_record(record)
            spec = VmSpec(kernel=kernel, initrd=initrd, disk=self.paths.sandbox(sid),
                          workdir=self.registry.workdir(sid), memory_mib=record.memory_mib, cmdline=DEFAULT_CMDLINE,
                          memory_file=self._memory_path(sid), volume_port=self.backend.volume_port)
            self.volumes.forget(sid)
            record.volume_port, record.volumes = self.backend.volume_port, {}  # a cold boot: no mounts
            self.client.create_disk(memory_sid(sid), manifest=self.boot_files.zero_memory(record.memory_mib), volatile=True)
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
            self.volumes.forget(sid)  # the guest goes back in time: its request ids with it
            record.state, record.pid, record.operation, record.suspended_at = "suspended", None, "", time.time()
            record.recovered = _note(reason)
            self.registry.save(record)
            events.append(self.registry.workdir(sid), "warn", f"stopped at its last snapshot: {reason}")

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
        deleted once nothing needs it (`Snapshotting.drop_if_unused`): when the
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
            timings = self.snapshots.precopy(sid, sandbox.vm) if running else {"precopy": 0.0}
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
            with self.volumes.quiesced(sid):  # files the guest has open are published, for a restore elsewhere
                timings.update(self.snapshots.capture(sid, sandbox.vm, sandbox.workdir))
                if resume:  # the sealed generations are frozen: the guest writes to new ones while they publish
                    sandbox.vm.resume()
            timings["paused"] = time.monotonic() - paused
            snapshot_id = self.snapshots.publish(record, sandbox.workdir, implicit, timings,
                                                 devices_only=sandbox.vm.devices_only)
        except BaseException:
            self._after_failed_snapshot(sandbox, resume)
            raise
        previous, record.last_snapshot = record.last_snapshot, snapshot_id
        record.state = "running" if resume else "paused"
        record.operation = ""
        record.timings.update(timings)
        self.registry.save(record)
        events.append(sandbox.workdir, "info", f"snapshot {snapshot_id}", why=implicit or "asked")
        self.snapshots.drop_if_unused(previous)
        return snapshot_id

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
                egress: Egress | None = None, check_mounts: Callable[[dict[str, str]], None] | None = None,
                **lifetime: object) -> Sandbox:
        """A new sandbox started from a snapshot, its RAM and disk served
        lazily; with a NIC (and `egress` rules) if the snapshot's VM had one.
        The snapshot's guest has the volumes mounted it had, served again:
        `check_mounts` ({guest path: volume id}) may refuse them first
        (which team may have which volume is the caller's to say)."""
        snap = self.store.get_snapshot(snapshot_id)
        self.snapshots.check_complete(snapshot_id, snap)
        volumes = snapshot_volumes(snap)
        if check_mounts is not None:
            check_mounts(volumes)
        sid = self._new_sid(sid)
        with self._locked(sid):
            self._claim(sid)
            memory = int(snap.vm["memory_mib"])  # type: ignore[arg-type]
            record = SandboxRecord(sid, self.backend.name, f"snapshot:{snapshot_id}", memory,
                                   last_snapshot=snapshot_id, metadata=dict(metadata or {}),
                                   network=self._rules(egress, nic=bool(snap.vm.get("nic"))),
                                   volume_port=bool(snap.vm.get("volume_port")), volumes=volumes,
                                   **lifetime)  # type: ignore[arg-type]
            work = self.registry.workdir(sid)
            self.registry.save(record)
            return self._start(record, self._restore_spec(snapshot_id, snap, work), {"manifest": snap.layers["disk"]},
                               snap.layers["memory"], state_layer=snap.layers["state"])

    def _restore_spec(self, snapshot_id: str, snap: Snapshot, work: Path) -> VmSpec:
        return VmSpec(
            kernel=self.boot_files.file("vmlinuz", str(snap.vm["kernel"])),
            initrd=self.boot_files.file("initramfs.cpio.gz", str(snap.vm["initrd"])),
            disk=self.paths.sandbox(work.name), workdir=work,
            memory_mib=int(snap.vm["memory_mib"]), cmdline=str(snap.vm["cmdline"]),  # type: ignore[arg-type]
            memory_file=self._memory_path(work.name), incoming=self.paths.snapshot(snapshot_id, "state"),
            incoming_devices_only=bool(snap.vm.get("devices_only")),
            volume_port=bool(snap.vm.get("volume_port")))

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
            self.snapshots.check_complete(record.last_snapshot, snap)
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
            self.volumes.forget(sid)
            self.registry.remove(sid)

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
            self.volumes.forget(sid)
            self.registry.remove(sid)  # releasing the lock then removes its file too
            self.snapshots.drop_if_unused(record.last_snapshot)
            if record.source.startswith("snapshot:"):  # a fork's: its origin may be unneeded now
                self.snapshots.drop_if_unused(record.source.split(":", 1)[1])

    def mount_volumes(self, sid: str, mounts: dict[str, str], *, timeout: float = 60.0) -> SandboxRecord:
        """Mount volumes in the running guest of `sid`: {absolute guest path:
        volume id}. Which team may mount which volume is the caller's
        check. InvalidInput if the VM has no volume port (its template
        was made before volume mounts, or the backend has none)."""
        with self._locked(sid):
            sandbox = self.get(sid)
            record = sandbox.record
            if not record.volume_port:
                why = ("its template predates volume mounts: build it again" if self.backend.volume_port
                       else f"{self.backend.name} has none")
                raise InvalidInput(f"sandbox {sid} cannot mount volumes: its VM has no volume port ({why})")
            taken = set(mounts) & set(record.volumes)
            if taken:
                raise Conflict(f"{sorted(taken)[0]} already has a volume mounted in sandbox {sid}")
            record.volumes = {**record.volumes, **mounts}
            self.registry.save(record)
            self._serve_volumes(record, ensure=True)
            for path, volume_id in mounts.items():
                sandbox.vm.agent.call("mount_volume", volume=volume_id, path=path, timeout=timeout)
            events.append(sandbox.workdir, "info", "volumes mounted",
                          mounts=" ".join(f"{p}={v}" for p, v in sorted(mounts.items())))
            return record

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


def snapshot_volumes(snap: Snapshot) -> dict[str, str]:
    """The volumes a snapshot's guest has mounted ({guest path: volume id});
    CorruptObject if its annotation is not that."""
    text = snap.annotations.get("volumes")
    if text is None:
        return {}
    try:
        mounts = json.loads(text)
        if isinstance(mounts, dict) and all(isinstance(p, str) and p.startswith("/") and is_volume_id(v)
                                            for p, v in mounts.items()):
            return dict(mounts)
    except ValueError:
        pass
    raise CorruptObject("a snapshot's volumes annotation is not {guest path: volume id}")


def _note(reason: str) -> str:
    """A record's `recovered` text: when (UTC) and what was done."""
    return f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {reason}"
