"""E2B's volumes on a real `strata serve`, driven by the unchanged `e2b`
SDK's `Volume`: create, connect, list, destroy; write, read (whole and
streamed), list, make_dir, exists, get_info, update_metadata, remove.
Volumes outlive the node (a restart) and GC, count against the team's
stored-bytes quota, and are another team's to see never; a wrong token,
a path with `..` and a directory in a file's way get a clear error and
change nothing. Mounted in sandboxes (the guest agent's FUSE mount, served
over the volume port), a volume is the same files inside and out."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.conftest import needs_qemu
from tests.js_sdk import run_js
from tests.node_server import ADMIN_KEY, NodeServer

pytestmark = needs_qemu  # a node starts its mount daemon and reads its guest directory

ALPHA, BETA, QUOTA = "alpha-vol-key-01", "beta-vol-key-01", "gamma-vol-key-01"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, guest: Path) -> Iterator[NodeServer]:
    srv = NodeServer(tmp_path_factory.mktemp("volumes"), guest,
                     STRATA_API_KEYS=f"alpha:{ALPHA},beta:{BETA},gamma:{QUOTA}", STRATA_ADMIN_KEYS=f"ops:{ADMIN_KEY}",
                     STRATA_TEAM_MAX_STORED="gamma=2M", STRATA_MAX_UPLOAD="64M")
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture
def sdk(node: NodeServer, monkeypatch: pytest.MonkeyPatch) -> type:
    from e2b import Volume

    monkeypatch.setenv("E2B_API_URL", node.url)
    monkeypatch.setenv("E2B_VOLUME_API_URL", node.url)
    monkeypatch.setenv("E2B_API_KEY", ALPHA)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return Volume


def client(srv: NodeServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"X-API-Key": key}, timeout=300)


def test_the_sdk_round_trip(sdk: type, node: NodeServer) -> None:
    from e2b import VolumePathNotFoundException

    vol = sdk.create("data")
    assert vol.name == "data" and vol.volume_id.startswith("vol")
    assert [(v.volume_id, v.name) for v in sdk.list()] == [(vol.volume_id, "data")]
    big = os.urandom(5 << 20) + b"end"
    info = vol.write_file("/reports/2026/big.bin", big)
    assert info.size == len(big) and info.path == "/reports/2026/big.bin" and info.type.value == "file"
    vol.write_file("notes.txt", "hello volume")
    same = sdk.connect(vol.volume_id)  # a second client, from the id alone
    assert same.read_file("notes.txt") == "hello volume"
    assert same.read_file("/reports/2026/big.bin", format="bytes") == big
    assert b"".join(same.read_file("/reports/2026/big.bin", format="stream")) == big
    assert sorted(e.name for e in same.list("/")) == ["notes.txt", "reports"]
    assert [e.path for e in same.list("/reports", depth=2)] == ["/reports/2026", "/reports/2026/big.bin"]
    made = same.make_dir("/a/b/c", force=True)
    assert made.type.value == "directory" and same.exists("/a/b") and not same.exists("/nope")
    assert same.get_info("notes.txt").size == len("hello volume")
    changed = same.update_metadata("notes.txt", uid=1000, gid=1000, mode=0o600)
    assert (changed.uid, changed.gid, changed.mode) == (1000, 1000, 0o600)
    same.write_file("notes.txt", "replaced", force=True)
    assert vol.read_file("notes.txt") == "replaced"
    vol.remove("/reports")
    assert not vol.exists("/reports/2026/big.bin")
    with pytest.raises(VolumePathNotFoundException):
        vol.read_file("/reports/2026/big.bin")
    assert sdk.destroy(vol.volume_id) is True and sdk.destroy(vol.volume_id) is False
    assert sdk.list() == []


def test_bad_requests_change_nothing(sdk: type, node: NodeServer) -> None:
    from e2b import VolumeException

    vol = sdk.create("careful")
    vol.write_file("/d/f.txt", "kept")
    base = f"/volumecontent/{vol.volume_id}"
    raw = httpx.Client(base_url=node.url, headers={"Authorization": f"Bearer {vol.token}"}, timeout=60)
    cases = [("GET", "/file", {"path": "../../etc/passwd"}, None, 400),
             ("PUT", "/file", {"path": "/d/../../x"}, b"x", 400),
             ("PUT", "/file", {"path": "/d"}, b"x", 409),                   # a directory is in the way
             ("PUT", "/file", {"path": "/d/f.txt"}, b"x", 409),             # no overwrite without force
             ("PUT", "/file", {"path": "/d/f.txt/g"}, b"x", 400),           # a file is no parent
             ("POST", "/dir", {"path": "/x/y"}, None, 404),                 # no parents without force
             ("DELETE", "/path", {"path": "/"}, None, 400),
             ("GET", "/dir", {"path": "/d/f.txt"}, None, 400),
             ("GET", "/dir", {"path": "/", "depth": "0"}, None, 400),
             ("PATCH", "/path", {"path": "/d"}, {"mode": 0o100000}, 400)]
    for method, suffix, params, body, status in cases:
        kw = {"json": body} if isinstance(body, dict) else {"content": body}
        r = raw.request(method, base + suffix, params=params, **kw)
        assert r.status_code == status and r.json()["message"], (method, suffix, params, r.text)
    for headers in ({}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": f"Basic {vol.token}"},
                    {"X-API-Key": ALPHA}):  # the team's API key is no volume token
        r = httpx.get(node.url + base + "/file", params={"path": "/d/f.txt"}, headers=headers)
        assert r.status_code == 401, (headers, r.text)
    r = raw.get("/volumecontent/vol0123456789abcdef/file", params={"path": "/d/f.txt"})
    assert r.status_code == 401  # an unknown volume: the same answer as a wrong token
    assert sorted(e.path for e in vol.list("/", depth=3)) == ["/d", "/d/f.txt"] and vol.read_file("/d/f.txt") == "kept"
    with pytest.raises(VolumeException):
        sdk.create("careful")  # the team has one of that name: 409
    with pytest.raises(VolumeException):
        sdk.create("no/slashes")


def test_another_teams_volume_is_unknown(sdk: type, node: NodeServer) -> None:
    vol = sdk.create("private")
    vol.write_file("secret", "alpha's")
    beta = client(node, BETA)
    assert beta.get("/volumes").json() == []
    assert beta.get(f"/volumes/{vol.volume_id}").status_code == 404
    assert beta.delete(f"/volumes/{vol.volume_id}").status_code == 404
    assert beta.post("/volumes", json={"name": "private"}).status_code == 201  # names are per team
    assert vol.read_file("secret") == "alpha's"
    admin = client(node, ADMIN_KEY)
    assert vol.volume_id in [v["volumeID"] for v in admin.get("/volumes").json()]


def test_volumes_outlive_a_restart_and_gc(sdk: type, node: NodeServer) -> None:
    vol = sdk.create("durable")
    data = os.urandom(3 << 20)
    vol.write_file("/blob", data)
    node.stop()
    node.start()
    r = client(node, ADMIN_KEY).post("/admin/gc", json={"grace": "0s"})
    assert r.status_code == 200, r.text
    r = client(node, ADMIN_KEY).post("/admin/gc", json={"grace": "0s"})  # the second phase deletes
    assert r.status_code == 200, r.text
    assert sdk.connect(vol.volume_id).read_file("/blob", format="bytes") == data


def test_a_volume_counts_against_the_teams_stored_bytes(node: NodeServer) -> None:
    gamma = client(node, QUOTA)
    vol = gamma.post("/volumes", json={"name": "capped"}).json()
    content = httpx.Client(base_url=node.url, headers={"Authorization": f"Bearer {vol['token']}"}, timeout=60)
    url = f"/volumecontent/{vol['volumeID']}/file"
    assert content.put(url, params={"path": "/one"}, content=os.urandom(1 << 20)).status_code == 201
    r = content.put(url, params={"path": "/two"}, content=os.urandom(3 << 20))
    assert r.status_code == 429 and "team_max_stored" in r.json()["message"]
    assert [e["path"] for e in content.get(f"/volumecontent/{vol['volumeID']}/dir", params={"path": "/"}).json()] \
        == ["/one"]


def wait_for(check, what: str, *, seconds: float = 15.0):  # noqa: ANN001, ANN201
    """`check()` once it is truthy: mounts cache names and attributes for a second."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, what
            return value
        time.sleep(0.25)


