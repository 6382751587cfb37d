"""Push and pull between stores (layerstore/transfer.py): exactly the missing
chunks, manifests parents first, the name last; resumable; verified; lazy
pulls read through to the remote. Destinations: each backend (local, moto,
a real SeaweedFS), sources: a local store."""

from __future__ import annotations

import json
import os
import time
import subprocess
from pathlib import Path

import pytest

from layerstore.backend import Backend, RetryingBackend
from layerstore.catalog import Catalog
from layerstore.chunk import chunk_key
from layerstore.errors import BackendUnavailable, CorruptObject, MissingChunk, NotFound
from layerstore.exporter import export_image
from layerstore.importer import import_image
from layerstore.localdir import LocalDirBackend
from layerstore.peers import Peers
from layerstore.readthrough import Fallback
from layerstore.store import Store, chunk_read_path
from layerstore.templates import new_template
from layerstore.transfer import copy
from layerstore.verify import verify_store
from tests.conftest import seaweed_env
from tests.images import write_image
from tests.test_snapshot import _layers, _snap

ROOT = Path(__file__).resolve().parent.parent


def local_store(path: Path, remote: Backend | None = None, peers: Peers | None = None) -> Store:
    """A local store whose chunk reads fall back to `peers`, then `remote` (as open_store builds it)."""
    fallbacks = [*(peers.fallbacks() if peers else []), *([Fallback("remote", remote)] if remote else [])]
    own = RetryingBackend(LocalDirBackend(path / "objects"), attempts=2, base_delay=0.01)
    return Store(own, Catalog(path / "catalog"), read_path=chunk_read_path(own, fallbacks))


@pytest.fixture
def src(tmp_path: Path) -> Store:
    s = local_store(tmp_path / "src")
    yield s
    s.close()


def keys(store: Store, prefix: str) -> set[str]:
    return {o.key for o in store.backend.list(prefix)}


