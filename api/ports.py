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

import httpx

from layerstore.errors import StrataError

from . import errors
from .proxy import Scope, forward_http, forward_websocket, new_client, refuse, upstream

PORT_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9-]{1,64})\.")
ENVD_PORT = 49983
TOKEN_HEADER = "e2b-traffic-access-token"
_DROP = (TOKEN_HEADER.encode(),)  # the guest's server never sees the sandbox's token


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
            address = node.access.port_address(sid, token)
        except StrataError as exc:
            await refuse(scope, send, errors.status_of(exc), str(exc))
            return
        what = f"port {port} of sandbox {sid}"
        if scope["type"] == "websocket":
            url = upstream(httpx.URL(scheme="ws", host=address, port=port), scope)
            await forward_websocket(scope, receive, send, str(url), drop=_DROP, what=what)
            return
        if self._client is None:
            self._client = new_client()
        url = upstream(httpx.URL(scheme="http", host=address, port=port), scope)
        await forward_http(self._client, scope, receive, send, str(url), drop=_DROP, what=what)
