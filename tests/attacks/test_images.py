"""Rows: image names and the OCI importer's layer chains (api/routes/images.py,
layerstore/rootfs.py). Names starting with `strata-` are the node's own (the
importer's `strata-oci:<chain id>` disks, the boot layers, the demo image):
no team writes or removes one. And the importer builds a new version on a
chain's disk only if the store itself tagged it, so a chain ref that got
into the store any other way is ignored, never built on.

The target is a real `strata serve` of its own (teams alpha and beta, an
admin), not tests/attacks/lab.py's: these rows need no sandbox and no
network, so they run beside a lab another run holds (its resolver's port is
fixed)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from layerstore.oci import open_image
from layerstore.refs import STORE_OWNER
from layerstore.rootfs import chain_ids, make_ext4
from layerstore.store import open_store
from tests import hostile_tars
from tests.memory import run_measured
from tests.node_server import ADMIN_KEY, NodeServer
from tests.oci_images import layer, write_oci
from tests.test_cli import run, strata_cmd

ALPHA, BETA, BARE = "alpha-images-key-01", "beta-images-key-01", "bare-images-key-01"


class Target:
    """A node with teams alpha, beta and default (a bare key, the team the
    CLI's own refs count as) and an admin; clients for beta and default."""

    def __init__(self, tmp: Path, guest: Path) -> None:
        self.node = NodeServer(tmp, guest, STRATA_API_KEYS=f"alpha:{ALPHA},beta:{BETA},{BARE}",
                               STRATA_ADMIN_KEYS=f"ops:{ADMIN_KEY}")
        self.node.start()
        self.beta = httpx.Client(base_url=self.node.url, headers={"X-API-Key": BETA}, timeout=300)
        self.default = httpx.Client(base_url=self.node.url, headers={"X-API-Key": BARE}, timeout=300)
        self.env = {k: v for k, v in self.node.env.items() if k.startswith("STRATA_")}  # the operator's CLI

    def close(self) -> None:
        self.beta.close()
        self.default.close()
        self.node.cleanup()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, guest: Path) -> Iterator[Target]:
    target = Target(tmp_path_factory.mktemp("images-node"), guest)
    yield target
    target.close()


def public_image(tmp: Path, label: str) -> tuple[Path, Path]:
    """A public image's v1 (one layer) and v2 (v1's layer and one more), each
    an OCI layout; `label` makes its layers this row's own."""
    base = layer([("dir", "etc"), ("file", "etc/hostname", b"public\n"), ("file", "etc/os-release", label.encode()),
                  ("file", "bin/tool", b"#!/bin/sh\necho public\n", 0o755, 0, 0)])
    update = layer([("file", "etc/motd", b"v2\n")])
    return write_oci(tmp / f"{label}-v1", [base]), write_oci(tmp / f"{label}-v2", [base, update])


def chain_of(layout: Path) -> str:
    """The chain id the importer tags an image's disk with (`strata-oci:<this>`)."""
    image = open_image(layout)
    try:
        return chain_ids(image)[-1]
    finally:
        image.source.close()


def betas_disk(tmp: Path) -> bytes:
    """An ext4 disk of beta's: what beta would have a public image built on."""
    tree = tmp / "beta-tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hostname").write_text("beta\n")
    (tree / "pwned").write_text("planted by team beta\n")
    make_ext4(tree, tmp / "beta.ext4", size=8 << 20)
    return (tmp / "beta.ext4").read_bytes()


def strata(env: dict[str, str], *args: str) -> dict:
    r = run(list(args), env, timeout=300)
    assert r.returncode == 0, (args, r.stderr)
    return json.loads(r.stdout) if "--json" in args else {}


