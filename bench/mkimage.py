#!/usr/bin/env python3
"""Generate deterministic "mixed" raw disk images for the Strata ingest benchmark.

The image is cut into 1 MiB blocks.  Every group of four consecutive blocks
holds, in a seeded order, one pseudo-random block, one all-zero block and two
low-entropy text-like blocks, so the whole image is exactly 1/4 random,
1/4 zero and 1/2 compressible.  Zero blocks are never written: we seek past
them, so the file is sparse on disk just like a freshly provisioned VM image.

Why the text blocks look the way they do: each one is 256 slices of 4 KiB
taken at seeded offsets from a 4 MiB corpus of Zipf-distributed pseudo-words.
That gives real text statistics (zstd -3 squeezes it roughly 3-4x) without
creating long byte runs that repeat across blocks.  Any repeat longer than
4 KiB would let the content-defined chunkers of restic, borg and casync
deduplicate *inside* v1 while Strata's fixed 1 MiB chunks cannot, so the
benchmark would measure an artefact of the generator instead of the tools.

All bytes come from SHAKE-256 (stdlib, standardised) and ``random.Random``
seeded with strings, so the same ``seed`` yields the same image with any
CPython >= 3.9, with or without numpy/blake3 installed.

CLI::

    python bench/mkimage.py OUT --size 1G [--seed N]
    python bench/mkimage.py OUT --change-from BASE [--change-pct 1] [--seed N]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 1 << 20
"""Block size; matches Strata's chunk size so block kinds map onto chunks."""

SLICE = 4096
"""Text slice size; smaller than every peer's minimum CDC chunk (casync 16 KiB)."""

CORPUS_SIZE = 4 << 20
VOCAB_WORDS = 4096
ZERO_BLOCK = bytes(BLOCK)

KIND_RANDOM = "random"
KIND_ZERO = "zero"
KIND_TEXT = "text"
GROUP = (KIND_RANDOM, KIND_ZERO, KIND_TEXT, KIND_TEXT)

_LETTERS = b"etaoinshrdlcumwfgypbvkjxqz"
# 256-entry table mapping keystream bytes to letters with a rough English
# skew (earlier letters in _LETTERS get more slots); used with bytes.translate
# so no per-byte Python loop is needed.
_LETTER_TABLE = bytes(_LETTERS[min(25, int((i / 256) ** 1.8 * 26))] for i in range(256))

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Parse ``256M``/``1G``/``1GiB``/``12345`` (binary units) into bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def keystream(seed: int, label: str, index: int, length: int) -> bytes:
    """Return ``length`` pseudo-random bytes unique to (seed, label, index).

    SHAKE-256 is used instead of ``random.randbytes`` because its output is
    fixed by a standard, and each block is derived independently, so any
    block can be regenerated without replaying the ones before it.
    """
    key = f"strata-bench:{seed}:{label}:{index}".encode()
    return hashlib.shake_256(key).digest(length)


def block_kinds(n_blocks: int, seed: int) -> list[str]:
    """Kind of every block: each group of 4 is a seeded shuffle of ``GROUP``.

    Shuffling within groups keeps the 1/4-1/4-1/2 split exact for any size
    that is a multiple of 4 MiB, while avoiding a strict period that could
    line up with some tool's internal batching.
    """
    rng = random.Random(f"layout:{seed}")
    kinds: list[str] = []
    while len(kinds) < n_blocks:
        group = list(GROUP)
        rng.shuffle(group)
        kinds.extend(group)
    return kinds[:n_blocks]


def _vocabulary(seed: int) -> list[bytes]:
    """Build pseudo-words (2-10 letters) with some punctuation, like prose/logs."""
    raw = keystream(seed, "vocab", 0, VOCAB_WORDS * 10).translate(_LETTER_TABLE)
    rng = random.Random(f"vocab:{seed}")
    words: list[bytes] = []
    pos = 0
    for i in range(VOCAB_WORDS):
        n = rng.randint(2, 10)
        word = raw[pos:pos + n]
        pos += n
        if i % 23 == 0:
            word += b","
        elif i % 31 == 0:
            word += b".\n"
        elif i % 97 == 0:
            word = word.upper()
        words.append(word)
    return words


