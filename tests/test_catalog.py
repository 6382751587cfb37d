"""api/catalog.py's Catalog on a real store (every backend): another team's
snapshot, template or image is unknown, exactly like a missing one; a name
another team holds cannot be taken over and nothing changes; `strata-*`
names are no team's to write or remove; names that cannot be ids (path
tricks) are simply unknown; a snapshot something needs is not deleted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from api.catalog import Catalog, writable_ref
from api.sources import resolve
from api.teams import Caller
from layerstore.chunk import chunk_key
from layerstore.config import NodeConfig
from layerstore.errors import Conflict, InvalidInput, NotFound
from layerstore.importer import import_image
from layerstore.snapshot import Snapshot
from layerstore.store import Store
from layerstore.templates import new_template
from tests.images import write_image

ALPHA, BETA, ADMIN = Caller("alpha"), Caller("beta"), Caller("ops", admin=True)


def node_config(tmp_path: Path, **env: str) -> NodeConfig:
    """A NodeConfig from `env` alone (an empty config file), state under tmp_path/state."""
    (tmp_path / "empty.toml").touch()
    return NodeConfig.load({"STRATA_STATE_DIR": str(tmp_path / "state"), "STRATA_RUN_DIR": str(tmp_path / "run"),
                            "STRATA_CONFIG": str(tmp_path / "empty.toml"), **env})


class World:
    """A Catalog over `store` holding alpha's image base:v1, template `base`
    naming it, and snapshot `snap`; `deleted` counts the removal callbacks."""

    def __init__(self, store: Store, tmp_path: Path) -> None:
        config = node_config(tmp_path, STRATA_STORE=str(tmp_path / "unused"))
        self.users: dict[str, list[str]] = {}
        self.deleted = 0
        self.cat = Catalog(store, config, uploads=tmp_path / "uploads", node_users=lambda: self.users,
                           deleted=self._count)
        self.store = store
        ids = {}
        for i, role in enumerate(("disk", "memory", "state", "kernel", "initrd")):
            write_image(tmp_path / f"{role}.img", "rz", seed=i)
            ids[role] = import_image(store, tmp_path / f"{role}.img").manifest_id
        self.manifest = ids["disk"]
        store.set_ref("base:v1", self.manifest, owner="alpha")
        self.snap = store.put_snapshot(Snapshot(
            layers={"disk": ids["disk"], "memory": ids["memory"], "state": ids["state"]},
            vm={"backend": "qemu", "cmdline": "console=ttyS0", "cpus": 1, "memory_mib": 256,
                "kernel": ids["kernel"], "initrd": ids["initrd"]},
            annotations={"sandbox": "sb1", "team": "alpha"}))
        self.cat.create_template(ALPHA, "base", image="base:v1", snapshot=None)

    def _count(self) -> None:
        self.deleted += 1


@pytest.fixture
def world(store: Store, tmp_path: Path) -> World:
    return World(store, tmp_path)


async def _body(data: bytes) -> AsyncIterator[bytes]:
    yield data


def test_another_teams_image_answers_as_a_missing_one(world: World) -> None:
    """Beta neither lists nor inspects alpha's image, and the message is the
    one a missing image gets (no existence leak); alpha and admins see it."""
    assert [i.ref for i in world.cat.images(ALPHA)] == ["base:v1"]
    assert world.cat.images(BETA) == []
    with pytest.raises(NotFound) as hidden:
        world.cat.image(BETA, "base:v1")
    with pytest.raises(NotFound) as missing:
        world.cat.image(BETA, "nosuch:v1")
    assert str(hidden.value) == str(missing.value).replace("nosuch:v1", "base:v1")
    assert world.cat.image(ALPHA, "base:v1").manifest == world.manifest
    assert world.cat.image(ADMIN, "base:v1").manifest == world.manifest


def test_another_team_cannot_delete_or_take_over_an_image(world: World) -> None:
    """Beta's delete is 404 and its import under alpha's name is 409 before
    and after the upload; the ref still points at alpha's manifest."""
    with pytest.raises(NotFound):
        world.cat.delete_image(BETA, "base:v1")
    with pytest.raises(Conflict, match="another team"):
        world.cat.check_import(BETA, "base:v1", "10")
    with pytest.raises(Conflict, match="another team"):
        anyio.run(lambda: world.cat.import_stream(BETA, "base:v1", _body(b"x" * 4096), declared="4096"))
    assert world.store.resolve("base:v1") == world.manifest
    assert world.store.ref_owner("base:v1") == "alpha"
    assert world.deleted == 0


