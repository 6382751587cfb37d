"""E2B's volumes on a real `strata serve`, driven by the unchanged `e2b`
SDK's `Volume`: create, connect, list, destroy; write, read (whole and
streamed), list, make_dir, exists, get_info, update_metadata, remove.
Volumes outlive the node (a restart) and GC, count against the team's
stored-bytes quota, and are another team's to see never; a wrong token,
a path with `..`, a directory in a file's way and a volume mount at create
get a clear error and change nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.conftest import needs_qemu
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


def test_a_volume_mount_at_create_is_refused(node: NodeServer) -> None:
    r = client(node, ALPHA).post("/sandboxes", json={"templateID": "none", "volumeMounts": [
        {"name": "data", "path": "/mnt/data"}]})
    assert r.status_code == 400 and "volumeMounts" in r.json()["message"]
