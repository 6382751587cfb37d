"""The mount's tree as fusefs/paths.py states it: the paths the VMM opens
are the ones fs.py serves (tests/test_fusefs_mount.py reads through them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusefs.paths import MountPaths


def test_each_file_of_the_mount_has_one_path() -> None:
    paths = MountPaths(Path("/mnt/strata"))
    assert paths.image("base:v1") == Path("/mnt/strata/images/base:v1/disk.img")
    assert paths.layer("sha256-ab") == Path("/mnt/strata/layers/sha256-ab/disk.img")
    assert paths.sandbox("sb1.mem") == Path("/mnt/strata/sandboxes/sb1.mem/disk.img")
    assert [paths.snapshot("sha256-cd", role) for role in ("disk", "memory", "state")] == [
        Path("/mnt/strata/snapshots/sha256-cd/disk.img"), Path("/mnt/strata/snapshots/sha256-cd/memory"),
        Path("/mnt/strata/snapshots/sha256-cd/state")]
    with pytest.raises(KeyError):
        paths.snapshot("sha256-cd", "kernel")
