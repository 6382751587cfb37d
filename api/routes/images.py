"""Images: raw disk images imported into the store under NAME:TAG refs."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from layerstore.refs import parse_ref

from .. import models as m
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
    name = str(parse_ref(ref))  # 400 on a bad name, before any byte is read
    return await node.catalog.import_stream(caller, name, request.stream(), declared=request.headers.get("content-length"))
