"""What a VM boots from besides its disk: the node's kernel and initrd, as
layers a snapshot can name, and the all-holes layer a booted VM's RAM
starts from.

A snapshot records its kernel and initrd as layers, so a restore on any
node finds the very bytes it was taken with. Importing them is done once
per file version (identical bytes dedup anyway); a restore reads the node's
own file when it is that layer, unchanged since (a local read), else the
layer through the mount.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from fusefs.paths import MountPaths
from layerstore.errors import StrataError
from layerstore.importer import import_image
from layerstore.store import Store

from .registry import SandboxRecord

KERNEL, INITRD = "vmlinuz", "initramfs.cpio.gz"


class BootFiles:
    def __init__(self, store: Store, guest_dir: Path, paths: MountPaths, *, scratch: Path) -> None:
        """`guest_dir` holds the node's kernel and initrd; `scratch` is where a
        sparse file is made to import an all-holes RAM layer."""
        self._store = store
        self._guest_dir = guest_dir
        self._paths = paths
        self._scratch = scratch
        self._layers: dict[str, str] = {}
        self._signatures: dict[str, tuple[int, int, int] | None] = {}  # of the files imported as those layers
        self._guard = threading.Lock()

    def layer(self, name: str) -> str:
        """The node's kernel or initrd (`name`) as a layer (imported once per version)."""
        with self._guard:
            signature = _signature(self._guest_dir / name)
            if name not in self._layers or self._signatures.get(name) != signature:
                # a ref keeps the layer from GC between snapshots that name it
                ref = "strata-boot:" + name.replace(".", "-")
                self._layers[name] = import_image(self._store, self._guest_dir / name, ref).manifest_id
                self._signatures[name] = signature
            return self._layers[name]

    def file(self, name: str, layer: str) -> Path:
        """A snapshot's kernel or initrd (`layer`) for QEMU: the node's own
        file when it is that very layer (imported from it, unchanged since),
        read from the local disk; else the layer on the mount, whose first
        read on a node fetches the whole file through FUSE while the restore
        waits."""
        path = self._guest_dir / name
        with self._guard:
            same = self._layers.get(name) == layer and self._signatures.get(name) == _signature(path)
        return path if same else self._paths.layer(layer)

    def of_record(self, record: SandboxRecord) -> tuple[Path, Path]:
        """Kernel and initrd to cold-boot `record`: its snapshot's, if it came from one."""
        if record.source.startswith("snapshot:"):
            try:
                snap = self._store.get_snapshot(record.source.split(":", 1)[1])
                return self.file(KERNEL, str(snap.vm["kernel"])), self.file(INITRD, str(snap.vm["initrd"]))
            except StrataError:  # deleted since: the node's own guest boots the same disk
                pass
        return self._guest_dir / KERNEL, self._guest_dir / INITRD

    def zero_memory(self, memory_mib: int) -> str:
        """The layer a booted VM's RAM starts from: all holes (costs nothing to store)."""
        name = f"zero-{memory_mib}M"
        with self._guard:
            if name not in self._layers:
                with tempfile.NamedTemporaryFile(dir=self._scratch, prefix=".zero-") as f:
                    f.truncate(memory_mib << 20)
                    self._layers[name] = import_image(self._store, f.name, f"strata-boot:{name}").manifest_id
            return self._layers[name]


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or rewritten: inode, size, mtime."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
