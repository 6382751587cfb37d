"""The node API over real HTTP (`strata serve` on loopback) with real TCG
sandboxes: the official e2b SDK round trip, Strata's own endpoints, bad
input that must change nothing, lifetimes, restart, warm pool, metrics and a
schemathesis run against /openapi.json."""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.conftest import needs_qemu
from tests.node_server import ADMIN_KEY, API_KEY, ROOT, NodeServer

pytestmark = needs_qemu
OTHER_TEAM_KEY = "test-beta-key-0001"  # team beta's: sees none of the default team's


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, guest: Path) -> Iterator[NodeServer]:
    srv = NodeServer(tmp_path_factory.mktemp("node"), guest, STRATA_MAX_UPLOAD="16M",
                     STRATA_API_KEYS=f"{API_KEY},beta:{OTHER_TEAM_KEY}")
    srv.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    srv.start()
    r = srv.client.post("/templates", json={"name": "base", "image": "guest:v1"})
    assert r.status_code == 201, r.text
    yield srv
    srv.cleanup()
    assert subprocess.run(["pgrep", "-f", str(srv.tmp / "state")], capture_output=True).stdout == b""


def ids(srv: NodeServer, **params: str) -> list[str]:
    r = srv.client.get("/v2/sandboxes", params=params)
    assert r.status_code == 200, r.text
    return sorted(s["sandboxID"] for s in r.json())


def run(srv: NodeServer, sid: str, command: str) -> str:
    r = srv.client.post(f"/sandboxes/{sid}/exec", json={"command": command})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return r.json()["output"].strip()


def test_auth(server: NodeServer) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200  # the one open endpoint
    for headers in ({}, {"X-API-Key": "wrong-key-123"}, {"X-API-Key": API_KEY[:-1]}):
        for path in ("/v2/sandboxes", "/openapi.json", "/metrics", "/images"):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401 and r.json()["code"] == 401, (path, headers, r.text)
    assert server.client.get("/admin/sandboxes").status_code == 403  # an API key is not an admin key
    assert server.admin.get("/admin/sandboxes").status_code == 200
    assert server.admin.get("/v2/sandboxes").status_code == 200  # an admin key is also an API key


