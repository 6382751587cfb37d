"""`strata gateway` (api/gateway.py): routing rules and the cluster view on
a real store, then the cluster as it runs: three real `strata serve` nodes,
each in its own network namespace, on one real SeaweedFS behind a real
gateway, driven by the unchanged E2B SDK with real TCG guests. Placement
spreads and skips full nodes; commands and files reach the right guest by
sandbox id; listings merge and page across nodes; a node killed with its
sandbox paused makes GC refuse (naming it) until it is forgotten, and the
sandbox resumes on another node with its files and processes; GC while
nodes run sandboxes whose image and template were removed deletes only
garbage, and two concurrent GCs never both delete; a node that stops
answering is named (503); bad ids get 404s."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from vmm import placement
from api.gateway import Cluster, Route, _page, route
from layerstore import nodes
from layerstore.chunk import chunk_key
from layerstore.errors import InvalidInput
from layerstore.reach import Closure
from layerstore.store import open_store
from tests.conftest import IN_CI, ROOT, free_port, needs_qemu
from tests.netns import Forward, Lab, start_sdk_runtime
from tests.node_server import API_KEY, NodeServer
from tests.seaweedfs_server import SeaweedFS

needs_netns = pytest.mark.skipif((os.geteuid() != 0 or shutil.which("ip") is None) and not IN_CI,
                                 reason="network namespaces need root and iproute2 (ip)")


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
    keyed = [m.node for m in cluster.for_create("other", "retry-1")]
    for _ in range(5):  # the first try filled that node...
        cluster.placed_on(cluster.member(keyed[0]))
    assert [m.node for m in cluster.for_create("other", "retry-1")] == keyed  # ...a retry goes there all the same
    assert cluster.for_create("other", None)[0].node != keyed[0]  # a create without a key goes by load

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
    """A real `strata gateway` process (in a test's network namespace: `prefix`)."""

    def __init__(self, tmp: Path, env: dict[str, str], *, host: str, prefix: tuple[str, ...]) -> None:
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.log = tmp / "gateway.log"
        (tmp / "none.toml").write_text("")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*prefix, str(ROOT / ".venv/bin/strata"), "gateway", "--host", host,
                                          "--port", str(self.port), "--refresh", "0.3"],
                                         env={**env, "STRATA_CONFIG": str(tmp / "none.toml")}, stdout=log, stderr=log)
        self.client = httpx.Client(base_url=self.url, headers={"X-API-Key": API_KEY}, timeout=300)

    def wait_for(self, count: int) -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                health = self.client.get("/health").json()
                if health.get("count") == count:
                    return health
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the gateway never saw {count} nodes: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


@dataclass
class Lab3:
    """Three nodes, a gateway and SeaweedFS, each node in its own network namespace (tests/netns.py):
    the test thread, the gateway and SeaweedFS sit in the hub, the nodes reach the store and the
    gateway reaches the nodes over veth links, as separate machines would."""

    servers: list[NodeServer]
    gateway: Gateway
    sdk_url: str  # the gateway, for the E2B SDK (whose HTTP runtime's threads live in this process's own namespace)
    ops: dict[str, str]  # an operator's `strata` on the shared store, from no node
    prefix: tuple[str, ...]
    s3: Any  # a boto3 client of the store's bucket

    def placed(self) -> set[str]:
        """The sandbox ids with a placement object in the store."""
        listed = self.s3.list_objects_v2(Bucket="shared", Prefix="cluster/placements/").get("Contents", [])
        return {item["Key"].rsplit("/", 1)[1] for item in listed}

    def strata(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, str(ROOT / ".venv/bin/strata"), *args], env=self.ops,
                              capture_output=True, text=True, timeout=300)

    def strata_ok(self, *args: str) -> str:
        r = self.strata(*args)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout


