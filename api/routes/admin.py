"""Operators only (an admin key): the chunk cache, GC, push/pull to the
remote store, and every sandbox record including the warm pool."""

from __future__ import annotations

from fastapi import APIRouter

from layerstore.config import parse_duration
from layerstore.errors import InvalidInput
from layerstore.gc import GcReport
from layerstore.refs import parse_ref
from layerstore.transfer import TransferResult

from .. import models as m
from ..deps import ADMIN, NodeDep

router = APIRouter(tags=["admin"], dependencies=ADMIN)


def _grace(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise InvalidInput(f"grace: {exc}") from None


@router.post("/admin/cache/drop", summary="Evict every unpinned chunk")
def cache_drop(node: NodeDep) -> dict:
    return node.cache_drop()


@router.post("/admin/cache/pin", summary="Fetch an image's chunks into the cache and keep them there")
def cache_pin(body: m.PinRequest, node: NodeDep) -> dict:
    return node.pin(str(parse_ref(body.image)))


@router.post("/admin/cache/unpin")
def cache_unpin(body: m.PinRequest, node: NodeDep) -> dict:
    return node.unpin(str(parse_ref(body.image)))


@router.post("/admin/gc", response_model=GcReport,
             summary="Garbage-collect this node's store or its remote (grace period, two phases, leases)")
def run_gc(body: m.GcRequest, node: NodeDep) -> dict:
    return node.maintenance.gc(grace=_grace(body.grace), dry_run=body.dryRun, remote=body.target == "remote",
                               forget_nodes=body.forgetNodes, allow_missing=body.allowMissing)


@router.post("/admin/push", response_model=TransferResult,
             summary="Copy an image, snapshot or template (and all it needs) to the node's remote store")
def push(body: m.TransferRequest, node: NodeDep) -> dict:
    return node.maintenance.push(body.name)


@router.post("/admin/pull", response_model=TransferResult,
             summary="Fetch an image, snapshot or template from the node's remote store")
def pull(body: m.TransferRequest, node: NodeDep) -> dict:
    return node.maintenance.pull(body.name, full=body.full)


@router.get("/admin/sandboxes", summary="Every sandbox record on the node, warm pool included")
def all_records(node: NodeDep) -> list[dict]:
    return node.all_records()
