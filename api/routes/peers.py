"""What other nodes ask this one for: chunk objects, before they go to the remote store."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..deps import AUTH, NodeDep

router = APIRouter(tags=["peers"], dependencies=AUTH)
CHUNK = {200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.get("/chunks/{digest}", response_class=Response, responses=CHUNK,
            summary="A stored chunk object (zstd frame) for a peer node; it verifies the digest itself")
def get_chunk(digest: str, node: NodeDep) -> Response:
    return Response(node.catalog.chunk(digest), media_type="application/octet-stream")
