"""Templates: the names sandboxes are created from.

A template names either an image (a `NAME:TAG` ref: a sandbox boots it) or a
snapshot (a sandbox restores it, already running). It is a small JSON object:

    templates/<NAME>            {"kind": "image" | "snapshot", "target": "<ref or id>",
    template-tags/<NAME>/<TAG>   "created": <unix seconds>, "owner": "<team>" (optional),
                                 "process": {"env": {..}, "cwd": "..", "user": ".."} (optional:
                                 what every process of a sandbox made from it starts with),
                                 "public": true (optional: every team may start it; only
                                 its owner may replace or remove it)}

A name may carry a tag, as E2B's do (`my-snap:v2`); no tag means the tag
`default`, so `NAME` and `NAME:default` are one template, kept where
untagged names always were. Names and tags follow the ref alphabet (letter
or digit first, then letters, digits, '.', '_', '-'; at most 128 each), so
they are safe as object keys. GC marks whatever templates point at.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from .digest import check_digest
from .errors import CorruptObject, InvalidInput
from .refs import parse_ref

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KINDS = ("image", "snapshot")
DEFAULT_TAG = "default"  # E2B's: a template named without a tag
TEMPLATE_PREFIX, TAGGED_TEMPLATE_PREFIX = "templates/", "template-tags/"


@dataclass(frozen=True)
class Template:
    name: str
    kind: str
    target: str
    created: float
    owner: str = ""  # an opaque label (the API's team); "" = nobody in particular
    process: dict = field(default_factory=dict)  # {"env": {}, "cwd": "", "user": ""}: a build's ENV/WORKDIR/USER
    public: bool = False  # every team may start sandboxes from it (the node's code-interpreter-v1)

    @property
    def key(self) -> str:
        return template_key(self.name)

    def encode(self) -> bytes:
        body: dict[str, object] = {"kind": self.kind, "target": self.target, "created": self.created}
        if self.owner:
            body["owner"] = self.owner
        if self.process:
            body["process"] = self.process
        if self.public:
            body["public"] = True
        return json.dumps(body, sort_keys=True).encode()


def check_template_name(name: str) -> str:
    """`name` as its canonical spelling: `NAME` for `NAME` and `NAME:default`,
    else `NAME:TAG`; InvalidInput for anything else."""
    base, sep, tag = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not _NAME_RE.fullmatch(base) or sep and not _NAME_RE.fullmatch(tag):
        raise InvalidInput(f"invalid template name {name!r}: NAME or NAME:TAG, each of letters, digits, '.', '_', "
                           "'-' (starting with a letter or digit, at most 128)")
    return base if tag in ("", DEFAULT_TAG) else f"{base}:{tag}"


def check_tag(tag: str) -> str:
    """A template tag alone (E2B's tags API); InvalidInput otherwise."""
    if not isinstance(tag, str) or not _NAME_RE.fullmatch(tag):
        raise InvalidInput(f"invalid template tag {tag!r}: letters, digits, '.', '_', '-' (starting with a letter "
                           "or digit, at most 128)")
    return tag


def template_key(name: str) -> str:
    base, _, tag = check_template_name(name).partition(":")
    return f"{TAGGED_TEMPLATE_PREFIX}{base}/{tag}" if tag else f"{TEMPLATE_PREFIX}{base}"


def name_of_key(key: str) -> str:
    """The template name stored under `key` (InvalidInput if no template's key)."""
    if key.startswith(TEMPLATE_PREFIX):
        return check_template_name(key[len(TEMPLATE_PREFIX):])
    base, _, tag = key.removeprefix(TAGGED_TEMPLATE_PREFIX).partition("/")
    if not key.startswith(TAGGED_TEMPLATE_PREFIX) or tag in ("", DEFAULT_TAG):
        raise InvalidInput(f"{key!r} is no template's key")
    return check_template_name(f"{base}:{tag}")


def new_template(name: str, kind: str, target: str, *, owner: str = "", process: dict | None = None,
                 public: bool = False) -> Template:
    """A validated template (the target's existence is the store's check)."""
    name = check_template_name(name)
    if kind == "image":
        target = str(parse_ref(target))
    elif kind == "snapshot":
        check_digest(target, what="snapshot id")
    else:
        raise InvalidInput(f"template kind {kind!r} is not one of {', '.join(KINDS)}")
    return Template(name, kind, target, time.time(), owner, _process(process or {}), public)


def _process(p: object) -> dict:
    """Checked process defaults: env (str -> str), cwd, user (strings)."""
    if not isinstance(p, dict) or not isinstance(p.get("env", {}), dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in p.get("env", {}).items()) or not all(
            isinstance(p.get(k, ""), str) for k in ("cwd", "user")):
        raise InvalidInput("template process defaults must be {env: {str: str}, cwd: str, user: str}")
    return {k: p[k] for k in ("env", "cwd", "user") if p.get(k)}


def parse_template(name: str, blob: bytes) -> Template:
    try:
        data = json.loads(blob)
        template = new_template(name, data["kind"], data["target"])
        owner, public = data.get("owner", ""), data.get("public", False)
        if not isinstance(owner, str) or not isinstance(public, bool):
            raise TypeError("owner is not a string or public not a boolean")
        return Template(template.name, template.kind, template.target, float(data["created"]), owner,
                        _process(data.get("process", {})), public)
    except (ValueError, KeyError, TypeError, InvalidInput) as exc:
        raise CorruptObject(f"template {name} is malformed: {exc}") from None
