"""Sandboxes: VMs whose disk, memory and state live in Strata's layers.

`Sandboxes` ties the pieces together: the mount daemon gives each sandbox a
copy-on-write disk (`fusefs`), a `VmmBackend` runs the VM with its RAM in a
file, and the store keeps snapshots:

    snapshot = pause -> device state to a file -> seal the disk's upper layer
               -> RAM file and state file imported as layers (RAM with the
                  previous snapshot's RAM as parent, so only changed chunks
                  are stored) -> snapshot manifest -> resume
    restore  = new copy-on-write disk over the snapshot's disk layer, RAM
               mapped copy-on-write from snapshots/<id>/memory on the mount
               (paged in lazily), device state streamed from .../state
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from fusefs.client import call
from layerstore.errors import InvalidInput, MissingChunk, NotFound
from layerstore.importer import import_image
from layerstore.snapshot import Snapshot
from layerstore.store import Store

from .backend import DEFAULT_CMDLINE, Vm, VmmBackend, VmSpec


@dataclass
class Sandbox:
    sid: str
    vm: Vm
    workdir: Path
    memory_mib: int
    last_snapshot: str | None = None
    last_memory: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


class Sandboxes:
    """Boot, snapshot, restore and kill sandboxes on one node."""

    def __init__(
        self,
        store: Store,
        mountpoint: Path,
        backend: VmmBackend,
        *,
        guest_dir: Path,
        work_root: Path,
        memory_mib: int = 256,
        control_env: dict[str, str] | None = None,
    ) -> None:
        self.store = store
        self.mount = mountpoint
        self.backend = backend
        self.guest_dir = guest_dir
        self.work_root = work_root
        self.memory_mib = memory_mib
        self._env = control_env
        self.running: dict[str, Sandbox] = {}
        self._boot_layers: dict[str, str] = {}

    def _call(self, request: dict) -> dict:
        return call(self.mount, request, env=self._env)

    def _boot_layer(self, name: str) -> str:
        """Kernel and initrd as layers (imported once; identical bytes dedup)."""
        if name not in self._boot_layers:
            self._boot_layers[name] = import_image(self.store, self.guest_dir / name).manifest_id
        return self._boot_layers[name]

    def boot(self, sid: str, image: str) -> Sandbox:
        if sid in self.running:
            raise InvalidInput(f"sandbox {sid} is already running")
        self._call({"op": "sandbox_create", "sid": sid, "image": image})
        work = self.work_root / sid
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        started = time.monotonic()
        try:
            vm = self.backend.start(VmSpec(
                kernel=self.guest_dir / "vmlinuz", initrd=self.guest_dir / "initramfs.cpio.gz",
                disk=self.mount / "sandboxes" / sid / "disk.img", workdir=work, memory_mib=self.memory_mib,
                cmdline=DEFAULT_CMDLINE, memory_file=work / "ram", memory_shared=True))
        except BaseException:
            self._call({"op": "sandbox_remove", "sid": sid})
            raise
        sandbox = Sandbox(sid, vm, work, self.memory_mib, timings={"boot": time.monotonic() - started})
        self.running[sid] = sandbox
        return sandbox

    def snapshot(self, sid: str, *, resume: bool = True) -> str:
        sandbox = self.running.get(sid)
        if sandbox is None:
            raise NotFound(f"sandbox {sid} is not running")
        t0 = time.monotonic()
        sandbox.vm.pause()
        state = sandbox.workdir / "state"
        sandbox.vm.save_state(state)
        t1 = time.monotonic()
        disk = self._call({"op": "seal", "sid": sid, "wait": True})["manifest"]
        t2 = time.monotonic()
        memory = import_image(self.store, sandbox.workdir / "ram", parent=sandbox.last_memory).manifest_id
        state_id = import_image(self.store, state).manifest_id
        snap = Snapshot(
            layers={"disk": disk, "memory": memory, "state": state_id},
            vm={"backend": self.backend.name, "cmdline": DEFAULT_CMDLINE, "cpus": 1, "memory_mib": sandbox.memory_mib,
                "kernel": self._boot_layer("vmlinuz"), "initrd": self._boot_layer("initramfs.cpio.gz")},
            parent=sandbox.last_snapshot,
            annotations={"sandbox": sid},
        )
        snapshot_id = self.store.put_snapshot(snap)
        t3 = time.monotonic()
        sandbox.last_snapshot, sandbox.last_memory = snapshot_id, memory
        if resume:
            sandbox.vm.resume()
        sandbox.timings.update({"capture": t1 - t0, "seal": t2 - t1, "publish": t3 - t2})
        return snapshot_id

    def restore(self, snapshot_id: str, sid: str) -> Sandbox:
        if sid in self.running:
            raise InvalidInput(f"sandbox {sid} is already running")
        snap = self.store.get_snapshot(snapshot_id)
        self._check_complete(snapshot_id, snap)
        self._call({"op": "sandbox_create", "sid": sid, "manifest": snap.layers["disk"]})
        served = self.mount / "snapshots" / snapshot_id
        work = self.work_root / sid
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        started = time.monotonic()
        try:
            vm = self.backend.start(VmSpec(
                kernel=self.mount / "layers" / str(snap.vm["kernel"]) / "disk.img",
                initrd=self.mount / "layers" / str(snap.vm["initrd"]) / "disk.img",
                disk=self.mount / "sandboxes" / sid / "disk.img", workdir=work,
                memory_mib=int(snap.vm["memory_mib"]), cmdline=str(snap.vm["cmdline"]),  # type: ignore[arg-type]
                memory_file=served / "memory", memory_shared=False, incoming=served / "state"))
        except BaseException:
            self._call({"op": "sandbox_remove", "sid": sid})
            raise
        sandbox = Sandbox(sid, vm, work, int(snap.vm["memory_mib"]), last_snapshot=snapshot_id,  # type: ignore[arg-type]
                          last_memory=snap.layers["memory"], timings={"restore": time.monotonic() - started})
        self.running[sid] = sandbox
        return sandbox

    def _check_complete(self, snapshot_id: str, snap: Snapshot) -> None:
        """Refuse to start a VM whose memory or disk could fault on a missing chunk.

        Guest memory pages in lazily: a chunk missing from the store would
        surface as a crash mid-run. One batched existence check up front
        turns that into a clear error before anything starts.
        """
        digests: set[str] = set()
        for layer_id in snap.layer_ids():
            digests.update(self.store.chunk_map(layer_id)[1].values())
        missing = self.store.missing_chunks(digests)
        if missing:
            raise MissingChunk(
                f"snapshot {snapshot_id} cannot be restored: {len(missing)} chunk(s) missing from "
                f"{self.store.describe()} (e.g. {sorted(missing)[0]})"
            )

    def fork(self, sid: str, count: int, *, prefix: str | None = None) -> list[Sandbox]:
        """Snapshot `sid` once (it keeps running), then restore `count`
        independent sandboxes from it, each with its own upper layer."""
        if not 1 <= count <= 100:
            raise InvalidInput(f"fork count {count} must be between 1 and 100")
        snapshot_id = self.snapshot(sid, resume=True)
        forks: list[Sandbox] = []
        try:
            for i in range(count):
                forks.append(self.restore(snapshot_id, f"{prefix or sid}-fork{i + 1}"))
        except BaseException:
            for fork in forks:
                self.kill(fork.sid)
            raise
        return forks

    def kill(self, sid: str) -> None:
        sandbox = self.running.pop(sid, None)
        if sandbox is None:
            raise NotFound(f"sandbox {sid} is not running")
        sandbox.vm.kill()
        self._call({"op": "sandbox_remove", "sid": sid})
        shutil.rmtree(sandbox.workdir, ignore_errors=True)
