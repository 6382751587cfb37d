"""What a sandbox is started from: a template's image or snapshot, or an
image named directly (NAME:TAG), resolved for a caller (another team's is
unknown, a name that cannot exist is unknown too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerstore.errors import InvalidInput, NotFound
from layerstore.refs import parse_ref
from layerstore.store import Store
from layerstore.templates import check_template_name

from .teams import Caller


@dataclass(frozen=True)
class Source:
    template: str  # the templateID the client used
    kind: str  # image | snapshot
    target: str
    process: dict = field(default_factory=dict)  # the template's process defaults (env, cwd, user)


def resolve(store: Store, template_id: str, caller: Caller) -> Source:
    """A template name, or an image NAME:TAG, as what to boot or restore."""
    if ":" in template_id:
        ref = str(parse_ref(template_id))
        caller.check_sees(store.ref_owner(ref), f"image {ref} not found in {store.describe()}")
        store.resolve(ref)
        return Source(template_id, "image", ref)
    try:
        check_template_name(template_id)
    except InvalidInput:
        raise NotFound(f"template {template_id!r} not found") from None
    template = store.get_template(template_id)
    caller.check_sees(template.owner, f"template {template_id} not found in {store.describe()}")
    return Source(template_id, template.kind, template.target, template.process)
