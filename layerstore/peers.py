"""Peer fetch: read chunks from other nodes before the shared store.

A node serves the chunk objects its own store holds at `GET /chunks/{digest}`
(authenticated, api/app.py). A node missing a chunk asks its peers first,
one at a time with short timeouts, and falls back to the remote store:

    Store.read_chunk: own store -> peers (in order, a failing peer is skipped
                      for `cooldown` seconds) -> remote store

Nothing a peer returns is trusted: the object is decoded and its blake3
compared with the digest asked for before use (Store.read_chunk), so a
lying or broken peer costs a retry elsewhere, never a corrupt byte.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import httpx

from .chunk import chunk_key
from .errors import BackendUnavailable, NotFound

log = logging.getLogger("strata.peers")


class Peer:
    """One node's chunk endpoint."""

    def __init__(self, url: str, *, api_key: str, timeout: float = 2.0, read_timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(base_url=self.url, headers={"X-API-Key": api_key},
                                    timeout=httpx.Timeout(read_timeout, connect=timeout))

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

    def close(self) -> None:
        self._client.close()


class Peers:
    """The peers a node asks, in order; one that fails sits out `cooldown` seconds."""

    def __init__(self, urls: Iterable[str], *, api_key: str, cooldown: float = 30.0, timeout: float = 2.0) -> None:
        self.peers = [Peer(u, api_key=api_key, timeout=timeout) for u in urls if u.strip()]
        self.cooldown = cooldown
        self._down: dict[str, float] = {}
        self._lock = threading.Lock()

    def candidates(self) -> list[Peer]:
        now = time.monotonic()
        with self._lock:
            return [p for p in self.peers if self._down.get(p.url, 0.0) <= now]

    def failed(self, peer: Peer, why: str) -> None:
        log.warning("peer %s: %s; skipping it for %.0f s", peer.url, why, self.cooldown)
        with self._lock:
            self._down[peer.url] = time.monotonic() + self.cooldown

    def describe(self) -> str:
        return ", ".join(p.url for p in self.peers)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
