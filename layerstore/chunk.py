"""Chunk objects: how one chunk of an image is stored.

A stored chunk is exactly one zstd frame of the chunk's uncompressed bytes,
with the content size in the frame header. Its key is derived from the
blake3-256 digest of the *uncompressed* bytes, so the same data stored at any
compression level dedups to the same object:

    chunks/<first 2 hex digits>/<64 hex digits>      one zstd frame

Decoding always re-hashes the result and compares it with the expected digest:
a store that returns wrong, truncated or undecodable bytes yields
`CorruptObject` naming the chunk, never data.

All-zero chunks are holes: they are never encoded, stored or fetched.
"""

from __future__ import annotations

import zstandard

from .digest import check_digest, digest_bytes
from .errors import CorruptObject

MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 16 * 1024 * 1024
DEFAULT_CHUNK_SIZE = 1024 * 1024
# Level 1 wins the ingest benchmark (bench/ingest.py): level 3 costs ~40% more
# CPU for ~3% smaller objects on the mixed image.
DEFAULT_LEVEL = 1
CHUNK_PREFIX = "chunks/"


def chunk_key(digest: str) -> str:
    """The object key of the chunk with this digest (validated)."""
    check_digest(digest, what="chunk digest")
    return f"{CHUNK_PREFIX}{digest[:2]}/{digest}"


def encode_chunk(data: bytes | memoryview, *, level: int = DEFAULT_LEVEL) -> bytes:
    """Compress one chunk into a zstd frame (content size recorded in the header)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def decode_chunk(digest: str, blob: bytes, *, max_size: int = MAX_CHUNK_SIZE) -> bytes:
    """Decompress `blob` and return it only if its blake3 equals `digest`.

    `max_size` bounds the output so a hostile object cannot exhaust memory.
    """
    try:
        params = zstandard.get_frame_parameters(blob)
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
            raise CorruptObject(f"chunk {digest}: zstd frame records no content size (not written by Strata)")
        if params.content_size > max_size:
            raise CorruptObject(f"chunk {digest}: frame claims {params.content_size} bytes, above the {max_size} limit")
        data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise CorruptObject(f"chunk {digest}: stored object is not a valid zstd frame ({exc})") from None
    actual = digest_bytes(data)
    if actual != digest:
        raise CorruptObject(f"chunk {digest}: content hashes to {actual} (corrupt object)")
    return data
