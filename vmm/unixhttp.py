"""HTTP/1.1 over AF_UNIX, and Firecracker's REST API spoken through it.

Firecracker serves its API on a unix socket only; http.client does the
HTTP once its connection is pointed at the socket (through
layerstore/unixsock.py, so a deep work directory still connects). Error
bodies are the swagger `Error`, {"fault_message": "..."}; the endpoints
used are listed in vmm/firecracker.py.
"""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

from layerstore.unixsock import connect_unix

from .backend import VmmError


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client speaking to a unix socket: Firecracker's API is HTTP/1.1 on
    AF_UNIX only. The Host header stays "localhost" (ignored by Firecracker)."""

    def __init__(self, socket_path: str, *, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            connect_unix(sock, self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class FirecrackerApi:
    """One Firecracker process's API. A new connection per request: calls are
    rare (boot, pause, snapshot), and no keep-alive state survives a VM that
    another process controlled in between."""

    def __init__(self, socket_path: Path, *, timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
             timeout: float | None = None) -> dict[str, Any] | None:
        """Send one request; returns the JSON body (None for 204). A non-2xx
        answer raises VmmError carrying Firecracker's fault_message."""
        conn = UnixHTTPConnection(str(self.socket_path), timeout=timeout or self.timeout)
        headers = {"Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise VmmError(f"firecracker API {method} {path} failed: {exc or type(exc).__name__} "
                           "(VM stopped?)") from None
        finally:
            conn.close()
        if not 200 <= response.status < 300:
            raise VmmError(f"firecracker refused {method} {path} ({response.status}): "
                           f"{_fault_message(raw) or response.reason}")
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise VmmError(f"firecracker API {method} {path} answered non-JSON: {raw[:200]!r}") from None

    def put(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> None:
        self.call("PUT", path, body, timeout=timeout)

    def patch(self, path: str, body: dict[str, Any]) -> None:
        self.call("PATCH", path, body)

    def get(self, path: str, *, timeout: float | None = None) -> dict[str, Any]:
        return self.call("GET", path, timeout=timeout) or {}


def _fault_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["fault_message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace").strip()[:500]

