"""The HTTP layer: translate requests into `Node` actions, nothing more.

Paths, bodies and status codes of the sandbox endpoints are E2B's (see
api/models.py, and tests/test_e2b_spec.py for where and why they differ);
Strata's own endpoints cover images, snapshots, templates, the cache and
exec. Every route except /health and envd's data plane (which takes a
sandbox's access token, api/routes/envd.py) needs `X-API-Key`; /admin/*
needs an admin key. Routes are in api/routes/ (one router per resource), authentication
and the node dependency in api/deps.py, the error mapping in api/errors.py.
Worker threads are shared fairly (api/limits.py): long work (exec, the data
plane) has threads of its own, admitted per team and node, and a team has
at most a share of the short requests' threads.

The node is the app's state, not captured by the routes, so the app can be
built without one to write its OpenAPI document (`python -m api.openapi`).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute

from . import errors
from .deps import KEY_HEADER
from .limits import SHORT_THREADS, Limits
from .node import Node
from .ports import PortProxy
from .proxy import OriginForm
from .routes import ROUTERS
from .routes.builds import is_upload
from .routes.envd import is_data_plane
from .routes.volumes import is_volume_content
from .teams import caller_of

TITLE = "Strata node API"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # metric labels; others: "other"
OPEN = frozenset({("GET", "/health"), ("HEAD", "/health")})  # what answers without a key
EXEC = re.compile(r"/sandboxes/[^/]+/exec")  # the one keyed route that is long work (api/limits.py)
DESCRIPTION = "E2B-compatible sandbox lifecycle plus Strata's images, snapshots, templates and cache."


@asynccontextmanager
async def _lifespan(_app: FastAPI) -> AsyncIterator[None]:
    # Short requests' threads. Lifecycle calls block in the VMM layer for
    # seconds; with anyio's default 40 worker threads the 41st concurrent
    # client would wait for a thread, not for its VM. Long work (execs, the
    # data plane) never takes one of these: it has its own (api/limits.py).
    anyio.to_thread.current_default_thread_limiter().total_tokens = SHORT_THREADS  # each team a share of them
    yield


async def _timing(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Request latency by route template (not raw path: ids would explode the label set)."""
    started = time.monotonic()
    response = await call_next(request)
    route = request.scope.get("route")
    path = route.path if isinstance(route, APIRoute) else "other"
    method = request.method if request.method in METHODS else "other"  # a fixed label set, whatever clients send
    request.app.state.node.metrics.requests.labels(method, path, str(response.status_code)).observe(
        time.monotonic() - started)
    return response


async def _key_first(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Refuse a request without a valid key before anything reads its body:
    an anonymous client gets 401, never a parse error, and cannot make the
    node buffer what it sends. (The routes' own dependencies check again,
    and tell admin keys apart.) A keyed request that is not long work runs
    in one of its team's places among short requests (api/limits.py)."""
    path = request.url.path
    if (request.method, path) in OPEN or is_data_plane(path) or is_upload(request.method, path) or \
            is_volume_content(path):  # the volume's token: its route checks it
        return await call_next(request)
    caller = caller_of(request.headers.get(KEY_HEADER.model.name), request.app.state.node.config)
    if caller is None:  # and hang up: the body is never read
        return errors.error_response(401, "missing or invalid X-API-Key", {"Connection": "close"})
    if request.method == "POST" and EXEC.fullmatch(path):  # long work: admitted by its own limits
        return await call_next(request)
    async with request.app.state.limits.short(caller.team):
        return await call_next(request)


def create_app(node: Node | None = None) -> FastAPI:
    """The API of `node`; without one, an app good only for its OpenAPI document."""
    app = FastAPI(lifespan=_lifespan, title=TITLE, version="1.0", description=DESCRIPTION,
                  responses=errors.DOCUMENTED, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.node = node
    app.state.limits = Limits(node.config) if node is not None else None
    errors.install(app)
    app.middleware("http")(_key_first)
    app.middleware("http")(_timing)  # outermost of the API's, so refused requests are counted too
    app.add_middleware(PortProxy)  # a sandbox port's request never reaches the API
    app.add_middleware(OriginForm)  # outermost: only `/path?query` targets are routed, proxied or served
    for router in ROUTERS:
        app.include_router(router)
    return app
