"""Peer fetch (layerstore/peers.py through ReadThroughBackend): peers first, the remote
store last, and nothing a peer sends is used unverified. Peers here are real
HTTP servers on loopback; the remote is a local directory store."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from layerstore.chunk import chunk_key
from layerstore.errors import MissingChunk, NotFound
from layerstore.importer import import_image
from layerstore.localdir import LocalDirBackend
from layerstore.peers import Peers
from tests.conftest import free_port
from tests.images import write_image
from tests.test_transfer import local_store


class FakeNode:
    """Serves GET /chunks/{digest} from `objects` (a dict), checking the API key."""

    def __init__(self, objects: dict[str, bytes], key: str = "peer-key-123") -> None:
        self.objects = objects
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.requests += 1
                if self.headers.get("X-API-Key") != key:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = outer.objects.get(self.path.rsplit("/", 1)[-1])
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[tuple[object, list[str], dict[str, bytes]]]:
    """A store holding an image: its chunk digests and their stored objects."""
    s = local_store(tmp_path / "origin")
    write_image(tmp_path / "a.img", "rrp", seed=1)
    manifest = import_image(s, tmp_path / "a.img", "app:v1").manifest_id
    digests = sorted(set(s.chunk_map(manifest)[1].values()))
    objects = {d: s.backend.get(chunk_key(d)) for d in digests}
    yield s, digests, objects
    s.close()


def node_with(tmp_path: Path, peers: Peers, remote: Path | None) -> object:
    return local_store(tmp_path / "node", remote=LocalDirBackend(remote, create=False) if remote else None, peers=peers)


def test_peer_first_then_remote(origin, tmp_path: Path) -> None:  # noqa: ANN001
    src, digests, objects = origin
    honest = FakeNode({digests[0]: objects[digests[0]]})  # holds one chunk of three
    node = node_with(tmp_path, Peers([honest.url], api_key="peer-key-123"), tmp_path / "origin" / "objects")
    for d in digests:
        assert node.read_chunk(d) == src.read_chunk(d)
    assert node.sources["peer"] == 1 and node.sources["remote"] == 2 and node.sources["local"] == 0
    with pytest.raises(NotFound):  # what a node serves its peers is its own objects: it never relays
        node.backend.get(chunk_key(digests[0]))
    honest.close()
    node.close()


def test_a_lying_peer_cannot_corrupt_a_node(origin, tmp_path: Path) -> None:  # noqa: ANN001
    src, digests, objects = origin
    liar = FakeNode({d: objects[digests[(i + 1) % len(digests)]] for i, d in enumerate(digests)})  # wrong bytes
    honest = FakeNode(objects)
    node = node_with(tmp_path, Peers([liar.url, honest.url], api_key="peer-key-123"), None)
    assert node.read_chunk(digests[0]) == src.read_chunk(digests[0])
    assert node.sources["peer_rejected"] == 1 and node.sources["peer"] == 1
    before = liar.requests
    for d in digests[1:]:
        assert node.read_chunk(d) == src.read_chunk(d)
    assert liar.requests == before  # the liar sits out its cooldown
    liar.close()
    honest.close()
    node.close()


def test_dead_or_unauthorised_peers_cost_bounded_time(origin, tmp_path: Path) -> None:  # noqa: ANN001
    src, digests, objects = origin
    locked = FakeNode(objects, key="another-key-456")  # 401 to us
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    peers = Peers([dead, locked.url], api_key="peer-key-123", timeout=1.0)
    node = node_with(tmp_path, peers, tmp_path / "origin" / "objects")
    started = time.monotonic()
    assert node.read_chunk(digests[0]) == src.read_chunk(digests[0])
    assert time.monotonic() - started < 5 and node.sources["remote"] == 1
    assert peers.candidates() == []  # both sit out their cooldown
    alone = node_with(tmp_path / "x", Peers([dead], api_key="k" * 8), None)
    with pytest.raises(MissingChunk):
        alone.read_chunk(digests[0])
    locked.close()
    node.close()
    alone.close()