def test_push_image_then_only_what_changed(src: Store, store: Store, tmp_path: Path) -> None:
    data = write_image(tmp_path / "a.img", "rrzpd", seed=1)
    v1 = import_image(src, tmp_path / "a.img", "app:v1").manifest_id
    first = copy(src, store, "app:v1")
    assert first.chunks_sent == first.chunks_total == 3 and first.manifests_sent == 1
    assert store.resolve("app:v1") == v1
    export_image(store, "app:v1", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == data
    assert copy(src, store, "app:v1").chunks_sent == 0  # nothing new: nothing sent
    write_image(tmp_path / "b.img", "rrzpr", seed=1)  # one chunk differs
    import_image(src, tmp_path / "b.img", "app:v2", parent=v1)
    second = copy(src, store, "app:v2")
    assert second.chunks_sent == 1 and second.manifests_sent == 1  # the new layer; its parent was there
    assert not verify_store(store).errors


def test_interrupted_push_resumes_without_resending(src: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "rrrrrrrr", seed=2)
    import_image(src, tmp_path / "a.img", "big:v1")

    class Flaky(LocalDirBackend):
        puts = 0

        def put(self, key: str, data: bytes) -> None:
            if key.startswith("chunks/"):
                Flaky.puts += 1
                if Flaky.puts > 3:
                    raise BackendUnavailable("connection reset (injected)")
            super().put(key, data)

    flaky = Store(Flaky(tmp_path / "dst" / "objects"), Catalog(tmp_path / "dst" / "catalog"))
    with pytest.raises(BackendUnavailable):
        copy(src, flaky, "big:v1", workers=1)
    assert keys(flaky, "manifests/") == set() and keys(flaky, "refs/") == set()  # no name without its data
    assert len(keys(flaky, "chunks/")) == 3 and keys(flaky, "leases/") == set()
    flaky.close()
    dst = local_store(tmp_path / "dst")
    resumed = copy(src, dst, "big:v1")
    assert resumed.chunks_sent == 5 and resumed.chunks_total == 8  # the 3 already there were skipped
    assert not verify_store(dst).errors
    dst.close()


def test_corrupt_source_chunk_is_never_copied(src: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "rr", seed=3)
    manifest = import_image(src, tmp_path / "a.img", "bad:v1").manifest_id
    victim = sorted(src.chunk_map(manifest)[1].values())[0]
    path = next((tmp_path / "src").rglob(victim))
    path.write_bytes(path.read_bytes()[:-8] + b"XXXXXXXX")
    dst = local_store(tmp_path / "dst")
    with pytest.raises(CorruptObject):
        copy(src, dst, "bad:v1")
    assert chunk_key(victim) not in keys(dst, "chunks/")
    assert keys(dst, "manifests/") == set() and keys(dst, "refs/") == set()
    dst.close()


def test_snapshots_and_templates_carry_their_whole_closure(src: Store, store: Store, tmp_path: Path) -> None:
    ids = _layers(src, tmp_path)
    parent = src.put_snapshot(_snap(ids))
    child = src.put_snapshot(_snap(ids, parent=parent))
    src.put_template(new_template("tpl", "snapshot", child))
    result = copy(src, store, "tpl")
    assert result.snapshots_sent == 2  # the parent first, or the child would be refused
    assert store.get_snapshot(child).parent == parent and store.get_template("tpl").target == child
    assert not verify_store(store).errors
    with pytest.raises(NotFound):
        copy(src, store, "nope")
    with pytest.raises(NotFound):
        copy(src, store, "0" * 64)


def test_lazy_pull_reads_chunks_through_the_remote(src: Store, tmp_path: Path) -> None:
    data = write_image(tmp_path / "a.img", "rzp", seed=4)
    import_image(src, tmp_path / "a.img", "lazy:v1")
    remote = LocalDirBackend(tmp_path / "src" / "objects", create=False)
    node = local_store(tmp_path / "node", remote=remote)
    result = copy(src, node, "lazy:v1", chunks=False)
    assert result.chunks_sent == 0 and keys(node, "chunks/") == set()
    export_image(node, "lazy:v1", tmp_path / "out.img")  # every chunk read through, verified
    assert (tmp_path / "out.img").read_bytes() == data
    node.close()
    alone = local_store(tmp_path / "alone")  # no remote: a manifest naming absent chunks is refused
    with pytest.raises(MissingChunk):
        copy(src, alone, "lazy:v1", chunks=False)
    assert keys(alone, "manifests/") == set() and keys(alone, "refs/") == set()
    alone.close()


def strata(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / ".venv/bin/strata"), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)


