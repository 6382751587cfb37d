"""What routes share: the node, authentication, the limits of long work,
and the Server-Timing header.

The node is the app's state (`app.state.node`), reached per request through
`get_node`, so routes hold no closures over it and an app can be built
without one (for the OpenAPI document). So are the limits of long work
(`app.state.limits`, api/limits.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import Depends, Request, Response
from fastapi.security import APIKeyHeader
from starlette.exceptions import HTTPException

from .limits import Limits
from .node import Node
from .teams import Caller, caller_of

KEY_HEADER = APIKeyHeader(name="X-API-Key", auto_error=False, description="an API key (STRATA_API_KEYS)")


async def get_node(request: Request) -> Node:
    return request.app.state.node


NodeDep = Annotated[Node, Depends(get_node)]


async def get_limits(request: Request) -> Limits:
    return request.app.state.limits


LimitsDep = Annotated[Limits, Depends(get_limits)]


async def api_key(node: NodeDep, key: str | None = Depends(KEY_HEADER)) -> Caller:
    """Every route but /health: any API key (admin keys are API keys too);
    the caller it names (its team, whether admin)."""
    caller = caller_of(key, node.config)
    if caller is None:
        raise HTTPException(401, "missing or invalid X-API-Key")
    return caller


async def admin_key(node: NodeDep, key: str | None = Depends(KEY_HEADER)) -> None:
    """/admin/*: an admin key; a plain API key is known but not allowed (403)."""
    caller = caller_of(key, node.config)
    if caller is None or not caller.admin:
        raise HTTPException(401 if caller is None else 403, "an admin key is required")


AUTH = (Depends(api_key),)
ADMIN = (Depends(admin_key),)
CallerDep = Annotated[Caller, Depends(api_key)]


@contextmanager
def vmm_timing(node: Node, response: Response) -> Iterator[None]:
    """Report the share of the enclosed node action spent in the VMM layer
    (Server-Timing), for clients and the benchmark. Used inside the route's
    own body because the node counts VMM time per thread."""
    node.lifecycle.take_vmm_seconds()  # drop what a failed request left on this thread
    yield
    response.headers["Server-Timing"] = f"vmm;dur={node.lifecycle.take_vmm_seconds() * 1e3:.2f}"
