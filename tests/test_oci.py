"""layerstore/oci.py read directly on real archives (tests/oci_images.py):
an OCI layout, the same as a tar, and a `docker save` archive give the same
layers and config; every blob is checked against its digest as it is read;
malformed or hostile containers (path tricks, bad digests, no manifest,
not JSON, oversized JSON) are a clear error; `runtime_of` never fails a boot."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from layerstore.errors import CorruptObject, InvalidInput
from layerstore.oci import MAX_JSON, Hashing, Image, Runtime, is_image, open_image, runtime_of
from tests.oci_images import CONFIG, layer, write_docker, write_oci, write_tar

BASE = [("dir", "etc"), ("file", "etc/hostname", b"oci-demo\n")]
TOP = [("file", "etc/motd", b"hello\n")]


def tar_of(root: Path, path: Path) -> Path:
    """An OCI archive: the layout directory's files as tar members."""
    with tarfile.open(path, "w") as tar:
        for member in sorted(root.rglob("*")):
            tar.add(member, arcname=str(member.relative_to(root)), recursive=False)
    return path


def read_all(image: Image) -> list[bytes]:
    """Every layer's bytes, each checked against its digest as `rootfs` does."""
    out = []
    for blob in image.layers:
        with image.source.open(blob.path) as raw:
            hashing = Hashing(raw)
            data = b"".join(iter(lambda: hashing.read(1 << 16), b""))
        hashing.check(blob)
        out.append(data)
    return out


@pytest.fixture(params=["layout", "oci-archive", "docker"])
def container(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    layers = [layer(BASE), layer(TOP)]
    if request.param == "docker":
        return write_docker(tmp_path / "image.tar", layers)
    root = write_oci(tmp_path / "oci", layers)
    return root if request.param == "layout" else tar_of(root, tmp_path / "oci.tar")


def test_each_container_gives_the_layers_and_config(container: Path) -> None:
    """Layout, OCI archive and docker save: two layers in order, digests
    recorded, the config's runtime kept as the `oci.config` annotation."""
    assert is_image(container)
    image = open_image(container)
    try:
        assert [b.name.split(" ")[:2] for b in image.layers] == [["layer", "1"], ["layer", "2"]]
        assert all(b.digest.startswith("sha256:") for b in image.layers)
        data = read_all(image)
    finally:
        image.source.close()
    assert [tarfile.open(fileobj=io.BytesIO(d)).getnames() for d in data] == [["etc", "etc/hostname"], ["etc/motd"]]
    assert json.loads(image.runtime()["oci.config"]) == {k: CONFIG["config"][k] for k in ("Env", "WorkingDir", "Cmd")}
    assert runtime_of(image.runtime()) == Runtime({"PATH": "/usr/bin:/bin", "GREETING": "hi"}, "/srv", "")


def test_a_tampered_layer_is_named_when_read(tmp_path: Path) -> None:
    """Another layer's bytes under layer 2's digest: CorruptObject naming layer 2."""
    root = write_oci(tmp_path / "oci", [layer(BASE), layer(TOP)])
    blob = root / "blobs" / "sha256" / hashlib.sha256(layer(TOP)).hexdigest()
    blob.write_bytes(layer(BASE))
    image = open_image(root)
    try:
        with pytest.raises(CorruptObject, match=r"layer 2 .*does not match its digest"):
            read_all(image)
    finally:
        image.source.close()


def test_a_tampered_docker_layer_fails_its_diff_id(tmp_path: Path) -> None:
    """A classic `<id>/layer.tar` has no digest in its name: the config's diff_ids check it."""
    good = write_docker(tmp_path / "good.tar", [layer(BASE)])
    with tarfile.open(good) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    name = next(n for n in files if n.endswith("/layer.tar"))
    files[name] = b"X" + files[name][1:]  # its first member's name, one byte changed
    image = open_image(write_tar(tmp_path / "bad.tar", files))
    try:
        with pytest.raises(CorruptObject, match=r"layer 1 .*layer.tar.*does not match"):
            read_all(image)
    finally:
        image.source.close()


def test_a_tampered_image_manifest_is_refused(tmp_path: Path) -> None:
    """The manifest the index names, rewritten (still valid JSON): refused on open."""
    root = write_oci(tmp_path / "oci", [layer(BASE)])
    digest = json.loads((root / "index.json").read_text())["manifests"][0]["digest"]
    path = root / "blobs" / "sha256" / digest.split(":")[1]
    path.write_bytes(path.read_bytes() + b"\n")
    with pytest.raises(CorruptObject, match="image manifest: content does not match"):
        open_image(root)


def test_the_linux_amd64_manifest_is_chosen(tmp_path: Path) -> None:
    """An index listing arm64 first: the amd64 image is read."""
    root = write_oci(tmp_path / "oci", [layer(BASE)])
    index = json.loads((root / "index.json").read_text())
    arm = {**index["manifests"][0], "digest": "sha256:" + "0" * 64, "platform": {"architecture": "arm64", "os": "linux"}}
    index["manifests"].insert(0, arm)
    (root / "index.json").write_text(json.dumps(index))
    image = open_image(root)
    image.source.close()
    assert len(image.layers) == 1 and image.config["WorkingDir"] == "/srv"


@pytest.mark.parametrize("entry, message", [
    ({"Config": "../../etc/passwd", "Layers": []}, "points outside the image"),
    ({"Config": "/etc/passwd", "Layers": []}, "points outside the image"),
    ({"Config": "missing.json", "Layers": []}, "missing.json is missing from the archive"),
])
def test_docker_paths_outside_the_archive_are_refused(tmp_path: Path, entry: dict, message: str) -> None:
    path = write_tar(tmp_path / "evil.tar", {"manifest.json": json.dumps([entry]).encode()})
    with pytest.raises(CorruptObject, match=message):
        open_image(path)


def test_a_docker_layer_path_outside_the_archive_is_refused_when_opened(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "evil.tar", {"manifest.json": json.dumps([{"Layers": ["../../../etc/shadow"]}]).encode()})
    image = open_image(path)
    try:
        with pytest.raises(CorruptObject, match="points outside the image"):
            read_all(image)
    finally:
        image.source.close()


def test_an_oci_layout_directory_cannot_be_left_through_a_digest(tmp_path: Path) -> None:
    """A digest is the blob's path: anything but sha256:<64 hex> is refused."""
    root = write_oci(tmp_path / "oci", [layer(BASE)])
    (tmp_path / "secret").write_text("{}")
    index = json.loads((root / "index.json").read_text())
    index["manifests"][0]["digest"] = "sha256:../../../secret"
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptObject, match="malformed digest"):
        open_image(root)


