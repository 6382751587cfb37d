"""Rows: a team's limits hold wherever the resource is used: snapshots made
by pause and fork, and a disk the node could never hold."""

from __future__ import annotations

from tests.attacks.lab import Lab


def test_a_disk_larger_than_the_node_is_refused(lab: Lab) -> None:
    """attacker: team beta.  target: the node's disk.  attempt: a sandbox
    with a 16 TiB disk, promised on a node that has far less free.  must:
    400 naming the free space, nothing created."""
    before = len(lab.node.admin.get("/admin/sandboxes").json())
    r = lab.alpha.post("/sandboxes", json={"templateID": "guest:alpha", "diskSizeMB": 16 << 20})
    assert r.status_code == 400 and "free space" in r.json()["message"], r.text
    assert len(lab.node.admin.get("/admin/sandboxes").json()) == before


def test_pause_and_fork_count_against_the_snapshot_quota(lab: Lab) -> None:
    """attacker: team delta, allowed one snapshot.  target: the store's
    space, through snapshots that pause and fork keep.  attempt: a named
    snapshot (its one), then pause and fork.  must: both 429 naming
    team_max_snapshots, the sandbox still running."""
    rootfs = (lab.guest / "rootfs.ext4").read_bytes()
    assert lab.delta.put("/images/guest:delta", content=rootfs).status_code == 201
    r = lab.delta.post("/sandboxes", json={"templateID": "guest:delta", "timeout": 600})
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
