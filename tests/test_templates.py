"""Template names and tags (layerstore/templates.py): one canonical spelling
per template, tagged names kept under their own prefix and listed with the
rest, anything else refused before it becomes a key."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerstore.errors import InvalidInput, NotFound
from layerstore.importer import import_image
from layerstore.templates import check_template_name, name_of_key, new_template, template_key
from tests.images import write_image
from tests.test_transfer import local_store


def test_no_tag_and_the_default_tag_are_one_name() -> None:
    assert check_template_name("base") == check_template_name("base:default") == "base"
    assert check_template_name("base:v2") == "base:v2"
    assert template_key("base:default") == "templates/base"
    assert template_key("base:v2") == "template-tags/base/v2"
    for key in ("templates/base", "template-tags/base/v2"):
        assert template_key(name_of_key(key)) == key


@pytest.mark.parametrize("name", ["", ":v1", "base:", "base:v1:v2", "../x", "base:../x", "a/b", "-x", "x:-y",
                                  "x" * 129, "x:" + "y" * 129, "base:v 1"])
def test_names_that_cannot_be_keys_are_refused(name: str) -> None:
    with pytest.raises(InvalidInput, match="invalid template name"):
        check_template_name(name)


@pytest.mark.parametrize("key", ["template-tags/base/default", "template-tags/base", "refs/base/v1",
                                 "template-tags/base/v1/x"])
def test_keys_that_hold_no_template_are_refused(key: str) -> None:
    with pytest.raises(InvalidInput):
        name_of_key(key)


def test_tagged_templates_are_stored_listed_and_deleted_apart(tmp_path: Path) -> None:
    store = local_store(tmp_path / "s")
    write_image(tmp_path / "a.img", "rp", seed=1)
    import_image(store, tmp_path / "a.img", "app:v1")
    for name in ("app:default", "app:v2", "app:v3"):
        store.put_template(new_template(name, "image", "app:v1"))
    assert [t.name for t in store.list_templates()] == ["app", "app:v2", "app:v3"]
    assert store.get_template("app:default").name == "app"
    assert store.delete_template("app:v2").name == "app:v2"
    assert [t.name for t in store.list_templates()] == ["app", "app:v3"]
    with pytest.raises(NotFound):
        store.get_template("app:v2")
    store.close()
