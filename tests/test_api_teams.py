"""Teams on a real `strata serve` with a real TCG sandbox: another team's
sandboxes, snapshots, templates and images are unknown (404, the same answer
as a missing one) and cannot be taken over (409, nothing changes); admin keys
see everything; per-team quotas answer 429 and create nothing; a schemathesis
run with one team's key never answers 5xx and never shows the other team's
objects; one team's 600 long requests (streams and execs) leave the other
teams' short requests answered, and its 601st is refused naming its limit."""

from __future__ import annotations

import contextlib
import json
import re
import selectors
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from layerstore.store import open_store
from tests.conftest import needs_qemu
from tests.node_server import ADMIN_KEY, ROOT, NodeServer

pytestmark = needs_qemu

ALPHA, BETA = "alpha-key-0001", "beta-key-0001"
GAMMA, DELTA = "gamma-key-0001", "delta-key-0001"  # the long requests' team, and a team beside it


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, guest: Path) -> Iterator[NodeServer]:
    srv = NodeServer(tmp_path_factory.mktemp("teams"), guest, STRATA_API_KEYS=f"alpha:{ALPHA},beta:{BETA},gamma:{GAMMA},delta:{DELTA}",
                     STRATA_ADMIN_KEYS=f"ops:{ADMIN_KEY}", STRATA_TEAM_MAX_SANDBOXES="alpha=1",
                     STRATA_TEAM_MAX_SNAPSHOTS="alpha=1", STRATA_TEAM_MAX_STORED="beta=64M",
                     STRATA_TEAM_MAX_STREAMS="gamma=600,alpha=3")
    srv.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")  # the CLI's: team default
    srv.start()
    yield srv
    srv.cleanup()


def client(srv: NodeServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"X-API-Key": key}, timeout=300)


@pytest.fixture(scope="module")
def alpha_world(node: NodeServer) -> dict[str, str]:
    """What team alpha owns: an image and a template naming it. The image the
    CLI imported (team default) is not alpha's to use."""
    a = client(node, ALPHA)
    assert a.put("/images/base:v1", content=b"alpha's disk image\n" * 4096).status_code == 201
    assert a.post("/templates", json={"name": "boot", "image": "guest:v1"}).status_code == 404
    assert a.post("/sandboxes", json={"templateID": "guest:v1"}).status_code == 404
    assert a.post("/templates", json={"name": "base", "image": "base:v1"}).status_code == 201
    return {"image": "base:v1", "template": "base", "manifest": a.get("/images/base:v1").json()["manifest"]}


@pytest.fixture(scope="module")
def alpha_sandbox(node: NodeServer, alpha_world: dict[str, str]) -> dict[str, str]:
    """Alpha's running sandbox (booted from the guest rootfs uploaded with
    alpha's key) with a file in it, and a named snapshot of it."""
    a = client(node, ALPHA)
    guest = (Path(node.env["STRATA_GUEST_DIR"]) / "rootfs.ext4").read_bytes()
    assert a.put("/images/guest:alpha", content=guest).status_code == 201
    r = a.post("/sandboxes", json={"templateID": "guest:alpha", "timeout": 600})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert a.post(f"/sandboxes/{sid}/exec", json={"command": "echo alpha > /root/mine; sync"}).status_code == 200
    r = a.post(f"/sandboxes/{sid}/snapshots", json={"name": "alpha-snap"})
    assert r.status_code == 201, r.text
    return {**alpha_world, "sid": sid, "snapshot": r.json()["snapshotID"]}


