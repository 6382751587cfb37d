"""Peer fetch: other nodes as read-through sources of chunks.

A node serves the chunk objects its own store holds at `GET /chunks/{digest}`
(authenticated, api/routes/peers.py). A node's read path (store.open_store) asks its
peers, one at a time with short timeouts, after its own store and before
the remote store:

    ReadThroughBackend(own store, [peer, peer, ..., remote])

Each `Peer` is a best-effort `Source` (layerstore/readthrough.py): a peer
that is down, refuses us or sends an object that fails verification sits
out `cooldown` seconds, during which asking it costs nothing (a miss). Nothing
a peer returns is trusted: ReadThroughBackend decodes it and compares its
blake3 with the digest asked for before use, so a lying or broken peer
costs a retry elsewhere, never a corrupt byte.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import httpx

from .chunk import chunk_key
from .digest import is_digest
from .errors import BackendUnavailable, NotFound
from .readthrough import Fallback

log = logging.getLogger("strata.peers")


class Peer:
    """One node's chunk endpoint, as a read-through `Source` of chunk keys."""

    def __init__(self, url: str, *, api_key: str, cooldown: float = 30.0, timeout: float = 2.0,
                 read_timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.cooldown = cooldown
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._client = httpx.Client(base_url=self.url, headers={"X-API-Key": api_key},
                                    timeout=httpx.Timeout(read_timeout, connect=timeout))

    def available(self) -> bool:
        """False while the peer sits out its cooldown after a failure."""
        with self._lock:
            return self._down_until <= time.monotonic()

    def failed(self, why: str) -> None:
        """Skip this peer for `cooldown` seconds."""
        log.warning("peer %s: %s; skipping it for %.0f s", self.url, why, self.cooldown)
        with self._lock:
            self._down_until = time.monotonic() + self.cooldown

    def get_chunk(self, digest: str) -> bytes:
        """The peer's stored object for `digest` (unverified); NotFound if it has none."""
        chunk_key(digest)  # validates the digest before it goes into a URL
        try:
            response = self._client.get(f"/chunks/{digest}")
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"peer {self.url}: {type(exc).__name__}: {exc}") from None
        if response.status_code == 404:
            raise NotFound(f"peer {self.url} has no chunk {digest}")
        if response.status_code != 200:
            raise BackendUnavailable(f"peer {self.url} answered {response.status_code}")
        return response.content

    def get(self, key: str) -> bytes:
        """The object at chunk key `key`; a miss for other keys and while cooling down."""
        digest = key.rsplit("/", 1)[-1]
        if not self.available() or not is_digest(digest) or key != chunk_key(digest):
            raise NotFound(f"peer {self.url} not asked for {key}")
        return self.get_chunk(digest)

    def has_many(self, keys: Iterable[str]) -> set[str]:
        """Peers promise nothing: a chunk counts as readable only where a store holds it."""
        return set()

    def describe(self) -> str:
        return self.url

    def close(self) -> None:
        self._client.close()


class Peers:
    """The peers a node asks, in order."""

    def __init__(self, urls: Iterable[str], *, api_key: str, cooldown: float = 30.0, timeout: float = 2.0) -> None:
        self.peers = [Peer(u, api_key=api_key, cooldown=cooldown, timeout=timeout) for u in urls if u.strip()]

    def candidates(self) -> list[Peer]:
        """The peers not sitting out a cooldown."""
        return [p for p in self.peers if p.available()]

    def fallbacks(self) -> list[Fallback]:
        """The peers as best-effort read-through sources, each cooling down on failure."""
        return [Fallback("peer", p, best_effort=True, on_failure=p.failed) for p in self.peers]

    def describe(self) -> str:
        return ", ".join(p.url for p in self.peers)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
