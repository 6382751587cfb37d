"""api/maintenance.py's Maintenance on real local stores (a node's store and
its remote, as directories): without a remote, pull, push and a remote GC
are a clear Conflict that changes nothing; a lazy pull writes this node's
hold in the remote and `refresh_hold` removes it once the node's store no
longer reads through it; GC keeps what the node's `gc_roots` name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.maintenance import Maintenance
from layerstore.errors import Conflict, InvalidInput, NotFound
from layerstore.exporter import export_image
from layerstore.importer import import_image
from layerstore.reach import Name
from layerstore.store import Store, open_store
from tests.images import write_image
from tests.test_catalog import node_config

NODE = "node-b"


def node(tmp_path: Path, *, remote: bool = True, roots: list[Name] | None = None,
         node_id: str = NODE) -> Maintenance:
    """Maintenance of a node whose store is tmp_path/node (its remote tmp_path/remote, if `remote`)."""
    env = {"STRATA_STORE": str(tmp_path / "node")}
    if remote:
        env["STRATA_REMOTE"] = str(tmp_path / "remote")
    config = node_config(tmp_path, **env)
    store = open_store(config.store, **config.store_options())
    return Maintenance(store, config, gc_roots=lambda: list(roots or []), node_id=node_id)


def remote_with(tmp_path: Path, *refs: str) -> list[bytes]:
    """Import one small image per ref into the remote; their contents."""
    contents = []
    with open_store(str(tmp_path / "remote")) as remote:
        for n, ref in enumerate(refs):
            contents.append(write_image(tmp_path / f"{n}.img", "rzr", seed=n))
            import_image(remote, tmp_path / f"{n}.img", ref)
    return contents


def hold(tmp_path: Path) -> list[dict[str, str]] | None:
    """This node's hold in the remote (None: there is none)."""
    path = tmp_path / "remote" / "objects" / "holds" / NODE
    return json.loads(path.read_bytes())["roots"] if path.exists() else None


def refs(store: Store) -> list[str]:
    return [str(ref) for ref, _m, _u in store.list_refs()]


def test_without_a_remote_pull_push_and_remote_gc_are_a_clear_conflict(tmp_path: Path) -> None:
    """No `remote` configured: each remote operation names the setting, and the store is untouched."""
    m = node(tmp_path, remote=False)
    write_image(tmp_path / "a.img", "rr")
    import_image(m.store, tmp_path / "a.img", "app:v1")
    for operation in (lambda: m.pull("app:v1", full=True), lambda: m.pull("app:v1", full=False),
                      lambda: m.push("app:v1"), lambda: m.gc(grace=0, dry_run=False, remote=True)):
        with pytest.raises(Conflict, match="no remote store.*STRATA_REMOTE"):
            operation()
    assert refs(m.store) == ["app:v1"]
    m.refresh_hold()  # nothing to refresh: no remote, no error
    assert not (tmp_path / "remote").exists()