@pytest.fixture
def sandbox_sdk(node: NodeServer, sdk: type, monkeypatch: pytest.MonkeyPatch) -> type:
    from e2b import Sandbox

    monkeypatch.setenv("E2B_SANDBOX_URL", node.url)
    if client(node, ALPHA).get("/templates/aliases/base").status_code != 200:  # the CLI's, public
        node.strata("image", "import", str(Path(node.env["STRATA_GUEST_DIR"]) / "rootfs.ext4"), "guest:v1")
        node.strata("template", "create", "--image", "guest:v1", "--public", "base")
    return Sandbox


def test_a_mounted_volume_is_the_volume_in_the_guest_and_outside(sdk: type, sandbox_sdk: type,
                                                                  node: NodeServer) -> None:
    """Files a guest writes under its mount are the volume's (read through
    the volume API, from another sandbox, after pause and resume, in a
    fork, which shares the volume and does not copy it); files written
    through the volume API show in the guest."""
    vol = sdk.create("mounted")
    vol.write_file("/seed/hello.txt", "from the API\n")
    sbx = sandbox_sdk.create("base", volume_mounts={"/mnt/data": vol}, timeout=600)
    run = sbx.commands.run
    assert run("cat /mnt/data/seed/hello.txt").stdout == "from the API\n"
    out = run("cd /mnt/data && mkdir -p logs && echo one > logs/a.txt && echo two >> logs/a.txt && "
              "dd if=/dev/urandom of=big.bin bs=1M count=3 2>/dev/null && sha256sum big.bin && "
              "mv logs/a.txt logs/b.txt && ln -s logs/b.txt link && chmod 600 logs/b.txt && ls -la logs").stdout
    digest = out.split()[0]
    assert vol.read_file("logs/b.txt") == "one\ntwo\n"
    assert vol.get_info("logs/b.txt").mode & 0o777 == 0o600
    assert hashlib.sha256(vol.read_file("big.bin", format="bytes")).hexdigest() == digest
    assert not vol.exists("logs/a.txt")
    vol.write_file("/seed/later.txt", "written while mounted\n")
    assert wait_for(lambda: run("cat /mnt/data/seed/later.txt 2>/dev/null || true").stdout
                    == "written while mounted\n", "the API's write shows in the guest")
    errors = run("rmdir /mnt/data/seed 2>&1; rm /mnt/data/logs 2>&1; true").stdout
    assert "not empty" in errors.lower() and "directory" in errors.lower()

    other = sandbox_sdk.create("base", volume_mounts={"/data": "mounted"}, timeout=300)  # by name, a second writer
    assert other.commands.run("cat /data/logs/b.txt").stdout == "one\ntwo\n"
    other.commands.run("echo from-other > /data/other.txt")
    assert wait_for(lambda: run("cat /mnt/data/other.txt 2>/dev/null || true").stdout == "from-other\n",
                    "one sandbox's closed file shows in another")
    other.kill()

    # a file open for writing across a pause: what it wrote before is published by the pause,
    # and the resumed guest's later writes land on it
    run("sh -c 'exec 3>/mnt/data/open.txt; echo before >&3; sleep 6; echo after >&3'", background=True)
    wait_for(lambda: run("cat /mnt/data/open.txt").stdout == "before\n", "the open file's first write")
    sbx.pause()
    assert vol.read_file("open.txt") == "before\n"
    sbx = sandbox_sdk.connect(sbx.sandbox_id, timeout=600)
    assert sbx.commands.run("cat /mnt/data/logs/b.txt").stdout == "one\ntwo\n"
    wait_for(lambda: vol.read_file("open.txt") == "before\nafter\n", "the resumed guest's write on", seconds=40)
    sbx.commands.run("echo after-resume > /mnt/data/resumed.txt")
    assert vol.read_file("resumed.txt") == "after-resume\n"

    forks = client(node, ALPHA).post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1}).json()
    fork = forks[0]["sandbox"]["sandboxID"]
    r = client(node, ALPHA).post(f"/sandboxes/{fork}/exec",
                                 json={"command": "cat /mnt/data/resumed.txt && echo from-fork > /mnt/data/fork.txt"})
    assert r.json()["exitCode"] == 0 and r.json()["output"] == "after-resume\n"
    assert vol.read_file("fork.txt") == "from-fork\n"  # shared, not copied
    assert wait_for(lambda: sbx.commands.run("cat /mnt/data/fork.txt 2>/dev/null || true").stdout == "from-fork\n",
                    "the fork's write shows in its parent")
    client(node, ALPHA).delete(f"/sandboxes/{fork}")
    sbx.kill()
    assert sdk.destroy(vol.volume_id)


