"""E2B's sandbox lifecycle (paths, bodies and status codes as E2B's API has
them), plus Strata's fork and exec."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from fastapi import APIRouter, Header, Query, Response


from .. import models as m
from ..deps import AUTH, CallerDep, LimitsDep, NodeDep, vmm_timing
from ..listing import metadata_query, states_query

router = APIRouter(tags=["sandboxes"], dependencies=AUTH)
METADATA = Query(None, description="k=v&k2=v2 (URL-encoded)")
IDEMPOTENCY_KEY = Header(None, alias="Idempotency-Key", description="a retried create with the same key (and "
                         "body) returns the sandbox the first one made; 1-255 of a-z, 0-9, '-'")
NEXT_TOKEN = {200: {"headers": {"X-Next-Token": {"schema": {"type": "string"},
                                                 "description": "cursor of the next page, if any"}}}}


@router.post("/v2/sandboxes", status_code=201, response_model=m.Sandbox, operation_id="create_sandbox_v2",
             summary="Create a sandbox from a template (named image or snapshot) or an image NAME:TAG")
@router.post("/sandboxes", status_code=201, response_model=m.Sandbox, operation_id="create_sandbox",
             summary="Create a sandbox from a template (named image or snapshot) or an image NAME:TAG")
def create(body: m.NewSandbox, response: Response, node: NodeDep, caller: CallerDep,
           idempotency_key: str | None = IDEMPOTENCY_KEY) -> m.Sandbox:
    with vmm_timing(node, response):
        net = body.network or m.SandboxNetwork()
        volumes = node.volumes.mounts(caller, body.volumeMounts) if body.volumeMounts else None
        options = dict(timeout=body.timeout, auto_pause=body.autoPause, metadata=body.metadata, env=body.envVars,
                       disk_mb=body.diskSizeMB, public=net.allowPublicTraffic is not False, volumes=volumes,
                       egress=node.lifecycle.egress(body.allow_internet_access, net.allowOut, net.denyOut))
        if idempotency_key is None:
            record = node.lifecycle.create(caller, body.templateID, **options)
        else:
            digest = hashlib.sha256(body.model_dump_json().encode()).hexdigest()
            record, replayed = node.lifecycle.create_once(caller, idempotency_key, digest, body.templateID, **options)
            if replayed:
                response.headers["Idempotent-Replayed"] = "true"
    return m.Sandbox.of(record, domain=node.domain)


@router.get("/sandboxes", response_model=list[m.ListedSandbox])
def list_running(node: NodeDep, caller: CallerDep, metadata: str | None = METADATA) -> list[m.ListedSandbox]:
    return node.list_sandboxes(caller, metadata=metadata_query(metadata), states=frozenset({"running"}))


@router.get("/v2/sandboxes", response_model=list[m.ListedSandbox], responses=NEXT_TOKEN)
def list_v2(response: Response, node: NodeDep, caller: CallerDep,
            metadata: str | None = METADATA,
            state: str | None = Query(None, description="running,paused (default both)"),
            limit: int = Query(100, ge=1, le=100),
            nextToken: str | None = Query(None),
            order: str = Query("desc", pattern="^(asc|desc)$"),
            startedAfter: datetime | None = Query(None, description="RFC 3339; sandboxes started at or after it"),
            template: str | None = Query(None, max_length=257, description="a template's ID or name")
            ) -> list[m.ListedSandbox]:
    wanted = metadata_query(metadata)
    after = None if startedAfter is None else (startedAfter if startedAfter.tzinfo else
                                                startedAfter.replace(tzinfo=timezone.utc)).timestamp()
    rows, next_token = node.list_sandboxes_page(caller, metadata=wanted, states=states_query(state), order=order,
                                                limit=limit, token=nextToken, started_after=after, template=template)
    if next_token is not None:
        response.headers["X-Next-Token"] = next_token
    return rows


@router.get("/sandboxes/metrics", response_model=m.SandboxesWithMetrics,
            summary="One fresh sample of each running sandbox's guest (CPU, memory, disk)")
def many_metrics(node: NodeDep, caller: CallerDep,
                 sandbox_ids: str = Query(..., description="comma-separated sandbox ids (at most 100)")
                 ) -> m.SandboxesWithMetrics:
    sids = [s for s in sandbox_ids.split(",") if s][:100]
    out = {}
    for sid in sids:
        at, sample, traffic = node.lifecycle.metrics_of(caller, sid)
        out[sid] = m.SandboxMetric.of(at, sample, traffic)
    return m.SandboxesWithMetrics(sandboxes=out)


@router.get("/sandboxes/{sandboxID}/metrics", response_model=list[m.SandboxMetric],
            summary="A fresh sample of the guest's CPU, memory and disk (the node keeps no series)")
def sandbox_metrics(sandboxID: str, node: NodeDep, caller: CallerDep,
                    start: int | None = Query(None, description="unix seconds; a sample before it is not returned"),
                    end: int | None = Query(None, description="unix seconds; a sample after it is not returned")
                    ) -> list[m.SandboxMetric]:
    at, sample, traffic = node.lifecycle.metrics_of(caller, sandboxID)
    if (start is not None and at < start) or (end is not None and at > end + 1):
        return []
    return [m.SandboxMetric.of(at, sample, traffic)]


@router.get("/sandboxes/{sandboxID}/logs", response_model=m.SandboxLogs,
            summary="The sandbox's event log: lifecycle and the processes clients ran")
def sandbox_logs(sandboxID: str, node: NodeDep, caller: CallerDep,
                 start: int | None = Query(None, description="milliseconds since the epoch"),
                 limit: int = Query(1000, ge=1, le=10000)) -> m.SandboxLogs:
    rows = node.lifecycle.logs(caller, sandboxID, since=(start or 0) / 1e3, limit=limit)
    return m.SandboxLogs(logs=[m.SandboxLog(timestamp=m.timestamp(e.t), line=e.message) for e in rows],
                         logEntries=[m.SandboxLogEntry.of(e) for e in rows])


@router.get("/v2/sandboxes/{sandboxID}/logs", response_model=m.SandboxLogsV2,
            summary="The sandbox's event log, from a cursor, filtered")
def sandbox_logs_v2(sandboxID: str, node: NodeDep, caller: CallerDep,
                    cursor: int | None = Query(None, description="milliseconds since the epoch"),
                    limit: int = Query(1000, ge=1, le=10000),
                    direction: str = Query("forward", pattern="^(forward|backward)$"),
                    level: str = Query("debug", pattern="^(debug|info|warn|error)$"),
                    search: str = Query("", max_length=256)) -> m.SandboxLogsV2:
    rows = node.lifecycle.logs(caller, sandboxID, since=(cursor or 0) / 1e3, limit=limit, level=level, search=search,
                     backward=direction == "backward")
    return m.SandboxLogsV2(logs=[m.SandboxLogEntry.of(e) for e in rows])


@router.get("/sandboxes/{sandboxID}", response_model=m.SandboxDetail)
def get_sandbox(sandboxID: str, node: NodeDep, caller: CallerDep) -> m.SandboxDetail:
    return node.sandbox_detail(caller, sandboxID)


@router.delete("/sandboxes/{sandboxID}", status_code=204)
def kill_sandbox(sandboxID: str, node: NodeDep, caller: CallerDep) -> Response:
    response = Response(status_code=204)
    with vmm_timing(node, response):
        node.lifecycle.kill(caller, sandboxID)
    return response


@router.post("/sandboxes/{sandboxID}/pause", status_code=204,
             summary="Snapshot the sandbox to the store and free its VM (409 if already paused)")
def pause_sandbox(sandboxID: str, node: NodeDep, caller: CallerDep, body: m.SandboxPauseRequest | None = None) -> Response:
    response = Response(status_code=204)
    with vmm_timing(node, response):
        node.lifecycle.pause(caller, sandboxID)
    return response


@router.post("/sandboxes/{sandboxID}/resume", status_code=201, response_model=m.Sandbox,
             summary="Resume a paused sandbox (409 if running)")
def resume_sandbox(sandboxID: str, response: Response, node: NodeDep, caller: CallerDep,
                   body: m.ResumedSandbox | None = None) -> m.Sandbox:
    with vmm_timing(node, response):
        record = node.lifecycle.resume(caller, sandboxID, body.timeout if body else None)
    return m.Sandbox.of(record, domain=node.domain)


CONNECT = dict(response_model=m.Sandbox,
               responses={201: {"model": m.Sandbox, "description": "the sandbox was paused and is resumed"}},
               summary="200 if running (TTL extended), 201 if it was paused and is resumed")


@router.post("/v2/sandboxes/{sandboxID}/connect", operation_id="connect_sandbox_v2", **CONNECT)
@router.post("/sandboxes/{sandboxID}/connect", operation_id="connect_sandbox", **CONNECT)
def connect(sandboxID: str, response: Response, node: NodeDep, caller: CallerDep, body: m.ConnectSandbox | None = None) -> m.Sandbox:
    with vmm_timing(node, response):
        record, resumed = node.lifecycle.connect(caller, sandboxID, body.timeout if body else None)
    response.status_code = 201 if resumed else 200
    return m.Sandbox.of(record, domain=node.domain)


@router.put("/sandboxes/{sandboxID}/network", status_code=204,
            summary="Replace the sandbox's egress rules; a running sandbox's next packet obeys them")
def set_network(sandboxID: str, body: m.SandboxNetworkUpdate, node: NodeDep, caller: CallerDep) -> Response:
    node.lifecycle.set_network(caller, sandboxID, internet=body.allow_internet_access, allow=body.allowOut or [],
                     deny=body.denyOut or [])
    return Response(status_code=204)


@router.post("/sandboxes/{sandboxID}/timeout", status_code=204)
def set_timeout(sandboxID: str, body: m.SandboxTimeoutRequest, node: NodeDep, caller: CallerDep) -> Response:
    node.lifecycle.set_timeout(caller, sandboxID, body.timeout)
    return Response(status_code=204)


@router.post("/sandboxes/{sandboxID}/refreshes", status_code=204)
def refresh(sandboxID: str, node: NodeDep, caller: CallerDep, body: m.SandboxRefreshRequest | None = None) -> Response:
    node.lifecycle.refresh(caller, sandboxID, body.duration if body else None)
    return Response(status_code=204)


@router.post("/sandboxes/{sandboxID}/fork", status_code=201, response_model=list[m.SandboxForkResult],
             response_model_exclude_none=True, summary="Snapshot once, start `count` independent copies (the source keeps running)")
def fork(sandboxID: str, response: Response, node: NodeDep, caller: CallerDep,
         body: m.SandboxForkRequest | None = None) -> list[m.SandboxForkResult]:
    body = body or m.SandboxForkRequest()  # E2B's body is optional: one fork, the default lifetime
    with vmm_timing(node, response):
        records = node.lifecycle.fork(caller, sandboxID, body.count, body.timeout)
    return [m.SandboxForkResult(sandbox=m.Sandbox.of(r, domain=node.domain)) for r in records]


@router.post("/sandboxes/{sandboxID}/exec", response_model=m.ExecResult,
             summary="Strata: run a shell command in the sandbox through its agent")
async def exec_command(sandboxID: str, body: m.ExecRequest, node: NodeDep, caller: CallerDep,
                       limits: LimitsDep) -> m.ExecResult:
    # long work: on the long requests' threads, as one of the caller's team (api/limits.py)
    result = await limits.serve(caller.team, node.lifecycle.exec, caller, sandboxID, body.command, body.timeout)
    return m.ExecResult(exitCode=result.exit_code, output=result.output, truncated=result.dropped > 0)
