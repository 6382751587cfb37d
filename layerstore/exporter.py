"""Export an image from the store to a raw file, bit-exact and sparse.

Chunks are fetched and verified in a thread pool (zstd and blake3 release the
GIL) and written with pwrite at their offsets, around the page cache where the
filesystem allows (layerstore/directio.py); holes are never written, so the
output is sparse. The file is built under a temporary name beside the target
and renamed into place only when complete and fsynced: an interrupted export
never leaves a plausible-looking but wrong image behind.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .directio import AlignedBuffers, DirectFile
from .errors import CorruptObject, InvalidInput
from .manifest import Packed
from .refs import Ref, parse_ref
from .store import Store
from .windows import one_ahead


@dataclass
class ExportResult:
    ref: str
    manifest_id: str
    path: str
    size: int
    data_chunks: int
    fetched_chunks: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return {
            "ref": self.ref,
            "manifest": self.manifest_id,
            "path": self.path,
            "size": self.size,
            "data_chunks": self.data_chunks,
            "fetched_chunks": self.fetched_chunks,
            "seconds": round(self.seconds, 4),
            "throughput_mb_s": round(self.size / self.seconds / 1e6, 1) if self.seconds else None,
        }


def export_image(
    store: Store,
    ref: Ref | str,
    out: str | os.PathLike[str],
    *,
    workers: int | None = None,
    window: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write image `ref` to `out` (replacing it atomically if it exists)."""
    started = time.monotonic()
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    manifest_id = store.resolve(ref)
    top, resolved = store.chunk_map(manifest_id)
    packed = store.packed_map(manifest_id)
    out = Path(out)
    if out.is_dir():
        raise InvalidInput(f"{out}: is a directory; give the output file's path")
    if not out.parent.is_dir():
        raise InvalidInput(f"{out.parent}: no such directory")
    workers = workers or max(4, (os.cpu_count() or 2) * 2)
    window = window or workers * 4
    if on_total:
        on_total(top.size)
    tmp = out.with_name(f".{out.name}.strata-{uuid.uuid4().hex[:8]}")
    try:
        target = DirectFile(tmp, os.O_CREAT | os.O_EXCL, buffers=AlignedBuffers())
    except OSError as exc:
        raise InvalidInput(f"{out}: cannot write ({exc.strerror})") from None
    try:
        with target:
            os.ftruncate(target.fd, top.size)
            fetched = _write_chunks(store, target, top.size, top.chunk_size, resolved, packed, str(ref),
                                    workers=workers, window=window, progress=progress)
            target.fsync()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ExportResult(
        ref=str(ref),
        manifest_id=manifest_id,
        path=str(out),
        size=top.size,
        data_chunks=len(resolved),
        fetched_chunks=fetched,
        seconds=time.monotonic() - started,
    )


def _write_chunks(store: Store, target: DirectFile, size: int, cs: int, resolved: dict[int, str],
                  packed: dict[str, Packed], name: str, *, workers: int, window: int,
                  progress: Callable[[int], None] | None) -> int:
    """Fetch, verify and write every chunk at its offsets, a window at a time; the chunks fetched.

    Each worker writes what it fetched (pwrite releases the GIL), and the
    next window is fetched while the one before it is still landing
    (layerstore/windows.py). Written direct, nothing piles up in the page
    cache; written buffered (a filesystem without O_DIRECT), each window's
    writeback starts as soon as it landed, or dirty pages piled up until the
    kernel throttled every write to the disk's pace (an export at 360 MB/s
    where the disk takes 1.3 GB/s).
    """
    indices = sorted(resolved)

    def place(digest: str, slots: list[int]) -> None:
        data = store.read_chunk(digest, packed.get(digest))
        for index in slots:
            expected = min(cs, size - index * cs)
            if len(data) != expected:
                raise CorruptObject(f"chunk {digest} holds {len(data)} bytes but slot {index} of {name} "
                                    f"needs {expected}")
            target.pwrite(data, index * cs)

    def landed(part: list[int], futures: list[Future[None]]) -> int:
        for future in futures:
            future.result()
        if not target.direct:
            os.posix_fadvise(target.fd, part[0] * cs, (part[-1] + 1 - part[0]) * cs, os.POSIX_FADV_DONTNEED)
        return min(size, (part[-1] + 1) * cs)

    def start(part: list[int]) -> list[Future[None]]:
        """One fetch per distinct chunk of the window, writing it at each of its slots."""
        slots: dict[str, list[int]] = {}
        for index in part:
            slots.setdefault(resolved[index], []).append(index)
        return [pool.submit(place, digest, at) for digest, at in slots.items()]

    fetched = done = 0
    with ThreadPoolExecutor(workers, thread_name_prefix="strata-get") as pool:
        parts = (indices[at : at + window] for at in range(0, len(indices), window))
        for part, futures in one_ahead(parts, start):
            fetched += len(futures)
            reached = landed(part, futures)
            if progress:
                progress(reached - done)
            done = reached
    if progress and done < size:
        progress(size - done)
    return fetched
