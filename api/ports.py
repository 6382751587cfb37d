"""Sandbox ports through the node: E2B's `{port}-{sandboxID}.{domain}` URLs.

A request (HTTP or WebSocket) whose Host is `PORT-SID.anything` goes to
port PORT of sandbox SID, at the sandbox's address on the node (its network
namespace forwards it to the guest, vmm/network.py); every other request
goes on to the API. Port 49983 is envd's, which the node serves itself
(api/routes/envd.py). A sandbox created with `allowPublicTraffic: false`
answers only requests carrying its `e2b-traffic-access-token`.

    client --Host: 8000-sb1.example.com--> node :8080 --> 10.201.0.2:8000 --> guest :8000

E2B's SDKs name the port in headers instead when `E2B_SANDBOX_URL` points
them at one address (the code interpreter's `POST {url}/execute`):
`E2b-Sandbox-Port: PORT` with `E2b-Sandbox-Id: SID` goes to the same place,
under the same rules, as Host `PORT-SID.*` (port 49983 is envd's: the API).
A malformed port header, or one without a sandbox id, is 400. That form is
the SDK's own, so `X-Access-Token` there is the sandbox's envd token: a
wrong one is 401 (a missing one is fine: the SDK sends it on some calls
only, and the port is as public as its Host form), and neither it nor
`X-API-Key` nor the E2B headers are passed on to the guest.

One path is not public in either form: `/execute` on port 49999, where
E2B's code interpreter runs the code it is sent (the SDK sends its envd
token there, and only there). Without the sandbox's `X-Access-Token` it is
401, and the token is not passed on.

No API key is needed (these are the sandbox's public URLs). Bodies stream
both ways; hop-by-hop headers are dropped; the Host header is passed on.
The Host form passes the client's other headers on as they are, but for
the node's own secrets: an `X-API-Key` holding a key of this node, or an
`X-Access-Token` holding the sandbox's token, never reaches the guest (the
guest's code may be anyone's; its app's own headers of those names pass).
Errors are JSON `{"code", "message"}` like the API's: 400 malformed port
header, 401 wrong (or, for code, missing) access token, 404 unknown sandbox, 403 missing or wrong
traffic token, 409 paused or without a network, 502 nothing listening, 504
no answer in time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from layerstore.errors import NotFound, StrataError

from . import errors
from .proxy import Scope, forward_http, forward_websocket, header, new_client, refuse, upstream

if TYPE_CHECKING:
    from .access import Access

PORT_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9-]{1,64})\.")
SANDBOX_ID = re.compile(r"^[A-Za-z0-9-]{1,64}$")
PORT = re.compile(r"^\d{1,5}$")
ENVD_PORT = 49983
TOKEN_HEADER = "e2b-traffic-access-token"
PORT_HEADER, ID_HEADER, ACCESS_HEADER = b"e2b-sandbox-port", b"e2b-sandbox-id", b"x-access-token"
CODE_PORT, RUNS_CODE = 49999, "execute"  # E2B's code interpreter: the path that runs what it is sent
_DROP = (TOKEN_HEADER.encode(),)  # the guest's server never sees the sandbox's token
_DROP_ACCESS = (*_DROP, ACCESS_HEADER)
_DROP_SDK = (*_DROP, PORT_HEADER, ID_HEADER, ACCESS_HEADER, b"x-api-key")  # nor, from the SDK, the node's


@dataclass(frozen=True)
class Target:
    """A request for a sandbox's port, and the credentials it came with."""

    port: int
    sid: str
    traffic_token: str | None
    access_token: str | None = None  # X-Access-Token (None: not given, or the Host form off code paths)
    by_header: bool = False
    runs_code: bool = False  # the code interpreter's /execute: the access token is required


def runs_code(port: int, scope: Scope) -> bool:
    """Whether the request is for the path of `port` that runs code sent to it
    (matched as the guest's server routes it: slashes around it ignored)."""
    return port == CODE_PORT and str(scope.get("path", "")).strip("/") == RUNS_CODE


class BadTarget(Exception):
    """A port header that names no port (400)."""


def port_target(scope: Scope) -> Target | None:
    """The sandbox port a request is for, by its Host or else E2B's headers
    (None: the API's, envd's port included). BadTarget if the headers name
    one badly."""
    token = header(scope, TOKEN_HEADER.encode())
    match = PORT_HOST.match(header(scope, b"host") or "")
    if match is not None:
        port = int(match.group(1))
        if not 0 < port <= 65535 or port == ENVD_PORT:
            return None
        code = runs_code(port, scope)
        return Target(port, match.group(2), token, header(scope, ACCESS_HEADER) if code else None, runs_code=code)
    given = header(scope, PORT_HEADER)
    if given is None:
        return None
    if not PORT.match(given) or not 0 < int(given) <= 65535:
        raise BadTarget(f"E2b-Sandbox-Port must be a port number (1-65535), not {given[:40]!r}")
    sid = header(scope, ID_HEADER)
    if not sid:
        raise BadTarget("E2b-Sandbox-Port needs the sandbox's id in E2b-Sandbox-Id")
    if int(given) == ENVD_PORT:
        return None
    return Target(int(given), sid, token, header(scope, ACCESS_HEADER), by_header=True,
                  runs_code=runs_code(int(given), scope))


class PortProxy:
    """ASGI middleware: sandbox ports by Host, everything else to `app`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        try:
            target = port_target(scope) if scope["type"] in ("http", "websocket") else None
        except BadTarget as exc:
            await refuse(scope, send, 400, str(exc))
            return
        if target is None:
            await self.app(scope, receive, send)
            return
        try:
            address = _address(scope["app"].state.node.access, target)
        except StrataError as exc:
            await refuse(scope, send, errors.status_of(exc), str(exc))
            return
        port, what = target.port, f"port {target.port} of sandbox {target.sid}"
        drop = _DROP_SDK if target.by_header else _DROP_ACCESS if target.runs_code else _DROP
        if not target.by_header:
            drop = (*drop, *_secrets(scope, scope["app"].state.node.access, target.sid))
        if scope["type"] == "websocket":
            url = upstream(httpx.URL(scheme="ws", host=address, port=port), scope)
            await forward_websocket(scope, receive, send, str(url), drop=drop, what=what)
            return
        if self._client is None:
            self._client = new_client(keepalive=False)  # addresses pass from sandbox to sandbox
        url = upstream(httpx.URL(scheme="http", host=address, port=port), scope)
        await forward_http(self._client, scope, receive, send, str(url), drop=drop, what=what)


def _secrets(scope: Scope, access: Access, sid: str) -> tuple[bytes, ...]:
    """The credential headers of the request that hold the node's secrets (kept from the guest)."""
    return tuple(name for name in (b"x-api-key", ACCESS_HEADER)
                 if (value := header(scope, name)) is not None and access.is_secret(sid, value))


def _address(access: Access, target: Target) -> str:
    """Where `target` is (api/access.py checks its tokens). An id that cannot
    exist is unknown, as it is in a Host."""
    if not SANDBOX_ID.match(target.sid):
        raise NotFound(f"sandbox {target.sid[:64]!r} not found")
    return access.port_address(target.sid, target.traffic_token, access_token=target.access_token,
                               runs_code=target.runs_code)
