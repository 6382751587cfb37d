"""What a sandbox is started from: a template's image or snapshot, or an
image named directly (NAME:TAG), resolved for a caller (another team's is
unknown, a name that cannot exist is unknown too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerstore.digest import is_digest
from layerstore.errors import InvalidInput, NotFound
from layerstore.refs import parse_ref
from layerstore.store import Store
from layerstore.templates import DEFAULT_TAG, check_template_name

from .teams import Caller


@dataclass(frozen=True)
class Source:
    template: str  # the templateID the client used
    kind: str  # image | snapshot
    target: str
    process: dict = field(default_factory=dict)  # the template's process defaults (env, cwd, user)


def resolve(store: Store, template_id: str, caller: Caller) -> Source:
    """What `template_id` names, tried in E2B's order: a snapshot id (E2B's
    snapshots are templates: `ID` or `ID:default`), a template (`NAME` or
    `NAME:TAG`) the caller may start, then an image `NAME:TAG`. Another
    team's private template of the name is passed over, never in the way."""
    snapshot_id = snapshot_id_of(template_id)
    if snapshot_id is not None:
        team = store.get_snapshot(snapshot_id).annotations.get("team", "")
        caller.check_sees(team, f"template {template_id} not found in {store.describe()}")
        return Source(template_id, "snapshot", snapshot_id)
    try:
        template = store.get_template(check_template_name(template_id))
    except (InvalidInput, NotFound):
        template = None
    if template is not None and (template.public or caller.sees(template.owner)):  # a public one is every team's
        return Source(template_id, template.kind, template.target, template.process)
    if ":" not in template_id:
        raise NotFound(f"template {template_id!r} not found in {store.describe()}")
    ref = str(parse_ref(template_id))
    caller.check_sees(store.ref_owner(ref), f"image {ref} not found in {store.describe()}")
    store.resolve(ref)
    return Source(template_id, "image", ref)


def snapshot_id_of(template_id: str) -> str | None:
    """The snapshot id in `ID` or `ID:default` (E2B's spelling of a snapshot
    as a template), None when `template_id` is no snapshot id."""
    text = template_id.removesuffix(f":{DEFAULT_TAG}")
    return text if is_digest(text) else None