@pytest.fixture
def cluster(tmp_path: Path, guest: Path) -> Iterator[Lab3]:
    lab = Lab(f"g{os.getpid() % 10000}")
    servers: list[NodeServer] = []
    gateway = weed = forward = None
    try:
        for name in "abc":
            lab.add_node(name)
        start_sdk_runtime()  # the SDK's HTTP threads here, outside the hub, even when no SDK test ran before
        forward = Forward(lab, "hub")  # made here, outside the hub: its loopback port is this process's
        with lab.inside("hub"):  # setns(2) is per thread: the test's HTTP goes out through the hub's bridge
            weed = SeaweedFS(tmp_path / "weed", ip=lab.addrs["hub"], prefix=lab.prefix("hub")).start()
            weed.create_bucket("shared")
            s3 = {"STRATA_STORE": "s3://shared/cluster", "STRATA_S3_ENDPOINT": weed.endpoint,
                  "AWS_ACCESS_KEY_ID": weed.access_key, "AWS_SECRET_ACCESS_KEY": weed.secret_key,
                  "AWS_REGION": weed.region}
            servers += [NodeServer(tmp_path / name, guest, host=lab.addrs[name], prefix=lab.prefix(name), **s3,
                                   STRATA_MAX_SANDBOXES="1", STRATA_NODE_TTL="9s") for name in "abc"]
            servers[0].strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
            with ThreadPoolExecutor(3) as pool:
                list(pool.map(NodeServer.start, servers))
            assert servers[0].client.post("/templates", json={"name": "base", "image": "guest:v1"}).status_code == 201
            ops = {**servers[0].env, "STRATA_STATE_DIR": str(tmp_path / "ops"), "STRATA_CONFIG": str(
                tmp_path / "a" / "none.toml")}
            gateway = Gateway(tmp_path, ops, host=lab.addrs["hub"], prefix=lab.prefix("hub"))
            gateway.wait_for(3)
            forward.target = (lab.addrs["hub"], gateway.port)
            yield Lab3(servers, gateway, f"http://127.0.0.1:{forward.port}", ops, lab.prefix("hub"), weed.client())
    finally:
        if forward is not None:
            forward.close()
        if gateway is not None:
            gateway.stop()
        with ThreadPoolExecutor(3) as pool:  # each stops its service, VMs and mount
            list(pool.map(NodeServer.cleanup, servers))
        if weed is not None:
            weed.stop()
        lab.destroy()


def node_of(servers: list[NodeServer], sid: str) -> NodeServer:
    """The running node whose (running) sandboxes include `sid`."""
    return next(srv for srv in servers if srv.proc is not None and sid in {
        s["sandboxID"] for s in srv.client.get("/sandboxes").json()})


def node_id(srv: NodeServer) -> str:
    return (srv.tmp / "state" / "node-id").read_text().strip()


