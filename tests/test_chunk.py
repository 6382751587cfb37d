"""Chunk objects: zstd frames verified by blake3 on every decode."""

from __future__ import annotations

import os

import pytest
import zstandard

from layerstore.chunk import chunk_key, decode_chunk, encode_chunk
from layerstore.digest import digest_bytes
from layerstore.errors import CorruptObject, InvalidInput


def test_roundtrip_and_key_layout() -> None:
    data = os.urandom(100_000) + bytes(50_000)
    digest = digest_bytes(data)
    assert decode_chunk(digest, encode_chunk(data)) == data
    assert chunk_key(digest) == f"chunks/{digest[:2]}/{digest}"


def test_compression_level_does_not_change_identity() -> None:
    data = b"abc" * 100_000
    digest = digest_bytes(data)
    assert decode_chunk(digest, encode_chunk(data, level=1)) == decode_chunk(digest, encode_chunk(data, level=9))


def test_wrong_content_is_refused_naming_the_chunk() -> None:
    data, other = b"a" * 1000, b"b" * 1000
    digest = digest_bytes(data)
    with pytest.raises(CorruptObject, match=digest):
        decode_chunk(digest, encode_chunk(other))


def test_flipped_byte_is_refused() -> None:
    data = os.urandom(65536)
    blob = bytearray(encode_chunk(data))
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(CorruptObject):
        decode_chunk(digest_bytes(data), bytes(blob))


def test_truncated_object_is_refused() -> None:
    data = os.urandom(65536)
    blob = encode_chunk(data)
    for cut in (0, 3, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptObject):
            decode_chunk(digest_bytes(data), blob[:cut])


def test_frame_without_content_size_or_too_large_is_refused() -> None:
    data = b"x" * 1000
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    with pytest.raises(CorruptObject, match="no content size"):
        decode_chunk(digest_bytes(data), no_size)
    with pytest.raises(CorruptObject, match="limit"):
        decode_chunk(digest_bytes(data), encode_chunk(data), max_size=999)


@pytest.mark.parametrize("bad", ["", "AB" * 32, "ab" * 31, "../" + "a" * 61, "g" * 64])
def test_malformed_digest_never_becomes_a_key(bad: str) -> None:
    with pytest.raises(InvalidInput):
        chunk_key(bad)
