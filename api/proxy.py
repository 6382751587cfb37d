"""Passing HTTP and WebSocket requests on, as an ASGI app: the node's port
proxy (api/ports.py) to a sandbox's address, the gateway (api/gateway.py)
to a node. Bodies stream both ways; hop-by-hop headers (and whatever the
caller adds to `drop`) are not passed on; the Host header is. Failures to
reach the target are JSON errors like the API's: 502 nothing answers, 504
no answer in time.

Where a request goes is never taken from its bytes: the upstream URL is
the proxy's own scheme, host and port with the request's path and query
put in their place (`upstream`), and only an origin-form target
(`/path?query`, RFC 9112 3.2.1) is passed on at all (`OriginForm`,
outermost on the node and the gateway). `@host/`, `//host/`,
`http://host/`, `host:port` and `*` would otherwise become the authority
of the URL the proxy fetches.

    request line      GET /sandboxes/x?y=1 HTTP/1.1     GET @10.0.0.9:80/ HTTP/1.1
    target            origin-form: passed on            not origin-form: 400
    upstream URL      http://NODE:PORT/sandboxes/x?y=1  (none)
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio
import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from . import errors

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade"})
WS_OWN = frozenset({b"host", b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
                    b"sec-websocket-protocol", b"connection", b"upgrade"})
TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=300.0, pool=30.0)
MAX_TARGET = 8192  # bytes of a request target (path and query); longer is 414
# A WebSocket message, either way: a longer one closes the socket with 1009 before its payload is read (a
# frame's header declares its length). Uvicorn takes these for the client's side (api/server.py), the
# relay for the target's; with WS_QUEUE frames buffered at most, one socket holds ~5 x 16 MiB at worst.
MAX_WS_MESSAGE = 16 << 20
WS_QUEUE = 4
_PATH = re.compile(rb"^/(?!/)[!-~]*$")  # '/' then printable ASCII; not '//' (a network-path reference)
_QUERY = re.compile(rb"^[!-~]*$")

Scope = dict[str, Any]


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of request header `name` (lower case), None if it was not sent."""
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name), None)


class Unreachable(Exception):
    """The target did not take the request (nothing listening, no answer in
    time); nothing was sent to the client yet, so the caller may try elsewhere."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def new_client(*, keepalive: bool = True) -> httpx.AsyncClient:
    """A client for passing requests on. Without `keepalive` every request
    gets a connection of its own: a sandbox's address is reused by the next
    sandbox once it is killed, and a pooled connection to the old one would
    carry a request to the new one's address, or die in the attempt."""
    limits = httpx.Limits() if keepalive else httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=False, trust_env=False, limits=limits)


def target_error(scope: Scope) -> tuple[int, str] | None:
    """Why the request's target may not be passed on (status, message),
    None if it is origin-form: a path starting with one '/', printable ASCII
    without backslashes, and a query of printable ASCII."""
    path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    query = scope.get("query_string", b"")
    if len(path) + len(query) > MAX_TARGET:
        return 414, f"request target over {MAX_TARGET} bytes"
    if not _PATH.match(path) or b"\\" in path or not _QUERY.match(query):
        return 400, "request target must be origin-form: a path starting with one '/', no scheme, '@host' or backslash"
    return None


def upstream(base: httpx.URL, scope: Scope) -> httpx.URL:
    """`base`'s scheme, host and port with the request's path and query: built
    from parts, so nothing in the request can name another host. The target
    must have passed `target_error`; httpx refuses what is not a path."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string", b"")
    return base.copy_with(raw_path=path + (b"?" + query if query else b""))


class OriginForm:
    """ASGI middleware, outermost: a request whose target is not origin-form
    is refused (400, or 414 when overlong) before anything routes it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and (error := target_error(scope)) is not None:
            await refuse(scope, send, *error)
            return
        await self.app(scope, receive, send)