def test_an_upload_publishes_for_the_callers_team(world: World) -> None:
    """An import under a free name is the caller's: beta sees it, alpha does not."""
    result = anyio.run(lambda: world.cat.import_stream(BETA, "mine:v1", _body(b"beta's bytes" * 1000)))
    assert result.ref == "mine:v1" and result.size == 12000
    assert world.store.ref_owner("mine:v1") == "beta"
    assert [i.ref for i in world.cat.images(BETA)] == ["mine:v1"]
    assert "mine:v1" not in [i.ref for i in world.cat.images(ALPHA)]


def test_reserved_names_are_no_teams_to_write_or_remove(world: World) -> None:
    """`strata-*` refs: 400 for a team on write and delete, the ref kept; an admin may."""
    world.store.set_ref("strata-boot:v1", world.manifest, owner="alpha")  # even one the team holds
    with pytest.raises(InvalidInput, match="reserved"):
        writable_ref(ALPHA, "strata-oci:abc")
    with pytest.raises(InvalidInput, match="reserved"):
        world.cat.check_import(ALPHA, "strata-boot:v1", None)
    with pytest.raises(InvalidInput, match="reserved"):
        world.cat.delete_image(ALPHA, "strata-boot:v1")
    assert world.store.resolve("strata-boot:v1") == world.manifest
    assert writable_ref(ADMIN, "strata-oci:abc") == "strata-oci:abc"
    world.cat.delete_image(ADMIN, "strata-boot:v1")
    with pytest.raises(NotFound):
        world.store.resolve("strata-boot:v1")
    assert world.deleted == 1


@pytest.mark.parametrize("name", ["../../etc/passwd", "base:v1/../x", "/abs:v1", "a" * 300, "", "..", "%2e%2e"])
def test_names_that_cannot_be_ids_are_unknown(world: World, name: str) -> None:
    """Path-like or malformed text is 404 for images, snapshots, templates
    and chunks, and reaches no store object."""
    for lookup in (lambda: world.cat.image(ADMIN, name), lambda: world.cat.delete_image(ADMIN, name),
                   lambda: world.cat.snapshot(ADMIN, name), lambda: world.cat.delete_snapshot(ADMIN, name),
                   lambda: world.cat.delete_template(ADMIN, name), lambda: world.cat.chunk(name)):
        with pytest.raises(NotFound):
            lookup()
    assert world.deleted == 0 and world.store.resolve("base:v1") == world.manifest


def test_another_teams_templates_are_unknown_and_their_names_taken(world: World) -> None:
    """Beta does not list or delete `base`; naming it again is 409 and the
    template is unchanged; beta cannot name alpha's image or snapshot."""
    assert [t.templateID for t in world.cat.templates(ALPHA)] == ["base"]
    assert world.cat.templates(BETA) == []
    with pytest.raises(NotFound):
        world.cat.delete_template(BETA, "base")
    with pytest.raises(Conflict, match="another team"):
        world.cat.create_template(BETA, "base", image="base:v1", snapshot=None)
    with pytest.raises(NotFound):
        world.cat.create_template(BETA, "steal", image="base:v1", snapshot=None)
    with pytest.raises(NotFound):
        world.cat.create_template(BETA, "steal", image=None, snapshot=world.snap)
    with pytest.raises(InvalidInput, match="exactly one"):
        world.cat.create_template(ALPHA, "both", image="base:v1", snapshot=world.snap)
    with pytest.raises(InvalidInput, match="invalid template name"):
        world.cat.create_template(ALPHA, "../evil", image="base:v1", snapshot=None)
    assert [t.name for t in world.store.list_templates()] == ["base"]
    assert world.store.get_template("base").owner == "alpha"


