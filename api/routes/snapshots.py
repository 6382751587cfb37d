"""Snapshots: taking one of a sandbox (E2B's POST /sandboxes/{id}/snapshots),
listing (E2B's GET /snapshots), and Strata's inspect and delete."""

from __future__ import annotations

from fastapi import APIRouter, Response

from .. import models as m
from ..deps import AUTH, CallerDep, NodeDep, vmm_timing

router = APIRouter(tags=["snapshots"], dependencies=AUTH)


@router.post("/sandboxes/{sandboxID}/snapshots", status_code=201, response_model=m.SnapshotInfo)
def snapshot(sandboxID: str, response: Response, node: NodeDep, caller: CallerDep,
             body: m.SandboxSnapshotRequest | None = None) -> m.SnapshotInfo:
    with vmm_timing(node, response):
        snapshot_id, names = node.lifecycle.snapshot(caller, sandboxID, body.name if body else None)
    return m.SnapshotInfo(snapshotID=snapshot_id, names=names)


@router.get("/snapshots", response_model=list[m.SnapshotInfo])
def list_snapshots(node: NodeDep, caller: CallerDep, sandboxID: str | None = None,
                   name: str | None = None) -> list[m.SnapshotInfo]:
    return node.catalog.snapshots(caller, sandbox=sandboxID, name=name)


@router.get("/snapshots/{snapshotID}", response_model=m.SnapshotDetail)
def inspect_snapshot(snapshotID: str, node: NodeDep, caller: CallerDep) -> m.SnapshotDetail:
    return node.catalog.snapshot(caller, snapshotID)


@router.delete("/snapshots/{snapshotID}", status_code=204,
               summary="Delete a snapshot manifest (409 while a template or paused sandbox needs it)")
def delete_snapshot(snapshotID: str, node: NodeDep, caller: CallerDep) -> Response:
    node.catalog.delete_snapshot(caller, snapshotID)
    return Response(status_code=204)
