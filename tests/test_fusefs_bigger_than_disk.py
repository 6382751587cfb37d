"""A 32 GiB sparse image with 1 GiB of scattered data, read end to end through
FUSE with a 128 MiB cache: every byte matches, and the cache never passes its cap.
(A guest booting an image bigger than the node's disk: tests/test_envd.py.)"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path

import blake3
import pytest

from tests.test_fusefs_mount import Mount

GiB = 1 << 30
MiB = 1 << 20
SIZE = 32 * GiB
DATA_CHUNKS = 1024  # 1 GiB of 1 MiB chunks
CACHE = 128 * MiB


def chunk_bytes(slot: int) -> bytes:
    """Deterministic, incompressible content of data slot `slot` (1 MiB)."""
    return blake3.blake3(slot.to_bytes(8, "little")).digest(length=MiB)


@pytest.mark.slow
def test_image_larger_than_cache_reads_back_exactly(tmp_path: Path) -> None:
    slots = sorted(random.Random(64).sample(range(SIZE // MiB), DATA_CHUNKS))
    image = tmp_path / "big.img"
    with open(image, "wb") as f:
        f.truncate(SIZE)
        for slot in slots:
            os.pwrite(f.fileno(), chunk_bytes(slot), slot * MiB)
    m = Mount(tmp_path, cache_size="128M")
    try:
        t0 = time.monotonic()
        m.strata("image", "import", str(image), "big:v1", timeout=900)
        print(f"import took {time.monotonic() - t0:.1f} s")
        image.unlink()  # the store now holds the only copy
        m.start()
        samples: list[int] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append(m.client.stats(timeout=10).cache["size"])
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        wanted = set(slots)
        zero = bytes(MiB)
        mismatches = []
        t0 = time.monotonic()
        # O_DIRECT, as a VMM with cache=none reads: each 1 MiB read is one FUSE
        # request, and the kernel page cache does not fill with 32 GiB of zeros.
        fd = os.open(m.image("big:v1"), os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, MiB)
        try:
            assert os.fstat(fd).st_size == SIZE
            for slot in range(SIZE // MiB):
                assert os.preadv(fd, [buf], slot * MiB) == MiB
                expected = chunk_bytes(slot) if slot in wanted else zero
                if buf[:] != expected:
                    mismatches.append(slot)
        finally:
            print(f"read took {time.monotonic() - t0:.1f} s")
            os.close(fd)
            done.set()
            sampler.join(timeout=10)
        assert mismatches == []
        assert samples and max(samples) <= CACHE
        stats = m.client.stats()
        assert stats.cache["evictions"] > 0
        assert stats.fetches >= DATA_CHUNKS  # every data chunk came from the store; no hole did
    finally:
        m.stop()