def test_another_teams_sandbox_is_unknown(node: NodeServer, alpha_sandbox: dict[str, str]) -> None:
    b, sid = client(node, BETA), alpha_sandbox["sid"]
    missing = b.get("/sandboxes/sb000000000000").json()["message"].replace("sb000000000000", sid)
    assert b.get(f"/sandboxes/{sid}").json() == {"code": 404, "message": missing}  # no existence leak
    for method, path, body in (("DELETE", f"/sandboxes/{sid}", None), ("POST", f"/sandboxes/{sid}/pause", None),
                               ("POST", f"/sandboxes/{sid}/resume", {}), ("POST", f"/sandboxes/{sid}/connect", {}),
                               ("POST", f"/sandboxes/{sid}/timeout", {"timeout": 5}),
                               ("POST", f"/sandboxes/{sid}/refreshes", {}), ("POST", f"/sandboxes/{sid}/fork", {}),
                               ("POST", f"/sandboxes/{sid}/snapshots", {}),
                               ("POST", f"/sandboxes/{sid}/exec", {"command": "rm -rf /root"})):
        r = b.request(method, path, json=body)
        assert r.status_code == 404, (path, r.text)
    assert sid not in {s["sandboxID"] for s in b.get("/v2/sandboxes").json()}
    assert sid not in {s["sandboxID"] for s in b.get("/sandboxes").json()}
    assert b.get("/health").json()["sandboxes"] == 0
    # nothing happened to it: alpha still runs it, with its file
    a = client(node, ALPHA)
    assert a.get(f"/sandboxes/{sid}").json()["state"] == "running"
    assert a.post(f"/sandboxes/{sid}/exec", json={"command": "cat /root/mine"}).json()["output"].strip() == "alpha"
    assert sid in {s["sandboxID"] for s in node.admin.get("/v2/sandboxes").json()}  # admins see all


def test_another_teams_snapshots_and_templates_are_unknown_and_kept(node: NodeServer,
                                                                   alpha_sandbox: dict[str, str]) -> None:
    b, snap = client(node, BETA), alpha_sandbox["snapshot"]
    assert snap not in {s["snapshotID"] for s in b.get("/snapshots").json()}
    assert b.get(f"/snapshots/{snap}").status_code == 404
    assert b.delete(f"/snapshots/{snap}").status_code == 404
    assert b.post("/templates", json={"name": "mine", "snapshot": snap}).status_code == 404  # no cloning
    assert b.post("/sandboxes", json={"templateID": "alpha-snap"}).status_code == 404
    assert {t["templateID"] for t in b.get("/templates").json()} == set()
    before = client(node, ALPHA).get("/templates").json()
    for name in ("base", "alpha-snap"):
        r = b.post("/templates", json={"name": name, "image": "guest:v1"})
        assert r.status_code == 409 and "another team" in r.json()["message"], r.text
        assert b.delete(f"/templates/{name}").status_code == 404
    assert client(node, ALPHA).get("/templates").json() == before
    assert snap in {s["snapshotID"] for s in node.admin.get("/snapshots").json()}


def test_another_teams_image_cannot_be_overwritten(node: NodeServer, alpha_world: dict[str, str]) -> None:
    b = client(node, BETA)
    r = b.put("/images/base:v1", content=b"evil" * 1024)
    assert r.status_code == 409 and "another team" in r.json()["message"], r.text
    assert client(node, ALPHA).get("/images/base:v1").json()["manifest"] == alpha_world["manifest"]
    assert b.get("/images/base:v1").status_code == 404
    assert b.delete("/images/base:v1").status_code == 404
    assert "base:v1" not in {i["ref"] for i in b.get("/images").json()}
    assert "base:v1" in {i["ref"] for i in node.admin.get("/images").json()}
    # beta's own names work
    assert b.put("/images/beta:v1", content=b"beta" * 1024).status_code == 201
    assert {i["ref"] for i in b.get("/images").json()} == {"beta:v1"}