def tree_of(env: dict[str, str], ref: str, out: Path) -> dict[str, tuple[int, bytes]]:
    """Every path in image `ref`'s disk with its mode and content (or link target)."""
    strata(env, "image", "export", ref, str(out.with_suffix(".ext4")))
    out.mkdir()
    r = subprocess.run(["debugfs", "-R", f"rdump / {out}", str(out.with_suffix(".ext4"))], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    found: dict[str, tuple[int, bytes]] = {}
    for path in sorted(out.rglob("*")):
        st = path.lstat()
        body = os.readlink(path).encode() if path.is_symlink() else path.read_bytes() if path.is_file() else b""
        found[str(path.relative_to(out))] = (st.st_mode, body)
    return found


@pytest.fixture(scope="module")
def imported(target: Target, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A public image the operator has imported with `strata image import`: its chain ref."""
    v1, _v2 = public_image(tmp_path_factory.mktemp("public"), "imported")
    strata(target.env, "image", "import", str(v1), "public-imported:v1", "--json")
    return f"strata-oci:{chain_of(v1)}"


NAMES = ["a chain not imported yet", "a chain imported", "strata-boot:vmlinuz", "strata-guest:demo", "strata-oci"]


@pytest.mark.parametrize("team", ["beta", "default"])
@pytest.mark.parametrize("name", NAMES)
def test_a_team_cannot_write_the_stores_own_names(target: Target, imported: str, tmp_path: Path, name: str,
                                                  team: str) -> None:
    """attacker: team beta, or team default (a bare key: the team the
    CLI's own refs count as).  target: the names the store and node write
    for themselves: the OCI importer's `strata-oci:<chain id>` (of a public
    image not imported yet, or one imported), the boot layers, the demo
    image.  attempt: PUT an image under the name, DELETE it.  must: 400
    naming the reserved prefix; every ref in the store is as it was."""
    client = target.beta if team == "beta" else target.default
    if name == "a chain not imported yet":
        name = f"strata-oci:{chain_of(public_image(tmp_path, 'future')[0])}"
    elif name == "a chain imported":
        name = imported
    before = target.node.admin.get("/images").json()
    r = client.put(f"/images/{name}", content=betas_disk(tmp_path))
    assert r.status_code == 400, r.text
    assert "reserved" in r.json()["message"] and "strata-" in r.json()["message"], r.text
    r = client.delete(f"/images/{name}")
    assert r.status_code == 400 and "reserved" in r.json()["message"], r.text
    assert target.node.admin.get("/images").json() == before
    assert not [i for i in client.get("/images").json() if i["ref"].startswith("strata-")]


PLANTS = {  # how the unmarked chain ref got there -> (owner recorded, written through the admin API)
    "by a node before this fix (beta's PUT)": "beta",
    "before teams": "",
    "by a bare key (team default)": "default",
    "by an admin's PUT": None,
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_an_unmarked_chain_ref_is_never_built_on(target: Target, tmp_path: Path, plant: str) -> None:
    """attacker: team beta, with a `strata-oci:<chain id>` ref to its own disk
    in the store, the chain being a public image's first layer (left by a
    node before this fix, written before teams or by a bare key, or through
    an admin's PUT).  target: the operator's next `strata image import` of
    the public image.  attempt: have that import built on beta's disk (the
    importer reuses the disk of the longest chain it has a ref for).
    must: the ref is ignored: the import's disk is exactly what a fresh
    store's import of the same layers holds (none of beta's files), and the
    chain ref it leaves is the store's own."""
    env = target.env
    v1, v2 = public_image(tmp_path, f"row-{list(PLANTS).index(plant)}")
    planted = f"strata-oci:{chain_of(v1)}"
    disk = betas_disk(tmp_path)
    owner = PLANTS[plant]
    if owner is None:
        r = target.node.admin.put(f"/images/{planted}", content=disk)
        assert r.status_code == 201, r.text
    else:
        r = target.beta.put("/images/beta-disk:v1", content=disk)
        assert r.status_code == 201, r.text
        with open_store(env["STRATA_STORE"]) as store:
            store.set_ref(planted, r.json()["manifest"], owner=owner)
    strata(env, "image", "import", str(v2), "public:v2", "--json")
    fresh = {**env, "STRATA_STORE": str(tmp_path / "fresh-store")}
    strata(fresh, "image", "import", str(v2), "public:v2", "--json")
    got, want = tree_of(env, "public:v2", tmp_path / "got"), tree_of(fresh, "public:v2", tmp_path / "want")
    assert "pwned" not in got and got["etc/hostname"][1] == b"public\n"
    assert got == want
    with open_store(env["STRATA_STORE"]) as store:
        tagged = f"strata-oci:{chain_of(v2)}"
        assert store.resolve(tagged) == store.resolve("public:v2")
        assert store.ref_owner(tagged) == STORE_OWNER


