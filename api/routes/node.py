"""The node itself: health (open to all; with E2b-Sandbox-Id, that sandbox's), metrics, the API's own description, cache statistics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from layerstore.errors import StrataError

from .. import models as m
from ..connect import ConnectError
from ..deps import ADMIN, AUTH, KEY_HEADER, NodeDep
from ..errors import error_response
from ..node import Node
from ..teams import caller_of

router = APIRouter(tags=["node"])
cache_router = APIRouter(tags=["cache"], dependencies=AUTH)


@router.get("/openapi.json", dependencies=AUTH, include_in_schema=False)
def openapi(request: Request) -> dict:
    """Served with a key only: the document lists every operation the node has."""
    return request.app.openapi()


@router.get("/health", response_model=m.Health, responses={503: {"model": m.Health}},
            description="Open to all; without a valid X-API-Key only `status` is shown (not what the node serves).")
def health(request: Request, node: NodeDep, key: str | None = Depends(KEY_HEADER)) -> Response:
    sid = request.headers.get("e2b-sandbox-id")
    if sid:  # envd's health on the data plane (the SDK's is_running): 204 running, 502 anything else
        return sandbox_health(node, sid, request.headers.get("x-access-token"))
    caller = caller_of(key, node.config)
    body = node.health(caller) if caller is not None else node.health()
    shown = body.model_dump(mode="json") if caller is not None else {"status": body.status}
    return JSONResponse(shown, status_code=200 if body.mount else 503)


def sandbox_health(node: Node, sid: str, token: str | None) -> Response:
    """204 if the sandbox runs and `token` is its access token; otherwise
    502, as E2B's proxy answers for a sandbox that is gone, and the same
    for an unknown id and a wrong token (nobody learns which ids exist)."""
    try:
        node.access.data_plane(sid, token=token, key=None, user="").agent_of()
    except (ConnectError, StrataError):
        return error_response(502, f"sandbox {sid!r} is not running")
    return Response(status_code=204)


@router.get("/metrics", dependencies=ADMIN, response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(node: NodeDep) -> Response:
    """Admin keys only: the node's series name every team's sandboxes."""
    return Response(node.metrics.render(), media_type="text/plain; version=0.0.4")


@cache_router.get("/cache", response_model=m.CacheStats)
def cache_stats(node: NodeDep) -> m.CacheStats:
    return node.cache_summary()
