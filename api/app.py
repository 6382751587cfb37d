"""The HTTP layer: translate requests into `Node` actions, nothing more.

Paths, bodies and status codes of the sandbox endpoints are E2B's (see
api/models.py, and tests/test_e2b_spec.py for where and why they differ);
Strata's own endpoints cover images, snapshots, templates, the cache and
exec. Every route except /health needs `X-API-Key`; /admin/* needs an admin
key. Routes are in api/routes/ (one router per resource), authentication
and the node dependency in api/deps.py, the error mapping in api/errors.py.

The node is the app's state, not captured by the routes, so the app can be
built without one to write its OpenAPI document (`python -m api.openapi`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute

from . import errors
from .node import Node
from .routes import ROUTERS

TITLE = "Strata node API"
DESCRIPTION = "E2B-compatible sandbox lifecycle plus Strata's images, snapshots, templates and cache."


@asynccontextmanager
async def _lifespan(_app: FastAPI) -> AsyncIterator[None]:
    # Lifecycle calls block in the VMM layer for seconds; with anyio's default
    # 40 worker threads the 41st concurrent client would wait for a thread, not
    # for its VM. A waiting client costs a thread, nothing more.
    anyio.to_thread.current_default_thread_limiter().total_tokens = 512
    yield


async def _timing(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Request latency by route template (not raw path: ids would explode the label set)."""
    started = time.monotonic()
    response = await call_next(request)
    route = request.scope.get("route")
    path = route.path if isinstance(route, APIRoute) else "other"
    request.app.state.node.metrics.requests.labels(request.method, path, str(response.status_code)).observe(
        time.monotonic() - started)
    return response


def create_app(node: Node | None = None) -> FastAPI:
    """The API of `node`; without one, an app good only for its OpenAPI document."""
    app = FastAPI(lifespan=_lifespan, title=TITLE, version="1.0", description=DESCRIPTION,
                  responses=errors.DOCUMENTED, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.node = node
    errors.install(app)
    app.middleware("http")(_timing)
    for router in ROUTERS:
        app.include_router(router)
    return app