def test_another_teams_snapshot_is_unknown_and_kept(world: World) -> None:
    """Beta does not list, inspect or delete alpha's snapshot."""
    assert [s.snapshotID for s in world.cat.snapshots(ALPHA)] == [world.snap]
    assert world.cat.snapshots(BETA) == []
    for action in (lambda: world.cat.snapshot(BETA, world.snap), lambda: world.cat.delete_snapshot(BETA, world.snap)):
        with pytest.raises(NotFound):
            action()
    assert world.cat.snapshot(ALPHA, world.snap).snapshotID == world.snap
    assert world.store.get_snapshot(world.snap).annotations["team"] == "alpha"


def test_a_snapshot_something_needs_is_not_deleted(world: World) -> None:
    """A template or a paused sandbox of the node naming it is 409 (the
    snapshot stays); once neither does, it is deleted and `deleted` told."""
    world.cat.create_template(ALPHA, "snap-tpl", image=None, snapshot=world.snap)
    world.users[world.snap] = ["sandbox sb1"]
    with pytest.raises(Conflict, match="template snap-tpl"):
        world.cat.delete_snapshot(ALPHA, world.snap)
    world.cat.delete_template(ALPHA, "snap-tpl")
    with pytest.raises(Conflict, match="sandbox sb1"):
        world.cat.delete_snapshot(ALPHA, world.snap)
    assert world.store.get_snapshot(world.snap) is not None and world.deleted == 0
    world.users.clear()
    world.cat.delete_snapshot(ALPHA, world.snap)
    with pytest.raises(NotFound):
        world.cat.snapshot(ALPHA, world.snap)
    assert world.deleted == 1


def test_deleting_a_snapshot_as_a_template_takes_its_names(world: World) -> None:
    """E2B's delete_snapshot (DELETE /templates/ID): the snapshot goes with
    its names, unless a paused sandbox needs it (409, nothing removed);
    another team's is unknown; a template cannot be named like a snapshot id."""
    world.cat.create_template(ALPHA, "snap-tpl:v2", image=None, snapshot=world.snap)
    world.cat.create_template(ALPHA, "snap-tpl", image=None, snapshot=world.snap)
    with pytest.raises(NotFound):
        world.cat.delete_template(BETA, world.snap)
    world.users[world.snap] = ["sandbox sb1"]
    with pytest.raises(Conflict, match="sandbox sb1"):
        world.cat.delete_template(ALPHA, f"{world.snap}:default")
    assert [t.name for t in world.store.list_templates()] == ["base", "snap-tpl", "snap-tpl:v2"]
    world.users.clear()
    world.cat.delete_template(ALPHA, world.snap)
    assert [t.name for t in world.store.list_templates()] == ["base"] and world.deleted == 1
    with pytest.raises(NotFound):
        world.cat.snapshot(ALPHA, world.snap)
    with pytest.raises(InvalidInput, match="snapshot id"):
        world.cat.create_template(ALPHA, "ab" * 32, image="base:v1", snapshot=None)


def test_a_public_template_is_every_teams_to_start_and_its_owners_to_change(world: World) -> None:
    """A public template (the node's code-interpreter-v1) is listed for,
    found by and started from by every team; only its owner replaces or
    removes it."""
    from dataclasses import replace

    world.cat.create_template(ALPHA, "shared", image=None, snapshot=world.snap)
    with pytest.raises(NotFound):
        resolve(world.store, "shared", BETA)  # not public yet: another team's
    world.store.put_template(replace(world.store.get_template("shared"), public=True))
    assert "shared" in [t.templateID for t in world.cat.templates(BETA)]
    assert world.cat.template_alias(BETA, "shared").public is True
    assert resolve(world.store, "shared", BETA).target == world.snap
    with pytest.raises(Conflict):
        world.cat.create_template(BETA, "shared", image=None, snapshot=world.snap)
    with pytest.raises(NotFound):
        world.cat.delete_template(BETA, "shared")
    assert world.store.get_template("shared").owner == "alpha" and world.store.get_template("shared").public


