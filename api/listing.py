"""E2B's sandbox listing: which sandboxes a query selects, in what order,
one page at a time.

The query strings are E2B's (`metadata=k=v&k2=v2`, URL-encoded once more by
the SDK; `state=running,paused`). The page cursor (X-Next-Token) names the
last sandbox of a page by its start time and id, so a page boundary stays
put while sandboxes before it come and go; a cursor naming a sandbox that
has since gone ends the listing rather than restarting it.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import unquote_plus

from layerstore.errors import InvalidInput
from vmm.registry import SandboxRecord

from .models import e2b_state

STATES = frozenset({"running", "paused"})
T = TypeVar("T")


def metadata_query(raw: str | None) -> dict[str, str]:
    """E2B's metadata filter as a dict (empty: no filter)."""
    if not raw:
        return {}
    out = {}
    for pair in unquote_plus(raw).split("&"):
        parts = pair.split("=")
        if len(parts) != 2:
            raise InvalidInput(f"metadata filter {raw!r} is not key=value pairs joined by '&'")
        out[unquote_plus(parts[0])] = unquote_plus(parts[1])
    return out


def states_query(raw: str | None) -> frozenset[str]:
    """E2B's comma-separated state filter (unset: both states)."""
    states = frozenset(s for s in (raw or "running,paused").split(",") if s)
    if not states <= STATES:
        raise InvalidInput(f"state {raw!r}: use running, paused or both")
    return states


def select(records: Iterable[SandboxRecord], *, metadata: dict[str, str], states: frozenset[str],
           started_after: float | None = None, template: str | None = None) -> list[SandboxRecord]:
    """The records in one of `states` whose metadata includes `metadata`, started at or after
    `started_after` (unix seconds) and of `template` when given, in the order given."""
    return [r for r in records if e2b_state(r) in states and metadata.items() <= r.metadata.items()
            and (started_after is None or r.created >= started_after) and (template is None or r.template == template)]


def _cursor(record: SandboxRecord) -> str:
    return f"{record.created!r}|{record.sid}"


def _start(record: SandboxRecord) -> tuple[float, str]:
    return record.created, record.sid


def page(items: list[T], *, order: str, limit: int, token: str | None,
         key: Callable[[T], Any] = _start, cursor: Callable[[T], str] = _cursor) -> tuple[list[T], str | None]:
    """One page of `items` (sandbox records; a gateway's rows from every node)
    by start time (`key`; `order` asc|desc) after the sandbox `token` names,
    and the token of the next page (None: last page)."""
    rows = sorted(items, key=key, reverse=order == "desc")
    if token:
        try:
            after = base64.urlsafe_b64decode(token.encode()).decode()
        except (ValueError, UnicodeDecodeError):
            raise InvalidInput("nextToken is not a token issued here") from None
        keys = [cursor(r) for r in rows]
        rows = rows[keys.index(after) + 1:] if after in keys else []
    if len(rows) <= limit:
        return rows, None
    return rows[:limit], base64.urlsafe_b64encode(cursor(rows[limit - 1]).encode()).decode()