def test_the_stores_own_names_are_an_admins_alone(node: NodeServer) -> None:
    """`strata-*` image names (the importer's layer chains, boot layers, the
    demo image) are the node's: a team's PUT or DELETE is 400 and changes
    nothing; an admin's works, and its ref is the admin's team's, never the
    store's own mark (which the importer alone writes, tests/test_rootfs.py)."""
    name = "strata-oci:" + "ab" * 16
    for key in (ALPHA, BETA):
        r = client(node, key).put(f"/images/{name}", content=b"team disk" * 512)
        assert r.status_code == 400 and "is reserved" in r.json()["message"], r.text
        assert client(node, key).delete(f"/images/{name}").status_code == 400
    assert name not in {i["ref"] for i in node.admin.get("/images").json()}
    r = node.admin.put(f"/images/{name}", content=b"admin disk" * 512)
    assert r.status_code == 201, r.text
    with open_store(node.env["STRATA_STORE"]) as store:
        assert store.ref_entry(name) == (r.json()["manifest"], "ops")
    assert client(node, ALPHA).get(f"/images/{name}").status_code == 404  # the admin's team's, as any image
    assert node.admin.delete(f"/images/{name}").status_code == 204


def test_quotas_answer_429_and_create_nothing(node: NodeServer, alpha_sandbox: dict[str, str]) -> None:
    a, b = client(node, ALPHA), client(node, BETA)
    before = {s["sandboxID"] for s in node.admin.get("/v2/sandboxes").json()}
    r = a.post("/sandboxes", json={"templateID": "guest:alpha"})
    assert r.status_code == 429 and r.headers["Should-Retry"] == "false", r.text
    assert "team alpha is over its quota team_max_sandboxes" in r.json()["message"]
    assert "limit is 1" in r.json()["message"]
    assert a.post(f"/sandboxes/{alpha_sandbox['sid']}/fork", json={"count": 1}).status_code == 429
    r = a.post(f"/sandboxes/{alpha_sandbox['sid']}/snapshots", json={})
    assert r.status_code == 429 and "team_max_snapshots" in r.json()["message"], r.text
    assert {s["sandboxID"] for s in node.admin.get("/v2/sandboxes").json()} == before
    r = b.put("/images/big:v1", content=b"\x01" * (80 << 20))
    assert r.status_code == 429 and "team_max_stored" in r.json()["message"], r.text
    assert b.get("/images/big:v1").status_code == 404


