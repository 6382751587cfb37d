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
