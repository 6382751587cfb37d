"""Named refs: `NAME:TAG` pointing at a manifest.

A ref is stored as a small JSON object under

    refs/<NAME>/<TAG>      {"manifest": "<64 hex>", "updated": <unix seconds>,
                            "owner": "<team>"}     (optional: who may change it)

Names and tags become path components and object keys, so they are held to a
strict alphabet: a letter or digit, then letters, digits, `.`, `_`, `-`, at
most 128 characters. Anything else (`/`, `..`, NUL, spaces) is refused with a
message before it reaches a backend.

Names starting with `strata-` are the store's and node's own (`is_reserved`):
`strata-oci` (the OCI importer's layer chains, layerstore/rootfs.py),
`strata-boot` (a node's kernel and initrd layers), `strata-guest` (the demo
image); the API lets no team write one. A ref the store writes for itself
records the owner `STORE_OWNER`, which is no team's name (a team name never
holds '@', layerstore/config.py), so a reader that trusts such a ref for who
wrote it can tell it from any ref an API caller made.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from .digest import check_digest
from .errors import CorruptObject, InvalidInput

_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DEFAULT_TAG = "latest"
REF_PREFIX = "refs/"
RESERVED_PREFIX = "strata-"  # names the store and node write for themselves
STORE_OWNER = "@store"  # the owner of refs the store writes for itself: no team can be named so


@dataclass(frozen=True, order=True)
class Ref:
    """A validated `NAME:TAG` pair."""

    name: str
    tag: str

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}"

    @property
    def key(self) -> str:
        """The object key this ref is stored under."""
        return f"{REF_PREFIX}{self.name}/{self.tag}"


def _check_part(part: str, what: str, text: str) -> None:
    if not _PART_RE.fullmatch(part):
        raise InvalidInput(
            f"invalid image {what} in {text!r}: use letters, digits, '.', '_', '-' "
            "(starting with a letter or digit, at most 128 characters)"
        )


def parse_ref(text: str) -> Ref:
    """Parse `NAME[:TAG]` (tag defaults to `latest`), refusing path tricks."""
    if not isinstance(text, str) or not text:
        raise InvalidInput("empty image reference")
    name, sep, tag = text.partition(":")
    if not sep:
        tag = DEFAULT_TAG
    _check_part(name, "name", text)
    _check_part(tag, "tag", text)
    return Ref(name, tag)


def is_reserved(ref: Ref) -> bool:
    """True if `ref` is in the store's and node's own namespace (`strata-*`):
    no API caller but an admin may write or remove one."""
    return ref.name.startswith(RESERVED_PREFIX)


def ref_from_key(key: str) -> Ref | None:
    """Inverse of `Ref.key`; None for keys that are not well-formed refs."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "refs":
        return None
    if not (_PART_RE.fullmatch(parts[1]) and _PART_RE.fullmatch(parts[2])):
        return None
    return Ref(parts[1], parts[2])


def encode_ref_target(manifest_id: str, *, now: float | None = None, owner: str = "") -> bytes:
    """The stored body of a ref pointing at `manifest_id` (owned by `owner`, if given)."""
    check_digest(manifest_id, what="manifest id")
    body: dict[str, object] = {"manifest": manifest_id, "updated": int(time.time() if now is None else now)}
    if owner:
        body["owner"] = owner
    return json.dumps(body, sort_keys=True).encode()


def decode_ref_owner(blob: bytes) -> str:
    """The owner recorded in a stored ref body ("" if none, or unreadable:
    decode_ref_target reports that)."""
    try:
        owner = json.loads(blob).get("owner", "")
    except (ValueError, AttributeError):
        return ""
    return owner if isinstance(owner, str) else ""


def decode_ref_target(ref: Ref, blob: bytes) -> tuple[str, int]:
    """Return (manifest id, updated time) from a stored ref body."""
    try:
        body = json.loads(blob)
        manifest_id = check_digest(body["manifest"], what="manifest id")
        updated = int(body.get("updated", 0))
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptObject(f"ref {ref}: stored ref is malformed ({exc})") from None
    except InvalidInput as exc:
        raise CorruptObject(f"ref {ref}: {exc}") from None
    return manifest_id, updated
