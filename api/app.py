"""The HTTP layer: translate requests into `Node` actions, nothing more.

Paths, bodies and status codes of the sandbox endpoints are E2B's (see
api/models.py); Strata's own endpoints cover images, snapshots, templates,
the cache and exec. Every route except /health needs `X-API-Key`; /admin/*
needs an admin key. Errors are `{"code", "message"}` with:

    StrataError class        status          meaning
    NotFound                 404             unknown id, ref, template
    InvalidInput, bad body   400             nothing was changed
    Conflict, MissingChunk   409             wrong state / snapshot incomplete
    Capacity                 429             node full (Should-Retry: false)
    BackendUnavailable       503             object store down (Should-Retry: false)
    other StrataError        500             e.g. the VMM failed; message says why
"""

from __future__ import annotations

import base64
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
import hmac
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import unquote_plus

import anyio
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader
from starlette.exceptions import HTTPException

from layerstore.errors import (AccessDenied, BackendUnavailable, Conflict, InvalidInput, MissingChunk, NotFound,
                               StrataError)
from layerstore.chunk import chunk_key
from layerstore.config import parse_duration
from layerstore.gc import GcReport, collect
from layerstore.importer import import_image
from layerstore.refs import parse_ref
from layerstore.store import inspect_image
from layerstore.templates import new_template
from layerstore.transfer import TransferResult, copy
from vmm.registry import SandboxRecord

from . import models as m
from .node import Capacity, Node

STATUS = ((NotFound, 404), (InvalidInput, 400), (Conflict, 409), (MissingChunk, 409), (Capacity, 429),
          (BackendUnavailable, 503), (AccessDenied, 502))
ERRORS = {code: {"model": m.Error} for code in (400, 401, 403, 404, 409, 413, 429, 500, 503)}
UPLOAD_BLOCK = 1 << 20


def _iso(ts: float | None) -> datetime:
    return datetime.fromtimestamp(ts or 0.0, tz=timezone.utc)


def _e2b_state(record: SandboxRecord) -> str:
    return "paused" if record.state == "suspended" else "running"


def _sandbox(record: SandboxRecord) -> m.Sandbox:
    return m.Sandbox(templateID=record.template or record.source, sandboxID=record.sid)


def _listed(record: SandboxRecord, disk_mb: int) -> dict:
    return dict(templateID=record.template or record.source, sandboxID=record.sid, startedAt=_iso(record.created),
                endAt=_iso(record.end_at), cpuCount=1, memoryMB=record.memory_mib, diskSizeMB=disk_mb,
                state=_e2b_state(record), metadata=record.metadata)


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """E2B's metadata query: `k=v&k2=v2`, URL-encoded once more by the SDK."""
    if not raw:
        return {}
    out = {}
    for pair in unquote_plus(raw).split("&"):
        parts = pair.split("=")
        if len(parts) != 2:
            raise InvalidInput(f"metadata filter {raw!r} is not key=value pairs joined by '&'")
        out[unquote_plus(parts[0])] = unquote_plus(parts[1])
    return out


@asynccontextmanager
async def _lifespan(_app: FastAPI) -> AsyncIterator[None]:
    # Lifecycle calls block in the VMM layer for seconds; with anyio's default
    # 40 worker threads the 41st concurrent client would wait for a thread, not
    # for its VM. A waiting client costs a thread, nothing more.
    anyio.to_thread.current_default_thread_limiter().total_tokens = 512
    yield


