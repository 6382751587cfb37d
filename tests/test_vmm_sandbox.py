"""vmm/sandbox.py without a VM: what `Sandboxes` does when a step fails.
(Real QEMU guests go through the same code in test_vmm_qemu.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from layerstore.errors import BackendUnavailable
from layerstore.importer import import_image
from layerstore.store import open_store
from tests.test_vmm_lock import FakeVm, fake_node
from vmm.bootfiles import BootFiles
from vmm.registry import LOCKS


class SavingVm(FakeVm):
    def save_state(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"device state")


def failing_seal(sid: str, *, wait: bool = False) -> None:
    raise BackendUnavailable("the object store did not answer")


@pytest.mark.parametrize("paused_before, fails", [(False, "precopy"), (False, "paused"), (True, "paused")])
def test_a_failed_snapshot_leaves_the_vm_as_it_was_and_the_record_true(tmp_path: Path, paused_before: bool,
                                                                       fails: str) -> None:
    """A running guest's snapshot starts with a pre-copy (its RAM written
    back and both layers sealed while it runs): a failure there pauses
    nothing; one after the pause gives the guest its vCPUs back."""
    boxes, backend = fake_node(tmp_path)
    (tmp_path / "mnt" / "sandboxes" / "box.mem").mkdir(parents=True)
    (tmp_path / "mnt" / "sandboxes" / "box.mem" / "disk.img").touch()  # the RAM file a snapshot writes back
    vm = backend.vms["box"] = SavingVm(tmp_path / "work" / LOCKS / "box", 4242)
    seals: list[str] = []

    def seal(sid: str, *, wait: bool = False) -> None:
        seals.append(sid)
        if fails == "precopy" or "pause" in vm.calls:
            failing_seal(sid)

    boxes.client.seal = seal  # type: ignore[attr-defined]
    boxes.client.await_seal = lambda sid: None  # type: ignore[attr-defined]
    if paused_before:
        boxes.pause("box")
        vm.calls.clear()
    with pytest.raises(BackendUnavailable, match="did not answer"):
        boxes.snapshot("box")
    record = boxes.registry.load("box")
    if paused_before:  # no pre-copy; stays paused, as the record says
        assert vm.calls == ["pause"] and record.state == "paused" and seals == ["box"]
    elif fails == "precopy":  # the guest was never paused
        assert vm.calls == [] and record.state == "running" and seals == ["box"]
    else:  # the pre-copy sealed both layers; the guest gets its vCPUs back, and the record says running
        assert vm.calls == ["pause", "resume"] and record.state == "running" and seals == ["box", "box.mem", "box"]
    assert record.last_snapshot is None and record.operation == ""


class StoppedVm(FakeVm):
    """A VM whose vCPUs a dead snapshot left stopped."""

    def status(self) -> str:
        return "running" if "resume" in self.calls else "paused"


@pytest.mark.parametrize("state", ["running", "paused"])
def test_an_operation_that_died_midway_is_finished_by_the_next_lock_holder(tmp_path: Path, state: str) -> None:
    boxes, backend = fake_node(tmp_path)
    vm = backend.vms["box"] = StoppedVm(tmp_path / "work" / LOCKS / "box", 4242)
    boxes.update("box", state=state, operation="snapshot")  # as a SIGKILLed snapshot leaves it
    assert boxes.finish_interrupted() == ["box"]
    record = boxes.registry.load("box")
    assert record.operation == "" and record.state == state
    assert vm.calls == (["resume"] if state == "running" else [])  # the record's state is the VM's again
    assert boxes.finish_interrupted() == []


def test_a_restore_boots_from_the_nodes_own_kernel_only_when_it_is_the_snapshots(tmp_path: Path) -> None:
    """QEMU reads the kernel of a restore from the node's guest directory
    when that file is the snapshot's kernel layer, byte for byte; a rebuilt
    file or another layer goes through the mount, as before."""
    boxes, _backend = fake_node(tmp_path)
    store = open_store(str(tmp_path / "store"))
    boxes.boot_files = BootFiles(store, tmp_path, boxes.paths, scratch=tmp_path)  # vmm/bootfiles.py over a real store
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"kernel one" * 1000)
    layer = boxes.boot_files.layer("vmlinuz")  # as a snapshot records it
    assert boxes.boot_files.file("vmlinuz", layer) == kernel
    other = import_image(store, kernel, None, chunk_size=1 << 16).manifest_id  # another chunking: another layer
    assert other != layer and boxes.boot_files.file("vmlinuz", other) == tmp_path / "mnt" / "layers" / other / "disk.img"
    kernel.write_bytes(b"kernel two" * 1000)  # rebuilt since: no longer that layer
    assert boxes.boot_files.file("vmlinuz", layer) == tmp_path / "mnt" / "layers" / layer / "disk.img"
    assert boxes.boot_files.layer("vmlinuz") != layer  # and the next snapshot names the new one
