"""Where each file sits in a mount: the one statement of the tree fs.py serves.

    MOUNT/
      images/NAME:TAG/disk.img        read-only, lazily fetched
      layers/<manifest id>/disk.img   any layer stack by id, read-only
      snapshots/<id>/{disk.img,memory,state}   a VM snapshot's layers, read-only
      sandboxes/SID/disk.img          copy-on-write over an image (read-write)

fs.py builds its directories from these names, the daemon names a sandbox
disk's path with them, and the VMM (vmm/sandbox.py) points VMs at files on
the mount through `MountPaths`, so the layout is spelled once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

IMAGES = "images"
LAYERS = "layers"
SNAPSHOTS = "snapshots"
SANDBOXES = "sandboxes"
DISK = "disk.img"  # the one file of an image, layer or sandbox directory
# a snapshot directory's files by the role of their layer (Snapshot.layers)
SNAPSHOT_FILES = MappingProxyType({"disk": DISK, "memory": "memory", "state": "state"})


@dataclass(frozen=True)
class MountPaths:
    """The paths of the files a mount at `root` serves."""

    root: Path

    def image(self, ref: str) -> Path:
        """An image's disk, by its NAME:TAG."""
        return self.root / IMAGES / ref / DISK

    def layer(self, manifest_id: str) -> Path:
        """Any layer stack's disk, by its manifest id."""
        return self.root / LAYERS / manifest_id / DISK

    def snapshot(self, snapshot_id: str, role: str) -> Path:
        """One of a snapshot's layers: `role` is "disk", "memory" or "state"."""
        return self.root / SNAPSHOTS / snapshot_id / SNAPSHOT_FILES[role]

    def sandbox(self, sid: str) -> Path:
        """A sandbox's copy-on-write disk (its RAM layer is a sandbox too)."""
        return self.root / SANDBOXES / sid / DISK