def create_app(node: Node) -> FastAPI:
    config = node.config
    app = FastAPI(lifespan=_lifespan, title="Strata node API", version="1.0",
                  description="E2B-compatible sandbox lifecycle plus Strata's images, snapshots, templates and cache.",
                  responses=ERRORS, openapi_url=None, docs_url=None, redoc_url=None)
    key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="an API key (STRATA_API_KEYS)")

    def _match(given: str | None, keys: tuple[str, ...]) -> bool:
        # compare against every key, constant-time each, so timing reveals nothing
        ok = False
        for key in keys:
            ok |= hmac.compare_digest((given or "").encode(), key.encode())
        return ok and bool(given)

    def api_key(key: str | None = Depends(key_header)) -> None:
        if not _match(key, config.api_keys):
            raise HTTPException(401, "missing or invalid X-API-Key")

    def admin_key(key: str | None = Depends(key_header)) -> None:
        if not _match(key, config.admin_keys):
            raise HTTPException(401 if not _match(key, config.api_keys) else 403, "an admin key is required")

    def disk_mb(record: SandboxRecord) -> int:
        return 0 if record.state == "suspended" else _disk_mb(record)

    def _disk_mb(record: SandboxRecord) -> int:
        try:
            return os.stat(node.boxes.mount / "sandboxes" / record.sid / "disk.img").st_size >> 20
        except OSError:
            return 0

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)

    @app.exception_handler(StrataError)
    async def strata_error(_request: Request, exc: StrataError) -> JSONResponse:
        node.metrics.error(exc)
        status = next((code for cls, code in STATUS if isinstance(exc, cls)), 500)
        return error(status, str(exc), {"Should-Retry": "false"} if status in (429, 503) else None)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed')}")

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.middleware("http")
    async def timing(request: Request, call_next):  # noqa: ANN001, ANN202
        started = time.monotonic()
        response = await call_next(request)
        route = request.scope.get("route")
        path = route.path if isinstance(route, APIRoute) else "other"
        node.metrics.requests.labels(request.method, path, str(response.status_code)).observe(
            time.monotonic() - started)
        return response

    def vmm_timing(response: Response) -> None:
        # the share of this request spent in the VMM layer, for clients and the benchmark
        response.headers["Server-Timing"] = f"vmm;dur={node.take_vmm_seconds() * 1e3:.2f}"

    auth = [Depends(api_key)]
    admin = [Depends(admin_key)]

    # --- health, metrics, the API's own description ------------------------------------
    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    def openapi() -> dict:
        return app.openapi()

    @app.get("/health", response_model=m.Health, tags=["node"], responses={503: {"model": m.Health}})
    def health() -> JSONResponse:
        try:
            node.boxes.control({"op": "ping"})
            mounted = True
        except StrataError:
            mounted = False
        body = m.Health(status="ok" if mounted else "degraded", store=node.store.describe(), mount=mounted,
                        sandboxes=len(node.records()))
        return JSONResponse(body.model_dump(), status_code=200 if mounted else 503)

    @app.get("/metrics", dependencies=auth, tags=["node"], response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        return Response(node.metrics.render(), media_type="text/plain; version=0.0.4")

    # --- E2B sandbox lifecycle ---------------------------------------------------------
    def create(body: m.NewSandbox, response: Response) -> m.Sandbox:
        node.take_vmm_seconds()  # drop what a failed request left on this thread
        record = node.create(body.templateID, timeout=body.timeout, auto_pause=body.autoPause,
                             metadata=body.metadata)
        vmm_timing(response)
        return _sandbox(record)

    for path in ("/sandboxes", "/v2/sandboxes"):
        app.post(path, status_code=201, response_model=m.Sandbox, dependencies=auth, tags=["sandboxes"],
                 operation_id=f"create_sandbox{'_v2' if 'v2' in path else ''}",
                 summary="Create a sandbox from a template (named image or snapshot) or an image NAME:TAG")(create)

    @app.get("/sandboxes", response_model=list[m.ListedSandbox], dependencies=auth, tags=["sandboxes"])
    def list_running(metadata: str | None = Query(None, description="k=v&k2=v2 (URL-encoded)")) -> list[dict]:
        wanted = _metadata_filter(metadata)
        return [_listed(r, disk_mb(r)) for r in node.records()
                if _e2b_state(r) == "running" and wanted.items() <= r.metadata.items()]

    @app.get("/v2/sandboxes", response_model=list[m.ListedSandbox], dependencies=auth, tags=["sandboxes"],
             responses={200: {"headers": {"X-Next-Token": {"schema": {"type": "string"},
                                                           "description": "cursor of the next page, if any"}}}})
    def list_v2(response: Response,
                metadata: str | None = Query(None, description="k=v&k2=v2 (URL-encoded)"),
                state: str | None = Query(None, description="running,paused (default both)"),
                limit: int = Query(100, ge=1, le=100),
                nextToken: str | None = Query(None),
                order: str = Query("desc", pattern="^(asc|desc)$")) -> list[dict]:
        wanted = _metadata_filter(metadata)
        states = {s for s in (state or "running,paused").split(",") if s}
        if not states <= {"running", "paused"}:
            raise InvalidInput(f"state {state!r}: use running, paused or both")
        rows = [r for r in node.records() if _e2b_state(r) in states and wanted.items() <= r.metadata.items()]
        rows.sort(key=lambda r: (r.created, r.sid), reverse=order == "desc")
        if nextToken:
            try:
                after = base64.urlsafe_b64decode(nextToken.encode()).decode()
            except (ValueError, UnicodeDecodeError):
                raise InvalidInput("nextToken is not a token this node issued") from None
            keys = [f"{r.created!r}|{r.sid}" for r in rows]
            rows = rows[keys.index(after) + 1:] if after in keys else []
        page = rows[:limit]
        if len(rows) > limit:
            last = page[-1]
            response.headers["X-Next-Token"] = base64.urlsafe_b64encode(f"{last.created!r}|{last.sid}".encode()).decode()
        return [_listed(r, disk_mb(r)) for r in page]

    @app.get("/sandboxes/{sandboxID}", response_model=m.SandboxDetail, dependencies=auth, tags=["sandboxes"])
    def get_sandbox(sandboxID: str) -> dict:
        record = node.record(sandboxID)
        return {**_listed(record, disk_mb(record)),
                "lifecycle": {"autoResume": False, "onTimeout": "pause" if record.auto_pause else "kill"}}

    @app.delete("/sandboxes/{sandboxID}", status_code=204, dependencies=auth, tags=["sandboxes"])
    def kill_sandbox(sandboxID: str) -> Response:
        node.take_vmm_seconds()  # drop what a failed request left on this thread
        node.kill(sandboxID)
        response = Response(status_code=204)
        vmm_timing(response)
        return response

    @app.post("/sandboxes/{sandboxID}/pause", status_code=204, dependencies=auth, tags=["sandboxes"],
              summary="Snapshot the sandbox to the store and free its VM (409 if already paused)")
    def pause_sandbox(sandboxID: str, body: m.SandboxPauseRequest | None = None) -> Response:
        node.take_vmm_seconds()  # drop what a failed request left on this thread
        node.pause(sandboxID)
        response = Response(status_code=204)
        vmm_timing(response)
        return response

    @app.post("/sandboxes/{sandboxID}/resume", status_code=201, response_model=m.Sandbox, dependencies=auth,
              tags=["sandboxes"], summary="Resume a paused sandbox (409 if running)")
    def resume_sandbox(sandboxID: str, response: Response, body: m.ResumedSandbox | None = None) -> m.Sandbox:
        node.take_vmm_seconds()  # drop what a failed request left on this thread
        record = node.resume(sandboxID, body.timeout if body else None)
        vmm_timing(response)
        return _sandbox(record)

    def connect(sandboxID: str, response: Response, body: m.ConnectSandbox | None = None) -> m.Sandbox:
        node.take_vmm_seconds()  # drop what a failed request left on this thread
        record, resumed = node.connect(sandboxID, body.timeout if body else None)
        response.status_code = 201 if resumed else 200
        vmm_timing(response)
        return _sandbox(record)

    for path in ("/sandboxes/{sandboxID}/connect", "/v2/sandboxes/{sandboxID}/connect"):
        app.post(path, response_model=m.Sandbox, dependencies=auth, tags=["sandboxes"],
                 operation_id=f"connect_sandbox{'_v2' if 'v2' in path else ''}",
                 responses={201: {"model": m.Sandbox, "description": "the sandbox was paused and is resumed"}},
                 summary="200 if running (TTL extended), 201 if it was paused and is resumed")(connect)

    @app.post("/sandboxes/{sandboxID}/timeout", status_code=204, dependencies=auth, tags=["sandboxes"])
    def set_timeout(sandboxID: str, body: m.SandboxTimeoutRequest) -> Response:
        node.set_timeout(sandboxID, body.timeout)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandboxID}/refreshes", status_code=204, dependencies=auth, tags=["sandboxes"])
    def refresh(sandboxID: str, body: m.SandboxRefreshRequest | None = None) -> Response:
        node.refresh(sandboxID, body.duration if body else None)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandboxID}/fork", status_code=201, response_model=list[m.SandboxForkResult],
              dependencies=auth, tags=["sandboxes"],
              summary="Snapshot once, start `count` independent copies (the source keeps running)")
    def fork(sandboxID: str, body: m.SandboxForkRequest, response: Response) -> list[m.SandboxForkResult]:
        node.take_vmm_seconds()  # drop what a failed request left on this thread
        records = node.fork(sandboxID, body.count, body.timeout)
        vmm_timing(response)
        return [m.SandboxForkResult(sandbox=_sandbox(r)) for r in records]

    @app.post("/sandboxes/{sandboxID}/snapshots", status_code=201, response_model=m.SnapshotInfo,
              dependencies=auth, tags=["snapshots"])
    def snapshot(sandboxID: str, response: Response, body: m.SandboxSnapshotRequest | None = None) -> m.SnapshotInfo:
        node.take_vmm_seconds()  # drop what a failed request left on this thread
        snapshot_id, names = node.snapshot(sandboxID, body.name if body else None)
        vmm_timing(response)
        return m.SnapshotInfo(snapshotID=snapshot_id, names=names)

    @app.post("/sandboxes/{sandboxID}/exec", response_model=m.ExecResult, dependencies=auth, tags=["sandboxes"],
              summary="Strata: run a shell command in the sandbox through its agent")
    def exec_command(sandboxID: str, body: m.ExecRequest) -> m.ExecResult:
        result = node.exec(sandboxID, body.command, body.timeout)
        return m.ExecResult(exitCode=result.exit_code, output=result.output)

    # --- snapshots & templates ------------------------------------------------------------
    @app.get("/snapshots", response_model=list[m.SnapshotInfo], dependencies=auth, tags=["snapshots"])
    def list_snapshots(sandboxID: str | None = None, name: str | None = None) -> list[m.SnapshotInfo]:
        names: dict[str, list[str]] = {}
        for template in node.store.list_templates():
            if template.kind == "snapshot":
                names.setdefault(template.target, []).append(template.name)
        out = []
        for snapshot_id in node.store.list_snapshots():
            if name is not None and name not in names.get(snapshot_id, []):
                continue
            if sandboxID is not None:
                try:
                    if node.store.get_snapshot(snapshot_id).annotations.get("sandbox") != sandboxID:
                        continue
                except StrataError:
                    continue
            out.append(m.SnapshotInfo(snapshotID=snapshot_id, names=names.get(snapshot_id, [])))
        return out

    @app.get("/snapshots/{snapshotID}", response_model=m.SnapshotDetail, dependencies=auth, tags=["snapshots"])
    def inspect_snapshot(snapshotID: str) -> m.SnapshotDetail:
        snap = node.store.get_snapshot(_snapshot_id(snapshotID))
        parents, parent = [], snap.parent
        while parent and len(parents) < 1000:
            parents.append(parent)
            try:
                parent = node.store.get_snapshot(parent).parent
            except NotFound:
                break
        layers, all_digests = [], set()
        for role, layer_id in sorted(snap.layers.items()):
            layer, chunk_map = node.store.chunk_map(layer_id)
            digests = set(chunk_map.values())
            all_digests |= digests
            layers.append(m.SnapshotLayer(role=role, manifest=layer_id, size=layer.size,
                                          stored_bytes=sum(node.store.stored_sizes(digests).values())))
        users = node.snapshots_in_use().get(snapshotID, [])
        return m.SnapshotDetail(snapshotID=snapshotID, parents=parents, layers=layers,
                                stored_bytes=sum(node.store.stored_sizes(all_digests).values()),
                                vm=dict(snap.vm), annotations=dict(snap.annotations),
                                templates=[u.split(" ", 1)[1] for u in users if u.startswith("template ")])

    def _snapshot_id(text: str) -> str:
        if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
            raise NotFound(f"snapshot {text!r} not found")
        return text

    @app.delete("/snapshots/{snapshotID}", status_code=204, dependencies=auth, tags=["snapshots"],
                summary="Delete a snapshot manifest (409 while a template or paused sandbox needs it)")
    def delete_snapshot(snapshotID: str) -> Response:
        node.store.get_snapshot(_snapshot_id(snapshotID))
        users = node.snapshots_in_use().get(snapshotID)
        if users:
            raise Conflict(f"snapshot {snapshotID} is still used by {', '.join(users)}")
        node.store.delete_snapshot(snapshotID)
        return Response(status_code=204)

    def _template(t) -> m.Template:  # noqa: ANN001
        return m.Template(templateID=t.name, buildID=t.target[:32] if t.kind == "snapshot" else t.target,
                          cpuCount=1, memoryMB=config.sandbox_memory, diskSizeMB=0, aliases=[t.name],
                          names=[t.name], createdAt=_iso(t.created), updatedAt=_iso(t.created), kind=t.kind,
                          target=t.target)

    @app.get("/templates", response_model=list[m.Template], dependencies=auth, tags=["templates"])
    def list_templates() -> list[m.Template]:
        return [_template(t) for t in node.store.list_templates()]

    @app.post("/templates", status_code=201, response_model=m.Template, dependencies=auth, tags=["templates"],
              summary="Strata: name an imported image or a snapshot as a template")
    def create_template(body: m.NewTemplate) -> m.Template:
        if (body.image is None) == (body.snapshot is None):
            raise InvalidInput("give exactly one of image (NAME:TAG) or snapshot (id)")
        template = new_template(body.name, "image" if body.image else "snapshot", body.image or body.snapshot or "")
        node.store.put_template(template)
        return _template(template)

    @app.delete("/templates/{templateID}", status_code=204, dependencies=auth, tags=["templates"])
    def delete_template(templateID: str) -> Response:
        try:
            node.store.delete_template(templateID)
        except InvalidInput:
            raise NotFound(f"template {templateID!r} not found") from None
        return Response(status_code=204)

    # --- images ---------------------------------------------------------------------
    def _ref(text: str) -> str:
        try:
            return str(parse_ref(text))
        except InvalidInput:
            raise NotFound(f"image {text!r} not found") from None

    @app.get("/images", response_model=list[m.ImageInfo], dependencies=auth, tags=["images"])
    def list_images() -> list[m.ImageInfo]:
        out = []
        for ref, manifest_id, updated in node.store.list_refs():
            try:
                size = node.store.get_layer(manifest_id).size
            except StrataError:
                size = None
            out.append(m.ImageInfo(ref=str(ref), manifest=manifest_id, size=size, updated=updated))
        return out

    @app.get("/images/{ref}", response_model=m.ImageDetail, dependencies=auth, tags=["images"])
    def get_image(ref: str) -> m.ImageDetail:
        info = inspect_image(node.store, _ref(ref))
        return m.ImageDetail(ref=info.ref, manifest=info.manifest_id, size=info.size, chunk_size=info.chunk_size,
                             layers=info.layers, data_chunks=info.data_chunks, hole_chunks=info.hole_chunks,
                             unique_chunks=info.unique_chunks, stored_bytes=info.stored_bytes,
                             missing_chunks=info.missing_chunks)

    @app.delete("/images/{ref}", status_code=204, dependencies=auth, tags=["images"],
                summary="Remove an image ref (data stays until GC)")
    def delete_image(ref: str) -> Response:
        node.store.delete_ref(_ref(ref))
        return Response(status_code=204)

    @app.put("/images/{ref}", status_code=201, response_model=m.ImportResult, dependencies=auth, tags=["images"],
             summary="Import a raw image, streamed (Content-Type: application/octet-stream)",
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def import_raw(ref: str, request: Request) -> m.ImportResult:
        name = str(parse_ref(ref))  # 400 on a bad name, before any byte is read
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_upload:
            raise HTTPException(413, f"image of {declared} bytes exceeds the {config.max_upload}-byte upload limit")
        uploads = Path(config.state_dir) / "uploads"
        uploads.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=uploads, prefix=".upload-")
        try:
            received = 0
            with os.fdopen(fd, "wb") as f:
                pending = bytearray()
                async for part in request.stream():
                    received += len(part)
                    if received > config.max_upload:
                        raise HTTPException(413, f"upload exceeds the {config.max_upload}-byte limit")
                    pending += part
                    if len(pending) >= UPLOAD_BLOCK:  # write in large blocks, off the event loop
                        await anyio.to_thread.run_sync(f.write, bytes(pending))
                        pending.clear()
                await anyio.to_thread.run_sync(f.write, bytes(pending))
            if received == 0:
                raise InvalidInput("empty upload: send the raw image as the request body")
            result = await anyio.to_thread.run_sync(lambda: import_image(node.store, tmp, name,
                                                                         annotations={"source": "api upload"}))
        finally:
            os.unlink(tmp)
        return m.ImportResult(ref=name, manifest=result.manifest_id, size=result.size, new_chunks=result.new_chunks,
                              new_stored_bytes=result.new_stored_bytes, seconds=round(result.seconds, 3))

    # --- chunks for peers -------------------------------------------------------------------------
    @app.get("/chunks/{digest}", dependencies=auth, tags=["peers"], response_class=Response,
             summary="A stored chunk object (zstd frame) for a peer node; it verifies the digest itself",
             responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                 "format": "binary"}}}}})
    def get_chunk(digest: str) -> Response:
        try:
            key = chunk_key(digest)
        except InvalidInput:
            raise NotFound(f"chunk {digest!r} not found") from None
        blob = node.store.backend.get(key)  # this node's own store only: peers fall back to the remote themselves
        return Response(blob, media_type="application/octet-stream")

    # --- cache (stats for everyone, control for admins) -------------------------------------------
    @app.get("/cache", response_model=m.CacheStats, dependencies=auth, tags=["cache"])
    def cache_stats() -> dict:
        reply = node.boxes.control({"op": "stats"})
        return {**reply["cache"], "memory_hits": reply["memory_hits"], "backend_fetches": reply["fetches"],
                "sources": reply.get("sources", {})}

    @app.post("/admin/cache/drop", dependencies=admin, tags=["admin"], summary="Evict every unpinned chunk")
    def cache_drop() -> dict:
        return node.boxes.control({"op": "cache_drop"})

    @app.post("/admin/cache/pin", dependencies=admin, tags=["admin"],
              summary="Fetch an image's chunks into the cache and keep them there")
    def cache_pin(body: m.PinRequest) -> dict:
        return node.boxes.control({"op": "pin", "image": str(parse_ref(body.image))})

    @app.post("/admin/cache/unpin", dependencies=admin, tags=["admin"])
    def cache_unpin(body: m.PinRequest) -> dict:
        return node.boxes.control({"op": "unpin", "image": str(parse_ref(body.image))})

    remote_lock = threading.Lock()  # one open of the remote's catalog at a time

    @contextmanager
    def _remote():  # noqa: ANN202
        if not config.remote:
            raise Conflict("this node has no remote store (config `remote`, STRATA_REMOTE)")
        from layerstore.store import open_store

        with remote_lock, open_store(config.remote, env={**os.environ, **config.env()}) as remote:
            yield remote

    @app.post("/admin/gc", response_model=GcReport, dependencies=admin, tags=["admin"],
              summary="Garbage-collect this node's store or its remote (grace period, two phases, leases)")
    def run_gc(body: m.GcRequest) -> dict:
        try:
            grace = parse_duration(body.grace)
        except ValueError as exc:
            raise InvalidInput(f"grace: {exc}") from None
        if body.target == "remote":
            with _remote() as remote:
                return collect(remote, grace=grace, dry_run=body.dryRun).as_dict()
        return collect(node.store, grace=grace, dry_run=body.dryRun, extra_roots=node.gc_roots()).as_dict()

    @app.post("/admin/push", response_model=TransferResult, dependencies=admin, tags=["admin"],
              summary="Copy an image, snapshot or template (and all it needs) to the node's remote store")
    def push(body: m.TransferRequest) -> dict:
        with _remote() as remote:
            return copy(node.store, remote, body.name).as_dict()

    @app.post("/admin/pull", response_model=TransferResult, dependencies=admin, tags=["admin"],
              summary="Fetch an image, snapshot or template from the node's remote store")
    def pull(body: m.TransferRequest) -> dict:
        if not body.full and node.store.remote is None:
            raise Conflict("a lazy pull needs the node to read chunks from its remote (config `remote`)")
        with _remote() as remote:
            return copy(remote, node.store, body.name, chunks=body.full).as_dict()

    @app.get("/admin/sandboxes", dependencies=admin, tags=["admin"],
             summary="Every sandbox record on the node, warm pool included")
    def all_records() -> list[dict]:
        return node.boxes.list()

    return app
