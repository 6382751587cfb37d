"""Templates: the names sandboxes are created from.

A template names either an image (a `NAME:TAG` ref: a sandbox boots it) or a
snapshot (a sandbox restores it, already running). It is a small JSON object:

    templates/<NAME>     {"kind": "image" | "snapshot", "target": "<ref or id>",
                          "created": <unix seconds>, "owner": "<team>" (optional)}

Template names follow the ref alphabet (letter or digit first, then letters,
digits, '.', '_', '-'; at most 128), so they are safe as object keys. GC
marks whatever templates point at.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from .digest import check_digest
from .errors import CorruptObject, InvalidInput
from .refs import parse_ref

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KINDS = ("image", "snapshot")


@dataclass(frozen=True)
class Template:
    name: str
    kind: str
    target: str
    created: float
    owner: str = ""  # an opaque label (the API's team); "" = nobody in particular

    @property
    def key(self) -> str:
        return template_key(self.name)

    def encode(self) -> bytes:
        body: dict[str, object] = {"kind": self.kind, "target": self.target, "created": self.created}
        if self.owner:
            body["owner"] = self.owner
        return json.dumps(body, sort_keys=True).encode()


def check_template_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidInput(f"invalid template name {name!r}: letters, digits, '.', '_', '-' "
                           "(starting with a letter or digit, at most 128)")
    return name


def template_key(name: str) -> str:
    return f"templates/{check_template_name(name)}"


def new_template(name: str, kind: str, target: str, *, owner: str = "") -> Template:
    """A validated template (the target's existence is the store's check)."""
    check_template_name(name)
    if kind == "image":
        target = str(parse_ref(target))
    elif kind == "snapshot":
        check_digest(target, what="snapshot id")
    else:
        raise InvalidInput(f"template kind {kind!r} is not one of {', '.join(KINDS)}")
    return Template(name, kind, target, time.time(), owner)


def parse_template(name: str, blob: bytes) -> Template:
    try:
        data = json.loads(blob)
        template = new_template(name, data["kind"], data["target"])
        owner = data.get("owner", "")
        if not isinstance(owner, str):
            raise TypeError("owner is not a string")
        return Template(template.name, template.kind, template.target, float(data["created"]), owner)
    except (ValueError, KeyError, TypeError, InvalidInput) as exc:
        raise CorruptObject(f"template {name} is malformed: {exc}") from None
