"""`strata gateway`: one E2B endpoint for every node on a shared store.

Stateless, so run as many as you like: what it routes by lives in the
shared store, read through a short cache.
  - members, their URLs and how full they are: node records
    (layerstore/nodes.py), re-read every `refresh` seconds;
  - where each sandbox runs: placement records (vmm/placement.py).

    client -> gateway -> the node running the sandbox   E2b-Sandbox-Id header, {port}-{id}.DOMAIN
                                                          host, /sandboxes/{id}/..., WebSockets too
                      -> a node the scheduler picks      POST /sandboxes (next one if it is full)
                      -> every node, merged             GET /sandboxes, /v2/sandboxes (paged here),
                                                          /sandboxes/metrics, /admin/sandboxes
                      -> the node a template hashes to  template builds (their state is the node's)
                      -> any node                       the rest: images, snapshots, templates
                                                          (one shared store behind them all)

Placement prefers a node with a warm sandbox of the template ready, then
the most free places, then a node already running the template (its chunks
are cached there). Between two reads of the records the gateway counts what
it placed itself, so a burst of creates spreads.

The gateway checks no keys: the nodes do (they share STRATA_API_KEYS), and
every header is passed on, Host included (upload links a node makes then
point back at the gateway). But for its own `/health`: anyone is told the
status and how many nodes there are; only an admin key (STRATA_ADMIN_KEYS,
as the nodes') is shown the nodes and their URLs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from layerstore.backend import Backend
from layerstore.errors import InvalidInput, StrataError
from layerstore.nodes import read_nodes
from vmm import placement

from . import listing
from .ports import PORT_HOST
from .proxy import (Scope, Unreachable, forward_websocket, header, new_client, refuse, relay, request_body,
                    send_request, target_error, upstream)
from .teams import same_secret

log = logging.getLogger("strata.gateway")

SANDBOX_PATH = re.compile(r"^/(?:v2/)?sandboxes/([^/]+)")
TEMPLATE_PATH = re.compile(r"^/(?:v2/)?templates/([^/]+)/")
MAX_BODY = 1 << 20  # a create or build request is buffered (it may go to a second node)
PLACED_TTL = 300.0  # seconds a sandbox's node is remembered (a 404 or a dead node forgets it sooner)
UNREACHABLE_HEADER = "x-strata-unreachable-nodes"
_HOST = re.compile(r"^([A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))(?::(\d{1,5}))?$")  # a Host header a WebSocket may carry on


@dataclass(frozen=True)
class Member:
    """A live node as the gateway places and routes by it."""

    node: str
    url: str
    max: int = 0
    held: int = 0
    pools: dict[str, int] = field(default_factory=dict)
    templates: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    kind: str  # sandbox | create | list | metrics | template | build | health | any
    key: str = ""  # the sandbox id, list flavour (v1, v2, admin) or template name


def route(scope: Scope) -> Route:
    """Where a request goes, from its host, headers and path alone."""
    headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
    method, path = scope.get("method", "GET"), scope["path"]
    host = PORT_HOST.match(headers.get(b"host", ""))  # envd's port too: the node serves it
    if host is not None:
        return Route("sandbox", host.group(2))
    if headers.get(b"e2b-sandbox-id"):
        return Route("sandbox", headers[b"e2b-sandbox-id"])
    if path in ("/sandboxes", "/v2/sandboxes"):
        if method == "POST":
            return Route("create")
        return Route("list", "v2" if path.startswith("/v2") else "v1")
    if path == "/admin/sandboxes":
        return Route("list", "admin")
    if path == "/sandboxes/metrics":
        return Route("metrics")
    if (match := SANDBOX_PATH.match(path)) is not None:
        return Route("sandbox", match.group(1))
    if (match := TEMPLATE_PATH.match(path)) is not None:
        return Route("template", match.group(1))
    if path == "/v3/templates" and method == "POST":
        return Route("build")
    if path == "/health":
        return Route("health")
    return Route("any")


def _rank(key: str, node: str) -> bytes:
    """Rendezvous hashing: every gateway orders the nodes the same way for `key`."""
    return hashlib.blake2b(f"{key}\0{node}".encode(), digest_size=8).digest()


class Cluster:
    """The members and placements a gateway routes by, read from the shared store (blocking calls)."""

    def __init__(self, backend: Backend, *, refresh: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.refresh = refresh
        self.clock = clock
        self._lock = threading.Lock()
        self._members: list[Member] = []
        self._read_at = float("-inf")
        self._refreshing = False
        self._sent: dict[str, int] = {}  # node -> sandboxes placed there since the records were read
        self._placed: dict[str, tuple[str, float]] = {}  # sid -> (node, when looked up)

    def members(self) -> list[Member]:
        """The live nodes that say where they are reached, re-read every `refresh`
        seconds off the requests' path (reading a thousand records takes seconds):
        only the very first read is waited for."""
        with self._lock:
            if self.clock() - self._read_at < self.refresh or self._refreshing:
                return self._members
            self._refreshing = True
            if self._read_at != float("-inf"):
                threading.Thread(target=self._refresh, name="strata-gateway-refresh", daemon=True).start()
                return self._members
        return self._refresh()

    def _refresh(self) -> list[Member]:
        try:
            return self._read()
        except StrataError as exc:  # the store is down: keep routing by what was read last
            log.error("reading the node records: %s", exc)
            with self._lock:
                if self._read_at == float("-inf"):
                    raise
                return self._members
        finally:
            with self._lock:
                self._refreshing = False

    def _read(self) -> list[Member]:
        members = []
        for view in read_nodes(self.backend):
            url = view.about.get("url")
            if not view.live or not isinstance(url, str) or not url.startswith(("http://", "https://")):
                continue
            about = view.about
            members.append(Member(view.node, url.rstrip("/"), max=_int(about.get("max")),
                                  held=_int(about.get("held")), pools=_counts(about.get("pools")),
                                  templates=_counts(about.get("templates"))))
        with self._lock:
            self._members, self._read_at, self._sent = members, self.clock(), {}
        return members

    def member(self, node: str) -> Member | None:
        return next((m for m in self.members() if m.node == node), None)

    def locate(self, sid: str) -> Member | None:
        """The live node that runs `sid` (its placement record, remembered a while)."""
        with self._lock:
            cached = self._placed.get(sid)
        if cached is not None and self.clock() - cached[1] < PLACED_TTL:
            member = self.member(cached[0])
            if member is not None:
                return member
        node = placement.placed(self.backend, sid)  # a store that fails raises: 503, not 404
        with self._lock:
            if node is None:
                self._placed.pop(sid, None)
                return None
            if len(self._placed) > 100_000:
                self._placed.clear()
            self._placed[sid] = (node, self.clock())
        return self.member(node)

    def holder(self, sid: str) -> str | None:
        """The node `locate` found holding `sid`, live or not (None: the store has no placement)."""
        with self._lock:
            cached = self._placed.get(sid)
        return cached[0] if cached is not None else None

    def forget(self, sid: str) -> None:
        """Ask the store again next time (the node answered that it does not run `sid`)."""
        with self._lock:
            self._placed.pop(sid, None)

    def schedule(self, template: str) -> list[Member]:
        """The members in the order a new sandbox of `template` should try them."""
        with self._lock:
            sent = dict(self._sent)

        def score(m: Member) -> tuple:
            free = m.max - m.held - sent.get(m.node, 0)
            return (free > 0, m.pools.get(template, 0) > sent.get(m.node, 0), free,
                    m.templates.get(template, 0) > 0, _rank(template, m.node))

        return sorted(self.members(), key=score, reverse=True)

    def for_create(self, template: str, idempotency_key: str | None) -> list[Member]:
        """Where a create tries: by load (`schedule`), or, under an
        Idempotency-Key, by the key alone, so a retry reaches the node the
        first try did (which answers with the sandbox it made) and not the
        emptiest one (which would make a second)."""
        if idempotency_key:
            return self.by_key(f"create {idempotency_key}")
        return self.schedule(template)

    def placed_on(self, member: Member) -> None:
        with self._lock:
            self._sent[member.node] = self._sent.get(member.node, 0) + 1

    def by_key(self, key: str) -> list[Member]:
        """The members in rendezvous order for `key` (a template's builds stay on its first)."""
        return sorted(self.members(), key=lambda m: _rank(key, m.node), reverse=True)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _counts(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int)}


