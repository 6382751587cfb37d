"""The target the attack matrix's API rows aim at: a real `strata serve` on
loopback with teams alpha (the victim), beta (the attacker), gamma (held to
one sandbox), delta (held to one snapshot) and epsilon (to 8 MiB stored) and
an admin, a running sandbox of alpha's, a real `strata gateway` in front of the
node's store, and a bait server on another loopback port that only an
attack would reach (every request it gets is counted)."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.node_server import ADMIN_KEY, NodeServer
from tests.test_gateway import Gateway

ALPHA, BETA, GAMMA, DELTA = "alpha-attack-key-01", "beta-attack-key-01", "gamma-attack-key-01", "delta-attack-key-1"
EPSILON = "epsilon-attack-key-1"
BAIT = b"bait-server-secret-3f9c"


class Bait:
    """An HTTP server on loopback holding a secret: the place an SSRF would reach."""

    def __init__(self) -> None:
        self.hits = 0
        bait = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                bait.hits += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(BAIT)))
                self.end_headers()
                self.wfile.write(BAIT)

            do_POST = do_PUT = do_DELETE = do_OPTIONS = do_GET  # noqa: N815

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def raw(port: int, request: bytes, *, host: str = "127.0.0.1", timeout: float = 10.0) -> bytes:
    """Send `request` as it is on a new connection; what came back (to close or `timeout`)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(request)
        got = b""
        try:
            while len(got) < 1 << 20:
                block = s.recv(65536)
                if not block:
                    break
                got += block
        except (TimeoutError, ConnectionResetError):
            pass
    return got


def status_of(reply: bytes) -> int:
    """The status code of a raw HTTP reply (0: none)."""
    parts = reply.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


class Lab:
    """The node, its gateway, the bait, and alpha's sandbox."""

    def __init__(self, tmp: Path, guest: Path) -> None:
        self.bait = Bait()
        self.node = NodeServer(tmp / "node", guest, STRATA_API_KEYS=f"alpha:{ALPHA},beta:{BETA},gamma:{GAMMA},delta:{DELTA},"
                               f"epsilon:{EPSILON}", STRATA_TEAM_MAX_SANDBOXES="gamma=1",
                               STRATA_TEAM_MAX_SNAPSHOTS="delta=1", STRATA_TEAM_MAX_STORED="epsilon=8M",
                               STRATA_ADMIN_KEYS=f"ops:{ADMIN_KEY}", STRATA_NETWORK_ENABLED="true",
                               STRATA_NETWORK_DNS_PORT=str(free_port()), STRATA_NETWORK_GATE_PORT=str(free_port()))
        self.node.env["STRATA_ADVERTISE_URL"] = self.node.url
        self.node.start()
        self.gateway = Gateway(tmp, self.node.env, host="127.0.0.1", prefix=())
        self.gateway.wait_for(1)
        self.alpha = httpx.Client(base_url=self.node.url, headers={"X-API-Key": ALPHA}, timeout=300)
        self.beta = httpx.Client(base_url=self.node.url, headers={"X-API-Key": BETA}, timeout=300)
        self.gamma = httpx.Client(base_url=self.node.url, headers={"X-API-Key": GAMMA}, timeout=300)  # 1 sandbox
        self.delta = httpx.Client(base_url=self.node.url, headers={"X-API-Key": DELTA}, timeout=300)  # 1 snapshot
        self.epsilon = httpx.Client(base_url=self.node.url, headers={"X-API-Key": EPSILON}, timeout=300)  # 8 MiB
        self.guest = guest
        assert self.alpha.put("/images/guest:alpha", content=(guest / "rootfs.ext4").read_bytes()).status_code == 201
        r = self.alpha.post("/sandboxes", json={"templateID": "guest:alpha", "timeout": 1800,
                                                "metadata": {"owner": "alpha"}})
        assert r.status_code == 201, r.text
        self.sandbox = r.json()

    def own_image(self, client: httpx.Client, name: str) -> str:
        """Image `name` (the guest's rootfs) of `client`'s team, uploaded once."""
        if client.get(f"/images/{name}").status_code == 404:
            r = client.put(f"/images/{name}", content=(self.guest / "rootfs.ext4").read_bytes())
            assert r.status_code == 201, r.text
        return name

    def close(self) -> None:
        self.gateway.stop()
        self.alpha.close()
        self.beta.close()
        self.gamma.close()
        self.delta.close()
        self.epsilon.close()
        self.node.cleanup()
        self.bait.close()
