"""Build OCI layouts and `docker save` archives by hand for the import tests:
layers are tars (gzip by default) of entries described as tuples."""

from __future__ import annotations

import gzip
import shutil
import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

Entry = tuple  # ("file", name, data, mode, uid, gid) | ("dir", name) | ("symlink", name, target)
#                ("link", name, target) | ("char", name, major, minor) | ("raw", TarInfo, data)


def layer(entries: list[Entry], *, compress: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            kind, name = e[0], e[1]
            if kind == "raw":
                tar.addfile(e[1], io.BytesIO(e[2]) if e[2] is not None else None)
                continue
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            data = None
            if kind == "file":
                data = e[2]
                info.size, info.mode = len(data), e[3] if len(e) > 3 else 0o644
                info.uid, info.gid = (e[4], e[5]) if len(e) > 5 else (0, 0)
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e[2]
            elif kind == "link":
                info.type, info.linkname = tarfile.LNKTYPE, e[2]
            elif kind == "char":
                info.type, info.devmajor, info.devminor, info.mode = tarfile.CHRTYPE, e[2], e[3], 0o666
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0) if compress else raw


def padding_layer(path: Path, blocks: Iterator[tuple[str, bytes]]) -> Path:
    """An uncompressed layer of big files written to `path` one at a time
    (a GiB-sized layer never sits in memory): `blocks` yields (name, data)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in blocks:
            info = tarfile.TarInfo(name)
            info.mtime, info.size, info.mode = 1_700_000_000, len(data), 0o644
            if not data:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info, io.BytesIO(data) if data else None)
    return path


def _sha(data: bytes | Path) -> str:
    if isinstance(data, Path):
        h = hashlib.sha256()
        with open(data, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        return h.hexdigest()
    return hashlib.sha256(data).hexdigest()


def _size(data: bytes | Path) -> int:
    return data.stat().st_size if isinstance(data, Path) else len(data)


CONFIG = {"architecture": "amd64", "os": "linux",
          "config": {"Env": ["PATH=/usr/bin:/bin", "GREETING=hi"], "WorkingDir": "/srv", "Cmd": ["/bin/sh"]}}


def write_oci(root: Path, layers: list[bytes | Path], *, config: dict = CONFIG) -> Path:
    """An OCI image layout directory at `root` (a layer given as a file is moved in)."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    cfg = json.dumps(config).encode()
    shas = [_sha(d) for d in layers]
    sizes = [_size(d) for d in layers]
    (blobs / _sha(cfg)).write_bytes(cfg)
    for data, sha in zip(layers, shas):
        if isinstance(data, Path):
            data.rename(blobs / sha)
        else:
            (blobs / sha).write_bytes(data)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + _sha(cfg),
                   "size": len(cfg)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": "sha256:" + sha,
                    "size": size} for sha, size in zip(shas, sizes)]}).encode()
    (blobs / _sha(manifest)).write_bytes(manifest)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + _sha(manifest),
         "size": len(manifest), "platform": {"architecture": "amd64", "os": "linux"}}]}))
    return root


def write_docker(path: Path, layers: list[bytes], *, config: dict = CONFIG) -> Path:
    """A `docker save` archive in the classic layout (<v1 id>/layer.tar,
    uncompressed, checked against the config's rootfs.diff_ids) at `path`."""
    plains = [gzip.decompress(d) if d[:2] == b"\x1f\x8b" else d for d in layers]
    config = {**config, "rootfs": {"type": "layers", "diff_ids": ["sha256:" + _sha(p) for p in plains]}}
    cfg = json.dumps(config).encode()
    files = {f"{_sha(cfg)}.json": cfg}
    names = []
    for n, plain in enumerate(plains):
        names.append(f"{_sha(str(n).encode() + cfg)}/layer.tar")  # a v1 id: not the layer's digest
        files[names[-1]] = plain
    files["manifest.json"] = json.dumps([{"Config": f"{_sha(cfg)}.json", "RepoTags": ["demo:v1"],
                                          "Layers": names}]).encode()
    return write_tar(path, files)


def write_tar(path: Path, files: dict[str, bytes]) -> Path:
    """A tar at `path` of regular files, in the given order."""
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_oci_index(root: Path, images: list[tuple[str, list[bytes]]]) -> Path:
    """An OCI layout whose one entry is an index of several images, one per
    `(architecture, layers)` (os linux): what `skopeo copy --all` pushes as a
    multi-platform image."""
    entries = []
    for n, (arch, layers) in enumerate(images):
        part = write_oci(root / f".{n}", layers, config={**CONFIG, "architecture": arch})
        entry = json.loads((part / "index.json").read_text())["manifests"][0]
        entries.append({**entry, "platform": {"architecture": arch, "os": "linux"}})
        blobs = root / "blobs" / "sha256"
        blobs.mkdir(parents=True, exist_ok=True)
        for blob in (part / "blobs" / "sha256").iterdir():
            blob.replace(blobs / blob.name)
        shutil.rmtree(part)
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": entries}).encode()
    (root / "blobs" / "sha256" / _sha(index)).write_bytes(index)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": "sha256:" + _sha(index),
         "size": len(index)}]}))
    return root