def test_cli_push_and_pull_through_seaweedfs(tmp_path: Path, seaweed) -> None:  # noqa: ANN001
    env = {**seaweed_env(seaweed), "STRATA_STATE_DIR": str(tmp_path / "state"),
           "STRATA_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text("")
    remote = f"s3://strata-tests/push-{os.getpid()}-{tmp_path.name}"
    data = write_image(tmp_path / "a.img", "rrzp", seed=5)
    a, b = str(tmp_path / "node-a"), str(tmp_path / "node-b")
    assert strata(["image", "import", str(tmp_path / "a.img"), "app:v1", "--store", a], env).returncode == 0
    pushed = strata(["push", "app:v1", "--to", remote, "--store", a, "--json"], env)
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["chunks_sent"] == 3
    full = strata(["pull", "app:v1", "--from", remote, "--store", b, "--full", "--json"], env)
    assert full.returncode == 0 and json.loads(full.stdout)["chunks_sent"] == 3, full.stderr
    assert strata(["image", "export", "app:v1", str(tmp_path / "b.img"), "--store", b], env).returncode == 0
    assert (tmp_path / "b.img").read_bytes() == data
    lazy = strata(["pull", "app:v1", "--from", remote, "--store", str(tmp_path / "node-c")], env)
    assert lazy.returncode == 1 and "STRATA_REMOTE" in lazy.stderr and lazy.stderr.count("\n") == 1
    c_env = {**env, "STRATA_REMOTE": remote}
    lazy = strata(["pull", "app:v1", "--from", remote, "--store", str(tmp_path / "node-c"), "--json"], c_env)
    assert lazy.returncode == 0 and json.loads(lazy.stdout)["chunks_sent"] == 0, lazy.stderr
    assert strata(["image", "export", "app:v1", str(tmp_path / "c.img"), "--store", str(tmp_path / "node-c")],
                  c_env).returncode == 0
    assert (tmp_path / "c.img").read_bytes() == data
    dead = strata(["push", "app:v1", "--to", "s3://strata-tests/x", "--store", a],
                  {**env, "STRATA_S3_ENDPOINT": "http://127.0.0.1:9"})
    assert dead.returncode == 1 and dead.stderr.startswith("strata: error:") and dead.stderr.count("\n") == 1


def test_prefetch_pull_copies_only_the_recorded_working_set(src: Store, tmp_path: Path) -> None:
    write_image(tmp_path / "a.img", "rrrr", seed=6)
    manifest = import_image(src, tmp_path / "a.img", "ws:v1").manifest_id
    chunk_map = src.chunk_map(manifest)[1]
    src.put_prefetch(manifest, [0, 2])  # what record-prefetch writes
    node = local_store(tmp_path / "node", remote=LocalDirBackend(tmp_path / "src" / "objects", create=False))
    result = copy(src, node, "ws:v1", chunks=False, prefetch=True)
    assert result.chunks_sent == 2
    assert keys(node, "chunks/") == {chunk_key(chunk_map[0]), chunk_key(chunk_map[2])}
    assert node.get_prefetch(manifest) == [0, 2]  # the list travels too
    export_image(node, "ws:v1", tmp_path / "out.img")  # the other two read through the remote
    assert (tmp_path / "out.img").read_bytes() == (tmp_path / "a.img").read_bytes()
    node.close()


def test_credentials_revoked_mid_push(src: Store, tmp_path: Path, seaweed) -> None:  # noqa: ANN001
    """A real SeaweedFS starts rejecting our keys halfway: a clear AccessDenied, nothing named, and a
    retry with good keys finishes the job."""
    from layerstore.errors import AccessDenied
    from layerstore.s3 import S3Backend, S3Config

    write_image(tmp_path / "a.img", "rrrrrr", seed=7)
    import_image(src, tmp_path / "a.img", "rev:v1")
    config = S3Config(bucket="strata-tests", prefix=f"rev-{tmp_path.name}", endpoint=seaweed.endpoint,
                      region=seaweed.region, access_key=seaweed.access_key, secret_key=seaweed.secret_key)

    class Revoked(S3Backend):
        puts = 0

        def put(self, key: str, data: bytes) -> None:
            if key.startswith("chunks/"):
                Revoked.puts += 1
                if Revoked.puts == 3:  # from now on this client signs with keys the server does not know
                    self._client = seaweed.client(access_key="revoked-key", secret_key="revoked-secret")
            super().put(key, data)

    dst = Store(RetryingBackend(Revoked(config), attempts=2, base_delay=0.01), Catalog(tmp_path / "cat1"))
    with pytest.raises(AccessDenied):
        copy(src, dst, "rev:v1", workers=1)
    dst.close()
    good = Store(RetryingBackend(S3Backend(config), attempts=2), Catalog(tmp_path / "cat2"))
    assert keys(good, "manifests/") == set() and keys(good, "refs/") == set()
    assert copy(src, good, "rev:v1").chunks_sent == 4  # the 2 that made it are not sent again
    assert not verify_store(good).errors
    good.close()


def test_full_pull_completes_a_lazy_pull(src: Store, tmp_path: Path) -> None:
    """A manifests-only pull marks its layers partial; a later `pull --full`
    copies their chunks (it used to take the published manifests for
    complete and send nothing), then clears the mark."""
    write_image(tmp_path / "a.img", "rzp", seed=5)
    import_image(src, tmp_path / "a.img", "lazy:v1")
    remote = LocalDirBackend(tmp_path / "src" / "objects", create=False)
    node = local_store(tmp_path / "node", remote=remote)
    assert copy(src, node, "lazy:v1", chunks=False).chunks_sent == 0
    manifest = node.resolve("lazy:v1")
    assert node.partial_layers([manifest]) == {manifest}
    full = copy(src, node, "lazy:v1")
    assert full.chunks_sent == full.chunks_total == 2
    digests = {d for d in node.get_layer(manifest).chunks.values() if d is not None}
    assert node.local_missing_chunks(digests) == set() and node.partial_layers([manifest]) == set()
    assert copy(src, node, "lazy:v1").chunks_sent == 0  # complete now: nothing more to send
    node.close()


def _node_env(tmp_path: Path, name: str, remote: Path | None = None) -> dict[str, str]:
    """The environment of `strata` on a node whose store is tmp_path/name (and whose remote is `remote`)."""
    env = {"STRATA_STORE": str(tmp_path / name), "STRATA_STATE_DIR": str(tmp_path / f"{name}-state"),
           "STRATA_RUN_DIR": str(tmp_path / f"{name}-run")}
    return {**env, "STRATA_REMOTE": str(remote)} if remote is not None else env


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_cli_lazy_pull_is_a_root_of_the_remote_gc(tmp_path: Path) -> None:
    """Node B pulls img:a manifests-only from R with the CLI (no `strata serve` on B); img:a is
    removed on R and R is collected twice with no grace: B's export of img:a is still exact. The
    pull recorded B's roots in R (holds/B), and R's GC marks them (finding 12, issue #33)."""
    from tests.test_cli import run

    data = write_image(tmp_path / "a.img", "rzrp", seed=12, tail=99)
    remote, node = _node_env(tmp_path, "r"), _node_env(tmp_path, "b", remote=tmp_path / "r")
    _ok(run(["image", "import", str(tmp_path / "a.img"), "img:a"], remote))
    pulled = json.loads(_ok(run(["pull", "img:a", "--from", str(tmp_path / "r"), "--json"], node)))
    assert pulled["chunks_sent"] == 0  # lazy: every chunk stays in R
    _ok(run(["image", "rm", "img:a"], remote))
    for _ in range(2):  # two phases: candidates, then deletion
        _ok(run(["gc", "--grace", "0"], remote))
    _ok(run(["image", "export", "img:a", str(tmp_path / "out.img")], node))
    assert (tmp_path / "out.img").read_bytes() == data


def _hold(store_dir: Path) -> list[dict[str, str]]:
    """The roots of every hold in the local store at `store_dir`."""
    holds = sorted((store_dir / "objects" / "holds").glob("*")) if (store_dir / "objects" / "holds").exists() else []
    return [root for path in holds for root in json.loads(path.read_bytes())["roots"]]


def test_a_hold_follows_the_nodes_store_and_releases_what_it_no_longer_reads(tmp_path: Path) -> None:
    """The hold names the layers the node reads lazily, and no more: `pull --full` completes a
    layer and releases it, `image rm` releases the rest, and R may then collect them (a hold is
    no leak for a node that goes on running commands)."""
    from tests.test_cli import run

    write_image(tmp_path / "a.img", "rr", seed=21)
    write_image(tmp_path / "b.img", "rp", seed=22)
    remote, node = _node_env(tmp_path, "r"), _node_env(tmp_path, "b", remote=tmp_path / "r")
    a = json.loads(_ok(run(["image", "import", str(tmp_path / "a.img"), "img:a", "--json"], remote)))["manifest"]
    b = json.loads(_ok(run(["image", "import", str(tmp_path / "b.img"), "img:b", "--json"], remote)))["manifest"]
    for ref in ("img:a", "img:b"):
        _ok(run(["pull", ref], node))
    assert _hold(tmp_path / "r") == [{"kind": "layer", "value": m} for m in sorted((a, b))]
    _ok(run(["pull", "img:a", "--full"], node))  # every chunk of img:a is in B now
    assert _hold(tmp_path / "r") == [{"kind": "layer", "value": b}]
    _ok(run(["image", "rm", "img:b"], node))
    assert _hold(tmp_path / "r") == []  # an empty hold is removed
    for ref in ("img:a", "img:b"):
        _ok(run(["image", "rm", ref], remote))
    for _ in range(2):
        report = json.loads(_ok(run(["gc", "--grace", "0", "--json"], remote)))
    assert report["deleted"] > 0 and report["holds"] == []
    _ok(run(["image", "export", "img:a", str(tmp_path / "out.img")], node))  # pulled in full: B's own


class _NoHolds(LocalDirBackend):
    """A remote this node may read and lease in, but not record a hold in (a read-mostly key)."""

    def put(self, key: str, data: bytes) -> None:
        if key.startswith("holds/"):
            from layerstore.errors import AccessDenied

            raise AccessDenied(f"access denied putting {key} (injected)")
        super().put(key, data)


def test_a_remote_that_refuses_the_hold_refuses_the_lazy_pull(src: Store, tmp_path: Path) -> None:
    """Fail closed: a lazy pull that cannot make its roots known publishes nothing, and says
    `pull --full` is the way; a full copy needs no hold and works."""
    from layerstore.errors import StrataError
    from layerstore.nodes import Holds
    from layerstore.transfer import lazy_pull

    write_image(tmp_path / "a.img", "rzp", seed=23)
    import_image(src, tmp_path / "a.img", "img:a")
    remote = Store(_NoHolds(tmp_path / "src" / "objects"), Catalog(tmp_path / "remote-catalog"))
    node = local_store(tmp_path / "node", remote=remote.backend)
    holds = Holds(remote.backend, "node-b", tmp_path / "node-state")
    with pytest.raises(StrataError, match=r"holds/node-b.*access denied.*nothing was pulled.*pull --full"):
        lazy_pull(remote, node, "img:a", holds=holds)
    assert keys(node, "refs/") == set() and keys(node, "manifests/") == set()
    assert keys(src, "leases/") == set()  # the lease went with the refusal
    assert copy(remote, node, "img:a").chunks_sent == 2  # a full pull leaves nothing to hold
    node.close()
    remote.close()


def test_a_gc_of_the_remote_during_a_lazy_pull_deletes_nothing_it_needs(src: Store, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """R's ref is removed and R is collected twice while B's pull is publishing: the pull's lease
    in R postpones deletion, and once it is done B's hold keeps the chunks for every later GC."""
    from layerstore import gc
    from layerstore.nodes import Holds
    from layerstore.transfer import lazy_pull

    data = write_image(tmp_path / "a.img", "rrzp", seed=24)
    import_image(src, tmp_path / "a.img", "img:a")
    node = local_store(tmp_path / "node", remote=LocalDirBackend(tmp_path / "src" / "objects", create=False))
    put_layer, reports = node.put_layer, []

    def racing(layer, **kw):  # noqa: ANN001, ANN003
        if not reports:
            src.delete_ref("img:a")
            reports.extend(gc.collect(src, grace=0, now=time.time() + step) for step in (10, 20))
        return put_layer(layer, **kw)

    monkeypatch.setattr(node, "put_layer", racing)
    lazy_pull(src, node, "img:a", holds=Holds(src.backend, "node-b", tmp_path / "node-state"))
    assert [r.deleted for r in reports] == [0, 0] and "live lease" in reports[1].postponed
    for step in (30, 40):
        report = gc.collect(src, grace=0, now=time.time() + step)
    assert report.deleted == 0 and report.holds[0]["node"] == "node-b"
    export_image(node, "img:a", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == data
    node.close()
