"""layerstore/tarsafe.py: ordinary archives read exactly as tarfile reads
them; every hostile header shape (tests/hostile_tars.py) is refused,
streamed or not, compressed or not, within a few MiB and a fraction of a
second."""

from __future__ import annotations

import gzip
import io
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest

from layerstore import tarsafe
from layerstore.tarsafe import HostileTar, IndexedTar, TarRefused, check_pax_records
from tests import hostile_tars
from tests.hostile_tars import SHAPES, record

REFUSALS = {"pax-bomb": "extended header of", "longname-bomb": "extended header of", "keyword-scan": "malformed",
            "digit-run": "digits in a row", "header-chain": "extended headers before one member",
            "global-flood": "global pax headers", "long-name": "name or link passes", "gnu-sparse": "sparse",
            "pax-sparse": "sparse"}


def ordinary(fmt: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for i, name in enumerate(["etc", "etc/hello", "d" * 150 + "/" + "n" * 200, "link", "hard"]):
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.mode = 1_700_000_000 + i, 1000 + i, 0o640
            data = b""
            if name == "etc":
                info.type = tarfile.DIRTYPE
            elif name == "link":
                info.type, info.linkname = tarfile.SYMTYPE, "l" * 300
            elif name == "hard":
                info.type, info.linkname = tarfile.LNKTYPE, "etc/hello"
            else:
                data = bytes(range(256)) * (i + 1)
            if fmt == tarfile.PAX_FORMAT:
                info.pax_headers = {"SCHILY.xattr.user.note": f"é{i}"}
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def described(tar: tarfile.TarFile) -> list[tuple]:
    return [(m.name, m.type, m.size, m.linkname, m.mode, m.uid, m.mtime, dict(m.pax_headers),
             tar.extractfile(m).read() if m.isreg() else None) for m in tar]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("mode", ["r|*", "r:*"])
def test_an_ordinary_archive_reads_as_tarfile_reads_it(fmt: int, compress: bool, mode: str) -> None:
    raw = ordinary(fmt)
    data = gzip.compress(raw) if compress else raw
    with tarfile.open(fileobj=io.BytesIO(data), mode=mode) as tar:
        expected = described(tar)
    with HostileTar.open(fileobj=io.BytesIO(data), mode=mode) as tar:
        assert described(tar) == expected
        assert tar.members == []  # none kept
    assert len(expected) == 5 and any(len(name) > 300 for name, *_ in expected)


def test_an_indexed_tar_finds_members_by_name_and_keeps_a_bounded_number(monkeypatch: pytest.MonkeyPatch) -> None:
    data = ordinary(tarfile.PAX_FORMAT)
    with IndexedTar.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        assert tar.extractfile(tar.getmember("etc/hello")).read() == bytes(range(256)) * 2
    monkeypatch.setattr(tarsafe, "MAX_INDEXED", 3)
    with pytest.raises(TarRefused, match="more than 3 members"):
        with IndexedTar.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.getmembers()


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("mode", ["r|*", "r:*"])
@pytest.mark.parametrize("name", SHAPES)
def test_a_hostile_header_is_refused_within_bounds(tmp_path: Path, name: str, mode: str, compress: bool) -> None:
    path = hostile_tars.write(tmp_path / "hostile.tar", name, size=64 << 20, compress=compress)
    tracemalloc.start()
    started = time.process_time()
    try:
        with pytest.raises(TarRefused, match=REFUSALS[name]):
            with open(path, "rb") as f, HostileTar.open(fileobj=f, mode=mode) as tar:
                for _ in tar:
                    pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    spent = time.process_time() - started
    print(f"{name}: peak {peak >> 10} KiB, {spent:.3f} s of CPU")
    assert peak < 8 << 20, f"{name}: refusing it took {peak >> 20} MiB"


@pytest.mark.parametrize("payload", [record("path", b"a/b") + record("SCHILY.xattr.user.x", b"\x00=\n1"),
                                     b"", record("k", b"")])
def test_well_formed_pax_records_pass(payload: bytes) -> None:
    check_pax_records(payload)


@pytest.mark.parametrize("payload", [b"path=a\n", b"x9 path=a\n", b"99 path=a\n", b"10 path=ab", b"7 =abc\n",
                                     b"10 pathab\n", record("k", b"v") + b"\0" * 10, b"1" * 30 + b" k=v\n"])
def test_malformed_pax_records_are_refused(payload: bytes) -> None:
    with pytest.raises(TarRefused):
        check_pax_records(payload)