def test_a_bad_volume_mount_makes_no_sandbox(sdk: type, sandbox_sdk: type, node: NodeServer) -> None:
    """Another team's volume is as missing as none, paths must be plain
    absolute directories outside /proc, /sys and /dev: 4xx, nothing left."""
    sdk.create("mine")
    beta = client(node, BETA)
    assert beta.post("/volumes", json={"name": "theirs"}).status_code == 201
    alpha = client(node, ALPHA)
    before = alpha.get("/v2/sandboxes").json()
    cases = [([{"name": "theirs", "path": "/mnt/x"}], 404), ([{"name": "nope", "path": "/mnt/x"}], 404),
             ([{"name": "mine", "path": "mnt/x"}], 400), ([{"name": "mine", "path": "/mnt/../etc"}], 400),
             ([{"name": "mine", "path": "/proc/x"}], 400), ([{"name": "mine", "path": "/"}], 400),
             ([{"name": "mine", "path": "/a"}, {"name": "mine", "path": "/a/b"}], 400)]
    for mounts, status in cases:
        r = alpha.post("/sandboxes", json={"templateID": "base", "volumeMounts": mounts})
        assert r.status_code == status, (mounts, r.text)
    assert alpha.get("/v2/sandboxes").json() == before


def test_a_snapshot_keeps_its_mounts_for_its_team_only(sdk: type, sandbox_sdk: type, node: NodeServer) -> None:
    """A sandbox restored from a snapshot of one with a volume mounted has
    the volume mounted (its guest's memory holds the mount); a public
    template made of that snapshot is refused to another team (it would
    serve them alpha's volume), and to alpha once the volume is gone."""
    vol = sdk.create("kept-mount")
    sbx = sandbox_sdk.create("base", volume_mounts={"/mnt/kept": vol}, timeout=300)
    sbx.commands.run("echo in-volume > /mnt/kept/f")
    snap = sbx.create_snapshot()
    sbx.kill()
    child = sandbox_sdk.create(snap.snapshot_id, timeout=300)
    assert child.commands.run("cat /mnt/kept/f").stdout == "in-volume\n"
    child.commands.run("echo from-child > /mnt/kept/g")
    assert vol.read_file("g") == "from-child\n"
    assert client(node, ALPHA).get(f"/sandboxes/{child.sandbox_id}").json()["volumeMounts"] == [
        {"name": "kept-mount", "path": "/mnt/kept"}]
    child.kill()
    node.strata("template", "create", "--snapshot", snap.snapshot_id, "--public", "leaky")
    r = client(node, BETA).post("/sandboxes", json={"templateID": "leaky"})
    assert r.status_code == 400 and "another team" in r.json()["message"], r.text
    assert sdk.destroy(vol.volume_id)
    r = client(node, ALPHA).post("/sandboxes", json={"templateID": snap.snapshot_id})
    assert r.status_code == 400 and "no longer exists" in r.json()["message"], r.text


