"""OCI and Docker images in: where an image's config and layers are.

Three containers of the same thing are read:

    OCI layout directory        oci-layout, index.json, blobs/sha256/<hex>
    OCI archive (tar of that)   the same files as tar members
    `docker save` archive       manifest.json [{"Config": "<path>", "Layers": ["<path>", ...]}]
                                (new Dockers also write index.json + blobs/: read as OCI)

An OCI index names one image manifest (the first for linux/amd64, else the
first); the manifest names the config and the layers, each with a digest
and a media type (tar, tar+gzip, tar+zstd). Every blob is checked against
its digest while it is read (`Blob.open` hashes as it goes and `Blob.check`
compares at the end), so a tampered or truncated layer is an error naming
it, found before anything is published. Docker's manifest.json has no
digests: a layer stored as `blobs/sha256/<hex>` is checked against that
name, a classic `<id>/layer.tar` (uncompressed) against the config's
`rootfs.diff_ids`.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .errors import CorruptObject, InvalidInput
from .tarsafe import HostileTar, IndexedTar

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MAX_JSON = 8 << 20  # an index, manifest or config larger than this is not one


@dataclass(frozen=True)
class Blob:
    """One layer (or config) of an image, in its container."""

    name: str  # how errors name it: "layer 2 (sha256:ab12...)"
    path: str  # file or member path inside the container
    digest: str  # "sha256:<hex>", or "" when the container records none
    media_type: str


@dataclass
class Image:
    """What an import needs of an OCI/Docker image."""

    source: "Source"
    layers: list[Blob]
    config: dict[str, Any] = field(default_factory=dict)  # the image config's "config" (Env, Cmd, ...)

    def runtime(self) -> dict[str, str]:
        """The parts of the config a sandbox applies (kept as annotations)."""
        keep = {k: self.config[k] for k in ("Env", "WorkingDir", "User", "Entrypoint", "Cmd") if self.config.get(k)}
        return {"oci.config": json.dumps(keep, sort_keys=True)} if keep else {}


@dataclass(frozen=True)
class Runtime:
    """What a sandbox booted from an imported image applies: the image
    config's Env (as a dict), WorkingDir and User (Entrypoint and Cmd are
    kept in the annotation, not run)."""

    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    user: str = ""


def runtime_of(annotations: Mapping[str, str]) -> Runtime:
    """The Runtime an image's `oci.config` annotation describes (empty for
    an image that has none, or one that does not parse: a disk still boots)."""
    try:
        config = json.loads(annotations.get("oci.config", "{}"))
        env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
        return Runtime({str(k): str(v) for k, v in env.items()}, str(config.get("WorkingDir") or ""),
                       str(config.get("User") or "").split(":", 1)[0])
    except (ValueError, TypeError, AttributeError):
        return Runtime()


class Source:
    """A directory or a tar archive holding an image's files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        if path.is_file():
            try:
                self._tar = IndexedTar.open(path, "r:")
            except (tarfile.TarError, OSError) as exc:
                raise InvalidInput(f"{path}: not an image archive ({exc})") from None

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()

    def exists(self, name: str) -> bool:
        if self._tar is None:
            return (self.path / name).is_file()
        try:
            self._tar.getmember(name)
            return True
        except KeyError:
            return False

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """A member or file, refused if it would leave the container."""
        if name.startswith("/") or ".." in Path(name).parts:
            raise CorruptObject(f"{self.path}: {name!r} points outside the image")
        if self._tar is None:
            with open(self.path / name, "rb") as f:
                yield f
            return
        try:
            member = self._tar.getmember(name)
            f = self._tar.extractfile(member)
        except (KeyError, tarfile.TarError) as exc:
            raise CorruptObject(f"{self.path}: {name} is missing from the archive ({exc})") from None
        if f is None:
            raise CorruptObject(f"{self.path}: {name} is not a file in the archive")
        with f:
            yield f

    def json(self, name: str) -> Any:
        with self.open(name) as f:
            data = f.read(MAX_JSON + 1)
        if len(data) > MAX_JSON:
            raise CorruptObject(f"{self.path}: {name} is larger than {MAX_JSON} bytes")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise CorruptObject(f"{self.path}: {name} is not JSON ({exc})") from None