@pytest.mark.parametrize("files, error, message", [
    ({"index.json": b'{"manifests": []}'}, CorruptObject, "index.json names no manifest"),
    ({"index.json": b"[]"}, CorruptObject, "index.json names no manifest"),
    ({"manifest.json": b"{oops"}, CorruptObject, "manifest.json is not JSON"),
    ({"manifest.json": b'{"Config": "c.json"}'}, CorruptObject, "not a docker save manifest"),
    ({"manifest.json": b"[]"}, CorruptObject, "not a docker save manifest"),
    ({"manifest.json": b" " * (MAX_JSON + 1)}, CorruptObject, "larger than"),
    ({"README": b"hello"}, InvalidInput, "neither index.json .* nor manifest.json"),
])
def test_malformed_archives_are_a_clear_error(tmp_path: Path, files: dict[str, bytes], error: type,
                                              message: str) -> None:
    with pytest.raises(error, match=message):
        open_image(write_tar(tmp_path / "bad.tar", files))


def test_what_is_not_an_image(tmp_path: Path) -> None:
    """A raw disk, an empty directory, a missing path and a tar of other files
    are no image (a raw import names their problem); opening a non-tar file
    is InvalidInput."""
    (tmp_path / "disk.img").write_bytes(b"\xeb\x3c\x90" + b"\xff" * 8189)
    (tmp_path / "empty").mkdir()
    other = write_tar(tmp_path / "other.tar", {"README": b"x"})
    for path in (tmp_path / "disk.img", tmp_path / "empty", tmp_path / "missing", other):
        assert not is_image(path)
    with pytest.raises(InvalidInput, match="not an image archive"):
        open_image(tmp_path / "disk.img")


@pytest.mark.parametrize("note, expected", [
    ({"oci.config": json.dumps({"Env": ["A=b=c", "NOVALUE", "B="], "User": "1000:1000", "WorkingDir": "/w"})},
     Runtime({"A": "b=c", "B": ""}, "/w", "1000")),
    ({}, Runtime()),
    ({"oci.config": "{not json"}, Runtime()),
    ({"oci.config": "[1, 2]"}, Runtime()),
    ({"oci.config": json.dumps({"Env": 5})}, Runtime()),
    ({"oci.config": json.dumps({"Env": [["x"]]})}, Runtime()),
])
def test_runtime_of_an_annotation(note: dict[str, str], expected: Runtime) -> None:
    """Env split at the first `=`, entries without one dropped, the user
    without its group; anything that does not parse is the empty Runtime."""
    assert runtime_of(note) == expected


def test_an_image_without_runtime_config_has_no_annotation(tmp_path: Path) -> None:
    root = write_oci(tmp_path / "oci", [layer(BASE)], config={"architecture": "amd64", "os": "linux"})
    image = open_image(root)
    image.source.close()
    assert image.runtime() == {} and runtime_of(image.runtime()) == Runtime()
