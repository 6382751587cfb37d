"""Images: raw disk images imported into the store under NAME:TAG refs.
Names starting with `strata-` are the node's own: a team's PUT or DELETE of
one is 400 (api/catalog.py `writable_ref`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from .. import models as m
from ..catalog import writable_ref
from ..deps import AUTH, CallerDep, NodeDep

router = APIRouter(tags=["images"], dependencies=AUTH)
RAW_BODY = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.get("/images", response_model=list[m.ImageInfo])
def list_images(node: NodeDep, caller: CallerDep) -> list[m.ImageInfo]:
    return node.catalog.images(caller)


@router.get("/images/{ref}", response_model=m.ImageDetail)
def get_image(ref: str, node: NodeDep, caller: CallerDep) -> m.ImageDetail:
    return node.catalog.image(caller, ref)


@router.delete("/images/{ref}", status_code=204, summary="Remove an image ref (data stays until GC)")
def delete_image(ref: str, node: NodeDep, caller: CallerDep) -> Response:
    node.catalog.delete_image(caller, ref)
    return Response(status_code=204)


@router.put("/images/{ref}", status_code=201, response_model=m.ImportResult,
            summary="Import a raw image, streamed (Content-Type: application/octet-stream)", openapi_extra=RAW_BODY)
async def import_raw(ref: str, request: Request, node: NodeDep, caller: CallerDep) -> m.ImportResult:
    name = writable_ref(caller, ref)  # 400 on a bad or reserved name, before any byte is read
    return await node.catalog.import_stream(caller, name, request.stream(), declared=request.headers.get("content-length"))
