"""E2B's template build routes (the SDK's `Template.build`): request a build,
upload COPY files, start it, poll its status and logs. What a build does is
api/builds.py's."""

from __future__ import annotations

import re

import anyio
from fastapi import APIRouter, Query, Request, Response

from layerstore.errors import InvalidInput

from .. import models as m
from ..deps import AUTH, CallerDep, NodeDep
from ..uploads import staged

router = APIRouter(tags=["templates"], dependencies=AUTH)
uploads = APIRouter(include_in_schema=False)  # the SDK PUTs files without an API key: a signed URL instead
UPLOAD_PATH = re.compile(r"^/templates/[^/]+/files/[0-9a-f]{64}$")
MAX_FILES_UPLOAD = 16 << 30


def is_upload(method: str, path: str) -> bool:
    return method == "PUT" and bool(UPLOAD_PATH.match(path))


@router.post("/v3/templates", status_code=202, response_model=m.TemplateRequestResponseV3,
             summary="Start a template build (then upload its files and POST its steps)")
def request_build(body: m.TemplateBuildRequestV3, node: NodeDep, caller: CallerDep) -> m.TemplateRequestResponseV3:
    name = body.name or body.alias
    if not name:
        raise InvalidInput("name is required")
    build = node.builds.request(caller, name)
    return m.TemplateRequestResponseV3(templateID=build.name, buildID=build.build_id, names=[build.name],
                                       tags=body.tags or [], aliases=[build.name])


@router.get("/templates/{templateID}/files/{hash}", status_code=201, response_model=m.TemplateBuildFileUpload,
            summary="Where to upload a COPY step's files (present: already here)")
def upload_link(templateID: str, hash: str, request: Request, node: NodeDep,
                caller: CallerDep) -> m.TemplateBuildFileUpload:
    grant = node.builds.upload_grant(caller, templateID, hash)
    if node.builds.upload_path(caller.team, hash).exists():
        return m.TemplateBuildFileUpload(present=True)
    url = request.url_for("upload_files", templateID=templateID, hash=hash).include_query_params(**grant)
    return m.TemplateBuildFileUpload(present=False, url=str(url))


@uploads.put("/templates/{templateID}/files/{hash}")
async def upload_files(templateID: str, hash: str, request: Request, node: NodeDep, team: str = Query(""),
                       expires: str = Query(""), token: str = Query("")) -> Response:
    dest = node.builds.check_grant(templateID, hash, team=team, expires=expires, token=token)  # before any byte
    limit = min(MAX_FILES_UPLOAD, node.builds.files_room(team))
    async with staged(request.stream(), directory=node.builds.files, limit=limit,
                      declared=request.headers.get("content-length")) as tar:
        await anyio.to_thread.run_sync(node.builds.keep_upload, tar, dest)
    return Response(status_code=200)


@router.post("/v2/templates/{templateID}/builds/{buildID}", status_code=202,
             summary="Start the build's steps: boot, RUN/ENV/WORKDIR/USER/COPY, start/ready command, snapshot")
def start_build(templateID: str, buildID: str, body: m.TemplateBuildStartV2, node: NodeDep,
                caller: CallerDep) -> Response:
    node.builds.start(caller, templateID, buildID, body.model_dump())
    return Response(status_code=202)


@router.get("/templates/{templateID}/builds/{buildID}/status", response_model=m.TemplateBuildInfo,
            response_model_exclude_none=True)  # E2B's clients parse a null reason as a reason
def build_status(templateID: str, buildID: str, node: NodeDep, caller: CallerDep,
                 logsOffset: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=1000)) -> m.TemplateBuildInfo:
    b = node.builds.get(caller, templateID, buildID)
    entries = b.logs[logsOffset:logsOffset + limit]
    return m.TemplateBuildInfo(
        templateID=b.name, buildID=b.build_id, status=b.status,  # type: ignore[arg-type]
        logs=[e.message for e in entries],
        logEntries=[m.BuildLogEntry(timestamp=m.timestamp(e.t), level=e.level, message=e.message)  # type: ignore[arg-type]
                    for e in entries],
        reason=m.BuildStatusReason(message=b.reason, step=b.step or None) if b.reason else None)