def test_schemathesis_with_another_teams_key_leaks_nothing(node: NodeServer, alpha_sandbox: dict[str, str]) -> None:
    """Generated requests with beta's key: no 5xx, and no response names
    alpha's sandbox, snapshot, templates or image; alpha's objects survive."""
    result = subprocess.run(
        [str(ROOT / ".venv/bin/schemathesis"), "run", f"{node.url}/openapi.json", "-H", f"X-API-Key: {BETA}",
         "--checks", "not_a_server_error", "--max-examples", "6", "--phases", "examples,fuzzing",
         "--generation-deterministic", "--request-timeout", "120", "--report", "har",
         "--report-dir", str(node.tmp / "report")],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    har = "".join(p.read_text() for p in (node.tmp / "report").glob("har-*.json"))
    assert har, "schemathesis wrote no HAR report"
    for secret in (alpha_sandbox["sid"], alpha_sandbox["snapshot"], alpha_sandbox["manifest"], "alpha-snap",
                   "guest:alpha", "base:v1"):
        assert secret not in har, f"beta saw {secret}"
    a = client(node, ALPHA)
    assert a.get(f"/sandboxes/{alpha_sandbox['sid']}").json()["state"] == "running"
    assert a.get(f"/snapshots/{alpha_sandbox['snapshot']}").status_code == 200
    assert a.get("/images/base:v1").json()["manifest"] == alpha_sandbox["manifest"]
    for s in client(node, BETA).get("/v2/sandboxes").json():  # a generated create may have started one
        client(node, BETA).delete(f"/sandboxes/{s['sandboxID']}")


# --- one team's long requests and everyone else's short ones (api/limits.py) ---------------

def envelope(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


def post(path: str, headers: dict[str, str], body: bytes) -> bytes:
    """A raw HTTP/1.1 POST of `body`."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def stream_request(sandbox: dict, rpc: str, message: dict) -> bytes:
    """An envd process stream (Start, Connect) with the sandbox's token; it
    lasts as long as the process, quiet: a keepalive an hour (a client's choice)."""
    return post(f"/process.Process/{rpc}", {"E2b-Sandbox-Id": sandbox["sandboxID"],
                                            "X-Access-Token": sandbox["envdAccessToken"],
                                            "Content-Type": "application/connect+json",
                                            "Keepalive-Ping-Interval": "3600"}, envelope(message))


def exec_request(sandbox: dict, key: str, command: str) -> bytes:
    return post(f"/sandboxes/{sandbox['sandboxID']}/exec", {"X-API-Key": key, "Content-Type": "application/json"},
                json.dumps({"command": command, "timeout": 3600}).encode())


class Held:
    """Requests held open on raw sockets: each sent whole, its answer
    collected as it comes (a client that starts streams and sits on them)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.selector = selectors.DefaultSelector()
        self.replies: dict[socket.socket, bytes] = {}

    def open(self, request: bytes, count: int = 1) -> list[socket.socket]:
        opened = []
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            s.sendall(request)
            s.setblocking(False)
            self.replies[s] = b""
            self.selector.register(s, selectors.EVENT_READ)
            opened.append(s)
        return opened

    def started_pid(self, s: socket.socket, timeout: float = 60) -> int:
        """The pid a Start stream on `s` reported."""
        assert self.wait(lambda h: b'"pid"' in h.replies[s], timeout), self.replies[s][:500]
        found = re.search(rb'"pid":\s*(\d+)', self.replies[s])
        assert found, self.replies[s][:500]
        return int(found.group(1))

    def count(self, marker: bytes) -> int:
        return sum(marker in reply for reply in self.replies.values())

    def wait(self, done: Callable[["Held"], bool], timeout: float) -> bool:
        """Collect answers until `done(self)` or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while not done(self) and time.monotonic() < deadline:
            for key, _ in self.selector.select(0.2):
                s = key.fileobj
                try:
                    data = s.recv(65536)  # type: ignore[union-attr]
                except (BlockingIOError, ConnectionResetError):
                    data = b""
                if not data:
                    self.selector.unregister(s)
                self.replies[s] += data  # type: ignore[index]
        return done(self)

    def drop(self, s: socket.socket) -> None:
        """Leave one request: its socket closed, its answer forgotten."""
        if s in self.selector.get_map():
            self.selector.unregister(s)
        del self.replies[s]
        s.close()

    def close(self) -> None:
        for s in self.replies:
            s.close()
        self.selector.close()


def test_a_teams_600_long_requests_leave_other_teams_answered(node: NodeServer) -> None:
    """Team gamma (allowed 600 long requests) holds 20 execs of `sleep 600`
    and 580 process streams (a start and 289 attaches on each of two
    sandboxes): more than the worker threads short requests have (512).
    Team delta's list, create, exec, info and kill are answered all the
    while, as are alpha's; gamma's 601st is 429 naming team_max_streams.
    (Timeouts here only catch a hang; nothing is timed.)"""
    gamma = client(node, GAMMA)
    delta, alpha = (httpx.Client(base_url=node.url, headers={"X-API-Key": key}, timeout=60) for key in (DELTA, ALPHA))
    rootfs = (Path(node.env["STRATA_GUEST_DIR"]) / "rootfs.ext4").read_bytes()
    for team, ref in ((gamma, "guest:gamma"), (delta, "guest:delta")):
        assert team.put(f"/images/{ref}", content=rootfs).status_code == 201
    boxes = [gamma.post("/sandboxes", json={"templateID": "guest:gamma", "timeout": 900}).json() for _ in range(2)]
    held = Held(node.port)
    try:
        for box in boxes:
            started = held.open(stream_request(box, "Start", {"process": {"cmd": "/bin/sh",
                                                                          "args": ["-c", "sleep 3000"]}}))
            pid = held.started_pid(started[0])
            held.open(exec_request(box, GAMMA, "sleep 600"), 10)
            held.open(stream_request(box, "Connect", {"process": {"pid": pid}}), 289)
        # as many as there are threads for short requests: a node that shares them is stuck from here on
        assert held.wait(lambda h: h.count(b'"start"') >= 512 - 20, 120), held.count(b'"start"')
        for _ in range(2):
            assert delta.get("/v2/sandboxes").status_code == 200
            assert alpha.get("/v2/sandboxes").status_code == 200
        r = delta.post("/sandboxes", json={"templateID": "guest:delta", "timeout": 300})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        assert delta.post(f"/sandboxes/{sid}/exec", json={"command": "echo answered"}).json()["output"] == "answered\n"
        assert delta.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert delta.delete(f"/sandboxes/{sid}").status_code == 204
        assert held.wait(lambda h: h.count(b'"start"') == 580, 120), held.count(b'"start"')
        assert held.count(b"HTTP/1.1 5") == 0 and held.count(b"resource_exhausted") == 0
        r = gamma.post(f"/sandboxes/{boxes[0]['sandboxID']}/exec", json={"command": "true"})
        assert r.status_code == 429 and r.headers["X-Strata-Limit"] == "team", r.text
        assert "team gamma is over its quota team_max_streams" in r.json()["message"] and "600" in r.json()["message"]
    finally:
        held.close()
        for box in boxes:  # a node that is stuck does not answer this either: the failure above is the one to see
            with contextlib.suppress(httpx.HTTPError):
                gamma.delete(f"/sandboxes/{box['sandboxID']}", timeout=30)


def test_polling_watchers_hold_their_teams_places_until_removed(node: NodeServer,
                                                                 alpha_sandbox: dict[str, str]) -> None:
    """A polling watcher (envd's CreateWatcher) holds a thread and a guest
    stream until it is removed, so it holds one of its team's places among
    long requests (alpha has 3) until then: a 4th watcher and an exec are
    429 naming team_max_streams; removing one gives its place back; a
    stream that has ended holds none; polling and removing a watcher, and
    signalling a process, are answered at the limit too."""
    data_plane = httpx.Client(base_url=node.url, timeout=60,
                              headers={"E2b-Sandbox-Id": alpha_sandbox["sid"], "X-API-Key": ALPHA})
    a = client(node, ALPHA)
    ended = data_plane.post("/process.Process/Start", content=envelope({"process": {"cmd": "/bin/true"}}),
                            headers={"Content-Type": "application/connect+json"})
    assert b'"end"' in ended.content, ended.content[:300]
    watchers = []
    for _ in range(3):
        r = data_plane.post("/filesystem.Filesystem/CreateWatcher", json={"path": "/tmp"})
        assert r.status_code == 200, r.text
        watchers.append(r.json()["watcherId"])
    r = data_plane.post("/filesystem.Filesystem/CreateWatcher", json={"path": "/tmp"})
    assert r.status_code == 429 and r.json()["code"] == "resource_exhausted", r.text
    assert "team alpha is over its quota team_max_streams" in r.json()["message"]
    assert r.headers["X-Strata-Limit"] == "team"
    r = a.post(f"/sandboxes/{alpha_sandbox['sid']}/exec", json={"command": "true"})
    assert r.status_code == 429 and "team_max_streams" in r.json()["message"], r.text
    r = data_plane.post("/process.Process/SendSignal", json={"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 404 and r.json()["code"] == "not_found", r.text  # asked the guest: no such process
    assert a.get("/v2/sandboxes").status_code == 200  # short requests are not long ones
    r = data_plane.post("/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": watchers[0]})
    assert r.status_code == 200, r.text  # polling takes no place, removing may go past: a team can wind down
    assert data_plane.post("/filesystem.Filesystem/RemoveWatcher", json={"watcherId": watchers.pop()}
                           ).status_code == 200
    assert a.post(f"/sandboxes/{alpha_sandbox['sid']}/exec", json={"command": "echo again"}).json()["output"] == "again\n"
    for wid in watchers:
        assert data_plane.post("/filesystem.Filesystem/RemoveWatcher", json={"watcherId": wid}).status_code == 200
