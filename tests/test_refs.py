"""Ref names: strict alphabet, no path tricks."""

from __future__ import annotations

import pytest

from layerstore.errors import CorruptObject, InvalidInput
from layerstore.refs import Ref, decode_ref_target, encode_ref_target, parse_ref, ref_from_key


def test_parse_and_default_tag() -> None:
    assert parse_ref("ubuntu:22.04") == Ref("ubuntu", "22.04")
    assert parse_ref("base") == Ref("base", "latest")
    assert parse_ref("my_img-1:v1.2-rc_3").key == "refs/my_img-1/v1.2-rc_3"


@pytest.mark.parametrize(
    "text",
    ["", ":tag", "name:", "../etc:x", "a/b:c", "a:b/c", "a:..", "..:a", ".hidden:x", "a\0b:c", "a:b\0", "a b:c",
     "a:b:c", "x" * 129, "ü:x", "-a:b"],
)
def test_bad_refs_refused(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_ref(text)


def test_ref_from_key_roundtrip_and_rejects_strays() -> None:
    assert ref_from_key("refs/a/b") == Ref("a", "b")
    assert ref_from_key("refs/a") is None
    assert ref_from_key("refs/a/b/c") is None
    assert ref_from_key("refs/../b") is None


def test_ref_target_roundtrip_and_corruption() -> None:
    ref = Ref("a", "b")
    body = encode_ref_target("ab" * 32, now=5)
    assert decode_ref_target(ref, body) == ("ab" * 32, 5)
    for bad in (b"", b"{}", b'{"manifest": "xyz"}', b"[1]", b"\xff"):
        with pytest.raises(CorruptObject, match="a:b"):
            decode_ref_target(ref, bad)


def test_the_stores_own_names_are_reserved() -> None:
    """`strata-*` names are the store's and node's own: the importer's layer
    chains, the demo image; a name merely holding `strata` is not."""
    from layerstore.refs import is_reserved
    from layerstore.rootfs import chain_ref
    from vmm.cli import DEMO_IMAGE

    for text in (chain_ref("ab" * 32), DEMO_IMAGE, "strata-boot:vmlinuz", "strata-oci", "strata-x:y"):
        assert is_reserved(parse_ref(text)), text
    for text in ("strata:v1", "my-strata-oci:x", "app:strata-oci", "Strata-oci:x", "stratax:y"):
        assert not is_reserved(parse_ref(text)), text


def test_the_stores_owner_is_no_team_name(tmp_path) -> None:  # noqa: ANN001
    """No API key's team (STRATA_API_KEYS, STRATA_ADMIN_KEYS) can be named
    STORE_OWNER, so no API caller's ref can carry the store's mark."""
    from layerstore.config import TEAM_RE, NodeConfig
    from layerstore.refs import STORE_OWNER

    assert not TEAM_RE.fullmatch(STORE_OWNER)
    (tmp_path / "empty.toml").write_text("")
    for setting in ("STRATA_API_KEYS", "STRATA_ADMIN_KEYS"):
        env = {"STRATA_STORE": "/s", "STRATA_CONFIG": str(tmp_path / "empty.toml"),
               setting: f"{STORE_OWNER}:a-long-enough-key"}
        with pytest.raises(InvalidInput, match=f"{setting}: '{STORE_OWNER}' is not a team name"):
            NodeConfig.load(env)


def test_ref_entry_reads_manifest_and_owner_of_one_write(tmp_path) -> None:  # noqa: ANN001
    from layerstore.errors import NotFound
    from layerstore.importer import import_image
    from layerstore.refs import STORE_OWNER
    from layerstore.store import open_store

    (tmp_path / "disk.img").write_bytes(b"x" * 4096)
    with open_store(str(tmp_path / "store")) as store:
        manifest = import_image(store, tmp_path / "disk.img", None).manifest_id
        store.set_ref("strata-oci:abc", manifest, owner=STORE_OWNER)
        store.set_ref("app:v1", manifest, owner="beta")
        assert store.ref_entry("strata-oci:abc") == (manifest, STORE_OWNER)
        assert store.ref_entry("app:v1") == (manifest, "beta")
        with pytest.raises(NotFound, match="app:v2"):
            store.ref_entry("app:v2")