def is_image(path: Path) -> bool:
    """Whether `path` is an OCI layout, an OCI archive or a docker-save archive (not a raw disk)."""
    if path.is_dir():
        return (path / "oci-layout").is_file() or (path / "manifest.json").is_file()
    try:  # unreadable or missing: not for us to say (the raw import names the problem)
        with HostileTar.open(path, "r:") as tar:
            names = {member.name for member, _ in zip(tar, range(10000))}
    except (tarfile.TarError, OSError):
        return False
    return bool(names & {"oci-layout", "manifest.json", "./oci-layout", "./manifest.json"})


def open_image(path: Path) -> Image:
    """Read an image's index/manifest and config; layers are opened later."""
    source = Source(path)
    try:
        if source.exists("index.json"):
            return _oci(source)
        if source.exists("manifest.json"):
            return _docker(source)
        raise InvalidInput(f"{path}: neither index.json (OCI) nor manifest.json (docker save) found")
    except BaseException:
        source.close()
        raise


def _blob_path(digest: str) -> str:
    algo, _, hexa = str(digest).partition(":")
    if algo != "sha256" or len(hexa) != 64 or any(c not in "0123456789abcdef" for c in hexa):
        raise CorruptObject(f"unsupported or malformed digest {digest!r} (want sha256:<64 hex>)")
    return f"blobs/sha256/{hexa}"


def _oci(source: Source) -> Image:
    index = source.json("index.json")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not manifests:
        raise CorruptObject(f"{source.path}: index.json names no manifest")
    chosen = _choose(manifests)
    manifest = source.json(_blob_path(chosen["digest"]))
    if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:  # a nested index (multi-platform)
        chosen = _choose(manifest["manifests"])
        manifest = source.json(_blob_path(chosen["digest"]))
    _check_blob(source, Blob("image manifest", _blob_path(chosen["digest"]), chosen["digest"], ""))
    layers = [Blob(f"layer {n + 1} ({d.get('digest', '?')[:19]})", _blob_path(d["digest"]), d["digest"],
                   str(d.get("mediaType", ""))) for n, d in enumerate(manifest.get("layers", []))]
    config = source.json(_blob_path(manifest["config"]["digest"]))
    return Image(source, layers, config.get("config") or {})


def _choose(manifests: list[dict]) -> dict:
    for m in manifests:
        platform = m.get("platform") or {}
        if platform.get("architecture") in ("amd64", None) and platform.get("os") in ("linux", None):
            return m
    return manifests[0]


def _docker(source: Source) -> Image:
    entries = source.json("manifest.json")
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        raise CorruptObject(f"{source.path}: manifest.json is not a docker save manifest")
    entry = entries[0]
    config = source.json(str(entry["Config"])) if entry.get("Config") else {}
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    layers = []
    for n, path in enumerate(entry.get("Layers", [])):
        digest = _digest_from_path(str(path)) or (str(diff_ids[n]) if n < len(diff_ids) else "")
        layers.append(Blob(f"layer {n + 1} ({path})", str(path), digest, ""))
    return Image(source, layers, config.get("config") or {})


def _digest_from_path(path: str) -> str:
    """A layer stored as blobs/sha256/<hex> is named by its digest."""
    parts = Path(path).parts
    if len(parts) == 3 and parts[:2] == ("blobs", "sha256") and len(parts[2]) == 64:
        return "sha256:" + parts[2]
    return ""


def _check_blob(source: Source, blob: Blob) -> None:
    with source.open(blob.path) as f:
        hashing = Hashing(f)
        while hashing.read(1 << 20):
            pass
    hashing.check(blob)


class Hashing:
    """A reader that hashes what passes through it (sha256), for `check`."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def check(self, blob: Blob) -> None:
        """CorruptObject if what was read is not what `blob`'s digest names."""
        if blob.digest and "sha256:" + self.sha.hexdigest() != blob.digest:
            raise CorruptObject(f"{blob.name}: content does not match its digest {blob.digest} "
                                f"(sha256:{self.sha.hexdigest()[:16]}... over {self.size} bytes; corrupt or truncated)")
