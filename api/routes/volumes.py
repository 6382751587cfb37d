"""Volumes (E2B's `Volume` SDK): `/volumes` with an API key, and the content
API `/volumecontent/{id}/...` with the volume's bearer token (what each
does: api/volumes.py). A content request is admitted like other work of
the volume's team: file bodies as long work, the rest as short requests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from layerstore.config import DEFAULT_TEAM
from layerstore.volumes import Volume

from .. import models as m
from ..deps import AUTH, CallerDep, LimitsDep, NodeDep
from ..limits import LeasedStream

router = APIRouter(tags=["volumes"], dependencies=AUTH)
content = APIRouter(tags=["volumes"], responses={414: {"model": m.Error, "description": "a path so long the "
                                                                                       "request target is past 8 KiB"}})
CONTENT_PREFIX = "/volumecontent/"
T = TypeVar("T")
RAW_BODY = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


def is_volume_content(path: str) -> bool:
    """Paths that authenticate with a volume's token instead of an API key."""
    return path.startswith(CONTENT_PREFIX)


@router.get("/volumes", response_model=list[m.Volume])
def list_volumes(node: NodeDep, caller: CallerDep) -> list[m.Volume]:
    return node.volumes.list(caller)


@router.post("/volumes", status_code=201, response_model=m.VolumeAndToken)
def create_volume(body: m.NewVolume, node: NodeDep, caller: CallerDep) -> m.VolumeAndToken:
    return node.volumes.create(caller, body.name, from_snapshot=body.fromSnapshot)


@router.post("/volumes/{volumeID}/snapshots", status_code=201, response_model=m.VolumeSnapshot,
             summary="Strata: keep the volume as it is now (POST /volumes with fromSnapshot starts a new one from it)")
def snapshot_volume(volumeID: str, node: NodeDep, caller: CallerDep) -> m.VolumeSnapshot:
    return node.volumes.snapshot(caller, volumeID)


@router.get("/volumes/{volumeID}/snapshots", response_model=list[m.VolumeSnapshot],
            summary="Strata: the volume's snapshots, oldest first")
def volume_snapshots(volumeID: str, node: NodeDep, caller: CallerDep) -> list[m.VolumeSnapshot]:
    return node.volumes.snapshots(caller, volumeID)


@router.delete("/volume-snapshots/{snapshotID}", status_code=204,
               summary="Strata: delete a volume snapshot (its files' data stays while anything else names it)")
def delete_volume_snapshot(snapshotID: str, node: NodeDep, caller: CallerDep) -> Response:
    node.volumes.delete_snapshot(caller, snapshotID)
    return Response(status_code=204)


@router.get("/volumes/{volumeID}", response_model=m.VolumeAndToken)
def get_volume(volumeID: str, node: NodeDep, caller: CallerDep) -> m.VolumeAndToken:
    return node.volumes.get(caller, volumeID)


@router.delete("/volumes/{volumeID}", status_code=204)
def destroy_volume(volumeID: str, node: NodeDep, caller: CallerDep) -> Response:
    node.volumes.destroy(caller, volumeID)
    return Response(status_code=204)


# content: the volume's bearer token --------------------------------------------------------------
async def authorized(volumeID: str, node: NodeDep,
                     authorization: Annotated[str | None, Header(description="Bearer <the volume's token>")] = None
                     ) -> Volume:
    return await run_in_threadpool(node.volumes.authorized, volumeID, authorization)


VolumeDep = Annotated[Volume, Depends(authorized)]
PathQuery = Annotated[str, Query(max_length=4096, description="a path in the volume ('/' is its root)")]
Owner = Annotated[int | None, Query(ge=0, le=2**31)]
Mode = Annotated[int | None, Query(ge=0, le=0o7777)]


async def _short(limits: LimitsDep, volume: Volume, fn: Callable[[], T]) -> T:
    async with limits.short(volume.owner or DEFAULT_TEAM):
        return await run_in_threadpool(fn)


@content.get("/volumecontent/{volumeID}/path", response_model=m.VolumeEntryStat, response_model_exclude_none=True)
async def stat(volume: VolumeDep, path: PathQuery, node: NodeDep, limits: LimitsDep) -> m.VolumeEntryStat:
    return await _short(limits, volume, lambda: node.volumes.stat(volume, path))


@content.get("/volumecontent/{volumeID}/dir", response_model=list[m.VolumeEntryStat],
             response_model_exclude_none=True)
async def list_dir(volume: VolumeDep, path: PathQuery, node: NodeDep, limits: LimitsDep,
                   depth: Annotated[int, Query(ge=1, le=64)] = 1) -> list[m.VolumeEntryStat]:
    return await _short(limits, volume, lambda: node.volumes.list_dir(volume, path, depth))


@content.post("/volumecontent/{volumeID}/dir", status_code=201, response_model=m.VolumeEntryStat,
              response_model_exclude_none=True)
async def make_dir(volume: VolumeDep, path: PathQuery, node: NodeDep, limits: LimitsDep, uid: Owner = None,
                   gid: Owner = None, mode: Mode = None, force: bool = False) -> m.VolumeEntryStat:
    return await _short(limits, volume, lambda: node.volumes.make_dir(volume, path, uid=uid, gid=gid, mode=mode,
                                                                      force=force))


@content.delete("/volumecontent/{volumeID}/path", status_code=204)
async def remove(volume: VolumeDep, path: PathQuery, node: NodeDep, limits: LimitsDep) -> Response:
    await _short(limits, volume, lambda: node.volumes.remove(volume, path))
    return Response(status_code=204)


@content.patch("/volumecontent/{volumeID}/path", response_model=m.VolumeEntryStat, response_model_exclude_none=True)
async def set_metadata(volume: VolumeDep, path: PathQuery, body: m.VolumeMetadata, node: NodeDep,
                       limits: LimitsDep) -> m.VolumeEntryStat:
    return await _short(limits, volume, lambda: node.volumes.set_metadata(volume, path, body))


@content.get("/volumecontent/{volumeID}/file", response_class=Response,
             responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}})
async def read_file(volume: VolumeDep, path: PathQuery, node: NodeDep, limits: LimitsDep) -> Response:
    lease = limits.admit(volume.owner or DEFAULT_TEAM)
    try:
        blocks = await limits.run(node.volumes.read, volume, path)
    except BaseException:
        lease.release()
        raise
    return LeasedStream(blocks, limits=limits, lease=lease, media_type="application/octet-stream")


@content.put("/volumecontent/{volumeID}/file", status_code=201, response_model=m.VolumeEntryStat,
             response_model_exclude_none=True, openapi_extra=RAW_BODY)
async def write_file(volume: VolumeDep, path: PathQuery, request: Request, node: NodeDep, limits: LimitsDep,
                     uid: Owner = None, gid: Owner = None, mode: Mode = None, force: bool = False
                     ) -> m.VolumeEntryStat:
    with limits.admit(volume.owner or DEFAULT_TEAM):
        body: AsyncIterator[bytes] = request.stream()
        return await node.volumes.write(volume, path, body, declared=request.headers.get("content-length"),
                                        uid=uid, gid=gid, mode=mode, force=force)