def test_the_js_sdk_mounts_and_snapshots(sandbox_sdk: type, node: NodeServer) -> None:
    """E2B's JavaScript SDK (`e2b` from npm): Volume, volumeMounts, a
    snapshot started as a template, deleteSnapshot."""
    seen = run_js("volumes.mjs", {"E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url,
                                  "E2B_VOLUME_API_URL": node.url, "E2B_API_KEY": ALPHA})
    assert seen == {"seed": "from the JS API\n", "guest": "from-js-guest\n", "child": "from-js-guest\n",
                    "deleted": True, "deletedAgain": False, "destroyed": True}


def test_volume_snapshots(sdk: type, node: NodeServer) -> None:
    """Strata's volume snapshots: the volume as it was, a new volume started
    from it, another team's as missing (list, use, delete)."""
    vol = sdk.create("snapped")
    vol.write_file("/f.txt", "one")
    alpha, beta = client(node, ALPHA), client(node, BETA)
    r = alpha.post(f"/volumes/{vol.volume_id}/snapshots")
    assert r.status_code == 201, r.text
    snap = r.json()
    vol.write_file("/f.txt", "two", force=True)
    assert [s["snapshotID"] for s in alpha.get(f"/volumes/{vol.volume_id}/snapshots").json()] == [snap["snapshotID"]]
    r = alpha.post("/volumes", json={"name": "restored", "fromSnapshot": snap["snapshotID"]})
    assert r.status_code == 201, r.text
    assert sdk.connect(r.json()["volumeID"]).read_file("/f.txt") == "one"
    assert vol.read_file("/f.txt") == "two"
    assert beta.get(f"/volumes/{vol.volume_id}/snapshots").status_code == 404
    assert beta.post("/volumes", json={"name": "stolen", "fromSnapshot": snap["snapshotID"]}).status_code == 404
    assert beta.delete(f"/volume-snapshots/{snap['snapshotID']}").status_code == 404
    assert "stolen" not in beta.get("/volumes").text
    assert alpha.delete(f"/volume-snapshots/{snap['snapshotID']}").status_code == 204
    assert alpha.delete(f"/volume-snapshots/{snap['snapshotID']}").status_code == 404
    assert alpha.post("/volumes", json={"name": "late", "fromSnapshot": "vs../x"}).status_code == 404
