"""vmlinux from a bzImage (vmm/kernel.py): from synthetic bzImages in each
compression the kernel build offers, the refusals, and from the real guest
kernel (checked against an independent decoder where one is installed)."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vmm.backend import VmmError
from vmm.kernel import ensure_vmlinux, extract_vmlinux


def tiny_elf(machine: int = 62) -> bytes:
    """An ELF64 little-endian header for `machine` plus some body."""
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    return (ident + struct.pack("<HHI", 2, machine, 1)).ljust(64, b"\0") + b"kernel body " * 50


def bzimage(payload: bytes, *, version: int = 0x020F, garbage: bytes = b"") -> bytes:
    """A minimal bzImage: 1 setup sector, boot header, then `garbage` (like the
    decompressor stub) and the payload, which the header points at."""
    setup = bytearray(1024)
    setup[0x1F1] = 1
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, version)
    if version >= 0x208:
        struct.pack_into("<II", setup, 0x248, len(garbage), len(payload))
    return bytes(setup) + garbage + payload


def with_size(compressed: bytes, plain: bytes) -> bytes:
    return compressed + struct.pack("<I", len(plain))  # as the kernel's size_append


@pytest.mark.parametrize("name,compress", [
    ("gzip", lambda d: gzip.compress(d, mtime=0)),
    ("xz", lambda d: lzma.compress(d, format=lzma.FORMAT_XZ)),
    ("lzma", lambda d: lzma.compress(d, format=lzma.FORMAT_ALONE)),
    ("bzip2", bz2.compress),
    ("zstd", lambda d: __import__("zstandard").ZstdCompressor().compress(d)),
])
def test_extract_vmlinux_from_each_compression(name: str, compress: Any) -> None:
    elf = tiny_elf()
    # a false gzip magic before the payload: the header's payload offset wins
    image = bzimage(with_size(compress(elf), elf), garbage=b"stub \x1f\x8b\x08 not gzip")
    assert extract_vmlinux(image) == elf
    # old boot protocol (no payload fields): found by scanning, like extract-vmlinux
    assert extract_vmlinux(bzimage(with_size(compress(elf), elf), version=0x0207, garbage=b"stub")) == elf


def test_extract_vmlinux_lz4_legacy_matches_the_lz4_tool(tmp_path: Path) -> None:
    if shutil.which("lz4") is None:
        pytest.skip("lz4 CLI not installed (apt-get install lz4); the real kernel test covers LZ4")
    elf = tiny_elf() + os.urandom(3000) + b"abcabcabc" * 2000  # literals, long and overlapping matches
    compressed = subprocess.run(["lz4", "-l", "-12", "-c"], input=elf, capture_output=True, check=True).stdout
    assert extract_vmlinux(bzimage(with_size(compressed, elf))) == elf


def test_extract_vmlinux_refusals() -> None:
    elf = tiny_elf()
    assert extract_vmlinux(elf) == elf  # already a vmlinux
    with pytest.raises(VmmError, match="neither an ELF vmlinux nor a bzImage"):
        extract_vmlinux(b"MZ" + bytes(2000))
    with pytest.raises(VmmError, match="no ELF vmlinux"):
        extract_vmlinux(bzimage(with_size(gzip.compress(b"not an elf" * 10), b"x" * 100)))
    with pytest.raises(VmmError, match="machine 183"):  # an arm64 kernel
        extract_vmlinux(bzimage(with_size(gzip.compress(tiny_elf(183)), elf)))


def test_vmlinux_from_the_real_guest_kernel(guest: Path, tmp_path: Path) -> None:
    """Debian's cloud kernel (a bzImage) -> an x86_64 ELF Firecracker can boot."""
    image = (guest / "vmlinuz").read_bytes()
    assert image[0x202:0x206] == b"HdrS" and image[:4] != b"\x7fELF"  # really a bzImage
    path = ensure_vmlinux(guest / "vmlinuz", tmp_path / "cache")
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1  # ELF64, little-endian
    assert struct.unpack_from("<H", data, 18)[0] == 62  # EM_X86_64
    # the kernel build appends the uncompressed size after the compressed payload
    protected = ((image[0x1F1] or 4) + 1) * 512
    offset, length = struct.unpack_from("<II", image, 0x248)
    payload = image[protected + offset:protected + offset + length]
    assert len(data) == struct.unpack_from("<I", payload, len(payload) - 4)[0]
    # every program header's bytes lie inside the file (a truncated decode would not)
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    loads = 0
    for i in range(phnum):
        p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        assert p_offset + p_filesz <= len(data)
        loads += p_type == 1
    assert loads > 0
    # an independent decoder agrees, where its CLI is installed
    tools = {b"\x02\x21\x4c\x18": ["lz4", "-dc"], b"\xfd7zXZ\x00": ["xz", "-dc"], b"\x28\xb5\x2f\xfd": ["zstd", "-dc"],
             b"\x1f\x8b": ["gzip", "-dc"]}
    tool = next((argv for magic, argv in tools.items() if payload.startswith(magic)), None)
    if tool is not None and shutil.which(tool[0]):
        ref = subprocess.run(tool, input=payload[:-4], capture_output=True).stdout
        assert ref == data, f"{tool[0]} disagrees"
    # cached by content: a second call returns the same file without rewriting it
    mtime = path.stat().st_mtime_ns
    assert ensure_vmlinux(guest / "vmlinuz", tmp_path / "cache") == path
    assert path.stat().st_mtime_ns == mtime