def test_a_lazy_pull_holds_its_layer_until_the_node_no_longer_reads_it(tmp_path: Path) -> None:
    """A manifests-only pull writes this node's hold (the layer) in the remote
    and reads through; after the image is removed from the node's store,
    `refresh_hold` removes the empty hold."""
    (content,) = remote_with(tmp_path, "img:a")
    m = node(tmp_path)
    result = m.pull("img:a", full=False)
    assert result["chunks_sent"] == 0
    manifest = m.store.resolve("img:a")
    assert hold(tmp_path) == [{"kind": "layer", "value": manifest}]
    export_image(m.store, "img:a", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == content  # read through the remote
    m.refresh_hold()
    assert hold(tmp_path) == [{"kind": "layer", "value": manifest}]  # still read: still held
    m.store.delete_ref("img:a")
    m.refresh_hold()
    assert hold(tmp_path) is None


def test_a_full_pull_leaves_nothing_held(tmp_path: Path) -> None:
    """A full pull copies every chunk: the node holds nothing in the remote."""
    (content,) = remote_with(tmp_path, "img:a")
    m = node(tmp_path)
    assert m.pull("img:a", full=True)["chunks_sent"] == 2
    assert hold(tmp_path) is None
    m.store.close()
    with open_store(str(tmp_path / "node")) as alone:  # no read path to the remote: its own chunks
        export_image(alone, "img:a", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == content


def test_pulling_an_unknown_name_is_not_found_and_holds_nothing(tmp_path: Path) -> None:
    remote_with(tmp_path, "img:a")
    m = node(tmp_path)
    for full in (True, False):
        with pytest.raises(NotFound):
            m.pull("nosuch:v1", full=full)
    assert refs(m.store) == [] and hold(tmp_path) is None


def test_a_node_id_that_is_a_path_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A node id is the hold's key: `../x` is InvalidInput, no file appears
    outside the remote's holds/ and the node's store gets no ref."""
    remote_with(tmp_path, "img:a")
    m = node(tmp_path, node_id="../../escape")
    with pytest.raises(InvalidInput, match="invalid node id"):
        m.pull("img:a", full=False)
    assert refs(m.store) == []
    assert not list(tmp_path.rglob("escape"))


def test_refresh_hold_is_nothing_when_the_remote_is_the_store(tmp_path: Path) -> None:
    config = node_config(tmp_path, STRATA_STORE=str(tmp_path / "node"), STRATA_REMOTE=str(tmp_path / "node"))
    with open_store(config.store) as store:
        Maintenance(store, config, gc_roots=list, node_id=NODE).refresh_hold()
    assert not (tmp_path / "node" / "objects" / "holds").exists()


def test_push_copies_to_the_remote(tmp_path: Path) -> None:
    remote_with(tmp_path)
    m = node(tmp_path)
    content = write_image(tmp_path / "a.img", "rzp", seed=3)
    import_image(m.store, tmp_path / "a.img", "app:v1")
    assert m.push("app:v1")["chunks_sent"] == 2
    with open_store(str(tmp_path / "remote")) as remote:
        export_image(remote, "app:v1", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == content
    with pytest.raises(NotFound):
        m.push("nosuch:v1")


def test_gc_keeps_what_the_nodes_roots_name(tmp_path: Path) -> None:
    """Two unnamed layers; the node's gc_roots name one. Two GC passes with
    no grace delete the other only (a dry run first deletes nothing)."""
    kept_roots: list[Name] = []
    remote_with(tmp_path)
    m = node(tmp_path, roots=kept_roots)
    layers = []
    for n in range(2):
        write_image(tmp_path / f"{n}.img", "r", seed=10 + n)
        layers.append(import_image(m.store, tmp_path / f"{n}.img").manifest_id)
    kept_roots.append(Name("layer", layers[0]))
    for _ in range(2):
        assert m.gc(grace=0, dry_run=True)["deleted"] == 0
    assert m.store.get_layer(layers[1]) is not None
    deleted = sum(m.gc(grace=0, dry_run=False)["deleted"] for _ in range(2))
    assert deleted > 0
    assert m.store.get_layer(layers[0]).size == 1 << 20
    with pytest.raises(NotFound):
        m.store.get_layer(layers[1])


def test_a_remote_gc_keeps_what_this_node_holds(tmp_path: Path) -> None:
    """After a lazy pull, the image is removed from the remote and the remote
    collected (through this node, twice, no grace): the node still reads it."""
    (content,) = remote_with(tmp_path, "img:a")
    m = node(tmp_path)
    m.pull("img:a", full=False)
    with open_store(str(tmp_path / "remote")) as remote:
        remote.delete_ref("img:a")
    reports = [m.gc(grace=0, dry_run=False, remote=True) for _ in range(2)]
    assert [h["node"] for h in reports[-1]["holds"]] == [NODE]
    export_image(m.store, "img:a", tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == content