async def request_body(receive: Any) -> AsyncIterator[bytes]:
    """The request's body as it arrives."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        yield message.get("body", b"")
        if not message.get("more_body"):
            return


async def send_request(client: httpx.AsyncClient, scope: Scope, url: str, *, body: Any,
                       drop: Iterable[bytes] = (), what: str) -> httpx.Response:
    """Send the request on to `url` (headers but hop-by-hop and `drop`); the
    response streams. Unreachable if nothing answered."""
    dropped = HOP_BY_HOP | frozenset(drop)
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in dropped]
    request = client.build_request(scope["method"], url, headers=headers,
                                   content=body if scope["method"] not in ("GET", "HEAD") else None)
    try:
        return await client.send(request, stream=True)
    except httpx.TimeoutException:
        raise Unreachable(504, f"{what} did not answer in time") from None
    except httpx.HTTPError:
        raise Unreachable(502, f"nothing answers at {what}") from None


async def relay(response: httpx.Response, send: Any, *, what: str) -> None:
    """Stream `response` to the client, then close it."""
    try:
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]})
        async for block in response.aiter_raw():
            await send({"type": "http.response.body", "body": block, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except httpx.HTTPError:  # the target broke off midway: so does the reply
        raise RuntimeError(f"{what} broke off its reply") from None
    finally:
        await response.aclose()


async def forward_http(client: httpx.AsyncClient, scope: Scope, receive: Any, send: Any, url: str, *,
                       drop: Iterable[bytes] = (), what: str) -> None:
    """The whole exchange: the request to `url`, its response to the client
    (a JSON 502/504 if nothing answered)."""
    try:
        response = await send_request(client, scope, url, body=request_body(receive), drop=drop, what=what)
    except Unreachable as exc:
        await refuse(scope, send, exc.status, str(exc))
        return
    await relay(response, send, what=what)


async def forward_websocket(scope: Scope, receive: Any, send: Any, url: str, *, drop: Iterable[bytes] = (),
                            what: str, connect_to: tuple[str, int] | None = None) -> None:
    """A WebSocket to `url`, messages relayed both ways until either side
    closes. With `connect_to` (host, port) the connection goes there while
    `url` still names the Host the handshake carries (a gateway passing a
    `{port}-{id}.{domain}` host on to a node)."""
    if (await receive())["type"] != "websocket.connect":
        return
    dropped = WS_OWN | frozenset(drop)
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k.lower() not in dropped]
    target = {"host": connect_to[0], "port": connect_to[1]} if connect_to else {}
    try:
        upstream = await ws_connect(url, additional_headers=headers, subprotocols=scope.get("subprotocols") or None,
                                    open_timeout=10, max_size=MAX_WS_MESSAGE, max_queue=WS_QUEUE, compression=None,
                                    user_agent_header=None, proxy=None, **target)
    except (OSError, TimeoutError, InvalidHandshake):
        await send({"type": "websocket.close", "code": 1011, "reason": f"{what}: no WebSocket"[:120]})
        return
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
    async with upstream, anyio.create_task_group() as tasks:
        async def to_target() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text") if message.get("text") is not None else message.get("bytes")
                try:
                    await upstream.send(data if data is not None else b"")
                except ConnectionClosed:
                    break
            tasks.cancel_scope.cancel()

        async def to_client() -> None:
            code = 1000
            try:
                async for data in upstream:
                    key = "text" if isinstance(data, str) else "bytes"
                    await send({"type": "websocket.send", key: data})
                code = sendable_close_code(upstream.close_code, 1000)  # 1005: closed without a code
            except ConnectionClosed as closed:
                code = relayed_close_code(closed)
            await send({"type": "websocket.close", "code": code})
            tasks.cancel_scope.cancel()

        tasks.start_soon(to_target)
        tasks.start_soon(to_client)


def relayed_close_code(closed: ConnectionClosed) -> int:
    """The close code a client gets when its target's socket failed: the relay's own when the relay
    ended it (1009: a message over MAX_WS_MESSAGE), else the target's; 1011 for none, or for one that
    no close frame may carry (1005, 1006, 1015)."""
    frame = closed.sent if closed.sent is not None and not closed.rcvd_then_sent else closed.rcvd
    return sendable_close_code(frame.code if frame is not None else None, 1011)


def sendable_close_code(code: int | None, default: int) -> int:
    """`code` if a close frame may carry it (RFC 6455 7.4: not 1004-1006, 1015), else `default`."""
    return code if code is not None and 1000 <= code <= 4999 and code not in (1004, 1005, 1006, 1015) else default


async def refuse(scope: Scope, send: Any, status: int, message: str) -> None:
    """A JSON error (before accept, a WebSocket client sees the close)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008 if status < 500 else 1011, "reason": message[:120]})
        return
    response = errors.error_response(status, message)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
