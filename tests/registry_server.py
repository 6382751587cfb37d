"""A real OCI registry on loopback for the pull tests: Debian's
`docker-registry` (github.com/distribution/distribution 2.8) with no auth,
htpasswd (bcrypt) basic auth, or the Bearer token flow through a token
service this module runs (RS256 JWTs whose x5c certificate the registry
trusts). Images are pushed with `skopeo copy` from OCI layouts the tests
write. `Proxy` sits in front of a registry, records every request it sees,
and can corrupt the bytes of chosen blobs (a registry that lies).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import shutil
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx

from tests.conftest import free_port

USER, PASSWORD = "alice", "s3cret-pass"
SERVICE, ISSUER = "strata-test-registry", "strata-test-issuer"
PACKAGES = "docker-registry skopeo apache2-utils"


def missing_tools() -> list[str]:
    return [tool for tool in ("docker-registry", "skopeo", "htpasswd") if shutil.which(tool) is None]


class Registry:
    """`docker-registry` on 127.0.0.1:<free port>; `auth` is none, basic or bearer."""

    def __init__(self, root: Path, *, auth: str = "none") -> None:
        self.root, self.auth = root, auth
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        self.token: TokenService | None = None
        config: dict[str, Any] = {
            "version": "0.1", "log": {"level": "info", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(root / "data")}, "delete": {"enabled": True}},
            "http": {"addr": self.host, "secret": uuid.uuid4().hex}}
        if auth == "basic":
            subprocess.run(["htpasswd", "-Bbc", str(root / "htpasswd"), USER, PASSWORD], check=True,
                           capture_output=True)
            config["auth"] = {"htpasswd": {"realm": "strata-test", "path": str(root / "htpasswd")}}
        elif auth == "bearer":
            self.token = TokenService(root)
            config["auth"] = {"token": {"realm": self.token.url, "service": SERVICE, "issuer": ISSUER,
                                        "rootcertbundle": str(self.token.cert_path)}}
        (root / "config.yml").write_text(json.dumps(config))  # YAML reads JSON
        self.log = open(root / "registry.log", "ab")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")], stdout=self.log,
                                     stderr=self.log)
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {(self.root / 'registry.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=2).status_code in (200, 401):
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("docker-registry did not answer")

    def push(self, layout: Path, repo_tag: str, *, all_images: bool = False) -> None:
        """`skopeo copy oci:LAYOUT docker://HOST/REPO:TAG` (with --all: an index as a manifest list)."""
        creds = ["--dest-creds", f"{USER}:{PASSWORD}"] if self.auth != "none" else []
        r = subprocess.run(["skopeo", "--insecure-policy", "copy", "--dest-tls-verify=false", *creds,
                            *(["--all"] if all_images else []), f"oci:{layout}", f"docker://{self.host}/{repo_tag}"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if self.token is not None:
            self.token.close()


class TokenService:
    """The Bearer realm: a token for the requested scope to USER:PASSWORD,
    401 to anyone else; signed with a key whose self-signed certificate is
    the registry's rootcertbundle."""

    def __init__(self, root: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "strata test token issuer")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self.cert_path = root / "token-cert.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.requests: list[str] = []
        self.server = _serve(self._handle)
        self.url = f"http://127.0.0.1:{self.server.server_port}/token"

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        self.requests.append(handler.path)
        good = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        if handler.headers.get("Authorization") != good:
            _reply(handler, 401, b'{"errors": [{"code": "UNAUTHORIZED"}]}')
            return
        query = parse_qs(urlparse(handler.path).query)
        access = []
        for scope in query.get("scope", []):
            for one in scope.split(" "):
                kind, _, rest = one.partition(":")
                repo, _, actions = rest.rpartition(":")
                access.append({"type": kind, "name": repo, "actions": actions.split(",")})
        token = self._sign({"iss": ISSUER, "sub": USER, "aud": SERVICE, "exp": int(time.time()) + 300,
                            "nbf": int(time.time()) - 10, "iat": int(time.time()), "jti": uuid.uuid4().hex,
                            "access": access})
        _reply(handler, 200, json.dumps({"token": token, "access_token": token, "expires_in": 300}).encode())

    def _sign(self, claims: dict[str, Any]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(self.cert_der).decode()]}
        signing = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{b64(signature)}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Proxy:
    """HTTP in front of `upstream` (HOST:PORT): records each request's path;
    the bodies of the blobs in `corrupt` (digests) come back with one byte flipped."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.requests: list[str] = []
        self.corrupt: set[str] = set()
        self.client = httpx.Client(timeout=60)
        self.server = _serve(self._handle)
        self.host = f"127.0.0.1:{self.server.server_port}"

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        self.requests.append(handler.path)
        headers = {k: v for k, v in handler.headers.items() if k.lower() in ("authorization", "accept")}
        r = self.client.get(f"http://{self.upstream}{handler.path}", headers=headers)
        body = r.content
        if r.status_code == 200 and handler.path.rsplit("/", 1)[-1] in self.corrupt:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        keep = {k: v for k, v in r.headers.items()
                if k.lower() in ("content-type", "docker-content-digest", "www-authenticate", "location")}
        _reply(handler, r.status_code, body, keep)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()


def _serve(handle: Any) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            handle(self)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _reply(handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    handler.send_response(status)
    for key, value in (headers or {"Content-Type": "application/json"}).items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