def gc_json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@needs_qemu
@needs_netns
@pytest.mark.slow
def test_three_nodes_behind_a_gateway_on_one_store(cluster: Lab3, monkeypatch: pytest.MonkeyPatch) -> None:
    servers, gateway = cluster.servers, cluster.gateway
    monkeypatch.setenv("E2B_API_URL", cluster.sdk_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", cluster.sdk_url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    from e2b import Sandbox

    # one place per node: three creates land on three nodes, a fourth is refused
    boxes = [Sandbox.create(template="base", timeout=600, metadata={"n": str(i)}) for i in range(3)]
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
    assert gateway.client.get("/sandboxes", headers={"X-API-Key": "wrong-key-000"}).status_code == 401
    metrics = gateway.client.get("/sandboxes/metrics", params={"sandbox_ids": ",".join(b.sandbox_id for b in boxes)})
    assert metrics.status_code == 200 and set(metrics.json()["sandboxes"]) == {b.sandbox_id for b in boxes}

    # killed through the gateway: gone everywhere, and its place is free again
    boxes[0].kill()
    gone = gateway.client.get(f"/sandboxes/{boxes[0].sandbox_id}")
    assert gone.status_code == 404, gone.text
    again = Sandbox.create(template="base", timeout=300)
    assert again.commands.run("echo back").stdout == "back\n"
    freed = node_of(servers, again.sandbox_id)
    assert again.sandbox_id in cluster.placed()
    freed.strata("sandbox", "kill", again.sandbox_id)  # on the node itself, not through the API
    assert again.sandbox_id not in cluster.placed()  # no placement left behind for gateways to follow
    assert gateway.client.get(f"/sandboxes/{again.sandbox_id}").status_code == 404

    # paused on node A, and A dies (SIGKILL): its sandbox answers 503 while A's record is live, then
    # 503 naming A once it lapses; GC refuses to run while A's record is stale
    boxes[2].commands.run("sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 & echo $! > /root/pid")
    assert boxes[2].pause() is True
    owner = next(srv for srv in servers if boxes[2].sandbox_id in on[srv.url])
    owner.kill()
    r = gateway.client.get(f"/sandboxes/{boxes[2].sandbox_id}")
    assert r.status_code == 503 and "unavailable" in r.json()["message"], r.text
    deadline = time.monotonic() + 30
    while "is not answering" not in r.json()["message"] and time.monotonic() < deadline:
        time.sleep(0.5)  # node_ttl is 9 s here: then the gateway reads A's record as lapsed
        r = gateway.client.get(f"/sandboxes/{boxes[2].sandbox_id}")
    assert r.status_code == 503 and f"its node {node_id(owner)} is not answering" in r.json()["message"], r.text
    refused = cluster.strata("gc", "--grace", "0s")
    assert refused.returncode != 0 and node_id(owner) in refused.stderr, refused.stderr

    # resumed through the gateway: it lands on node B, with its files and its memory
    moved = Sandbox.connect(boxes[2].sandbox_id, timeout=600)
    assert moved.commands.run("cat /root/who").stdout == "box 2\n"
    assert moved.commands.run("kill -0 $(cat /root/pid) && echo alive").stdout == "alive\n"
    assert moved.get_info().metadata["n"] == "2"
    assert node_of(servers, moved.sandbox_id) is freed
    assert cluster.strata("gc", "--grace", "0s").returncode != 0  # A is still stale: still refused
    gc_json(cluster.strata("gc", "--grace", "0s", "--forget-node", node_id(owner), "--json"))  # drained: forgotten
    owner.start()  # A comes back: it publishes again, and forgets the sandbox B took
    assert owner.client.get(f"/sandboxes/{moved.sandbox_id}").status_code == 404
    assert moved.commands.run("echo still here").stdout == "still here\n"
    boxes[2] = moved

    # GC while B and C run sandboxes whose image and template are gone from the store's names: B's
    # sits on A's pause snapshot, C's on image guest:v1, read lazily; only their nodes' records name them
    cluster.strata_ok("template", "rm", "base")
    cluster.strata_ok("image", "rm", "guest:v1")
    junk = servers[0].tmp.parent / "junk.img"
    junk.write_bytes(os.urandom(6 << 20))
    cluster.strata_ok("image", "import", str(junk), "junk:v1")
    cluster.strata_ok("image", "rm", "junk:v1")  # garbage: what GC must delete, and nothing else
    time.sleep(1.5)  # the store's timestamps are whole seconds: with grace 0 they must be in the past
    first = gc_json(cluster.strata("gc", "--grace", "0s", "--json"))
    assert first["deleted"] == 0 and first["candidates"] >= 7, first  # phase one: candidates only
    with ThreadPoolExecutor(2) as pool:  # two GCs at once: one deletes, the other finds the lock or nothing
        runs = list(pool.map(lambda _: cluster.strata("gc", "--grace", "0s", "--json"), range(2)))
    reports = [json.loads(r.stdout) for r in runs if r.returncode == 0]
    locked = [r.stderr for r in runs if r.returncode != 0]
    assert all("another GC" in err for err in locked), locked
    assert sorted(rep["deleted"] > 0 for rep in reports) in ([True], [False, True]), (reports, locked)
    assert max(rep["deleted"] for rep in reports) >= 7  # junk's manifest and six 1 MiB chunks at least
    c = node_of(servers, boxes[1].sandbox_id)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(name, cluster.ops[name])
    with open_store("s3://shared/cluster", s3_endpoint=cluster.ops["STRATA_S3_ENDPOINT"],
                    state_dir=servers[0].tmp.parent / "check") as store:
        records = {view.node: view for view in nodes.read_nodes(store.backend)}
        needed = Closure()  # all that B's and C's records name: every layer and chunk still there
        for srv in (freed, c):
            for name in records[node_id(srv)].roots:
                needed.add(store, name, strict=False)
        present = {info.key for info in store.backend.list("chunks/")}
        assert needed.layers and not needed.missing, needed.missing
        assert {chunk_key(d) for d in needed.chunks} <= present
    for srv in (freed, c):
        assert srv.admin.post("/admin/cache/drop").status_code == 200  # unpinned chunks read from the store again
    for sbx, text in ((boxes[1], "box 1\n"), (moved, "box 2\n")):
        assert sbx.commands.run("dd if=/dev/vda of=/dev/null bs=1M", user="root").exit_code == 0  # every disk chunk
        assert sbx.commands.run("cat /root/who").stdout == text
    assert moved.commands.run("kill -0 $(cat /root/pid) && echo alive").stdout == "alive\n"

    # bad ids: 404 from the gateway itself after one store read, no node asked
    for bad in ("nope", "..", "a%2F..%2Fb"):
        r = gateway.client.get(f"/sandboxes/{bad}")
        assert r.status_code == 404, (bad, r.text)
    assert gateway.client.post("/process.Process/List", headers={"E2b-Sandbox-Id": "../x"},
                               json={}).status_code == 404
    assert gateway.client.post("/sandboxes", content=b"x" * (2 << 20)).status_code == 413

    # a node that stops answering: its sandboxes answer 503 naming it, listings name it and go on
    c.stop()
    r = gateway.client.get(f"/sandboxes/{boxes[1].sandbox_id}")
    assert r.status_code == 503 and "node" in r.json()["message"], r.text
    listing = gateway.client.get("/sandboxes")
    assert listing.status_code == 200 and listing.headers["x-strata-unreachable-nodes"]
    assert moved.sandbox_id in {s["sandboxID"] for s in listing.json()}
    assert moved.commands.run("echo still").stdout == "still\n"
    assert cluster.placed() == {boxes[1].sandbox_id, moved.sandbox_id}  # nothing lingers for the killed ones


def test_a_store_that_fails_is_an_error_not_a_missing_sandbox() -> None:
    from layerstore.errors import StrataError
    from layerstore.store import open_backend

    dead = open_backend("s3://gone/cluster", endpoint=f"http://127.0.0.1:{free_port()}", retry_attempts=1)
    with pytest.raises(StrataError):
        Cluster(dead).locate("sb1")  # the gateway answers 503 naming the store, never 404
    with pytest.raises(StrataError):
        placement.read(dead, "sb1")
    assert placement.read(dead, "../x") is None  # no store request for an id that cannot exist
