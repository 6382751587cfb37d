"""OCI layouts and `docker save` archives through `strata image import`:
layers applied with whiteouts, opaque directories, owners, modes, links and
device nodes into an ext4 disk (read back with debugfs, no mount needed),
the image config kept; and hostile archives refused with an error naming
the layer, nothing published, nothing written outside the build directory."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.oci_images import layer, write_docker, write_oci
from tests.test_cli import run


def strata(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run(list(args), env)

BASE = [("dir", "etc"), ("file", "etc/hostname", b"oci-demo\n"), ("file", "etc/passwd", b"root:x:0:0::/root:/bin/sh\n"),
        ("dir", "usr"), ("dir", "usr/lib"), ("symlink", "lib", "usr/lib"), ("file", "usr/lib/libdemo.so", b"ELF" * 100),
        ("file", "bin/tool", b"#!/bin/sh\necho tool\n", 0o4755, 0, 0), ("dir", "var/cache"),
        ("file", "var/cache/old1", b"stale"), ("file", "var/cache/old2", b"stale"),
        ("file", "home/ann/notes", b"ann's", 0o600, 1000, 1000), ("file", "tmp/gone", b"bye"),
        ("char", "dev/null", 1, 3)]
TOP = [("file", ".wh.tmp", b""), ("file", "var/cache/.wh..wh..opq", b""), ("file", "var/cache/new", b"fresh"),
       ("file", "lib/libextra.so", b"via the lib symlink"), ("link", "bin/tool2", "bin/tool"),
       ("file", "etc/hostname", b"replaced\n")]


def debugfs(image: Path, request: str) -> str:
    r = subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def stat_of(image: Path, path: str) -> dict[str, str]:
    out = debugfs(image, f"stat {path}")
    fields = dict(re.findall(r"(Inode|Links|User|Group|Mode):\s+(\S+)", out))
    fields["Type"] = re.search(r"Type: (\S+)", out).group(1)  # type: ignore[union-attr]
    return fields


@pytest.fixture(params=["oci", "docker"])
def archive(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    layers = [layer(BASE), layer(TOP)]
    if request.param == "oci":
        return write_oci(tmp_path / "oci", layers)
    return write_docker(tmp_path / "image.tar", layers)


def test_layers_become_an_ext4_disk_with_everything_in_place(archive: Path, tmp_path: Path) -> None:
    store, env = tmp_path / "store", {"STRATA_STATE_DIR": str(tmp_path / "state")}
    r = strata("image", "import", "--store", str(store), str(archive), "demo:v1", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "disk.img"
    assert strata("image", "export", "--store", str(store), "demo:v1", str(out), env=env).returncode == 0
    assert debugfs(out, "cat /etc/hostname") == "replaced\n"  # the top layer wins
    assert debugfs(out, "cat /usr/lib/libextra.so") == "via the lib symlink"  # written through lib -> usr/lib
    assert "tmp/gone" not in debugfs(out, "ls -p /tmp") and "gone" not in debugfs(out, "ls /tmp")  # whiteout
    cache = debugfs(out, "ls /var/cache")
    assert "new" in cache and "old1" not in cache and "old2" not in cache  # opaque directory
    tool, tool2 = stat_of(out, "/bin/tool"), stat_of(out, "/bin/tool2")
    assert tool["Inode"] == tool2["Inode"] and tool["Links"] == "2"  # a hard link, not a copy
    assert tool["Mode"] == "04755"  # setuid kept
    ann = stat_of(out, "/home/ann/notes")
    assert (ann["User"], ann["Group"], ann["Mode"]) == ("1000", "1000", "0600")
    assert stat_of(out, "/lib")["Type"] == "symlink" and "usr/lib" in debugfs(out, "stat /lib")
    assert stat_of(out, "/dev/null")["Type"] == "character"
    inspect = json.loads(strata("image", "inspect", "--store", str(store), "demo:v1", "--json", env=env).stdout)
    assert inspect["size"] >= 64 << 20  # room to grow beyond the files
    assert not list((tmp_path / "state" / "build").iterdir())  # the build directory is gone


def test_the_image_config_is_kept(tmp_path: Path) -> None:
    from layerstore.store import open_store

    store = tmp_path / "store"
    archive = write_oci(tmp_path / "oci", [layer(BASE)])
    assert strata("image", "import", "--store", str(store), str(archive), "demo:v1",
               env={"STRATA_STATE_DIR": str(tmp_path / "state")}).returncode == 0
    with open_store(str(store)) as s:
        notes = s.get_layer(s.resolve("demo:v1")).annotations
    assert json.loads(notes["oci.config"]) == {"Env": ["PATH=/usr/bin:/bin", "GREETING=hi"], "WorkingDir": "/srv",
                                               "Cmd": ["/bin/sh"]}


def hostile(tmp_path: Path, case: str) -> tuple[Path, str]:
    """An archive that must be refused, and what the error must say."""
    if case == "escape":
        return write_oci(tmp_path / "a", [layer([("file", "../../evil", b"x")])]), ""
    if case == "symlink-out":  # a link to the host's directory, then a write through it
        outside = tmp_path / "outside"
        outside.mkdir()
        layers = [layer([("symlink", "etc", str(outside))]), layer([("file", "etc/pwned", b"x")])]
        return write_oci(tmp_path / "a", layers), ""
    if case == "digest":
        root = write_oci(tmp_path / "a", [layer(BASE), layer(TOP)])
        blob = next(p for p in (root / "blobs" / "sha256").iterdir() if p.read_bytes() == layer(TOP))
        blob.write_bytes(layer(TOP[:-1]))  # another layer under the old name
        return root, "layer 2 .* does not match its digest"
    if case == "truncated":
        root = write_oci(tmp_path / "a", [layer(BASE)])
        blob = next(p for p in (root / "blobs" / "sha256").iterdir() if p.read_bytes() == layer(BASE))
        blob.write_bytes(blob.read_bytes()[:300])
        return root, "layer 1 .*(corrupt or truncated|does not match)"
    if case == "bomb":  # ~3 KB of gzip unpacking to 3 MiB, over a 2 MiB limit
        return write_oci(tmp_path / "a", [layer([("file", "big", b"\0" * (3 << 20))])]), "layer 1 .*tar bomb"
    if case == "garbage":
        path = tmp_path / "a.tar"
        with tarfile.open(path, "w") as tar:
            info = tarfile.TarInfo("manifest.json")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"{oops"))
        return path, "manifest.json is not JSON"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["escape", "symlink-out", "digest", "truncated", "bomb", "garbage"])
def test_hostile_archives_publish_nothing_and_write_nothing_outside(tmp_path: Path, case: str) -> None:
    archive, message = hostile(tmp_path, case)
    store, env = tmp_path / "store", {"STRATA_STATE_DIR": str(tmp_path / "state")}
    r = strata("image", "import", "--store", str(store), str(archive), "evil:v1", "--max-unpacked", "2M", env=env)
    if case in ("escape", "symlink-out"):  # contained: lands inside the image, never on the host
        assert r.returncode == 0, r.stderr
        assert not (tmp_path / "evil").exists() and not list(tmp_path.parent.glob("evil"))
        assert not (tmp_path / "outside" / "pwned").exists()
        out = tmp_path / "disk.img"
        assert strata("image", "export", "--store", str(store), "evil:v1", str(out), env=env).returncode == 0
        inside = "/evil" if case == "escape" else str(tmp_path / "outside" / "pwned")
        assert debugfs(out, f"cat {inside}") == "x"  # the write landed inside the disk image
        return
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(message, r.stderr), r.stderr
    assert strata("image", "ls", "--store", str(store), "--json", env=env).stdout.count("evil") == 0
    build = tmp_path / "state" / "build"
    assert not build.exists() or not list(build.iterdir())


def test_a_new_version_builds_on_the_old_disk_and_shares_its_chunks(tmp_path: Path) -> None:
    """v2 = v1's layer + one small layer: built on v1's disk (fuse2fs), so
    it stores a handful of new chunks, not a new disk; its tree is right and
    the filesystem checks clean."""
    import random

    rng = random.Random(7)
    files = [("file", f"usr/share/data/f{i:02d}", rng.randbytes(1 << 20)) for i in range(24)]
    base = layer(BASE + files)
    update = layer([("file", "etc/motd", b"v2\n"), ("file", "usr/share/data/.wh.f03", b""),
                    ("file", "usr/share/data/f05", b"rewritten")])
    env = {"STRATA_STATE_DIR": str(tmp_path / "state")}
    store = str(tmp_path / "store")
    one = json.loads(strata("image", "import", "--json", "--store", store,
                            str(write_oci(tmp_path / "v1", [base])), "app:v1", env=env).stdout)
    two = json.loads(strata("image", "import", "--json", "--store", store,
                            str(write_oci(tmp_path / "v2", [base, update])), "app:v2", env=env).stdout)
    assert one["new_chunks"] >= 24
    assert two["new_chunks"] <= max(6, one["new_chunks"] // 5), (one, two)
    disk = tmp_path / "v2.ext4"
    strata("image", "export", "--store", store, "app:v2", str(disk), env=env)
    assert subprocess.run(["e2fsck", "-fn", str(disk)], capture_output=True).returncode == 0
    assert debugfs(disk, "cat /etc/motd") == "v2\n"
    assert debugfs(disk, "cat /usr/share/data/f05") == "rewritten"
    gone = subprocess.run(["debugfs", "-R", "stat /usr/share/data/f03", str(disk)], capture_output=True, text=True)
    assert "not found" in gone.stderr
    assert stat_of(disk, "/bin/tool")["Mode"].endswith("4755")
    # a third import of v2's exact layers stores nothing new
    three = json.loads(strata("image", "import", "--json", "--store", store,
                              str(write_oci(tmp_path / "v2b", [base, update])), "app:v2b", env=env).stdout)
    assert three["new_chunks"] == 0
