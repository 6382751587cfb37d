"""Deterministic test images: random, zero (hole) and repetitive chunks."""

from __future__ import annotations

import random
from pathlib import Path

MiB = 1 << 20


def write_image(path: Path, pattern: str, *, chunk: int = MiB, seed: int = 0, tail: int = 0) -> bytes:
    """Write one chunk per pattern letter: r=random, z=hole, p=repetitive, d=duplicate of chunk 0.

    `tail` extra random bytes make the size not a multiple of the chunk size.
    Returns the full logical content for comparison.
    """
    rng = random.Random(seed)
    parts: list[bytes] = []
    with open(path, "wb") as f:
        for i, kind in enumerate(pattern):
            if kind == "z":
                parts.append(bytes(chunk))
                f.seek(chunk, 1)
                continue
            if kind == "r":
                data = rng.randbytes(chunk)
            elif kind == "p":
                data = (f"line {i} of a repetitive text block\n".encode() * (chunk // 30 + 1))[:chunk]
            elif kind == "d":
                data = parts[0]
            else:
                raise ValueError(kind)
            parts.append(data)
            f.write(data)
        if tail:
            data = rng.randbytes(tail)
            parts.append(data)
            f.write(data)
        f.truncate(len(pattern) * chunk + tail)
    return b"".join(parts)
