"""Sandbox ports through the node: E2B's `{port}-{sandboxID}.{domain}` URLs.

A request (HTTP or WebSocket) whose Host is `PORT-SID.anything` goes to
port PORT of sandbox SID, at the sandbox's address on the node (its network
namespace forwards it to the guest, vmm/network.py); every other request
goes on to the API. Port 49983 is envd's, which the node serves itself
(api/routes/envd.py). A sandbox created with `allowPublicTraffic: false`
answers only requests carrying its `e2b-traffic-access-token`.

    client --Host: 8000-sb1.example.com--> node :8080 --> 10.201.0.2:8000 --> guest :8000

No API key is needed (these are the sandbox's public URLs). Bodies stream
both ways; hop-by-hop headers are dropped; the Host header is passed on.
Errors are JSON `{"code", "message"}` like the API's: 404 unknown sandbox,
403 missing or wrong traffic token, 409 paused or without a network, 502
nothing listening, 504 no answer in time.
"""

from __future__ import annotations

import re
from typing import Any

import anyio
import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from layerstore.errors import StrataError

from . import errors

PORT_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9-]{1,64})\.")
ENVD_PORT = 49983
TOKEN_HEADER = "e2b-traffic-access-token"
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", TOKEN_HEADER.encode()})
WS_OWN = frozenset({b"host", b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
                    b"sec-websocket-protocol", b"connection", b"upgrade", TOKEN_HEADER.encode()})
TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=300.0, pool=30.0)

Scope = dict[str, Any]


def port_target(scope: Scope) -> tuple[int, str] | None:
    """(port, sandbox id) if the request's Host names a sandbox port other than envd's."""
    host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), "")
    match = PORT_HOST.match(host)
    if match is None or int(match.group(1)) in (0, ENVD_PORT) or int(match.group(1)) > 65535:
        return None
    return int(match.group(1)), match.group(2)


class PortProxy:
    """ASGI middleware: sandbox ports by Host, everything else to `app`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        target = port_target(scope) if scope["type"] in ("http", "websocket") else None
        if target is None:
            await self.app(scope, receive, send)
            return
        port, sid = target
        node = scope["app"].state.node
        token = next((v.decode("latin-1") for k, v in scope["headers"] if k == TOKEN_HEADER.encode()), None)
        try:
            address = node.port_address(sid, token)
        except StrataError as exc:
            await _refuse(scope, send, errors.status_of(exc), str(exc))
            return
        if scope["type"] == "websocket":
            await _websocket(scope, receive, send, address, port, sid)
        else:
            await self._http(scope, receive, send, address, port, sid)

    async def _http(self, scope: Scope, receive: Any, send: Any, address: str, port: int, sid: str) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=False, trust_env=False)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]

        async def body() -> Any:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                yield message.get("body", b"")
                if not message.get("more_body"):
                    return

        request = self._client.build_request(scope["method"], _url("http", address, port, scope), headers=headers,
                                             content=body() if scope["method"] not in ("GET", "HEAD") else None)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TimeoutException:
            await _refuse(scope, send, 504, f"port {port} of sandbox {sid} did not answer in time")
            return
        except httpx.HTTPError:
            await _refuse(scope, send, 502, f"nothing answers on port {port} of sandbox {sid}")
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]})
            async for block in response.aiter_raw():
                await send({"type": "http.response.body", "body": block, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError:  # the guest's server broke off midway: so does the reply
            raise RuntimeError(f"port {port} of sandbox {sid} broke off its reply") from None
        finally:
            await response.aclose()


async def _websocket(scope: Scope, receive: Any, send: Any, address: str, port: int, sid: str) -> None:
    if (await receive())["type"] != "websocket.connect":
        return
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k.lower() not in WS_OWN]
    try:
        upstream = await ws_connect(_url("ws", address, port, scope), additional_headers=headers,
                                    subprotocols=scope.get("subprotocols") or None, open_timeout=10, max_size=None,
                                    compression=None, user_agent_header=None)
    except (OSError, TimeoutError, InvalidHandshake):
        await send({"type": "websocket.close", "code": 1011, "reason": f"port {port} of sandbox {sid}: no WebSocket"})
        return
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
    async with upstream, anyio.create_task_group() as tasks:
        async def to_guest() -> None:
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
            try:
                async for data in upstream:
                    key = "text" if isinstance(data, str) else "bytes"
                    await send({"type": "websocket.send", key: data})
            except ConnectionClosed:
                pass
            await send({"type": "websocket.close", "code": upstream.close_code or 1000})
            tasks.cancel_scope.cancel()

        tasks.start_soon(to_guest)
        tasks.start_soon(to_client)


def _url(scheme: str, address: str, port: int, scope: Scope) -> str:
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string", b"")
    return f"{scheme}://{address}:{port}{path.decode('latin-1')}{'?' + query.decode('latin-1') if query else ''}"


async def _refuse(scope: Scope, send: Any, status: int, message: str) -> None:
    if scope["type"] == "websocket":  # before accept: the client sees an HTTP 403
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    response = errors.error_response(status, message)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})

