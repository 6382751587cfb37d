"""Two nodes and one SeaweedFS server, each in its own network namespace
(tests/netns.py): node A snapshots a running sandbox and pushes it; node B
pulls only the manifests and restores it, its chunks coming from A while A is
reachable and from the shared store once A is cut off. Real TCG guests, real
FUSE mounts, real HTTP between the namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import IN_CI, ROOT, needs_qemu
from tests.netns import Lab
from tests.node_server import ADMIN_KEY, NodeServer
from tests.seaweedfs_server import SeaweedFS

pytestmark = [needs_qemu, pytest.mark.skipif(
    (os.geteuid() != 0 or shutil.which("ip") is None) and not IN_CI,
    reason="network namespaces need root and iproute2 (ip)")]


def exec_in(node: NodeServer, sid: str, command: str) -> str:
    r = node.client.post(f"/sandboxes/{sid}/exec", json={"command": command})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return r.json()["output"].strip()


def test_push_pull_and_peer_fetch_across_namespaces(tmp_path: Path, guest: Path) -> None:
    lab = Lab(f"{os.getpid() % 10000}")
    nodes: list[NodeServer] = []
    weed = None
    try:
        lab.add_node("a")
        lab.add_node("b")
        with lab.inside("hub"):  # this thread talks to every namespace through the hub's bridge
            weed = SeaweedFS(tmp_path / "weed", ip=lab.addrs["hub"], prefix=lab.prefix("hub")).start()
            weed.create_bucket("shared")
            s3 = {"STRATA_S3_ENDPOINT": weed.endpoint, "AWS_ACCESS_KEY_ID": weed.access_key,
                  "AWS_SECRET_ACCESS_KEY": weed.secret_key, "AWS_REGION": weed.region,
                  "STRATA_REMOTE": "s3://shared/cluster"}
            a = NodeServer(tmp_path / "a", guest, host=lab.addrs["a"], prefix=lab.prefix("a"), **s3)
            b = NodeServer(tmp_path / "b", guest, host=lab.addrs["b"], prefix=lab.prefix("b"), **s3,
                           STRATA_PEERS=a.url, STRATA_PEER_KEY=ADMIN_KEY)
            nodes += [a, b]
            a.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
            a.start()
            b.start()
            assert a.client.post("/templates", json={"name": "base", "image": "guest:v1"}).status_code == 201

            # node A: a sandbox with state on disk and in memory, snapshotted as a template, pushed
            src = a.client.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
            exec_in(a, src, "echo made-on-a > /root/origin; sync; "
                            "(i=0; while :; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done) >/dev/null 2>&1 &")
            r = a.client.post(f"/sandboxes/{src}/snapshots", json={"name": "golden"})
            assert r.status_code == 201, r.text
            pushed = a.admin.post("/admin/push", json={"name": "golden"})
            assert pushed.status_code == 200 and pushed.json()["chunks_sent"] > 0, pushed.text

            # node B: manifests only, then a restore whose chunks come from A
            pulled = b.admin.post("/admin/pull", json={"name": "golden", "full": False})
            assert pulled.status_code == 200 and pulled.json()["chunks_sent"] == 0, pulled.text
            first = b.client.post("/sandboxes", json={"templateID": "golden"})
            assert first.status_code == 201, first.text
            sid = first.json()["sandboxID"]
            assert exec_in(b, sid, "cat /root/origin") == "made-on-a"
            assert int(exec_in(b, sid, "cat /tmp/n")) > 0  # the process kept counting after the move
            sources = b.client.get("/cache").json()["sources"]
            assert sources.get("peer", 0) > 0 and sources.get("remote", 0) == 0, sources

            # A unplugged: B's next restore (empty cache) falls back to the shared store
            assert b.client.delete(f"/sandboxes/{sid}").status_code == 204
            assert b.admin.post("/admin/cache/drop").status_code == 200
            lab.cut("a")
            second = b.client.post("/sandboxes", json={"templateID": "golden"})
            assert second.status_code == 201, second.text
            assert exec_in(b, second.json()["sandboxID"], "cat /root/origin") == "made-on-a"
            after = b.client.get("/cache").json()["sources"]
            assert after.get("remote", 0) > 0 and after.get("peer_rejected", 0) == 0, after

            # the shared store loses the template and its snapshot, then is collected twice: B's
            # sandbox still reads every chunk (its node's roots name the layers it sits on), and
            # B's own copy of the template, pulled manifests-only, keeps what it needs (B's hold)
            ops = {**b.env, "STRATA_STORE": "s3://shared/cluster", "STRATA_STATE_DIR": str(tmp_path / "ops")}

            def ops_cli(*args: str) -> str:
                r = subprocess.run([str(ROOT / ".venv/bin/strata"), *args], env=ops, capture_output=True, text=True,
                                   timeout=300)
                assert r.returncode == 0, (args, r.stderr)
                return r.stdout

            snapshots = [row["snapshot"] for row in json.loads(ops_cli("snapshot", "ls", "--json"))]
            ops_cli("template", "rm", "golden")
            for snapshot_id in snapshots:
                ops_cli("snapshot", "rm", snapshot_id)
            for _ in range(2):  # two phases: candidates, then deletion
                r = b.admin.post("/admin/gc", json={"grace": "0s", "target": "remote"})
                assert r.status_code == 200, r.text
            assert r.json()["deleted"] == 0, r.json()  # the device state too: B's template restores from it
            assert [h["node"] for h in r.json()["holds"]] == [(b.tmp / "state" / "node-id").read_text().strip()]
            assert b.admin.post("/admin/cache/drop").status_code == 200
            exec_in(b, second.json()["sandboxID"], "dd if=/dev/vda of=/dev/null bs=1M")  # every disk chunk
            assert exec_in(b, second.json()["sandboxID"], "cat /root/origin") == "made-on-a"
            assert b.client.delete(f"/sandboxes/{second.json()['sandboxID']}").status_code == 204

            # B lets go of its copy through its API: its hold is rewritten, the shared store collects
            assert b.client.delete("/templates/golden").status_code == 204
            for snapshot_id in snapshots:
                assert b.client.delete(f"/snapshots/{snapshot_id}").status_code in (204, 404)
            for _ in range(60):
                r = b.admin.post("/admin/gc", json={"grace": "0s", "target": "remote", "dryRun": True})
                if r.status_code == 200 and r.json()["holds"] == []:
                    break
                time.sleep(0.5)
            assert r.json()["holds"] == [], r.text
            for _ in range(2):
                r = b.admin.post("/admin/gc", json={"grace": "0s", "target": "remote"})
            assert r.status_code == 200 and r.json()["deleted"] > 0, r.text
    finally:
        for node in nodes:
            node.cleanup()
        if weed is not None:
            weed.stop()
        lab.destroy()
    for node in nodes:
        assert subprocess.run(["pgrep", "-f", str(node.tmp / "state")], capture_output=True).stdout == b""
