"""Where each sandbox runs, for gateways and for nodes that take over paused ones.

    placements/<sandbox id>   {"sandbox": "<id>", "node": "<node id>",
                               "record": {...} | null}

The node that creates (or forks) a sandbox writes it before it answers and
removes it when the sandbox is killed or reclaimed (by the API or by
`strata sandbox kill` on the node). A gateway (api/gateway.py)
reads it to route a request that names the sandbox, and maps the node id to
a URL through the node records (layerstore/nodes.py). While the sandbox is
paused to the store, `record` holds its whole record (vmm/registry.py), so
another node can wake it from its snapshot when its own node is gone: that
node first rewrites the object naming itself, conditionally on the version
it read (`claim`), so of two nodes only one takes it; and a node that wakes
one of its own paused sandboxes claims it the same way, so it never wakes
one another node took. Writes that only inform (`place`, `unplace`) are best
effort: a store that is down does not fail a create.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fusefs.control import check_sid
from layerstore.backend import Backend
from layerstore.errors import BackendError, InvalidInput, NotFound, StrataError
from layerstore.nodes import check_node_id

log = logging.getLogger(__name__)

PREFIX = "placements/"


@dataclass(frozen=True)
class Placement:
    node: str
    version: str  # of the object read: what `claim` is conditional on
    record: dict[str, Any] | None  # the sandbox's record while it is paused to the store


def _body(sid: str, node_id: str, record: dict[str, Any] | None) -> bytes:
    return json.dumps({"sandbox": check_sid(sid), "node": check_node_id(node_id), "record": record},
                      sort_keys=True).encode()


def place(backend: Backend, sid: str, node_id: str, *, record: dict[str, Any] | None = None) -> None:
    """Record that `node_id` holds sandbox `sid` (with its record if paused); logged, not raised, if the store fails."""
    try:
        backend.put(PREFIX + sid, _body(sid, node_id, record))
    except (BackendError, StrataError) as exc:
        log.error("recording where sandbox %s runs: %s", sid, exc)


def unplace(backend: Backend, sid: str, *, holder: str | None = None) -> None:
    """Forget where `sid` ran (it was killed); with `holder`, only if the
    placement names that node (a paused sandbox another node took is not
    this node's to forget). Logged, not raised, if the store fails."""
    try:
        if holder is not None and placed(backend, sid) != holder:
            return
        backend.delete(PREFIX + check_sid(sid))
    except NotFound:
        pass
    except (BackendError, StrataError) as exc:
        log.error("removing the placement of sandbox %s: %s", sid, exc)


def read(backend: Backend, sid: str) -> Placement | None:
    """Where `sid` is, None if nowhere (or the id or object is not one of ours);
    a store that fails raises (BackendError), never reads as "nowhere"."""
    try:
        key = PREFIX + check_sid(sid)
    except InvalidInput:
        return None
    info = backend.head(key)
    if info is None:
        return None
    try:
        data = json.loads(backend.get(key))
        record = data.get("record")
        return Placement(check_node_id(data["node"]), info.version, record if isinstance(record, dict) else None)
    except NotFound:
        return None
    except (ValueError, KeyError, TypeError, AttributeError, InvalidInput):
        return None


def placed(backend: Backend, sid: str) -> str | None:
    """The id of the node holding `sid`, None if none is recorded."""
    seen = read(backend, sid)
    return None if seen is None else seen.node


def claim(backend: Backend, sid: str, node_id: str, seen: Placement, *,
          record: dict[str, Any] | None = None) -> bool:
    """Make `node_id` the holder of `sid` if the object is still the one `seen` was read from."""
    return backend.put_if(PREFIX + check_sid(sid), _body(sid, node_id, record), seen.version) is not None
