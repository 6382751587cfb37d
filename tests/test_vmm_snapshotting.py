"""vmm/snapshotting.py without a VM or a mount daemon: the order of the
pipeline's steps and the snapshot it publishes. (Real QEMU guests go
through it in test_vmm_qemu.py; `Sandboxes`' handling of a failed step is
in test_vmm_sandbox.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from layerstore.importer import import_image
from layerstore.store import open_store
from tests.images import write_image
from vmm.registry import SandboxRecord
from vmm.snapshotting import Snapshotting, memory_sid


class FakeMount:
    """The mount daemon's client: seals logged, each publishing a fixed layer."""

    def __init__(self, mountpoint: Path, layers: dict[str, str]) -> None:
        self.mountpoint = mountpoint
        self.layers = layers  # sid -> the manifest its seal publishes
        self.calls: list[str] = []
        for sid in layers:
            (mountpoint / "sandboxes" / sid).mkdir(parents=True)
            (mountpoint / "sandboxes" / sid / "disk.img").touch()

    def seal(self, sid: str, *, wait: bool = False) -> None:
        self.calls.append(f"seal {sid}")

    def await_seal(self, sid: str) -> SimpleNamespace:
        self.calls.append(f"await {sid}")
        return SimpleNamespace(manifest=self.layers[sid])


class StateVm:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def save_state(self, path: Path) -> None:
        self.calls.append("save_state")
        path.write_bytes(b"device state")

    def sync_memory(self) -> None:
        self.calls.append("sync_memory")


def pipeline(tmp_path: Path) -> tuple[Snapshotting, FakeMount]:
    store = open_store(str(tmp_path / "store"))
    layers = {}
    for i, name in enumerate(("box", memory_sid("box"), "vmlinuz", "initramfs.cpio.gz")):
        write_image(tmp_path / f"{name}.img", "rz", chunk=1 << 16, seed=i)
        layers[name] = import_image(store, tmp_path / f"{name}.img", None, chunk_size=1 << 16).manifest_id
    mount = FakeMount(tmp_path / "mnt", {"box": layers["box"], "box.mem": layers["box.mem"]})
    return Snapshotting(store, mount, "fake", lambda name: layers[name], records=list), mount  # type: ignore[arg-type]


def test_precopy_capture_publish_seal_both_layers_and_chain_the_snapshots(tmp_path: Path) -> None:
    snaps, mount = pipeline(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    timings = snaps.precopy("box", StateVm(mount.calls))  # type: ignore[arg-type]
    assert mount.calls == ["sync_memory", "seal box", "seal box.mem", "await box", "await box.mem"]
    mount.calls.clear()
    timings.update(snaps.capture("box", StateVm(mount.calls), work))  # type: ignore[arg-type]
    assert mount.calls == ["save_state", "seal box", "seal box.mem"]  # nothing waits on a publication
    record = SandboxRecord("box", "fake", "image:x:v1", 256, team="t1")
    first = snaps.publish(record, work, "", timings)
    assert set(timings) == {"precopy", "capture", "seal", "publish"}
    snap = snaps.store.get_snapshot(first)
    assert snap.layers["disk"] == mount.layers["box"] and snap.layers["memory"] == mount.layers["box.mem"]
    assert snap.vm["backend"] == "fake" and snap.vm["memory_mib"] == 256 and "nic" not in snap.vm
    assert snap.parent is None and snap.annotations == {"sandbox": "box", "team": "t1"}

    record.last_snapshot = first
    second = snaps.publish(record, work, "pause", {})
    assert snaps.store.get_snapshot(second).parent == first
    assert "devices_only" not in snaps.store.get_snapshot(second).vm
    record.last_snapshot = second
    third = snaps.publish(record, work, "", {}, devices_only=True)  # a restore must leave the boot files out
    assert snaps.store.get_snapshot(third).vm["devices_only"] is True
    assert snaps.store.get_snapshot(second).annotations["implicit"] == "pause"
    snaps.store.delete_snapshot(second)
    record.last_snapshot = second  # deleted since: the next one starts a new chain
    assert snaps.store.get_snapshot(snaps.publish(record, work, "", {})).parent is None