def test_e2b_sdk_round_trip(server: NodeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The official e2b SDK: create, list, get_info, set_timeout, pause, connect (resume), kill."""
    from e2b import Sandbox, SandboxQuery, SandboxState

    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    sbx = Sandbox.create(template="base", timeout=120, metadata={"owner": "sdk test"}, envs={"A": "1"})
    sid = sbx.sandbox_id
    listed = Sandbox.list(query=SandboxQuery(metadata={"owner": "sdk test"})).next_items()
    assert [s.sandbox_id for s in listed] == [sid]
    assert Sandbox.list(query=SandboxQuery(metadata={"owner": "nobody"})).next_items() == []
    info = sbx.get_info()
    # started_after and template, as the SDK sends them (startedAfter in RFC 3339, template by name)
    for query, found in ((SandboxQuery(started_after=info.started_at - timedelta(seconds=5)), [sid]),
                         (SandboxQuery(started_after=info.started_at + timedelta(seconds=5)), []),
                         (SandboxQuery(template="base"), [sid]), (SandboxQuery(template="other"), [])):
        assert [s.sandbox_id for s in Sandbox.list(query=query).next_items()] == found, query
    r = server.client.get("/v2/sandboxes", params={"startedAfter": "yesterday"})
    assert r.status_code == 400 and "startedAfter" in r.text, r.text
    assert info.template_id == "base" and info.state == SandboxState.RUNNING and info.metadata == {"owner": "sdk test"}
    sbx.set_timeout(900)
    assert (Sandbox.get_info(sid).end_at - info.started_at).total_seconds() > 800
    run(server, sid, "echo before-pause > /root/kept; sync")
    assert sbx.pause() is True
    assert Sandbox.pause(sid) is False  # already paused: 409, which the SDK reports as False
    assert Sandbox.get_info(sid).state == SandboxState.PAUSED
    assert [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()] == [sid]
    resumed = Sandbox.connect(sid, timeout=300)
    assert resumed.sandbox_id == sid and Sandbox.get_info(sid).state == SandboxState.RUNNING
    assert run(server, sid, "cat /root/kept") == "before-pause"
    Sandbox.connect(sid, timeout=60)  # running: 200, the TTL is not shortened
    assert (Sandbox.get_info(sid).end_at - Sandbox.get_info(sid).started_at).total_seconds() > 250
    assert sbx.kill() is True
    assert Sandbox.kill(sid) is False
    assert ids(server) == []


def test_e2b_sdk_template_tags(server: NodeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Template.assign_tags / get_tags / remove_tags, unchanged SDK: a new tag
    starts what the tagged name starts; another team sees no tags."""
    from e2b import Template, TemplateException

    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    info = Template.assign_tags("base:default", ["prod", "canary"])
    assert sorted(info.tags) == ["canary", "prod"]
    tags = {t.tag: t.build_id for t in Template.get_tags("base")}
    assert {"default", "prod", "canary"} <= set(tags) and tags["prod"] == tags["default"] == info.build_id
    assert Template.exists("base:prod")
    Template.remove_tags("base", "canary")
    assert "canary" not in {t.tag for t in Template.get_tags("base")}
    with pytest.raises(TemplateException):
        Template.assign_tags("base:default", "no/slash")
    monkeypatch.setenv("E2B_API_KEY", OTHER_TEAM_KEY)
    with pytest.raises(Exception, match="404|not found"):
        Template.get_tags("base")
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    Template.remove_tags("base", "prod")


def test_e2b_sdk_snapshots_are_templates(server: NodeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2B's snapshots are templates: create_snapshot's id (bare or `:default`)
    and its NAME:TAG names start sandboxes with the files it kept;
    list_snapshots filters by sandbox and by name; delete_snapshot removes
    the snapshot with its names, and another team sees none of it."""
    from e2b import Sandbox, SandboxException, Template

    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    sbx = Sandbox.create(template="base", timeout=300)
    sbx.commands.run("echo kept > /root/f && sync")
    plain = sbx.create_snapshot()
    named = sbx.create_snapshot(name="sdk-snap:v2")
    assert plain.names == [] and named.names == ["sdk-snap:v2"]
    listed = {s.snapshot_id: s.names for s in sbx.list_snapshots().next_items()}
    assert listed == {plain.snapshot_id: [], named.snapshot_id: ["sdk-snap:v2"]}
    assert [s.snapshot_id for s in Sandbox.list_snapshots(name="sdk-snap:v2").next_items()] == [named.snapshot_id]
    for template in (plain.snapshot_id, f"{plain.snapshot_id}:default", "sdk-snap:v2"):
        child = Sandbox.create(template, timeout=120)
        assert child.commands.run("cat /root/f").stdout == "kept\n", template
        assert child.is_running()
        child.kill()
        assert not child.is_running()  # envd's health through the node: 502 for a sandbox that is gone
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create("sdk-snap")  # the tag `default` is another template: none
    assert Template.exists("sdk-snap:v2") and not Template.exists("sdk-snap") and not Template.exists("../x")
    other = httpx.Client(base_url=server.url, headers={"X-API-Key": OTHER_TEAM_KEY}, timeout=60)
    assert other.post("/sandboxes", json={"templateID": plain.snapshot_id}).status_code == 404
    assert other.delete(f"/templates/{plain.snapshot_id}").status_code == 404
    assert other.get("/snapshots").json() == []
    assert other.get("/templates/aliases/sdk-snap:v2").status_code == 404
    for token in ("", "wrong-token", "x" * 64):  # a running sandbox's health needs its token: else as if gone
        r = httpx.get(f"{server.url}/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token})
        assert r.status_code == 502, r.text

    assert Sandbox.delete_snapshot(plain.snapshot_id) is True
    assert Sandbox.delete_snapshot(plain.snapshot_id) is False  # gone: 404
    assert Sandbox.delete_snapshot(f"{named.snapshot_id}:default") is True  # with its name
    assert "sdk-snap:v2" not in [t["templateID"] for t in server.client.get("/templates").json()]
    assert sbx.list_snapshots().next_items() == []
    sbx.kill()
    assert ids(server) == []


def test_bad_input_changes_nothing(server: NodeServer) -> None:
    c = server.client
    sid = c.post("/sandboxes", json={"templateID": "base", "timeout": 300}).json()["sandboxID"]
    before = sorted((r["sid"], r["state"]) for r in server.admin.get("/admin/sandboxes").json())
    images_before = c.get("/images").json()
    cases = [
        ("GET", "/sandboxes/nope", None, 404), ("DELETE", "/sandboxes/nope", None, 404),
        ("POST", "/sandboxes/nope/pause", None, 404), ("POST", "/v2/sandboxes/nope/connect", {}, 404),
        ("POST", "/sandboxes/nope/timeout", {"timeout": 10}, 404), ("POST", "/sandboxes/nope/fork", {"count": 1}, 404),
        ("POST", "/sandboxes/nope/snapshots", {}, 404), ("GET", "/sandboxes/..%2F..%2Fetc", None, 404),
        ("DELETE", "/sandboxes/.mem", None, 404), ("GET", "/snapshots/" + "0" * 64, None, 404),
        ("GET", "/snapshots/../../x", None, 404), ("DELETE", "/templates/nope", None, 404),
        ("GET", "/images/nope:v1", None, 404), ("DELETE", "/images/..%2Fx:v1", None, 404),
        ("POST", "/sandboxes", {"templateID": "nope"}, 404), ("POST", "/sandboxes", {"templateID": "../x"}, 404),
        ("POST", "/sandboxes", {"templateID": "nope:v9"}, 404),
        ("POST", "/sandboxes", {}, 400), ("POST", "/sandboxes", {"templateID": 5}, 400),
        ("POST", "/sandboxes", {"templateID": "base", "timeout": -1}, 400),
        ("POST", "/sandboxes", {"templateID": "base", "timeout": 10 ** 9}, 400),
        ("POST", f"/sandboxes/{sid}/fork", {"count": 0}, 400), ("POST", f"/sandboxes/{sid}/fork", {"count": 101}, 400),
        ("POST", f"/sandboxes/{sid}/timeout", {"timeout": 0}, 400), ("POST", f"/sandboxes/{sid}/timeout", {}, 400),
        ("POST", f"/sandboxes/{sid}/refreshes", {"duration": 4000}, 400),
        ("POST", f"/sandboxes/{sid}/exec", {"command": "true", "timeout": 0}, 400),
        ("POST", f"/sandboxes/{sid}/snapshots", {"name": "../evil"}, 400),
        ("POST", "/templates", {"name": "t", "image": "guest:v1", "snapshot": "a" * 64}, 400),
        ("POST", "/templates", {"name": "../t", "image": "guest:v1"}, 400),
        ("POST", "/templates", {"name": "t", "image": "nope:v1"}, 404),
        ("POST", f"/sandboxes/{sid}/pause", "not json", 400),
    ]
    # E2B's fields this node does not serve: refused naming the field, never taken and ignored
    unserved = {"mcp": {"mcp": {"github": {}}}, "iam": {"iam": {"tokens": {"aws": {}}}},
                "autoResume": {"autoResume": {"enabled": True}}, "autoPauseMemory": {"autoPauseMemory": False},
                "rules": {"network": {"rules": {"api.example.com": [{"transform": {}}]}}},
                "egressProxy": {"network": {"egressProxy": {"url": "http://proxy.example"}}},
                "maskRequestHost": {"network": {"maskRequestHost": "app.example"}}}
    for name, fields in unserved.items():
        r = c.post("/sandboxes", json={"templateID": "base", **fields})
        assert r.status_code == 400 and f"{name} is not served" in r.json()["message"], (name, r.text)
    r = c.put(f"/sandboxes/{sid}/network", json={"rules": {"a.example": []}, "allowOut": ["1.1.1.1"]})
    assert r.status_code == 400 and "rules is not served" in r.json()["message"], r.text
    for served in ({"autoResume": {"enabled": False}}, {"autoPauseMemory": True}, {"mcp": None}):
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60, **served})  # their defaults: taken
        assert r.status_code == 201, (served, r.text)
        assert c.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204
    for method, path, body, status in cases:
        kwargs = {"content": body} if isinstance(body, str) else {"json": body} if body is not None else {}
        r = c.request(method, path, headers={"content-type": "application/json"} if body is not None else {}, **kwargs)
        assert r.status_code == status, (method, path, body, r.status_code, r.text)
        assert r.json()["code"] == status and r.json()["message"], (method, path, r.text)
    # oversized uploads: refused from Content-Length before reading, and mid-stream without one
    r = c.put("/images/big:v1", content=b"\0" * (17 << 20), headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413, r.text
    r = c.put("/images/big:v1", content=iter([b"x" * (1 << 20)] * 17), headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413, r.text
    r = c.put("/images/..:v1", content=b"x" * 10, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400, r.text
    after = sorted((r["sid"], r["state"]) for r in server.admin.get("/admin/sandboxes").json())
    assert after == before and c.get("/images").json() == images_before
    assert c.get("/templates").json()[0]["templateID"] == "base" and len(c.get("/templates").json()) == 1
    assert not list((server.tmp / "state" / "uploads").iterdir())  # refused uploads leave no file
    assert c.delete(f"/sandboxes/{sid}").status_code == 204


def test_bad_stored_data_is_never_a_500(server: NodeServer) -> None:
    """Objects damaged in the store (a template that is not JSON, one whose
    fields have the wrong types, a ref naming no manifest, a snapshot that
    fails its hash): every request that meets them gets a documented 4xx
    with a message, never a 5xx, and the node goes on serving."""
    from layerstore.store import open_store

    c = server.client
    with open_store(server.env["STRATA_STORE"], state_dir=server.tmp / "vandal") as store:
        store.backend.put("templates/garbled", b"{not json")
        store.backend.put("templates/typed", b'{"kind": "image", "target": ["x"], "created": "soon", "owner": 7}')
        store.backend.put("refs/dangling/v1", b'{"manifest": "' + b"ab" * 32 + b'", "updated": 0}')
        store.backend.put("refs/garbled/v1", b"\x00\xff")
        store.backend.put("snapshots/" + "cd" * 32, b'{"v": 1, "kind": "snapshot"}')
    try:
        for method, path, body in (("POST", "/sandboxes", {"templateID": "garbled"}),
                                   ("POST", "/sandboxes", {"templateID": "typed"}),
                                   ("POST", "/sandboxes", {"templateID": "dangling:v1"}),
                                   ("POST", "/sandboxes", {"templateID": "garbled:v1"}),
                                   ("GET", "/images/dangling:v1", None), ("GET", "/images/garbled:v1", None),
                                   ("GET", "/snapshots/" + "cd" * 32, None), ("DELETE", "/templates/garbled", None),
                                   ("POST", "/templates", {"name": "x", "snapshot": "cd" * 32}),
                                   ("GET", "/templates", None), ("GET", "/images", None), ("GET", "/snapshots", None)):
            r = c.request(method, path, json=body)
            assert r.status_code < 500, (method, path, r.status_code, r.text)
            assert r.status_code in (200, 204) or r.json()["message"], (method, path, r.text)
        assert c.get("/templates").status_code == 200 and c.get("/health").json()["status"] == "ok"
    finally:
        with open_store(server.env["STRATA_STORE"], state_dir=server.tmp / "vandal") as store:
            for key in ("templates/garbled", "templates/typed", "refs/dangling/v1", "refs/garbled/v1",
                        "snapshots/" + "cd" * 32):
                store.backend.delete(key)


def test_image_upload_streamed(server: NodeServer, tmp_path: Path) -> None:
    data = os.urandom(3 << 20) + b"\0" * (4 << 20) + b"tail"
    c = server.client
    r = c.put("/images/up:v1", content=iter([data[i:i + 65536] for i in range(0, len(data), 65536)]),
              headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    assert r.json()["size"] == len(data)
    assert "up:v1" in [i["ref"] for i in c.get("/images").json()]
    detail = c.get("/images/up:v1").json()
    assert detail["size"] == len(data) and detail["hole_chunks"] >= 3 and detail["missing_chunks"] == 0
    server.strata("image", "export", "up:v1", str(tmp_path / "out.img"))
    assert (tmp_path / "out.img").read_bytes() == data
    assert c.delete("/images/up:v1").status_code == 204
    assert c.get("/images/up:v1").status_code == 404


def test_fork_snapshot_and_templates(server: NodeServer) -> None:
    c = server.client
    src = c.post("/sandboxes", json={"templateID": "guest:v1", "timeout": 600}).json()["sandboxID"]
    run(server, src, "echo parent > /root/who; sync")
    r = c.post(f"/sandboxes/{src}/fork", json={"count": 2, "timeout": 300})
    assert r.status_code == 201, r.text
    forks = [f["sandbox"]["sandboxID"] for f in r.json()]
    assert len(forks) == 2 and len(set(forks + [src])) == 3
    for f in forks:
        assert run(server, f, "cat /root/who") == "parent"
        run(server, f, f"echo {f} > /root/who; sync")
    assert [run(server, f, "cat /root/who") for f in forks] == forks and run(server, src, "cat /root/who") == "parent"

    r = c.post(f"/sandboxes/{src}/snapshots", json={"name": "parent-snap"})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    assert r.json()["names"] == ["parent-snap"]
    assert {"snapshotID": snap, "names": ["parent-snap"]} in c.get("/snapshots", params={"sandboxID": src}).json()
    detail = c.get(f"/snapshots/{snap}").json()
    assert {layer["role"] for layer in detail["layers"]} == {"disk", "memory", "state"}
    assert detail["stored_bytes"] > 0 and detail["templates"] == ["parent-snap"] and len(detail["parents"]) >= 1
    assert "parent-snap" in [t["templateID"] for t in c.get("/templates").json()]
    child = c.post("/sandboxes", json={"templateID": "parent-snap"}).json()["sandboxID"]
    assert run(server, child, "cat /root/who") == "parent"
    assert c.delete(f"/snapshots/{snap}").status_code == 409  # the template still needs it
    assert c.delete("/templates/parent-snap").status_code == 204
    assert c.delete(f"/snapshots/{snap}").status_code == 204
    assert c.get(f"/snapshots/{snap}").status_code == 404
    for sid in [src, child, *forks]:
        assert c.delete(f"/sandboxes/{sid}").status_code == 204
    assert ids(server) == []


def test_lifetimes(server: NodeServer) -> None:
    c = server.client
    doomed = c.post("/sandboxes", json={"templateID": "base", "timeout": 2}).json()["sandboxID"]
    sleeper = c.post("/sandboxes", json={"templateID": "base", "timeout": 2, "autoPause": True}).json()["sandboxID"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if c.get(f"/sandboxes/{doomed}").status_code == 404 and c.get(f"/sandboxes/{sleeper}").json()["state"] == "paused":
            break
        time.sleep(0.5)
    assert c.get(f"/sandboxes/{doomed}").status_code == 404  # killed at its timeout
    detail = c.get(f"/sandboxes/{sleeper}").json()
    assert detail["state"] == "paused" and detail["lifecycle"]["onTimeout"] == "pause"
    r = c.post(f"/sandboxes/{sleeper}/connect", json={"timeout": 300})
    assert r.status_code == 201  # resumed
    assert c.post(f"/sandboxes/{sleeper}/connect", json={"timeout": 300}).status_code == 200
    assert c.delete(f"/sandboxes/{sleeper}").status_code == 204


def test_paused_sandboxes_survive_a_restart(server: NodeServer) -> None:
    c = server.client
    sid = c.post("/sandboxes", json={"templateID": "base", "timeout": 600, "metadata": {"k": "v"}}).json()["sandboxID"]
    running = c.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    run(server, sid, "echo survived > /root/state; sync")
    assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
    legacy = c.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    server.stop()
    record = server.tmp / "state" / "sandboxes" / legacy / "sandbox.json"  # as a Strata before record kinds
    data = json.loads(record.read_text())  # marked a template build's sandbox, which a restart forgets
    del data["kind"]
    data["metadata"] = {"strata.build": "b-1"}
    record.write_text(json.dumps(data))
    server.start()
    assert ids(server, state="paused") == [sid] and ids(server, state="running") == [running]
    assert not record.exists()  # the interrupted build's sandbox is gone, not just hidden
    assert c.get(f"/sandboxes/{sid}").json()["metadata"] == {"k": "v"}
    assert c.post(f"/sandboxes/{sid}/resume", json={"timeout": 300}).status_code == 201
    assert run(server, sid, "cat /root/state") == "survived"
    assert run(server, running, "echo still-up") == "still-up"  # its VM kept running through the restart
    for s in (sid, running):
        assert c.delete(f"/sandboxes/{s}").status_code == 204


def test_metrics(server: NodeServer) -> None:
    c = server.admin
    sid = c.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    assert c.get("/sandboxes/nope").status_code == 404
    assert server.client.get("/metrics").status_code == 403  # every team's sandboxes: an admin's view
    text = c.get("/metrics").text
    assert 'strata_sandboxes{state="running"} 1.0' in text
    assert c.delete(f"/sandboxes/{sid}").status_code == 204
    text = c.get("/metrics").text
    for needle in ('strata_sandboxes{state="running"}', 'strata_lifecycle_seconds_bucket{le="0.5",op="create"}',
                   "strata_cache_hits", 'strata_http_request_seconds_count{method="POST",route="/sandboxes",status="201"}'):
        assert needle in text, needle
    assert 'strata_sandboxes{state="running"} 0.0' in text
    assert 'strata_errors_total{kind="NotFound"} 1.0' in text  # the 404 above


def test_warm_pool(server: NodeServer) -> None:
    server.stop()
    server.start("--warm-pool", "base=1")
    c, admin = server.client, server.admin

    def pool() -> list[str]:
        return [r["sid"] for r in admin.get("/admin/sandboxes").json()
                if r["kind"] == "pool" and r["state"] == "paused"]  # ready to hand out

    deadline = time.monotonic() + 120
    while not pool() and time.monotonic() < deadline:
        time.sleep(0.5)
    first = pool()
    assert len(first) == 1 and ids(server) == []  # pool sandboxes are never listed
    r = c.post("/sandboxes", json={"templateID": "base", "metadata": {"from": "pool"}})
    assert r.status_code == 201 and r.json()["sandboxID"] == first[0]  # handed out, not booted
    assert c.get(f"/sandboxes/{first[0]}").json()["metadata"] == {"from": "pool"}
    assert run(server, first[0], "echo warm") == "warm"
    while (not pool() or pool() == first) and time.monotonic() < deadline + 60:
        time.sleep(0.5)
    assert len(pool()) == 1 and pool() != first  # refilled in the background
    assert c.delete(f"/sandboxes/{first[0]}").status_code == 204
    server.stop()
    server.start()  # without --warm-pool: the leftover pool sandbox is removed, not orphaned
    assert admin.get("/admin/sandboxes").json() == []


def test_gc_keeps_what_running_and_paused_sandboxes_need(server: NodeServer) -> None:
    c, admin = server.client, server.admin
    assert c.post("/admin/gc", json={"grace": "0s"}).status_code == 403  # admins only
    running = c.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    paused = c.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    run(server, running, "echo one > /root/f; sync")
    snap = c.post(f"/sandboxes/{running}/snapshots", json={}).json()["snapshotID"]  # seals its disk and RAM
    run(server, paused, "echo sleeping > /root/f; sync")
    assert c.post(f"/sandboxes/{paused}/pause").status_code == 204
    assert c.delete(f"/snapshots/{snap}").status_code == 204  # nothing names the sealed layers any more...
    for _ in range(2):  # ...except the running sandbox's disk: two phases, no grace
        r = admin.post("/admin/gc", json={"grace": "0s"})
        assert r.status_code == 200, r.text
    assert r.json()["deleted"] > 0  # the deleted snapshot's own state layer, at least
    assert admin.post("/admin/gc", json={"grace": "0s", "dryRun": True}).json()["deletable"] == 0
    assert run(server, running, "cat /root/f") == "one"
    assert c.post(f"/sandboxes/{running}/snapshots", json={}).status_code == 201  # its layers are all there
    assert c.post(f"/sandboxes/{paused}/connect", json={"timeout": 60}).status_code == 201
    assert run(server, paused, "cat /root/f") == "sleeping"
    assert admin.post("/admin/push", json={"name": "guest:v1"}).status_code == 409  # no remote configured
    assert admin.post("/admin/gc", json={"grace": "soon"}).status_code == 400
    for sid in (running, paused):
        assert c.delete(f"/sandboxes/{sid}").status_code == 204


def test_snapshots_nothing_needs_are_deleted_and_gc_reclaims_them(server: NodeServer) -> None:
    """A pause's snapshot is deleted when the next pause supersedes it and
    when the sandbox is killed; a snapshot asked for (and a fork's origin
    while forks live) is kept; GC then reclaims the chunks."""
    c, admin = server.client, server.admin

    sid = c.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]

    def snapshots() -> set[str]:  # the sandbox's own (a fork's origin is its sandbox's too)
        return {s["snapshotID"] for s in admin.get("/snapshots", params={"sandboxID": sid}).json()}

    run(server, sid, "head -c 3000000 /dev/urandom > /root/noise; sync")
    asked = c.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
    assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
    first = c.get(f"/sandboxes/{sid}").json()  # E2B's detail does not name the snapshot: ask the store
    first_pause = snapshots() - {asked}
    assert first["state"] == "paused" and len(first_pause) == 1
    assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).status_code == 201
    run(server, sid, "head -c 3000000 /dev/urandom > /root/noise2; sync")
    assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
    second_pause = snapshots() - {asked}
    assert not second_pause & first_pause and len(second_pause) == 1  # superseded: deleted
    assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).status_code == 201
    forks = [f["sandbox"]["sandboxID"] for f in c.post(f"/sandboxes/{sid}/fork", json={"count": 1}).json()]
    origin = snapshots() - {asked} - second_pause
    assert len(origin) == 1
    assert c.delete(f"/sandboxes/{sid}").status_code == 204
    assert snapshots() == {asked} | origin  # the fork still needs its origin; the pause's is gone
    assert c.delete(f"/sandboxes/{forks[0]}").status_code == 204
    assert snapshots() == {asked}  # what the user asked for stays until they delete it
    assert c.delete(f"/snapshots/{asked}").status_code == 204
    reclaimed = 0
    for _ in range(2):  # two phases, no grace
        r = admin.post("/admin/gc", json={"grace": "0s"})
        assert r.status_code == 200, r.text
        reclaimed += r.json()["freed_bytes"]
    assert reclaimed > 3_000_000  # at least the noise the pauses sealed


def test_capacity_limit_holds_under_concurrent_creates(server: NodeServer) -> None:
    from concurrent.futures import ThreadPoolExecutor

    server.stop()
    server.env["STRATA_MAX_SANDBOXES"] = "2"
    server.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: server.client.post("/sandboxes", json={"templateID": "base"}), range(4)))
        codes = sorted(r.status_code for r in replies)
        assert codes == [201, 201, 429, 429], [r.text for r in replies]
        refused = [r for r in replies if r.status_code == 429]
        assert all(r.headers["Should-Retry"] == "false" and "limit is 2" in r.json()["message"] for r in refused)
        assert len(ids(server)) == 2
        for sid in ids(server):
            assert server.client.delete(f"/sandboxes/{sid}").status_code == 204
    finally:
        server.stop()
        del server.env["STRATA_MAX_SANDBOXES"]
        server.start()


def test_schemathesis(server: NodeServer) -> None:
    """Generated requests against /openapi.json: no 5xx, every response matches the schema."""
    result = subprocess.run(
        [str(ROOT / ".venv/bin/schemathesis"), "run", f"{server.url}/openapi.json",
         "-H", f"X-API-Key: {ADMIN_KEY}", "--checks", "not_a_server_error,response_schema_conformance,"
         "status_code_conformance,content_type_conformance", "--max-examples", "8", "--phases", "examples,fuzzing",
         "--generation-deterministic", "--request-timeout", "120"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = result.stdout[result.stdout.rfind("Test cases:"):]
    assert " passed" in summary and "failed" not in summary, summary
    for sid in ids(server):  # a generated create that happened to name a real template
        server.client.delete(f"/sandboxes/{sid}")


def test_a_sandbox_paused_and_resumed_many_times_keeps_every_file(tmp_path: Path, guest: Path) -> None:
    """With squash_depth 3, ten pause/resume cycles squash the sandbox's
    stacks several times: every file written along the way is still there,
    and its disk stack stays shallow."""
    srv = NodeServer(tmp_path, guest, STRATA_SQUASH_DEPTH="3")
    srv.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    try:
        srv.start()
        c = srv.client
        sid = c.post("/sandboxes", json={"templateID": "guest:v1", "timeout": 600}).json()["sandboxID"]
        for cycle in range(10):
            run(srv, sid, f"echo {cycle} > /root/cycle-{cycle}; sync")
            assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
            assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).status_code == 201
        assert run(srv, sid, "cat /root/cycle-*").split() == [str(i) for i in range(10)]
        snap = c.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
        disk = next(x for x in c.get(f"/snapshots/{snap}").json()["layers"] if x["role"] == "disk")["manifest"]
        from layerstore.squash import depth
        from layerstore.store import open_store

        with open_store(srv.env["STRATA_STORE"], state_dir=tmp_path / "reader") as store:
            assert depth(store, disk) <= 4  # 10+ seals, squashed past 3
        assert c.delete(f"/sandboxes/{sid}").status_code == 204
    finally:
        srv.cleanup()