class Gateway:
    """The ASGI app of `strata gateway`."""

    def __init__(self, cluster: Cluster, *, admin_keys: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        self._admin_keys = admin_keys
        self._client: httpx.AsyncClient | None = None
        self._turn = itertools.count()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = new_client()
        return self._client

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] not in ("http", "websocket"):
            return
        if (error := target_error(scope)) is not None:  # where it goes is built from parts, never from the target
            await refuse(scope, send, *error)
            return
        r = route(scope)
        try:
            if r.kind == "sandbox":
                await self._sandbox(scope, receive, send, r.key)
            elif scope["type"] == "websocket":
                await refuse(scope, send, 404, "WebSockets reach sandbox ports only")
            elif r.kind == "create":
                await self._create(scope, receive, send)
            elif r.kind in ("list", "metrics"):
                await self._fan_out(scope, send, r.key or "metrics")
            elif r.kind == "health":
                await self._health(scope, send)
            else:
                await self._elsewhere(scope, receive, send, r)
        except StrataError as exc:  # the shared store failed under a lookup
            await refuse(scope, send, 503, f"the cluster's store: {exc}")

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _members(self) -> list[Member]:
        return await anyio.to_thread.run_sync(self.cluster.members)

    async def _sandbox(self, scope: Scope, receive: Any, send: Any, sid: str) -> None:
        """To the node holding `sid`."""
        member = await anyio.to_thread.run_sync(self.cluster.locate, sid)
        if member is None:
            member = await self._elsewhere_for(scope, send, sid)
            if member is None:
                return
        what = f"node {member.node} (sandbox {sid})"
        if scope["type"] == "websocket":  # to the node, with the client's Host (it names the sandbox's port)
            node = httpx.URL(member.url)
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), node.netloc.decode())
            if (named := _HOST.match(host)) is None:
                await refuse(scope, send, 400, "the Host header must be a host name, with a port if any")
                return
            url = upstream(httpx.URL(scheme="ws", host=named.group(1), port=int(named.group(2) or 80)), scope)
            await forward_websocket(scope, receive, send, str(url), what=what, connect_to=(node.host, node.port or 80))
            return
        moving = _wakes(scope)
        body: Any = await _read_body(receive) if moving else request_body(receive)
        if body is None:
            await refuse(scope, send, 413, f"request body over {MAX_BODY} bytes")
            return
        response = await self._try(scope, member, body, what)
        if moving and (isinstance(response, Unreachable) or _node_refused(response)):
            # a resume its node cannot take (gone, or full): the scheduler's pick takes the sandbox over
            others = [m for m in await anyio.to_thread.run_sync(self.cluster.schedule, "") if m != member]
            if others:
                if isinstance(response, httpx.Response):
                    await response.aclose()
                response = await self._try(scope, others[0], body, f"node {others[0].node} (sandbox {sid})")
        if isinstance(response, Unreachable):
            self.cluster.forget(sid)
            await refuse(scope, send, 503, f"sandbox {sid} is unavailable: {response}")
            return
        if response.status_code == 404:  # it may run elsewhere now (taken over): ask the store again
            self.cluster.forget(sid)
            moved = await anyio.to_thread.run_sync(self.cluster.locate, sid)
            if moved is not None and moved != member and scope["method"] in ("GET", "HEAD", "DELETE"):
                await response.aclose()  # a request without a body can go again, to where it is now
                response = await self._try(scope, moved, b"", f"node {moved.node} (sandbox {sid})")
                if isinstance(response, Unreachable):
                    await refuse(scope, send, 503, f"sandbox {sid} is unavailable: {response}")
                    return
        await relay(response, send, what=what)

    async def _try(self, scope: Scope, member: Member, body: Any, what: str) -> httpx.Response | Unreachable:
        try:
            return await send_request(self.client, scope, upstream(httpx.URL(member.url), scope), body=body, what=what)
        except Unreachable as exc:
            return exc

    async def _elsewhere_for(self, scope: Scope, send: Any, sid: str) -> Member | None:
        """A sandbox whose node is not live: a resume (or connect) goes to the node the
        scheduler picks, which takes it over if it was paused to the store; anything else
        is refused, naming the node."""
        owner = self.cluster.holder(sid)  # what `locate` just read: no second store request
        if owner is None:
            await refuse(scope, send, 404, f"sandbox {sid} not found: no node of this cluster holds it")
            return None
        if _wakes(scope):
            members = await anyio.to_thread.run_sync(self.cluster.schedule, "")
            if members:
                return members[0]
        await refuse(scope, send, 503, f"sandbox {sid} is unavailable: its node {owner} is not answering; if it "
                                       "is paused, resuming it wakes it on another node")
        return None

    async def _create(self, scope: Scope, receive: Any, send: Any) -> None:
        body = await _read_body(receive)
        if body is None:
            await refuse(scope, send, 413, f"request body over {MAX_BODY} bytes")
            return
        try:
            template = str(json.loads(body or b"{}").get("templateID", ""))
        except (ValueError, AttributeError):
            template = ""  # the node answers the bad request
        key = dict(scope.get("headers") or []).get(b"idempotency-key", b"").decode("latin-1")
        members = await anyio.to_thread.run_sync(self.cluster.for_create, template, key or None)
        last: tuple[int, str] = (503, "no live node in this cluster (none has published a record with its URL)")
        for member in members:
            what = f"node {member.node}"
            try:
                response = await send_request(self.client, scope, upstream(httpx.URL(member.url), scope), body=body,
                                              what=what)
            except Unreachable as exc:
                last = (exc.status, str(exc))
                continue
            if _node_refused(response) and member is not members[-1]:
                await response.aread()
                last = (response.status_code, response.text)
                await response.aclose()
                continue  # full (or draining): the next one
            if response.status_code < 300:
                self.cluster.placed_on(member)
            await relay(response, send, what=what)
            return
        await refuse(scope, send, last[0], last[1])

    async def _elsewhere(self, scope: Scope, receive: Any, send: Any, r: Route) -> None:
        """Builds and templates by their name's node, the rest by turns."""
        body: Any = request_body(receive)
        if r.kind == "build":
            body = await _read_body(receive)
            if body is None:
                await refuse(scope, send, 413, f"request body over {MAX_BODY} bytes")
                return
            try:
                data = json.loads(body or b"{}")
                key = str(data.get("name") or data.get("alias") or "")
            except (ValueError, AttributeError):
                key = ""
            members = await anyio.to_thread.run_sync(self.cluster.by_key, key)
        elif r.kind == "template":
            members = await anyio.to_thread.run_sync(self.cluster.by_key, r.key)
        else:
            members = await self._members()
            if members:
                turn = next(self._turn) % len(members)
                members = members[turn:] + members[:turn]
        if not members:
            await refuse(scope, send, 503, "no live node in this cluster")
            return
        member = members[0]
        what = f"node {member.node}"
        try:
            response = await send_request(self.client, scope, upstream(httpx.URL(member.url), scope), body=body,
                                          what=what)
        except Unreachable as exc:
            await refuse(scope, send, exc.status, str(exc))
            return
        await relay(response, send, what=what)

    async def _fan_out(self, scope: Scope, send: Any, flavour: str) -> None:
        """A listing across every node: the first refusal (a bad key) is the answer; nodes that
        do not answer are named in a header."""
        members = await self._members()
        if not members:
            await refuse(scope, send, 503, "no live node in this cluster")
            return
        if flavour == "metrics":
            answers = await self._metrics(scope, members)
        else:
            answers = {}
            async with anyio.create_task_group() as tasks:
                for member in members:
                    tasks.start_soon(self._collect, scope, member, flavour == "v2", answers)
        missing = sorted(node for node, answer in answers.items() if isinstance(answer, Unreachable))
        for answer in answers.values():
            if isinstance(answer, httpx.Response):  # a refusal: the same on every node
                await _send_json(send, answer.status_code, answer.content, {})
                return
        rows = _unique([row for answer in answers.values() if isinstance(answer, list) for row in answer])
        headers = {UNREACHABLE_HEADER: ",".join(missing)} if missing else {}
        if flavour == "metrics":
            merged = {k: v for answer in answers.values() if isinstance(answer, dict) for k, v in answer.items()}
            await _send_json(send, 200, json.dumps({"sandboxes": merged}).encode(), headers)
            return
        if flavour == "v2":
            try:
                rows, token = _page(rows, _query(scope))
            except InvalidInput as exc:
                await refuse(scope, send, 400, str(exc))
                return
            if token:
                headers["X-Next-Token"] = token
        await _send_json(send, 200, json.dumps(rows).encode(), headers)

    async def _collect(self, scope: Scope, member: Member, paged: bool, answers: dict[str, Any]) -> None:
        """Every row `member` lists for this request (all its pages), or what went wrong."""
        headers = _asked_with(scope)
        params = _query(scope)
        if paged:
            params = {k: v for k, v in params.items() if k not in ("limit", "nextToken")} | {"limit": "100"}
        rows: list[Any] = []
        for _ in range(1000):  # pages of 100: far past any node's sandboxes
            try:
                response = await self.client.get(httpx.URL(member.url).copy_with(path=scope["path"]), params=params,
                                                 headers=headers)
            except httpx.HTTPError as exc:
                answers[member.node] = Unreachable(503, f"node {member.node}: {exc}")
                return
            if response.status_code != 200:
                answers[member.node] = response
                return
            rows += response.json()
            token = response.headers.get("x-next-token")
            if not paged or not token:
                break
            params = {**params, "nextToken": token}
        answers[member.node] = rows

    async def _metrics(self, scope: Scope, members: list[Member]) -> dict[str, Any]:
        """/sandboxes/metrics: each node asked for its own sandboxes."""
        wanted = [s for s in _query(scope).get("sandbox_ids", "").split(",") if s][:100]
        by_node: dict[str, list[str]] = {}
        for sid in wanted:
            member = await anyio.to_thread.run_sync(self.cluster.locate, sid)
            by_node.setdefault(member.node if member else "", []).append(sid)
        answers: dict[str, Any] = {}
        if "" in by_node:
            answers[""] = httpx.Response(404, json={"code": 404, "message": f"sandbox {by_node[''][0]} not found: "
                                                                             "no live node of this cluster runs it"})
            return answers
        headers = _asked_with(scope)
        for member in members:
            if member.node not in by_node:
                continue
            try:
                asked = {"sandbox_ids": ",".join(by_node[member.node])}
                response = await self.client.get(httpx.URL(member.url).copy_with(path="/sandboxes/metrics"),
                                                 headers=headers, params=asked)
            except httpx.HTTPError as exc:
                answers[member.node] = Unreachable(503, f"node {member.node}: {exc}")
                continue
            answers[member.node] = response.json()["sandboxes"] if response.status_code == 200 else response
        return answers

    async def _health(self, scope: Scope, send: Any) -> None:
        """The status and the node count; the nodes themselves for an admin key only."""
        members = await self._members()
        body: dict[str, Any] = {"status": "ok" if members else "no nodes", "count": len(members)}
        if any(same_secret(header(scope, b"x-api-key"), key) for key in self._admin_keys):
            body["nodes"] = [{"node": m.node, "url": m.url, "held": m.held, "max": m.max} for m in members]
        await _send_json(send, 200 if members else 503, json.dumps(body).encode(), {})


