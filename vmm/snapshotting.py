"""The snapshot pipeline: a sandbox's disk, RAM and device state into the store.

`Sandboxes` (vmm/sandbox.py) runs a snapshot and keeps its record and lock;
`Snapshotting` does the steps that move bytes:

    precopy  = while the guest runs: the guest RAM the VMM holds written
               back (Vm.sync_memory), both upper layers sealed and their
               seals published
    capture  = with the guest paused: device state to workdir/state and the
               rest of guest RAM written back (Vm.save_state), both upper
               layers sealed (each new
               layer holds only the chunks dirtied since the last seal)
    publish  = the guest may run again: the seals published, the state file
               imported as a layer, the snapshot manifest written (parent:
               the previous snapshot)

Each step returns its timings ("precopy", "capture", "seal", "publish").
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fusefs.client import MountClient
from fusefs.paths import MountPaths
from layerstore import inventory
from layerstore.errors import MissingChunk, NotFound, StrataError
from layerstore.importer import import_image
from layerstore.snapshot import Snapshot
from layerstore.store import Store

from .backend import DEFAULT_CMDLINE, Vm
from .registry import SandboxRecord

log = logging.getLogger("strata.vmm")


class Snapshotting:
    """The snapshot steps of one node's sandboxes. Takes no locks: the
    caller holds the sandbox's (`Sandboxes._locked`) around all of them."""

    def __init__(self, store: Store, client: MountClient, backend: str, boot_layer: Callable[[str], str], *,
                 records: Callable[[], list[SandboxRecord]]) -> None:
        """`records()` are the node's sandbox records (what may still need a snapshot)."""
        self.store = store
        self.records = records
        self.client = client  # the mount daemon: seals
        self.mount = client.mountpoint
        self.paths = MountPaths(self.mount)
        self.backend = backend  # its name, recorded in the snapshot
        self.boot_layer = boot_layer  # "vmlinuz" -> the layer of the node's kernel (vmm/bootfiles.py)

    # what the store keeps, and what a restore needs of it --------------------------------------
    def drop_if_unused(self, snapshot_id: str | None) -> None:
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
            if any(r.last_snapshot == snapshot_id or r.source == source for r in self.records()):
                return
            self.store.delete_snapshot(snapshot_id)
        except NotFound:  # deleted already
            return
        except StrataError as exc:
            log.warning("kept snapshot %s, which nothing may need any more: %s", snapshot_id, exc)
            return
        log.info("deleted snapshot %s of sandbox %s (%s): nothing needs it any more", snapshot_id,
                 notes.get("sandbox"), notes["implicit"])

    def check_complete(self, snapshot_id: str, snap: Snapshot) -> None:
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


    def precopy(self, sid: str, vm: Vm) -> dict[str, float]:
        """While the guest still runs: its dirty RAM written back, and the RAM
        and disk upper layers sealed and published, as a live migration
        copies memory before it stops the VM. The pause that follows then
        writes back, seals and publishes only what the guest changed in the
        meantime, a few chunks instead of every chunk dirtied since the last
        snapshot, which were most of an incremental snapshot's pause to
        published. The price is a second layer per snapshot (pages changed
        in both windows are stored twice) and the snapshot call's own time."""
        t0 = time.monotonic()
        vm.sync_memory()
        self._seal_layers(sid)
        self.client.await_seal(sid)
        self.client.await_seal(memory_sid(sid))
        return {"precopy": time.monotonic() - t0}

    def capture(self, sid: str, vm: Vm, workdir: Path) -> dict[str, float]:
        """The part of a snapshot that needs the guest paused: device state
        saved, dirty RAM written back, RAM and disk upper layers sealed (a
        switch to new generations; publication goes on in the background)."""
        t0 = time.monotonic()
        vm.save_state(workdir / "state")
        self._seal_layers(sid)
        return {"capture": time.monotonic() - t0}

    def publish(self, record: SandboxRecord, workdir: Path, implicit: str, timings: dict[str, float], *,
                devices_only: bool = False) -> str:
        """The rest, which the guest need not wait for: the seals published,
        device state stored (beside them), the snapshot written (`implicit`:
        why the sandbox took it for its own sake, "" if asked for). Adds the
        step timings ("seal", "publish") to `timings` and returns the
        snapshot's id."""
        sid = record.sid
        t1 = time.monotonic()
        with ThreadPoolExecutor(1, thread_name_prefix="strata-state") as pool:
            state = pool.submit(import_image, self.store, workdir / "state")
            disk = self.client.await_seal(sid).manifest
            memory = self.client.await_seal(memory_sid(sid)).manifest
            t2 = time.monotonic()
            state_id = state.result().manifest_id
        snap = Snapshot(
            layers={"disk": disk, "memory": memory, "state": state_id},
            vm={"backend": self.backend, "cmdline": DEFAULT_CMDLINE, "cpus": 1, "memory_mib": record.memory_mib,
                "kernel": self.boot_layer("vmlinuz"), "initrd": self.boot_layer("initramfs.cpio.gz"),
                **({"nic": True} if record.network is not None else {}),
                **({"volume_port": True} if record.volume_port else {}),
                **({"devices_only": True} if devices_only else {})},
            parent=self._existing_snapshot(record.last_snapshot),
            annotations={"sandbox": sid, "team": record.team, **({"implicit": implicit} if implicit else {}),
                         **({"volumes": json.dumps(record.volumes, sort_keys=True)} if record.volumes else {})},
        )
        snapshot_id = self.store.put_snapshot(snap)
        timings.update(seal=t2 - t1, publish=time.monotonic() - t2)
        return snapshot_id

    def _seal_layers(self, sid: str) -> None:
        """Seal the disk and RAM upper layers (publication goes on in the
        background), the guest's RAM pages dirty in the page cache written
        back into their upper layer first."""
        self._flush_memory(sid)
        self._flush_mount()
        self.client.seal(sid)
        self.client.seal(memory_sid(sid))

    def _existing_snapshot(self, snapshot_id: str | None) -> str | None:
        """The parent pointer of a new snapshot: the previous one, unless it was
        deleted since (its layers, which the new one builds on, are kept by GC
        as long as this sandbox's disk and RAM sit on them)."""
        if snapshot_id is None:
            return None
        try:
            self.store.get_snapshot(snapshot_id)
        except NotFound:
            return None
        return snapshot_id

    def _flush_memory(self, sid: str) -> None:
        """Write back the guest RAM pages dirty in the page cache (for a VM
        that maps this file shared, or wrote it: vmm/cowmemory.py fsyncs
        too) and wait for the mount to have them: fsync(2) of the file.

        syncfs(2) of the mount does not do it: it returns with the pages
        still dirty. Until QEMU was handed the state file as a descriptor,
        the shell QEMU forked for `exec:cat > FILE` did it by accident: the
        child's copy of the mapping, closed at exec, wrote the file back
        (FUSE's vma close), at a cost to every save.
        """
        try:
            fd = os.open(self.paths.sandbox(memory_sid(sid)), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StrataError(f"writing back sandbox {sid}'s RAM: {exc}") from None

    def _flush_mount(self) -> None:
        """Write back every dirty page of the mount (the disk's, should QEMU
        have left any) without opening each file: syncfs(2)."""
        fd = os.open(self.mount, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _libc().syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise StrataError(f"syncfs on {self.mount} failed: {os.strerror(err)}")
        finally:
            os.close(fd)


def memory_sid(sid: str) -> str:
    """The mount's name for a sandbox's RAM upper layer: sandboxes/<sid>.mem/disk.img."""
    return f"{sid}.mem"


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
