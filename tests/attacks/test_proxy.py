"""Rows: where a proxied request goes (api/proxy.py). The gateway and the
node's port proxy build each upstream URL from their own scheme, host and
port; a request target that is not origin-form is refused before routing.
Raw sockets, since no HTTP client sends these targets. And what a hostile
WebSocket target can make the relay hold: one message of 16 MiB at most."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import socket
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from layerstore import nodes
from layerstore.store import open_store
from tests.attacks.lab import BAIT, BETA, Lab, raw, status_of
from tests.memory import peak_rss
from tests.test_gateway import Gateway
from vmm import placement

TARGETS = {
    "userinfo": b"@127.0.0.1:{bait}/",
    "userinfo-after-path": b"/x@127.0.0.1:{bait}/",  # a path: stays one, and on the node
    "absolute-form": b"http://127.0.0.1:{bait}/",
    "authority-form": b"127.0.0.1:{bait}",
    "network-path": b"//127.0.0.1:{bait}/",
    "backslashes": b"/\\\\127.0.0.1:{bait}/",
    "asterisk": b"*",
    "overlong": b"/" + b"a" * 9000,
}
REFUSED = {400, 404, 414, 431}  # 404 only for the path that is a path


def attempt(lab: Lab, port: int, target: bytes, *, host: bytes, method: bytes = b"GET") -> bytes:
    request = (method + b" " + target.replace(b"{bait}", str(lab.bait.port).encode()) + b" HTTP/1.1\r\nHost: "
               + host + b"\r\nX-API-Key: " + BETA.encode() + b"\r\nConnection: close\r\n\r\n")
    return raw(port, request)


@pytest.mark.parametrize("form", sorted(TARGETS))
def test_gateway_fetches_no_address_a_request_names(lab: Lab, form: str) -> None:
    """attacker: anyone, no key needed.  target: the gateway's upstream URL.
    attempt: a request target naming another host (`@host:port/`, absolute-
    or authority-form, `//host`, backslashes, `*`, overlong).  must: 400/414,
    the bait is never reached, nothing of it is answered."""
    port = int(lab.gateway.url.rsplit(":", 1)[1])
    before = lab.bait.hits
    reply = attempt(lab, port, TARGETS[form], host=b"gw.example", method=b"CONNECT" if "authority" in form else b"GET")
    assert status_of(reply) in REFUSED, reply[:300]
    assert BAIT not in reply and lab.bait.hits == before


@pytest.mark.parametrize("form", sorted(TARGETS))
def test_port_proxy_reaches_only_the_sandbox(lab: Lab, form: str) -> None:
    """attacker: anyone who knows a sandbox's port URL.  target: the node's
    port proxy (`{port}-{id}.{domain}`).  attempt: a request target naming
    another host, so the URL built from the sandbox's address points past it.
    must: 400/414 (the path that stays a path reaches the sandbox's port and
    nothing else), the bait is never reached."""
    port = int(lab.node.url.rsplit(":", 1)[1])
    before = lab.bait.hits
    host = f"8000-{lab.sandbox['sandboxID']}.strata.local".encode()
    reply = attempt(lab, port, TARGETS[form], host=host, method=b"CONNECT" if "authority" in form else b"GET")
    assert status_of(reply) in REFUSED | {502}, reply[:300]  # 502: nothing listens on the sandbox's port 8000
    assert BAIT not in reply and lab.bait.hits == before


@pytest.mark.parametrize("where", ["gateway", "node"])
def test_control_characters_never_reach_a_target(lab: Lab, where: str) -> None:
    """attacker: anyone.  target: the request line's parser, then the proxy.
    attempt: CR/LF and a NUL inside the target (a second request smuggled
    into the upstream).  must: refused; the bait is never reached."""
    url = lab.gateway.url if where == "gateway" else lab.node.url
    port = int(url.rsplit(":", 1)[1])
    before = lab.bait.hits
    for target in (b"/a\r\nGET http://127.0.0.1:{bait}/ HTTP/1.1\r\nX: y", b"/a\x00@127.0.0.1:{bait}/"):
        reply = attempt(lab, port, target, host=b"gw.example")
        assert status_of(reply) in REFUSED | {0}, reply[:300]  # 0: the server hung up on it
        assert BAIT not in reply
    assert lab.bait.hits == before


def test_an_origin_form_request_still_passes(lab: Lab) -> None:
    """attacker: none (the control row).  target: the gateway.  attempt: a
    plain `GET /v2/sandboxes` with alpha's key.  must: answered by the node,
    listing alpha's sandbox: the refusals above are not a gateway that
    refuses everything."""
    port = int(lab.gateway.url.rsplit(":", 1)[1])
    request = (b"GET /v2/sandboxes?limit=10 HTTP/1.1\r\nHost: gw.example\r\nX-API-Key: "
               + lab.alpha.headers["X-API-Key"].encode() + b"\r\nConnection: close\r\n\r\n")
    reply = raw(port, request)
    assert status_of(reply) == 200 and lab.sandbox["sandboxID"].encode() in reply, reply[:300]


COUNT = 256  # MiB the hostile target sends of its one message: 16 times the cap


class HostileWebSocket:
    """A WebSocket server on loopback standing in for a guest's port (or a node, to the gateway): it
    completes the handshake, then sends one message far over any cap, `shape` deciding how, as fast
    as it is taken. `sent` counts the bytes it got rid of before the reader hung up."""

    def __init__(self, shape: str) -> None:
        self.shape, self.sent, self.done = shape, 0, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(30)
                request = b""
                while b"\r\n\r\n" not in request and len(request) < 65536:
                    request += conn.recv(4096)
                key = re.search(rb"(?im)^sec-websocket-key:\s*(\S+)", request).group(1)
                accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
                conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                             b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
                block = bytes(1 << 20)
                if self.shape == "one-frame":  # FIN, binary; 64-bit length 32 GiB; then zeros
                    conn.sendall(b"\x82\x7f" + struct.pack(">Q", 32 << 30))
                    frames = [block] * COUNT
                else:  # one message in 1 MiB fragments: binary without FIN, then continuations
                    frames = [(b"\x02" if i == 0 else b"\x00") + b"\x7f" + struct.pack(">Q", len(block)) + block
                              for i in range(COUNT)]
                for frame in frames:
                    conn.sendall(frame)
                    self.sent += len(frame)
        except OSError:
            pass  # the reader hung up: what it took is in `sent`
        finally:
            self.done.set()
            self.listener.close()


@pytest.mark.parametrize("shape", ["one-frame", "fragments"])
def test_an_oversized_websocket_message_is_refused_unread(tmp_path: Path, shape: str) -> None:
    """attacker: root in a guest (a WebSocket server on its port), or a node.  target: the memory of
    the relay that passes WebSockets on (api/proxy.py: the node's port proxy, the gateway).
    attempt: one message far over any cap: a frame declaring 32 GiB, or 256 MiB of 1 MiB fragments.
    must: the relay closes the client with 1009 once past 16 MiB, hangs up on the target, and its
    peak memory grows by less than 64 MiB (it discards what the target still sends)."""
    hostile = HostileWebSocket(shape)
    store = open_store(str(tmp_path / "store"), create=True)
    nodes.publish(store.backend, "hostile-node", [], about={"url": f"http://127.0.0.1:{hostile.port}", "max": 4})
    placement.place(store.backend, "sbevil", "hostile-node")
    store.close()
    gateway = Gateway(tmp_path, {**os.environ, "STRATA_STORE": str(tmp_path / "store")}, host="127.0.0.1", prefix=())
    try:
        gateway.wait_for(1)
        before = peak_rss(gateway.proc.pid)
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
        with connect("ws://8000-sbevil.sandboxes.test/", sock=sock, open_timeout=10, max_size=None) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
        assert hostile.done.wait(60), "the relay never hung up on the hostile target"
        grown = peak_rss(gateway.proc.pid) - before
        print(f"{shape}: the relay's peak memory grew by {grown >> 20} MiB; the target sent {hostile.sent >> 20} MiB")
        assert grown < 64 << 20, f"the relay's peak memory grew by {grown >> 20} MiB"
    finally:
        gateway.stop()


@pytest.mark.parametrize("form", ["host", "header"])
def test_the_code_interpreters_execute_wants_the_sandboxs_access_token(lab: Lab, form: str) -> None:
    """attacker: anyone who knows a sandbox's id (ids are no secret: they are
    in every port URL).  target: `/execute` on port 49999, where E2B's code
    interpreter runs the code it is sent (api/ports.py).  attempt: POST code
    there with no access token, a wrong one, another team's API key, and
    with the path written `/execute/` or with a query.  must: 401 naming the
    access token before anything reaches the sandbox; with the sandbox's own
    token the request passes on (502 here: nothing listens on 49999 of
    alpha's busybox sandbox)."""
    sid, token = lab.sandbox["sandboxID"], lab.sandbox["envdAccessToken"]
    port = int(lab.node.url.rsplit(":", 1)[1])

    def post(path: str, **headers: str) -> bytes:
        if form == "host":
            host = f"49999-{sid}.strata.local".encode()
        else:
            host, headers = b"node.example", {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", **headers}
        extra = b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
        return raw(port, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\n" + extra
                   + b"Content-Type: application/json\r\nContent-Length: 15\r\nConnection: close\r\n\r\n"
                   + b'{"code":"6*7"} ')

    for path in ("/execute", "/execute/", "/execute?context_id=x"):
        for headers in ({}, {"X-Access-Token": "wrong"}, {"X-API-Key": BETA}):
            reply = post(path, **headers)
            assert status_of(reply) == 401 and b"access token" in reply, (path, headers, reply[:300])
    assert status_of(post("/execute", **{"X-Access-Token": token})) == 502


def test_the_gateways_health_names_no_node_but_to_an_admin(lab: Lab) -> None:
    """attacker: anyone, no key or a team's key.  target: the nodes' own URLs (the gateway's
    `/health` listed them, and a node's URL skips the gateway).  attempt: GET /health.
    must: the status and the node count, no URL; an admin key is shown the nodes."""
    from tests.node_server import ADMIN_KEY

    node_url = lab.node.url.encode()
    for headers in ({}, {"X-API-Key": BETA}, {"X-API-Key": "not-a-key"}):
        r = httpx.get(f"{lab.gateway.url}/health", headers=headers, timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok", "count": 1}, r.text
        assert node_url not in r.content
    shown = httpx.get(f"{lab.gateway.url}/health", headers={"X-API-Key": ADMIN_KEY}, timeout=30).json()
    assert [n["url"] for n in shown["nodes"]] == [lab.node.url]


def test_the_nodes_secrets_never_reach_a_guests_port(lab: Lab) -> None:
    """attacker: root in a guest (or whoever wrote the code its port serves).  target: the
    credentials of the clients that call the port by Host (`{port}-{id}.{domain}`).  attempt:
    read the request's headers in the guest when the client sends a team's API key in
    X-API-Key and the sandbox's token in X-Access-Token.  must: neither reaches the guest;
    headers of the same names that hold no secret of the node (the app's own) pass."""
    sid = lab.sandbox["sandboxID"]
    port = int(lab.node.url.rsplit(":", 1)[1])

    def seen_by_guest(headers: dict[str, str]) -> str:
        listen = ("rm -f /tmp/req.txt; setsid sh -c \"printf 'HTTP/1.0 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok' "
                  "| nc -l -p 7100 > /tmp/req.txt\" > /dev/null 2>&1 &")
        r = lab.alpha.post(f"/sandboxes/{sid}/exec", json={"command": listen, "timeout": 30})
        assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
        extra = b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
        for _ in range(50):  # the listener is up within a few tries
            reply = raw(port, b"GET /x HTTP/1.1\r\nHost: 7100-" + sid.encode() + b".strata.local\r\n" + extra
                        + b"Connection: close\r\n\r\n")
            if status_of(reply) == 200:
                break
            time.sleep(0.2)
        assert status_of(reply) == 200, reply[:300]
        r = lab.alpha.post(f"/sandboxes/{sid}/exec", json={"command": "cat /tmp/req.txt", "timeout": 30})
        return r.json()["output"].lower()

    secrets = seen_by_guest({"X-API-Key": lab.alpha.headers["X-API-Key"],
                             "X-Access-Token": lab.sandbox["envdAccessToken"]})
    assert "get /x" in secrets and "x-api-key" not in secrets and "x-access-token" not in secrets, secrets
    own = seen_by_guest({"X-API-Key": "the-apps-own-key", "X-Access-Token": "the-apps-own-token"})
    assert "x-api-key: the-apps-own-key" in own and "x-access-token: the-apps-own-token" in own, own