def _asked_with(scope: Scope) -> list[tuple[str, str]]:
    """The caller's headers for a request of the gateway's own to a node (its key, above all)."""
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
            if k.lower() not in (b"host", b"content-length", b"connection")]


def _node_refused(response: httpx.Response) -> bool:
    """The node is full or draining: another may take the request. A team at
    its quota (X-Strata-Limit: team) is refused the same everywhere."""
    return response.status_code == 503 or (response.status_code == 429
                                           and response.headers.get("x-strata-limit") != "team")


def _wakes(scope: Scope) -> bool:
    """A resume or connect: a request another node may answer by taking a paused sandbox over."""
    return scope.get("method") == "POST" and scope["path"].rstrip("/").endswith(("/resume", "/connect"))


def _unique(rows: list[Any]) -> list[Any]:
    """One row per sandbox: a node that lost a paused sandbox to another lists it until it
    next looks at the store; the running copy is the real one."""
    best: dict[str, Any] = {}
    for row in rows:
        sid = row.get("sandboxID") if isinstance(row, dict) else None
        if sid is None or sid not in best or row.get("state") == "running":
            best[sid if sid is not None else id(row)] = row
    return list(best.values())


def _query(scope: Scope) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))


def _page(rows: list[dict[str, Any]], query: dict[str, str]) -> tuple[list[dict[str, Any]], str | None]:
    """E2B's v2 paging over every node's rows, as a node pages its own (api/listing.py)."""
    try:
        limit = max(1, min(100, int(query.get("limit", "100"))))
    except ValueError:
        raise InvalidInput("limit must be a number from 1 to 100") from None

    def cursor(row: dict[str, Any]) -> str:
        return f"{row.get('startedAt', '')}|{row.get('sandboxID', '')}"

    return listing.page(rows, order=query.get("order", "desc"), limit=limit, token=query.get("nextToken"),
                        key=cursor, cursor=cursor)


async def _read_body(receive: Any) -> bytes | None:
    """The whole request body, None past MAX_BODY."""
    chunks, size = [], 0
    async for block in request_body(receive):
        size += len(block)
        if size > MAX_BODY:
            return None
        chunks.append(block)
    return b"".join(chunks)


async def _send_json(send: Any, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
