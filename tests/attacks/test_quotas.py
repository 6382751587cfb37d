"""Rows: a team's limits hold wherever the resource is used: snapshots made
by pause and fork, a disk the node could never hold, and sandboxes on every
node of a shared store (a gateway does not shop a team's refusal around)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from layerstore import nodes
from layerstore.store import open_store
from tests.attacks.lab import Lab
from tests.test_gateway import Gateway
from tests.test_proxy import Served


def test_a_disk_larger_than_the_node_is_refused(lab: Lab) -> None:
    """attacker: team beta.  target: the node's disk.  attempt: a sandbox
    with a 16 TiB disk, promised on a node that has far less free.  must:
    400 naming the free space, nothing created."""
    before = len(lab.node.admin.get("/admin/sandboxes").json())
    r = lab.alpha.post("/sandboxes", json={"templateID": "guest:alpha", "diskSizeMB": 16 << 20})
    assert r.status_code == 400 and "free space" in r.json()["message"], r.text
    assert len(lab.node.admin.get("/admin/sandboxes").json()) == before


def test_a_chunked_upload_counts_against_the_stored_quota(lab: Lab) -> None:
    """attacker: team epsilon, allowed 8 MiB stored.  target: the store's
    space.  attempt: a 24 MiB image sent chunked (no Content-Length, so
    nothing was declared to check).  must: 429 naming team_max_stored, no
    image made."""
    def body() -> Iterator[bytes]:
        for _ in range(24):
            yield os.urandom(1 << 20)

    r = lab.epsilon.put("/images/big:v1", content=body())
    assert r.status_code == 429 and "team_max_stored" in r.json()["message"], r.text
    assert lab.epsilon.get("/images/big:v1").status_code == 404


def test_pause_and_fork_count_against_the_snapshot_quota(lab: Lab) -> None:
    """attacker: team delta, allowed one snapshot.  target: the store's
    space, through snapshots that pause and fork keep.  attempt: a named
    snapshot (its one), then pause and fork.  must: both 429 naming
    team_max_snapshots, the sandbox still running."""
    r = lab.delta.post("/sandboxes", json={"templateID": lab.own_image(lab.delta, "guest:delta"), "timeout": 600})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        assert lab.delta.post(f"/sandboxes/{sid}/snapshots", json={}).status_code == 201
        for action, body in (("pause", None), ("fork", {"count": 1})):
            r = lab.delta.post(f"/sandboxes/{sid}/{action}", json=body)
            assert r.status_code == 429 and "team_max_snapshots" in r.json()["message"], (action, r.text)
        assert lab.delta.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        lab.delta.delete(f"/sandboxes/{sid}")


@pytest.fixture
def gamma_elsewhere(lab: Lab) -> Iterator[None]:
    """Another live node of the lab's store, whose record says gamma holds a sandbox there."""
    backend = open_store(lab.node.env["STRATA_STORE"]).backend
    nodes.publish(backend, "other-node", [], about={"url": "http://127.0.0.1:9", "max": 0, "held": 1,
                                                    "teams": {"gamma": 1}})
    yield
    nodes.forget(backend, "other-node")


def test_a_teams_quota_counts_every_node_of_the_store(lab: Lab, gamma_elsewhere: None) -> None:
    """attacker: team gamma, allowed one sandbox, holding it on another node
    of the shared store.  target: gamma's quota.  attempt: a create on this
    node, which holds none of gamma's.  must: 429 naming team_max_sandboxes
    and marked as the team's limit (X-Strata-Limit: team), nothing created."""
    image = lab.own_image(lab.gamma, "guest:gamma")
    time.sleep(2.5)  # past the node's reuse of what it last read of other nodes
    r = lab.gamma.post("/sandboxes", json={"templateID": image})
    assert r.status_code == 429 and "team_max_sandboxes" in r.json()["message"], r.text
    assert r.headers["x-strata-limit"] == "team"
    assert lab.gamma.get("/v2/sandboxes").json() == []


class StandIn:
    """A node that answers every create with `status` (and counts them)."""

    def __init__(self, status: int, limit: str = "") -> None:
        self.status, self.limit, self.creates = status, limit, 0

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        self.creates += 1
        headers = [(b"content-type", b"application/json")] + ([(b"x-strata-limit", self.limit.encode())]
                                                               if self.limit else [])
        await send({"type": "http.response.start", "status": self.status, "headers": headers})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b'{"code": %d, "message": "refused"}' % self.status})  # type: ignore[operator]


@pytest.mark.parametrize("limit", ["team", "node"])
def test_the_gateway_does_not_shop_a_team_quota_around(tmp_path: Path, limit: str) -> None:
    """attacker: a team at its quota behind a gateway.  target: the team's
    cluster-wide limit.  attempt: a create the first node refuses for the
    team's quota, which the gateway used to retry on the next node.  must:
    the team's 429 is the answer and no other node is asked; a node that is
    merely full (`node`) still passes the create on."""
    first, second = StandIn(429, limit), StandIn(201)
    servers = [Served(first), Served(second)]
    store = open_store(str(tmp_path / "store"), create=True)
    for name, served, held in (("n1", servers[0], 0), ("n2", servers[1], 3)):  # n1 has more room: asked first
        nodes.publish(store.backend, name, [], about={"url": f"http://127.0.0.1:{served.port}", "max": 4,
                                                      "held": held})
    gateway = Gateway(tmp_path, {**os.environ, "STRATA_STORE": str(tmp_path / "store")}, host="127.0.0.1", prefix=())
    try:
        gateway.wait_for(2)
        r = httpx.post(f"{gateway.url}/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": "k"})
        assert first.creates == 1
        if limit == "team":
            assert r.status_code == 429 and second.creates == 0, r.text
        else:
            assert r.status_code == 201 and second.creates == 1, r.text
    finally:
        gateway.stop()
        for served in servers:
            served.stop()