def test_chunks_for_peers_come_from_this_store(world: World) -> None:
    """A stored chunk is returned as its object; an unknown digest is 404."""
    digest = next(d for d in world.store.get_layer(world.manifest).chunks.values() if d is not None)
    assert world.cat.chunk(digest) == world.store.backend.get(chunk_key(digest))
    with pytest.raises(NotFound):
        world.cat.chunk("ab" * 32)


def test_template_tags_name_one_template_and_stay_their_teams(world: World) -> None:
    """E2B's tags: assign gives what NAME:TAG names to more tags (one build
    id), get lists them, remove drops them and nothing else; another team
    can neither tag, list nor remove alpha's, nor take a tag it holds, and
    a bad tag changes nothing."""
    cat = world.cat
    cat.create_template(ALPHA, "base:v1", image="base:v1", snapshot=None)
    assigned = cat.assign_tags(ALPHA, "base:v1", ["prod", "stable"])
    assert assigned.tags == ["prod", "stable"]
    assert world.store.get_template("base:prod").target == "base:v1"
    tags = {t.tag: t.buildID for t in cat.tags(ALPHA, "base")}
    assert set(tags) == {"default", "v1", "prod", "stable"} and len(set(tags.values())) == 1
    assert assigned.buildID == tags["prod"]
    with pytest.raises(NotFound):
        cat.assign_tags(BETA, "base:v1", ["mine"])
    with pytest.raises(NotFound):
        cat.tags(BETA, "base")
    with pytest.raises(NotFound):
        cat.remove_tags(BETA, "base", ["prod"])
    with pytest.raises(InvalidInput):
        cat.assign_tags(ALPHA, "base:v1", ["ok", "../x"])
    assert not any(t.name == "base:ok" for t in world.store.list_templates())  # checked before any is written
    cat.remove_tags(ALPHA, "base", ["prod"])
    assert {t.tag for t in cat.tags(ALPHA, "base")} == {"default", "v1", "stable"}
    with pytest.raises(NotFound):
        cat.remove_tags(ALPHA, "base", ["prod"])  # gone
    assert world.store.resolve("base:v1") == world.manifest  # the image is untouched


def test_another_teams_private_template_never_stands_before_your_image(world: World) -> None:
    """A template of beta's named like alpha's image (written before names were owned, or by an
    admin) is passed over when alpha starts that name: alpha gets its own image, beta its template."""
    world.store.put_template(new_template("base:v1", "snapshot", world.snap, owner="beta"))
    assert resolve(world.store, "base:v1", ALPHA).kind == "image"
    assert resolve(world.store, "base:v1", BETA).kind == "snapshot"


def test_a_template_name_holds_its_tags_against_images_and_templates(world: World) -> None:
    """alpha's template `base` holds every `base:TAG`: beta makes no template and no image under it."""
    with pytest.raises(Conflict, match="template base, with its tags"):
        world.cat.create_template(BETA, "base:prod", image=None, snapshot=world.snap)
    with pytest.raises(Conflict, match="template base, with its tags"):
        world.cat.check_import(BETA, "base:v9", None)
    world.cat.check_import(ALPHA, "base:v9", None)  # its own team's name
    world.store.set_ref("other:v1", world.manifest, owner="beta")
    with pytest.raises(Conflict, match="image other:v1"):  # no template over another team's image
        world.cat.create_template(ALPHA, "other:v1", image="base:v1", snapshot=None)
