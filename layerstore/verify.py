"""Verify a store: every manifest and volume index parses, every ref resolves, every chunk
and pack re-hashes to its name, every chunk and pack a manifest needs is
present, and every packed chunk rebuilds to its digest.

Verification only reads. Problems are collected, not raised, so one run
reports all of them; the CLI exits non-zero if any were found.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .chunk import CHUNK_PREFIX, chunk_key, decode_chunk
from .digest import digest_bytes, is_digest
from .errors import CorruptObject, NotFound, StrataError
from .manifest import MANIFEST_PREFIX, Layer, parse_manifest
from .pack import PACK_PREFIX, pack_key
from .refs import REF_PREFIX, decode_ref_target, ref_from_key
from .snapshot import SNAPSHOT_PREFIX, is_snapshot_key, parse_snapshot
from .store import Store
from .volumes import Volumes


@dataclass
class VerifyReport:
    refs: int = 0
    manifests: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    referenced_chunks: int = 0
    unreferenced_chunks: int = 0
    corrupt_chunks: list[str] = field(default_factory=list)
    missing_chunks: list[tuple[str, str]] = field(default_factory=list)  # (digest, manifest naming it)
    bad_manifests: list[str] = field(default_factory=list)  # messages
    bad_refs: list[str] = field(default_factory=list)  # messages
    errors: list[str] = field(default_factory=list)  # every problem, one line each

    @property
    def ok(self) -> bool:
        return not (self.corrupt_chunks or self.missing_chunks or self.bad_manifests or self.bad_refs)

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "refs": self.refs,
            "manifests": self.manifests,
            "chunks_checked": self.chunks_checked,
            "bytes_checked": self.bytes_checked,
            "referenced_chunks": self.referenced_chunks,
            "unreferenced_chunks": self.unreferenced_chunks,
            "corrupt_chunks": self.corrupt_chunks,
            "missing_chunks": [{"chunk": d, "manifest": m} for d, m in self.missing_chunks],
            "bad_manifests": self.bad_manifests,
            "bad_refs": self.bad_refs,
            "errors": self.errors,
        }


def verify_store(
    store: Store,
    *,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check every ref, manifest and chunk in `store` (reads all chunk data)."""
    report = VerifyReport()
    backend = store.backend
    layers: dict[str, Layer] = {}
    for key, _size, _ in backend.list(MANIFEST_PREFIX):
        manifest_id = key.rsplit("/", 1)[-1]
        report.manifests += 1
        if not is_digest(manifest_id):
            report.bad_manifests.append(f"stray object {key}")
            continue
        try:
            layers[manifest_id] = parse_manifest(manifest_id, backend.get(key))
        except (CorruptObject, NotFound) as exc:
            report.bad_manifests.append(str(exc))
    for manifest_id, layer in layers.items():
        if layer.parent is not None and layer.parent not in layers:
            report.bad_manifests.append(f"manifest {manifest_id}: parent {layer.parent} is missing")
    for key, _size, _ in backend.list(SNAPSHOT_PREFIX):
        snapshot_id = key.rsplit("/", 1)[-1]
        report.manifests += 1
        try:
            snap = parse_snapshot(snapshot_id, backend.get(key)) if is_snapshot_key(key) else None
        except (CorruptObject, NotFound) as exc:
            report.bad_manifests.append(str(exc))
            continue
        if snap is None:
            report.bad_manifests.append(f"stray object {key}")
            continue
        for layer_id in sorted(snap.layer_ids() - set(layers)):
            report.bad_manifests.append(f"snapshot {snapshot_id}: layer {layer_id} is missing or corrupt")
    for bad in Volumes(backend).gc_roots()[1]:  # GC keeps what they may name; an operator mends or deletes them
        report.bad_manifests.append(f"{bad.key}: {bad.reason}")
    for key, _size, _ in backend.list(REF_PREFIX):
        report.refs += 1
        ref = ref_from_key(key)
        if ref is None:
            report.bad_refs.append(f"stray object {key}")
            continue
        try:
            manifest_id, _ = decode_ref_target(ref, backend.get(key))
        except (CorruptObject, NotFound) as exc:
            report.bad_refs.append(str(exc))
            continue
        if manifest_id not in layers:
            report.bad_refs.append(f"ref {ref} points at missing or corrupt manifest {manifest_id}")

    named: dict[str, str] = {}
    for manifest_id, layer in layers.items():
        for digest in sorted(layer.needs()[0]):
            named.setdefault(digest, manifest_id)
    present: dict[str, int] = {}
    for key, size, _ in backend.list(CHUNK_PREFIX):
        digest = key.rsplit("/", 1)[-1]
        if is_digest(digest) and key == chunk_key(digest):
            present[digest] = size
        else:
            report.corrupt_chunks.append(key)
    if on_total:
        on_total(sum(present.values()))

    def check(item: tuple[str, int]) -> tuple[str, int, str | None]:
        digest, size = item
        try:
            data = decode_chunk(digest, backend.get(chunk_key(digest)))
            return digest, len(data), None
        except StrataError as exc:  # corrupt, missing, or the store failing
            return digest, 0, str(exc)

    with ThreadPoolExecutor(workers or max(2, (os.cpu_count() or 2) * 2), thread_name_prefix="strata-verify") as pool:
        for (digest, raw, problem), size in zip(pool.map(check, present.items()), present.values()):
            report.chunks_checked += 1
            report.bytes_checked += raw
            if problem:
                report.corrupt_chunks.append(digest)
                report.errors.append(problem)
            if progress:
                progress(size)
    for digest, manifest_id in sorted(named.items()):
        if digest not in present:
            report.missing_chunks.append((digest, manifest_id))
            report.errors.append(f"chunk {digest} named by manifest {manifest_id} is missing")
    _verify_packs(store, layers, report)
    report.referenced_chunks = len(named)
    report.unreferenced_chunks = len(set(present) - set(named))
    report.errors[:0] = report.bad_manifests + report.bad_refs
    if report.corrupt_chunks:
        store.catalog.forget_chunks(d for d in report.corrupt_chunks if is_digest(d))
    return report


def _verify_packs(store: Store, layers: dict[str, Layer], report: VerifyReport) -> None:
    """Every pack re-hashes to its id, and every packed chunk rebuilds from
    its pack and base to its digest (its base, a chunk object, is checked
    with the chunks)."""
    present = {key.rsplit("/", 1)[-1] for key, _size, _ in store.backend.list(PACK_PREFIX)}
    for pack_id in sorted(present):
        try:
            ok = is_digest(pack_id) and digest_bytes(store.backend.get(pack_key(pack_id))) == pack_id
        except (StrataError, NotFound) as exc:
            report.errors.append(f"pack {pack_id}: {exc}")
            ok = False
        if not ok:
            report.corrupt_chunks.append(f"{PACK_PREFIX}{pack_id}")
            report.errors.append(f"pack {pack_id} is corrupt (its content hashes to something else)")
    for manifest_id, layer in sorted(layers.items()):
        for index, where in sorted(layer.packed.items()):
            digest = str(layer.chunks[index])
            if where.pack not in present:
                report.missing_chunks.append((f"{PACK_PREFIX}{where.pack}", manifest_id))
                report.errors.append(f"pack {where.pack} named by manifest {manifest_id} is missing")
                continue
            try:
                store.read_chunk(digest, where)
            except StrataError as exc:
                report.corrupt_chunks.append(digest)
                report.errors.append(str(exc))
