"""Snapshot manifests: one VM's disk, memory and device state, as layers.

A snapshot names three layer stacks (each a layer manifest id) and how to run
them again, plus the snapshot it was taken after (so incremental snapshots
form a chain; their layers have parents too, and unchanged chunks are shared
by content). Stored at `snapshots/<id>` as canonical JSON:

    {
      "annotations": {"sandbox": "sb1"},        optional, str -> str
      "kind": "snapshot",
      "layers": {"disk": "<layer id>", "memory": "<layer id>", "state": "<layer id>"},
      "parent": "<snapshot id>" | null,
      "v": 1,
      "vm": {"backend": "qemu", "cmdline": "console=ttyS0 ...", "cpus": 1,
             "initrd": "<layer id>", "kernel": "<layer id>", "memory_mib": 256,
             "nic": true,                       optional: the VM had a network card
             "volume_port": true,               optional: ... the volume port (vmm/volumeport.py)
             "devices_only": true}              optional: the state layer is device state alone
                                                (no RAM, no ROM: vmm/qemu.py)
    }

A snapshot of a sandbox with volumes mounted names them in its annotations
(`"volumes": "{\"/mnt/data\": \"vol...\"}"`, JSON text): its guest's memory
holds those mounts, so whatever restores it serves them.

The id is the blake3-256 of those bytes. A snapshot is published only after
every layer it names (and its parent snapshot) is in the store, so a reader
that finds a snapshot can always restore it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

from .digest import check_digest, digest_bytes, is_digest
from .errors import CorruptObject, InvalidInput
from .manifest import canonical_json, check_annotations, check_hashes_to

FORMAT_VERSION = 1
LAYER_ROLES = ("disk", "memory", "state")
VM_INT_FIELDS = ("cpus", "memory_mib")
VM_STR_FIELDS = ("backend", "cmdline")
VM_LAYER_FIELDS = ("kernel", "initrd")
VM_OPTIONAL_BOOL_FIELDS = ("nic", "volume_port", "devices_only")  # absent = false (snapshots from before they existed)


SNAPSHOT_PREFIX = "snapshots/"


def snapshot_key(snapshot_id: str) -> str:
    check_digest(snapshot_id, what="snapshot id")
    return f"{SNAPSHOT_PREFIX}{snapshot_id}"


@dataclass(frozen=True)
class Snapshot:
    layers: Mapping[str, str]
    vm: Mapping[str, object]
    parent: str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    def layer_ids(self) -> set[str]:
        """Every layer manifest this snapshot needs (disk, memory, state, kernel, initrd)."""
        return set(self.layers.values()) | {str(self.vm[f]) for f in VM_LAYER_FIELDS}

    def encode(self) -> bytes:
        _validate(self)
        body: dict[str, object] = {
            "kind": "snapshot",
            "layers": dict(self.layers),
            "parent": self.parent,
            "v": FORMAT_VERSION,
            "vm": dict(self.vm),
        }
        if self.annotations:
            body["annotations"] = dict(self.annotations)
        return canonical_json(body)

    def snapshot_id(self) -> str:
        return digest_bytes(self.encode())


def _validate(snap: Snapshot) -> None:
    if set(snap.layers) != set(LAYER_ROLES):
        raise InvalidInput(f"snapshot layers must be exactly {', '.join(LAYER_ROLES)}")
    for role, layer_id in snap.layers.items():
        check_digest(layer_id, what=f"{role} layer id")
    expected = set(VM_INT_FIELDS) | set(VM_STR_FIELDS) | set(VM_LAYER_FIELDS)
    if set(snap.vm) - set(VM_OPTIONAL_BOOL_FIELDS) != expected:
        raise InvalidInput(f"snapshot vm fields must be exactly {', '.join(sorted(expected))} "
                           f"(and optionally {', '.join(VM_OPTIONAL_BOOL_FIELDS)})")
    for name in VM_OPTIONAL_BOOL_FIELDS:
        if not isinstance(snap.vm.get(name, False), bool):
            raise InvalidInput(f"snapshot vm.{name} must be true or false")
    for name in VM_INT_FIELDS:
        value = snap.vm[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 20:
            raise InvalidInput(f"snapshot vm.{name} {value!r} out of range")
    for name in VM_STR_FIELDS:
        if not isinstance(snap.vm[name], str) or len(str(snap.vm[name])) > 4096:
            raise InvalidInput(f"snapshot vm.{name} must be a string")
    for name in VM_LAYER_FIELDS:
        check_digest(snap.vm[name], what=f"vm.{name} layer id")
    if snap.parent is not None:
        check_digest(snap.parent, what="parent snapshot id")
    check_annotations(snap.annotations)


def parse_snapshot(snapshot_id: str, blob: bytes) -> Snapshot:
    """Verify `blob` hashes to `snapshot_id` and decode it, or raise CorruptObject."""
    check_hashes_to("snapshot", snapshot_id, blob)
    try:
        body = json.loads(blob)
        if not isinstance(body, dict) or body.get("v") != FORMAT_VERSION or body.get("kind") != "snapshot":
            raise ValueError("not a version-1 snapshot manifest")
        extra = set(body) - {"v", "kind", "layers", "vm", "parent", "annotations"}
        if extra:
            raise ValueError(f"unknown fields {sorted(extra)}")
        if not isinstance(body["layers"], dict) or not isinstance(body["vm"], dict):
            raise ValueError("layers and vm must be objects")
        snap = Snapshot(layers=body["layers"], vm=body["vm"], parent=body["parent"],
                        annotations=body.get("annotations", {}))
        _validate(snap)
    except (ValueError, KeyError, TypeError, InvalidInput) as exc:
        raise CorruptObject(f"snapshot {snapshot_id}: malformed ({exc})") from None
    return snap


def is_snapshot_key(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 2 and parts[0] == "snapshots" and is_digest(parts[1])
