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
        runtime = s.runtime("demo:v1")  # what a sandbox booted from it gets
    assert json.loads(notes["oci.config"]) == {"Env": ["PATH=/usr/bin:/bin", "GREETING=hi"], "WorkingDir": "/srv",
                                               "Cmd": ["/bin/sh"]}
    assert (runtime.env, runtime.cwd, runtime.user) == ({"PATH": "/usr/bin:/bin", "GREETING": "hi"}, "/srv", "")


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


# layer chains: built on only when the store itself tagged them ----------------------------------
def _chain_world(tmp_path: Path):  # noqa: ANN202 (a store, v1 and v2 layouts, beta's disk's manifest)
    """A store holding beta's disk (a `/pwned` file, its own /etc/hostname),
    and a public image's v1 (BASE) and v2 (BASE and a layer that applies on
    any disk, so building on the wrong one fails nothing) as OCI layouts."""
    from layerstore.importer import import_image
    from layerstore.rootfs import make_ext4
    from layerstore.store import open_store

    tree = tmp_path / "beta-tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hostname").write_text("beta\n")
    (tree / "pwned").write_text("planted\n")
    make_ext4(tree, tmp_path / "beta.ext4", size=8 << 20)
    store = open_store(str(tmp_path / "store"))
    beta = import_image(store, tmp_path / "beta.ext4", "beta-disk:v1").manifest_id
    v1 = write_oci(tmp_path / "v1", [layer(BASE)])
    v2 = write_oci(tmp_path / "v2", [layer(BASE), layer([("file", "etc/motd", b"v2\n")])])
    return store, v1, v2, beta


def _chains(layout: Path) -> list[str]:
    from layerstore.oci import open_image
    from layerstore.rootfs import full_chain_ids

    image = open_image(layout)
    try:
        return full_chain_ids(image)
    finally:
        image.source.close()


def _exported(store, ref: str, out: Path) -> Path:  # noqa: ANN001
    from layerstore.exporter import export_image

    export_image(store, ref, out)
    return out


def _plant(store, tmp_path: Path, how: str, chain: str, beta: str) -> None:  # noqa: ANN001
    """A `strata-oci:<chain>` ref the store did not write, as `how` says."""
    from layerstore.refs import STORE_OWNER
    from layerstore.rootfs import chain_ref, import_oci

    if how.startswith("owner "):
        store.set_ref(chain_ref(chain), beta, owner=how.split(" ", 1)[1].strip("'"))
    elif how == "the store's mark, a disk of no chain":
        store.set_ref(chain_ref(chain), beta, owner=STORE_OWNER)
    elif how == "the store's mark, another chain's disk":
        other = write_oci(tmp_path / "other", [layer([("file", "etc/hostname", b"other image\n")])])
        manifest = import_oci(store, other, "other:v1", build_root=tmp_path / "build").manifest_id
        store.set_ref(chain_ref(chain), manifest, owner=STORE_OWNER)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["owner ''", "owner 'default'", "owner 'beta'", "owner 'ops'",
                                 "the store's mark, a disk of no chain", "the store's mark, another chain's disk"])
def test_a_chain_ref_the_store_did_not_tag_is_not_built_on(tmp_path: Path, how: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A `strata-oci` ref to another disk for v2's first layer (written by a
    team, a bare key, an admin, or marked as the store's but naming a disk
    that records no such chain): the import of v2 ignores it, says so in the
    log, builds from the layers alone, and tags v2's chain as the store's."""
    from layerstore.refs import STORE_OWNER
    from layerstore.rootfs import chain_ref, import_oci, trusted_chain

    store, _v1, v2, beta = _chain_world(tmp_path)
    with store:
        chains = _chains(v2)
        _plant(store, tmp_path, how, chains[0], beta)
        assert trusted_chain(store, chains[0]) is None
        result = import_oci(store, v2, "app:v2", build_root=tmp_path / "build")
        disk = _exported(store, "app:v2", tmp_path / "v2.ext4")
        assert debugfs(disk, "cat /etc/hostname") == "oci-demo\n"  # not beta's, not the other image's
        assert "pwned" not in debugfs(disk, "ls /") and debugfs(disk, "cat /etc/motd") == "v2\n"
        assert debugfs(disk, "cat /usr/lib/libdemo.so") == "ELF" * 100
        assert store.ref_entry(chain_ref(chains[-1])) == (result.manifest_id, STORE_OWNER)
        assert trusted_chain(store, chains[-1]) == result.manifest_id
    assert f"{chain_ref(chains[0])}: not built on" in caplog.text


def test_the_stores_own_chain_is_built_on_and_records_its_chain(tmp_path: Path) -> None:
    """v1's import tags its chain as the store's (owner STORE_OWNER, the
    manifest's `oci.chain` the whole chain id); v2's import builds on it."""
    from layerstore.refs import STORE_OWNER
    from layerstore.rootfs import CHAIN_NOTE, chain_ref, import_oci

    store, v1, v2, _beta = _chain_world(tmp_path)
    with store:
        one = import_oci(store, v1, "app:v1", build_root=tmp_path / "build")
        chain = _chains(v1)[0]
        assert store.ref_entry(chain_ref(chain)) == (one.manifest_id, STORE_OWNER)
        assert store.get_layer(one.manifest_id).annotations[CHAIN_NOTE] == chain
        two = import_oci(store, v2, "app:v2", build_root=tmp_path / "build")
        assert two.new_chunks < one.new_chunks  # on v1's disk: its blocks kept
        assert debugfs(_exported(store, "app:v2", tmp_path / "v2.ext4"), "cat /etc/motd") == "v2\n"


def test_a_chain_ref_moved_during_its_export_is_not_built_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ref is trusted, then moved to beta's disk before the export reads
    it (even with the store's mark): what was exported is not what was
    checked, so the import builds from the layers alone."""
    from layerstore import rootfs
    from layerstore.refs import STORE_OWNER

    store, v1, v2, beta = _chain_world(tmp_path)
    real = rootfs.export_image

    def moved_first(store_, ref, out, **kw):  # noqa: ANN001, ANN202
        store_.set_ref(ref, beta, owner=STORE_OWNER)
        return real(store_, ref, out, **kw)

    with store:
        rootfs.import_oci(store, v1, "app:v1", build_root=tmp_path / "build")
        monkeypatch.setattr(rootfs, "export_image", moved_first)
        rootfs.import_oci(store, v2, "app:v2", build_root=tmp_path / "build")
        disk = _exported(store, "app:v2", tmp_path / "v2.ext4")
    assert "pwned" not in debugfs(disk, "ls /") and debugfs(disk, "cat /etc/hostname") == "oci-demo\n"
