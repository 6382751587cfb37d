"""What other nodes ask this one for: chunk objects, before they go to the remote store.

Only for an admin key (a peer presents STRATA_PEER_KEY, an admin key of
the nodes it asks): a chunk is anyone's data, and a team's key that could
fetch any digest would read every team's files whose digests it learns."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..deps import ADMIN, NodeDep

router = APIRouter(tags=["peers"], dependencies=ADMIN)
CHUNK = {200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.get("/chunks/{digest}", response_class=Response, responses=CHUNK,
            summary="A stored chunk object (zstd frame) for a peer node; it verifies the digest itself")
def get_chunk(digest: str, node: NodeDep) -> Response:
    return Response(node.catalog.chunk(digest), media_type="application/octet-stream")