@pytest.mark.parametrize("shape", ["pax-bomb", "longname-bomb", "keyword-scan", "global-flood"])
def test_a_layer_header_bomb_is_refused_unread(target: Target, tmp_path: Path, shape: str) -> None:
    """attacker: an image's publisher (a registry a build pulls from, an
    archive the operator imports).  target: the memory of the process that
    applies layers (layerstore/rootfs.py).  attempt: a gzip layer of a few
    hundred KiB whose tar headers attack the reader (tests/hostile_tars.py).
    must: the import fails naming the layer and the bound, no ref is
    written, and its peak memory passes an ordinary import's by < 64 MiB."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))} | target.env
    ordinary = write_oci(tmp_path / "ordinary", [layer([("file", "etc/hello", b"hello\n")])])
    code, err, baseline = run_measured([*strata_cmd(), "image", "import", str(ordinary), "bomb-baseline:v1"], env)
    assert code == 0, err
    bomb = write_oci(tmp_path / "bomb", [hostile_tars.write(tmp_path / "layer.tar.gz", shape)])
    code, err, peak = run_measured([*strata_cmd(), "image", "import", str(bomb), "bomb:v1"], env)
    print(f"{shape}: peak {peak >> 20} MiB, an ordinary import's {baseline >> 20} MiB")
    assert code != 0 and "refused" in err and "layer" in err, err
    assert "bomb:v1" not in {row["ref"] for row in strata(target.env, "image", "ls", "--json")}
    assert peak - baseline < 64 << 20, f"peak {peak >> 20} MiB against an ordinary import's {baseline >> 20} MiB"


@pytest.mark.parametrize("entry", ["..", "etc/../..", ".wh...", ".wh..", ".wh.", "etc/.wh..."])
def test_a_layer_entry_cannot_reach_above_its_own_directory(tmp_path: Path, entry: str) -> None:
    """attacker: an image's publisher.  target: the build directory around
    the staging root (layerstore/rootfs.py applies layers into BUILD/root).
    attempt: an entry whose last part is `..` (a directory with mode 0777
    and another owner), or a whiteout of `..`, `.` or nothing.  must: the
    layer is refused naming the entry; BUILD keeps its mode and its files,
    the root keeps its files."""
    from layerstore.errors import CorruptObject
    from layerstore.rootfs import apply_layers

    if entry.endswith(".."):
        info = tarfile.TarInfo(entry)
        info.type, info.mode, info.uid = tarfile.DIRTYPE, 0o777, 4242
        hostile = ("raw", info, None)
    else:
        hostile = ("file", entry, b"")
    layout = write_oci(tmp_path / "layout", [layer([("dir", "etc"), ("file", "etc/keep", b"keep\n")]),
                                             layer([hostile])])
    build = tmp_path / "build"
    (build / "root").mkdir(parents=True)
    build.chmod(0o700)
    (build / "sentinel").write_text("the build's own\n")
    image = open_image(layout)
    try:
        with pytest.raises(CorruptObject, match="names no file of its directory"):
            apply_layers(image, build / "root")
    finally:
        image.source.close()
    assert (build.stat().st_mode & 0o7777, build.stat().st_uid) == (0o700, os.getuid())
    assert (build / "sentinel").read_text() == "the build's own\n"
    assert (build / "root" / "etc" / "keep").read_text() == "keep\n"