def text_corpus(seed: int) -> bytes:
    """Return the 4 MiB Zipf-weighted word corpus that text blocks slice from."""
    words = _vocabulary(seed)
    rng = random.Random(f"corpus:{seed}")
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    n_words = CORPUS_SIZE // 4  # mean word+space is >4 bytes: enough text
    corpus = b" ".join(rng.choices(words, weights=weights, k=n_words))
    if len(corpus) < CORPUS_SIZE + SLICE:
        corpus = corpus * ((CORPUS_SIZE + SLICE) // len(corpus) + 1)
    return corpus[:CORPUS_SIZE + SLICE]


def text_block(corpus: bytes, seed: int, index: int) -> bytes:
    """One compressible block: 256 corpus slices at offsets seeded by ``index``."""
    rng = random.Random(f"text:{seed}:{index}")
    starts = [rng.randrange(CORPUS_SIZE) for _ in range(BLOCK // SLICE)]
    return b"".join(corpus[s:s + SLICE] for s in starts)


def random_block(seed: int, index: int) -> bytes:
    """One incompressible block."""
    return keystream(seed, "random", index, BLOCK)


@dataclass
class ImageInfo:
    """What was written, so the harness can report the composition."""

    path: str
    size: int
    seed: int
    blocks: dict[str, int] = field(default_factory=dict)
    changed_blocks: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _write_atomically(path: Path) -> Path:
    """Temp path next to ``path``; renamed on success so a crash leaves no half image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def make_image(path: str | os.PathLike[str], size: int = 1 << 30, seed: int = 1) -> ImageInfo:
    """Write the mixed image of ``size`` bytes to ``path`` (sparse zero blocks)."""
    t0 = time.perf_counter()
    out = Path(path)
    tmp = _write_atomically(out)
    n_blocks = -(-size // BLOCK)
    kinds = block_kinds(n_blocks, seed)
    corpus = text_corpus(seed)
    with open(tmp, "wb") as f:
        for i, kind in enumerate(kinds):
            length = min(BLOCK, size - i * BLOCK)
            if kind == KIND_ZERO:
                f.seek(length, os.SEEK_CUR)
                continue
            data = random_block(seed, i) if kind == KIND_RANDOM else text_block(corpus, seed, i)
            f.write(data[:length])
        f.truncate(size)  # materialise a trailing hole
    os.replace(tmp, out)
    counts = {k: kinds.count(k) for k in (KIND_RANDOM, KIND_ZERO, KIND_TEXT)}
    return ImageInfo(str(out), size, seed, counts, seconds=time.perf_counter() - t0)


def _sparse_copy(src: Path, dst: Path) -> tuple[int, list[int]]:
    """Copy ``src`` to ``dst`` keeping all-zero blocks as holes.

    Returns (size, indices of non-zero blocks).  Works on any image, not only
    ones made by ``make_image``, so the change step does not rely on the
    generator's layout.
    """
    nonzero: list[int] = []
    size = src.stat().st_size
    with open(src, "rb", buffering=0) as fi, open(dst, "wb") as fo:
        index = 0
        while True:
            data = fi.read(BLOCK)
            if not data:
                break
            if data == ZERO_BLOCK[:len(data)]:
                fo.seek(len(data), os.SEEK_CUR)
            else:
                fo.write(data)
                nonzero.append(index)
            index += 1
        fo.truncate(size)
    return size, nonzero


def make_changed(base: str | os.PathLike[str], out: str | os.PathLike[str],
                 pct: float = 1.0, seed: int = 1) -> ImageInfo:
    """Copy ``base`` to ``out`` and overwrite ``pct``% of its non-zero blocks.

    At least one block is changed.  Replacement bytes are fresh random data,
    so a content-addressed store has to store those blocks again; everything
    else should dedupe against the base image.
    """
    t0 = time.perf_counter()
    dst = Path(out)
    tmp = _write_atomically(dst)
    size, nonzero = _sparse_copy(Path(base), tmp)
    k = min(len(nonzero), max(1, round(len(nonzero) * pct / 100)))
    chosen = sorted(random.Random(f"change:{seed}").sample(nonzero, k)) if nonzero else []
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for index in chosen:
            length = min(BLOCK, size - index * BLOCK)
            os.pwrite(fd, keystream(seed, "changed", index, length), index * BLOCK)
    finally:
        os.close(fd)
    os.replace(tmp, dst)
    info = ImageInfo(str(dst), size, seed, {"nonzero": len(nonzero)}, chosen)
    info.seconds = time.perf_counter() - t0
    return info


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints what was written and how long it took."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output image path")
    p.add_argument("--size", default="1G", help="image size, binary units (default 1G)")
    p.add_argument("--seed", type=int, default=1, help="generator seed (default 1)")
    p.add_argument("--change-from", metavar="BASE",
                   help="instead of generating, copy BASE and change some blocks")
    p.add_argument("--change-pct", type=float, default=1.0,
                   help="percent of non-zero blocks to rewrite (default 1)")
    args = p.parse_args(argv)
    if args.change_from:
        info = make_changed(args.change_from, args.out, args.change_pct, args.seed)
        print(f"{info.path}: {info.size} bytes, changed {len(info.changed_blocks)} of "
              f"{info.blocks['nonzero']} non-zero blocks {info.changed_blocks} "
              f"in {info.seconds:.2f}s")
    else:
        info = make_image(args.out, parse_size(args.size), args.seed)
        print(f"{info.path}: {info.size} bytes, blocks {info.blocks} in {info.seconds:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
