"""Passing requests on (api/proxy.py) through the gateway's app served by a
real uvicorn on loopback, to real upstream servers on loopback standing in
for a node: HTTP with bodies both ways, the Host header kept and hop-by-hop
headers dropped, WebSockets routed by a `{port}-{id}.{domain}` host with that
host in the handshake, and an upstream that is gone answering 503."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from websockets.asyncio.server import serve
from websockets.sync.client import connect

from vmm import placement
from api.gateway import Cluster, Gateway
from layerstore import nodes
from layerstore.store import open_store
from tests.conftest import free_port


class Served:
    """An ASGI app under uvicorn in a thread."""

    def __init__(self, app: object) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def echo_app(scope: dict, receive: object, send: object) -> None:
    """An upstream HTTP server: answers with what it was sent (headers, body), streamed in parts."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()  # type: ignore[operator]
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    seen = {"path": scope["path"], "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
            "body": len(body)}
    await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                "headers": [(b"content-type", b"application/json"), (b"x-upstream", b"yes")]})
    await send({"type": "http.response.body", "body": json.dumps(seen).encode(), "more_body": True})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"\n" + b"z" * (1 << 20), "more_body": False})  # type: ignore[operator]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, object, int]]:
    store = open_store(str(tmp_path / "store"), create=True)
    upstream = Served(echo_app)
    ws_port = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def ws_echo(conn: object) -> None:
        host = conn.request.headers["Host"]  # type: ignore[attr-defined]
        async for message in conn:  # type: ignore[attr-defined]
            await conn.send(f"{host}|{message}")  # type: ignore[attr-defined]

    stop: list[asyncio.Future] = []

    async def ws_main() -> None:
        async with serve(ws_echo, "127.0.0.1", ws_port):
            stop.append(loop.create_future())
            ready.set()
            await stop[0]

    ws_thread = threading.Thread(target=lambda: loop.run_until_complete(ws_main()), daemon=True)
    ws_thread.start()
    assert ready.wait(10)
    nodes.publish(store.backend, "http-node", [], about={"url": f"http://127.0.0.1:{upstream.port}", "max": 4})
    nodes.publish(store.backend, "ws-node", [], about={"url": f"http://127.0.0.1:{ws_port}", "max": 4})
    nodes.publish(store.backend, "dead-node", [], about={"url": f"http://127.0.0.1:{free_port()}", "max": 4})
    placement.place(store.backend, "sbhttp", "http-node")
    placement.place(store.backend, "sbws", "ws-node")
    placement.place(store.backend, "sbdead", "dead-node")
    front = Served(Gateway(Cluster(store.backend, refresh=60)))
    try:
        yield f"http://127.0.0.1:{front.port}", store, front.port
    finally:
        front.stop()
        upstream.stop()
        loop.call_soon_threadsafe(stop[0].set_result, None)
        ws_thread.join(timeout=10)
        loop.close()
        store.close()


def test_http_goes_to_the_sandboxes_node_with_its_host_and_body(gateway: tuple[str, object, int]) -> None:
    url, _store, _port = gateway
    body = b"x" * (3 << 20)
    r = httpx.post(f"{url}/sandboxes/sbhttp/files", content=body, timeout=30,
                   headers={"Host": "49983-sbhttp.sandboxes.test", "Proxy-Authorization": "Basic c2VjcmV0",
                            "X-API-Key": "k", "e2b-traffic-access-token": "t"})
    assert r.status_code == 200 and r.headers["x-upstream"] == "yes"
    seen = json.loads(r.content.split(b"\n", 1)[0])
    assert len(r.content.split(b"\n", 1)[1]) == 1 << 20  # streamed back whole
    assert seen["body"] == len(body) and seen["path"] == "/sandboxes/sbhttp/files"
    assert seen["headers"]["host"] == "49983-sbhttp.sandboxes.test"  # upload links point back at the gateway
    assert seen["headers"]["x-api-key"] == "k" and seen["headers"]["e2b-traffic-access-token"] == "t"
    assert "proxy-authorization" not in seen["headers"]  # hop-by-hop: not passed on
    r = httpx.get(f"{url}/anything", headers={"E2b-Sandbox-Id": "sbhttp"}, timeout=30)
    assert json.loads(r.content.split(b"\n", 1)[0])["path"] == "/anything"


def test_a_websocket_reaches_the_node_with_the_sandbox_host(gateway: tuple[str, object, int]) -> None:
    _url, _store, port = gateway
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    with connect("ws://8000-sbws.sandboxes.test/socket", sock=sock, open_timeout=10) as ws:
        ws.send("ping")
        assert ws.recv(timeout=10) == "8000-sbws.sandboxes.test|ping"
        ws.send(b"\x00bytes")
        assert ws.recv(timeout=10) == "8000-sbws.sandboxes.test|b'\\x00bytes'"


def test_a_node_that_is_gone_answers_503_naming_it_and_unknown_ids_404(gateway: tuple[str, object, int]) -> None:
    url, _store, _port = gateway
    r = httpx.get(f"{url}/sandboxes/sbdead", timeout=30)
    assert r.status_code == 503 and "dead-node" in r.json()["message"], r.text
    r = httpx.get(f"{url}/sandboxes/nosuch", timeout=30)
    assert r.status_code == 404 and r.json()["code"] == 404
    r = httpx.post(f"{url}/sandboxes", content=b"{" * (2 << 20), timeout=30)
    assert r.status_code == 413
