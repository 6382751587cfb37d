"""vmm/durable.py: state files are replaced whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmm.durable import write_durably


def test_replaces_whole_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "vm.json"
    write_durably(path, b'{"pid": 1}')
    write_durably(path, b'{"pid": 2}')
    assert path.read_bytes() == b'{"pid": 2}' and sorted(p.name for p in tmp_path.iterdir()) == ["vm.json"]


def test_a_failed_write_keeps_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "vm.json"
    write_durably(path, b'{"pid": 1}')
    with pytest.raises(TypeError):
        write_durably(path, "not bytes")  # type: ignore[arg-type]  # fails mid-write
    assert path.read_bytes() == b'{"pid": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["vm.json"]
