"""`strata gateway` (api/gateway.py): routing rules and the cluster view on
a real store, then three real `strata serve` nodes on one shared store
behind a real gateway, driven by the unchanged E2B SDK with real TCG guests:
placement spreads and skips full nodes, commands and files reach the right
guest by sandbox id, listings merge and page across nodes, a paused sandbox
whose node is gone wakes on another with its files and processes, a node
that stops answering is named (503), bad ids get 404s."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from api import placement
from api.gateway import Cluster, Route, _page, route
from layerstore import nodes
from layerstore.errors import InvalidInput
from layerstore.store import open_store
from tests.conftest import ROOT, free_port, needs_qemu
from tests.node_server import API_KEY, NodeServer


def scope(path: str, method: str = "GET", **headers: str) -> dict:
    return {"type": "http", "method": method, "path": path,
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_routes_come_from_host_header_and_path() -> None:
    assert route(scope("/", host="49983-sb1.strata.test")) == Route("sandbox", "sb1")
    assert route(scope("/any", host="8000-abc-9.example.com")) == Route("sandbox", "abc-9")
    assert route(scope("/process.Process/Start", "POST", e2b_sandbox_id="sb2")) == Route("sandbox", "sb2")
    assert route(scope("/sandboxes/sb3/pause", "POST")) == Route("sandbox", "sb3")
    assert route(scope("/v2/sandboxes/sb4/logs")) == Route("sandbox", "sb4")
    assert route(scope("/sandboxes", "POST")) == Route("create")
    assert route(scope("/v2/sandboxes", "POST")) == Route("create")
    assert route(scope("/sandboxes")) == Route("list", "v1")
    assert route(scope("/v2/sandboxes")) == Route("list", "v2")
    assert route(scope("/admin/sandboxes")) == Route("list", "admin")
    assert route(scope("/sandboxes/metrics")) == Route("metrics")
    assert route(scope("/templates/base/builds/b1/status")) == Route("template", "base")
    assert route(scope("/v2/templates/base/builds/b1", "POST")) == Route("template", "base")
    assert route(scope("/v3/templates", "POST")) == Route("build")
    assert route(scope("/health")) == Route("health")
    assert route(scope("/images")) == Route("any")
    assert route(scope("/templates")) == Route("any")


def test_paging_across_nodes_keeps_its_place() -> None:
    rows = [{"sandboxID": f"s{i}", "startedAt": f"2026-12-04T10:00:0{i}Z"} for i in range(5)]
    first, token = _page(rows[::-1], {"limit": "2"})
    assert [r["sandboxID"] for r in first] == ["s4", "s3"] and token
    second, token = _page(rows, {"limit": "2", "nextToken": token})
    assert [r["sandboxID"] for r in second] == ["s2", "s1"] and token
    last, token = _page(rows, {"limit": "2", "nextToken": token})
    assert [r["sandboxID"] for r in last] == ["s0"] and token is None
    asc, _ = _page(rows, {"order": "asc", "limit": "1"})
    assert asc[0]["sandboxID"] == "s0"
    with pytest.raises(InvalidInput):
        _page(rows, {"limit": "many"})
    assert _page(rows, {"nextToken": "bm90IG91cnM="}) == ([], None)  # a token naming no row ends the listing


def test_the_cluster_view_reads_records_and_placements_from_the_store(tmp_path: Path) -> None:
    backend = open_store(str(tmp_path / "store"), create=True).backend
    about = {"max": 4, "pools": {}, "templates": {}}
    nodes.publish(backend, "a", [], about={**about, "url": "http://127.0.0.1:1", "held": 3})
    nodes.publish(backend, "b", [], about={**about, "url": "http://127.0.0.1:2", "held": 1})
    nodes.publish(backend, "c", [], about={**about, "url": "http://127.0.0.1:3", "held": 3,
                                           "pools": {"base": 1}})
    nodes.publish(backend, "d", [], about={**about, "url": "http://127.0.0.1:4"}, ttl=0)  # stale: not a member
    nodes.publish(backend, "e", [], about={"url": "file:///etc/passwd"})  # not a URL it follows
    now = [0.0]
    cluster = Cluster(backend, refresh=10, clock=lambda: now[0])
    assert [m.node for m in cluster.members()] == ["a", "b", "c"]
    # a warm sandbox first, then free places, then the template's chunks
    assert [m.node for m in cluster.schedule("base")] == ["c", "b", "a"]
    assert [m.node for m in cluster.schedule("other")] == ["b", "a", "c"] or \
        [m.node for m in cluster.schedule("other")] == ["b", "c", "a"]
    b = cluster.member("b")
    assert b is not None
    for _ in range(3):  # what the gateway placed itself counts until the records are read again
        cluster.placed_on(b)
    assert cluster.schedule("other")[-1].node == "b"
    assert [m.node for m in cluster.by_key("tpl")] == [m.node for m in cluster.by_key("tpl")]

    placement.place(backend, "sb1", "b")
    assert cluster.locate("sb1") == b
    assert cluster.locate("nope") is None and cluster.locate("../escape") is None
    placement.place(backend, "sb2", "d")  # placed on a node whose record went stale
    assert cluster.locate("sb2") is None
    placement.unplace(backend, "sb1")
    assert cluster.locate("sb1") == b  # remembered a while...
    cluster.forget("sb1")
    assert cluster.locate("sb1") is None  # ...until a node says it does not run it
    placement.unplace(backend, "sb1")  # twice is harmless


class Gateway:
    """A real `strata gateway` process on loopback."""

    def __init__(self, tmp: Path, store: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "gateway.log"
        env = {**os.environ, "STRATA_STORE": str(store), "STRATA_CONFIG": str(tmp / "none.toml")}
        (tmp / "none.toml").write_text("")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(ROOT / ".venv/bin/strata"), "gateway", "--port", str(self.port),
                                          "--refresh", "0.3"], env=env, stdout=log, stderr=log)
        self.client = httpx.Client(base_url=self.url, headers={"X-API-Key": API_KEY}, timeout=300)

    def wait_for(self, count: int) -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                health = self.client.get("/health").json()
                if len(health.get("nodes", [])) == count:
                    return health
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the gateway never saw {count} nodes: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


@pytest.fixture
def cluster(tmp_path: Path, guest: Path) -> Iterator[tuple[list[NodeServer], Gateway]]:
    store = tmp_path / "shared-store"
    servers = [NodeServer(tmp_path / f"n{i}", guest, STRATA_STORE=str(store), STRATA_MAX_SANDBOXES="1")
               for i in range(3)]
    servers[0].strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    gateway = None
    try:
        for srv in servers:
            srv.start()
        assert servers[0].client.post("/templates", json={"name": "base", "image": "guest:v1"}).status_code == 201
        gateway = Gateway(tmp_path, store)
        gateway.wait_for(3)
        yield servers, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        with ThreadPoolExecutor(len(servers)) as pool:  # each stops its service, VMs and mount
            list(pool.map(NodeServer.cleanup, servers))


@needs_qemu
@pytest.mark.slow
def test_three_nodes_behind_a_gateway(cluster: tuple[list[NodeServer], Gateway],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    servers, gateway = cluster
    monkeypatch.setenv("E2B_API_URL", gateway.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", gateway.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    from e2b import Sandbox

    # one place per node: three creates land on three nodes, a fourth is refused
    boxes = [Sandbox.create(template="base", timeout=300, metadata={"n": str(i)}) for i in range(3)]
    on = {srv.url: [s["sandboxID"] for s in srv.client.get("/sandboxes").json()] for srv in servers}
    assert sorted(len(v) for v in on.values()) == [1, 1, 1], on
    full = gateway.client.post("/sandboxes", json={"templateID": "base"})
    assert full.status_code == 429, full.text

    # the data plane reaches each one's own guest, by the sandbox id the SDK sends
    for i, sbx in enumerate(boxes):
        sbx.files.write("/root/who", f"box {i}\n")
    for i, sbx in enumerate(boxes):
        assert sbx.commands.run("cat /root/who").stdout == f"box {i}\n"
        assert sbx.get_info().metadata["n"] == str(i)

    # listings merge every node; v2 pages across them
    listed = Sandbox.list()
    assert sorted(s.sandbox_id for s in listed.next_items()) == sorted(b.sandbox_id for b in boxes)
    first = gateway.client.get("/v2/sandboxes", params={"limit": 2})
    assert len(first.json()) == 2 and first.headers["x-next-token"]
    rest = gateway.client.get("/v2/sandboxes", params={"limit": 2, "nextToken": first.headers["x-next-token"]})
    assert len(rest.json()) == 1 and "x-next-token" not in rest.headers
    assert {r["sandboxID"] for r in first.json() + rest.json()} == {b.sandbox_id for b in boxes}
    assert len(gateway.client.get("/sandboxes").json()) == 3
    assert gateway.client.get("/sandboxes", headers={"X-API-Key": "wrong-key-000"}).status_code == 401
    metrics = gateway.client.get("/sandboxes/metrics", params={"sandbox_ids": ",".join(b.sandbox_id for b in boxes)})
    assert metrics.status_code == 200 and set(metrics.json()["sandboxes"]) == {b.sandbox_id for b in boxes}

    # killed through the gateway: gone everywhere, and its place is free again
    boxes[0].kill()
    gone = gateway.client.get(f"/sandboxes/{boxes[0].sandbox_id}")
    assert gone.status_code == 404, gone.text
    again = Sandbox.create(template="base", timeout=300)
    assert again.commands.run("echo back").stdout == "back\n"
    freed = next(srv for srv in servers if again.sandbox_id in {s["sandboxID"] for s in srv.client.get(
        "/sandboxes").json()})
    again.kill()

    # paused, and its node goes away for good: resuming through the gateway wakes it on the free node
    boxes[2].commands.run("sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 & echo $! > /root/pid")
    assert boxes[2].pause() is True
    owner = next(srv for srv in servers if boxes[2].sandbox_id in on[srv.url])
    owner.stop()
    owner_id = (owner.tmp / "state" / "node-id").read_text().strip()
    store = open_store(str(owner.tmp.parent / "shared-store"))
    r = gateway.client.get(f"/sandboxes/{boxes[2].sandbox_id}")
    assert r.status_code == 503 and "unavailable" in r.json()["message"], r.text  # its record is live still
    nodes.publish(store.backend, owner_id, [], ttl=0)  # what its record looks like once it expires
    time.sleep(0.5)  # the gateway's next read of the records
    r = gateway.client.get(f"/sandboxes/{boxes[2].sandbox_id}")
    assert r.status_code == 503 and owner_id in r.json()["message"], r.text
    moved = Sandbox.connect(boxes[2].sandbox_id, timeout=300)
    assert moved.commands.run("cat /root/who").stdout == "box 2\n"  # its files came along
    assert moved.commands.run("kill -0 $(cat /root/pid) && echo alive").stdout == "alive\n"  # and its memory
    assert moved.get_info().metadata["n"] == "2"
    assert boxes[2].sandbox_id in {s["sandboxID"] for s in freed.client.get("/sandboxes").json()}
    owner.start()  # the old node comes back: it forgets the sandbox another node took
    assert owner.client.get(f"/sandboxes/{boxes[2].sandbox_id}").status_code == 404
    assert moved.commands.run("echo still here").stdout == "still here\n"
    boxes[2] = moved
    store.close()

    # bad ids: 404 from the gateway itself, nothing forwarded anywhere odd
    for bad in ("nope", "..", "a%2F..%2Fb"):
        r = gateway.client.get(f"/sandboxes/{bad}")
        assert r.status_code == 404, (bad, r.text)
    assert gateway.client.post("/process.Process/List", headers={"E2b-Sandbox-Id": "../x"},
                               json={}).status_code == 404
    assert gateway.client.post("/sandboxes", content=b"x" * (2 << 20)).status_code == 413

    # a node that stops answering: its sandboxes answer 503 naming it, listings name it and go on
    victim = next(srv for srv in servers if boxes[1].sandbox_id in on[srv.url])
    victim.stop()
    r = gateway.client.get(f"/sandboxes/{boxes[1].sandbox_id}")
    assert r.status_code == 503 and "node" in r.json()["message"], r.text
    listing = gateway.client.get("/sandboxes")
    assert listing.status_code == 200 and listing.headers["x-strata-unreachable-nodes"]
    assert boxes[2].sandbox_id in {s["sandboxID"] for s in listing.json()}
    assert boxes[2].commands.run("echo still").stdout == "still\n"


def test_a_store_that_fails_is_an_error_not_a_missing_sandbox() -> None:
    from layerstore.errors import StrataError
    from layerstore.store import open_backend

    dead = open_backend("s3://gone/cluster", endpoint=f"http://127.0.0.1:{free_port()}", retry_attempts=1)
    with pytest.raises(StrataError):
        Cluster(dead).locate("sb1")  # the gateway answers 503 naming the store, never 404
    with pytest.raises(StrataError):
        placement.read(dead, "sb1")
    assert placement.read(dead, "../x") is None  # no store request for an id that cannot exist
