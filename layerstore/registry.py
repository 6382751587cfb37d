"""Images pulled from OCI registries (the distribution API), into the store.

    HOST[:PORT]/REPO/PATH[:TAG][@sha256:...]
      GET /v2/REPO/manifests/TAG|DIGEST    an image manifest, or an index -> its linux/amd64 manifest
      GET /v2/REPO/blobs/CONFIG            the image config
      GET /v2/REPO/blobs/LAYER ...         only the layers the store has no disk of
    -> an OCI layout under the build directory -> `import_oci` (layerstore/rootfs.py)

Layers the store already holds are not fetched: the manifest names every
layer's digest, and so the OCI chain ids of its prefixes, before a byte of
a layer is read; the longest prefix whose disk the store itself tagged
(`strata-oci:<chain>`, rootfs.py) is built on, and only the layers after
it are downloaded and applied.

Every byte from a registry is hostile. References are parsed into parts
by a strict grammar and URLs are built from the parts; JSON documents are
capped (oci.MAX_JSON); every document and blob is checked against its
digest as it streams (a blob to a file, 1 MiB at a time, never past the size
its descriptor gives); a registry that lies is an error naming the layer,
before anything is published. Every request has a timeout, a pull a
deadline, redirects are followed a few times and only to https (http only
when the registry itself is on loopback or `insecure` says so), and a
registry at a public address cannot send the client to an internal one
(loopback, private, link-local such as cloud metadata).

Auth: anonymous; HTTP basic; or the Bearer token flow (a 401 with
`WWW-Authenticate: Bearer realm=...,service=...,scope=...`: the realm is
asked for a token with the basic credentials, the request retried with it).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import httpx

from .errors import CorruptObject, InvalidInput, NotFound, StrataError
from .importer import ImportResult
from .oci import INDEX_TYPES, MANIFEST_TYPES, MAX_JSON
from .rootfs import DEFAULT_MAX_BYTES, import_oci, known_layers
from .store import Store

BLOCK = 1 << 20
MAX_REDIRECTS = 5
MAX_LAYERS = 1000
REQUEST_TIMEOUT = 60.0  # seconds one request may wait for bytes
PULL_TIMEOUT = 3600.0  # seconds a whole pull may take, unless its caller says
LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
               "application/vnd.oci.image.layer.v1.tar+zstd", "application/vnd.docker.image.rootfs.diff.tar.gzip",
               "application/vnd.docker.image.rootfs.diff.tar")
ACCEPT = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
DIGEST_RE = re.compile(r"sha256:[a-f0-9]{64}")
_HOST_RE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
                      r"[A-Za-z0-9])?)*")
_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_PARAM_RE = re.compile(r'([A-Za-z][A-Za-z0-9_-]*)=(?:"([^"]*)"|([^,\s]*))')
DOCKER_HUB = ("docker.io", "index.docker.io")  # names of Docker Hub, whose API is at registry-1.docker.io

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]


class RegistryError(StrataError):
    """A registry failed, refused or answered something that is not an image."""


class RegistryAuthError(RegistryError):
    """A registry refused the credentials (or wants some)."""


@dataclass(frozen=True)
class Reference:
    """A parsed `HOST[:PORT]/REPO/PATH[:TAG][@sha256:...]`."""

    host: str
    port: int | None
    repository: str  # "team/app": components of the distribution grammar joined by '/'
    tag: str = ""
    digest: str = ""

    @property
    def registry(self) -> str:
        """HOST[:PORT], as the allowlist (config `registries`) names it."""
        return self.host if self.port is None else f"{self.host}:{self.port}"

    @property
    def reference(self) -> str:
        """What the manifest is asked for by: the digest if given, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + \
            (f"@{self.digest}" if self.digest else "")

    def default_name(self) -> str:
        """A Strata NAME:TAG for this image: the last path component and the
        tag (a digest alone: `sha256-<hex>`)."""
        tag = self.tag or (self.digest.replace(":", "-") if self.digest else "latest")
        return f"{self.repository.rsplit('/', 1)[-1]}:{tag}"


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)


def is_registry_ref(text: str) -> bool:
    """Whether `text` names a registry image (its first path component is a
    host: holds '.' or ':', or is `localhost`) rather than a store NAME:TAG."""
    first, slash, _ = text.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def parse_reference(text: str) -> Reference:
    """`text` as a Reference; InvalidInput for anything outside the grammar."""
    if not isinstance(text, str) or not text or len(text) > 512 or not text.isascii():
        raise InvalidInput(f"invalid registry reference {str(text)[:100]!r}")
    rest, at, digest = text.partition("@")
    if at and not DIGEST_RE.fullmatch(digest):
        raise InvalidInput(f"invalid registry reference {text!r}: a digest is sha256:<64 lowercase hex>")
    hostport, slash, path = rest.partition("/")
    if not slash or not is_registry_ref(rest):
        raise InvalidInput(f"invalid registry reference {text!r}: name the registry, HOST[:PORT]/REPO[:TAG]")
    host, port = _hostport(hostport, text)
    repository, colon, tag = path.partition(":")
    if colon and not _TAG_RE.fullmatch(tag):
        raise InvalidInput(f"invalid registry reference {text!r}: bad tag {tag!r}")
    components = repository.split("/")
    if len(repository) > 255 or not all(_COMPONENT_RE.fullmatch(c) for c in components):
        raise InvalidInput(f"invalid registry reference {text!r}: a repository is lowercase letters, digits and "
                           "separators ('.', '_', '-'), components joined by '/'")
    if host.lower() in DOCKER_HUB:
        host = "registry-1.docker.io"
        repository = repository if "/" in repository else f"library/{repository}"
    return Reference(host.lower(), port, repository, tag if colon else ("" if at else "latest"), digest)


def _hostport(text: str, whole: str) -> tuple[str, int | None]:
    host, colon, port = text.partition(":")
    if not _HOST_RE.fullmatch(host) or len(host) > 253:
        raise InvalidInput(f"invalid registry reference {whole!r}: bad host {host!r}")
    if not colon:
        return host, None
    if not port.isdigit() or not 1 <= int(port) <= 65535 or len(port) > 5:
        raise InvalidInput(f"invalid registry reference {whole!r}: bad port {port!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_host(name: str) -> list[str]:
    """The addresses a host name has (getaddrinfo); none when it has none."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return []


def host_addresses(host: str, resolve: Callable[[str], list[str]] = resolve_host) -> list[IPAddress]:
    """The addresses `host` stands for: a literal, an IPv4 shorthand the C library
    also takes (`127.1`, `0x7f.1`, `2130706433`), else every address its name has."""
    text = host.strip("[]")
    try:
        return [ipaddress.ip_address(text)]
    except ValueError:
        pass
    try:
        return [ipaddress.IPv4Address(socket.inet_aton(text))]
    except (OSError, UnicodeError):
        pass
    found: list[IPAddress] = []
    for address in resolve(text):
        try:
            found.append(ipaddress.ip_address(address.split("%", 1)[0]))
        except ValueError:
            continue
    return found


def is_internal(host: str, *, resolve: Callable[[str], list[str]] = resolve_host) -> bool:
    """An address no public registry sends a client to: loopback, private,
    link-local (cloud metadata at 169.254.169.254), unspecified, multicast,
    whether written as an address, a shorthand or a name that has one."""
    if is_loopback(host):
        return True
    for ip in host_addresses(host, resolve):
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_unspecified or ip.is_multicast \
                or ip.is_reserved:
            return True
    return False


# the wire ---------------------------------------------------------------------------------
class Session:
    """Requests to one registry: auth, redirects, timeouts, the deadline."""

    def __init__(self, ref: Reference, *, credentials: Credentials | None = None, insecure: bool = False,
                 timeout: float = REQUEST_TIMEOUT, deadline: float | None = None,
                 resolve: Callable[[str], list[str]] = resolve_host) -> None:
        self.ref = ref
        self.resolve = resolve  # host names to addresses, for the redirect check
        self.credentials = credentials
        self.plain_http = insecure or is_loopback(ref.host)  # http:// allowed (and used)
        self.timeout = timeout
        self.deadline = deadline if deadline is not None else time.monotonic() + PULL_TIMEOUT
        self.auth: str | None = None  # the Authorization header that worked
        self.client = httpx.Client(follow_redirects=False, trust_env=False)

    def close(self) -> None:
        self.client.close()

    def url(self, kind: str, reference: str) -> httpx.URL:
        """/v2/REPO/{manifests|blobs}/REFERENCE on the registry, built from parsed parts."""
        return httpx.URL(scheme="http" if self.plain_http else "https", host=self.ref.host, port=self.ref.port,
                         path=f"/v2/{self.ref.repository}/{kind}/{reference}")

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RegistryError(f"pulling {self.ref} did not finish before its deadline")
        return left

    @contextmanager
    def get(self, url: httpx.URL, *, accept: str = "") -> Iterator[httpx.Response]:
        """A streamed 200 response to GET `url`, authenticated as the registry asks."""
        response = self._send(url, accept)
        try:
            if response.status_code == 401:  # (again, when a token expired: a new one)
                challenge = response.headers.get("www-authenticate", "")
                response.close()
                self._authenticate(challenge)
                response = self._send(url, accept)
                if response.status_code == 401:
                    raise RegistryAuthError(self._refused(f"refused access to {self.ref.repository}"))
            _check_status(response, self.ref, url)
            yield response
        except httpx.HTTPError as exc:  # while the body streamed: cut off, timed out
            raise RegistryError(f"registry {self.ref.registry}: {type(exc).__name__}: {exc}") from None
        finally:
            response.close()

    def _send(self, url: httpx.URL, accept: str) -> httpx.Response:
        """GET with redirects followed by hand: at most MAX_REDIRECTS, each target checked, the
        credentials sent only to the registry itself."""
        for _ in range(MAX_REDIRECTS + 1):
            headers = {"Accept-Encoding": "identity", **({"Accept": accept} if accept else {})}
            if self.auth and (url.host, url.port) == (self.ref.host, self.ref.port):
                headers["Authorization"] = self.auth
            timeout = min(self.timeout, self.remaining())
            try:
                response = self.client.send(self.client.build_request("GET", url, headers=headers,
                                                                      timeout=httpx.Timeout(timeout)), stream=True)
            except httpx.HTTPError as exc:
                raise RegistryError(f"registry {self.ref.registry}: {type(exc).__name__}: {exc}") from None
            if response.status_code not in (301, 302, 303, 307, 308):
                return response
            location = response.headers.get("location", "")
            response.close()
            url = self._target(url, location)
        raise RegistryError(f"registry {self.ref.registry}: more than {MAX_REDIRECTS} redirects")

    def _target(self, base: httpx.URL, location: str) -> httpx.URL:
        """Where a redirect (or a token realm) may send the client."""
        try:
            url = base.join(location)
        except (httpx.InvalidURL, ValueError):
            raise RegistryError(f"registry {self.ref.registry}: malformed redirect {location[:200]!r}") from None
        if url.scheme not in ("https", "http") or (url.scheme == "http" and not self.plain_http):
            raise RegistryError(f"registry {self.ref.registry}: refused to follow it to {url.scheme}:// "
                                f"({str(url)[:200]}): https only")
        if is_internal(url.host, resolve=self.resolve) and not is_internal(self.ref.host, resolve=self.resolve):
            raise RegistryError(f"registry {self.ref.registry}: refused to follow it to an internal address "
                                f"({url.host})")
        return url

    def _authenticate(self, challenge: str) -> None:
        scheme, _, rest = challenge.strip().partition(" ")
        params = {k.lower(): a or b for k, a, b in _PARAM_RE.findall(rest)}
        if scheme.lower() == "basic":
            if self.credentials is None:
                raise RegistryAuthError(f"registry {self.ref.registry} needs a username and password")
            self.auth = _basic(self.credentials)
        elif scheme.lower() == "bearer" and params.get("realm"):
            self.auth = f"Bearer {self._token(params)}"
        else:
            raise RegistryError(f"registry {self.ref.registry}: unsupported authentication {scheme[:40]!r}")

    def _token(self, params: dict[str, str]) -> str:
        """A token from the challenge's realm, asked with the basic credentials if any."""
        realm = self._target(self.url("manifests", "x"), params["realm"])
        query = {"scope": params.get("scope") or f"repository:{self.ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        headers = {"Authorization": _basic(self.credentials)} if self.credentials else {}
        try:
            response = self.client.get(realm, params=query, headers=headers,
                                       timeout=min(self.timeout, self.remaining()))
        except httpx.HTTPError as exc:
            raise RegistryError(f"registry {self.ref.registry}: its token service {realm.host}: {exc}") from None
        if response.status_code in (401, 403):
            raise RegistryAuthError(self._refused(f"(its token service {realm.host}) refused the credentials"))
        if response.status_code != 200 or len(response.content) > MAX_JSON:
            raise RegistryError(f"registry {self.ref.registry}: its token service {realm.host} answered "
                                f"{response.status_code}")
        try:
            body = json.loads(response.content)
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token or not token.isascii() or any(c in token for c in "\r\n"):
            raise RegistryError(f"registry {self.ref.registry}: its token service {realm.host} sent no token")
        return token

    def _refused(self, what: str) -> str:
        who = f"as {self.credentials.username!r}" if self.credentials else "anonymously"
        return f"registry {self.ref.registry} {what} ({who}): check the username and password"

    def read_json(self, url: httpx.URL, *, accept: str = "", digest: str = "") -> tuple[bytes, str]:
        """A JSON document (at most MAX_JSON bytes, checked against `digest`
        if given) and its Content-Type."""
        with self.get(url, accept=accept) as response:
            data = bytearray()
            for block in response.iter_raw():
                data += block
                if len(data) > MAX_JSON:
                    raise CorruptObject(f"registry {self.ref.registry}: {url.path} is larger than {MAX_JSON} bytes")
                self.remaining()
            sent = response.headers.get("docker-content-digest", "")
            kind = response.headers.get("content-type", "").split(";")[0].strip()
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        for want in (digest, sent if DIGEST_RE.fullmatch(sent) else ""):
            if want and want != actual:
                raise CorruptObject(f"registry {self.ref.registry}: {url.path} does not match its digest {want} "
                                    f"(got {actual[:23]}...)")
        return bytes(data), kind

    def download(self, digest: str, size: int, dest: Path, name: str, advance: Callable[[int], None]) -> None:
        """Blob `digest` to the file `dest`, hashed as it streams; CorruptObject
        naming `name` if it is not `size` bytes hashing to `digest`."""
        sha, got = hashlib.sha256(), 0
        part = dest.with_name(dest.name + ".part")
        with self.get(self.url("blobs", digest)) as response, open(part, "wb", buffering=BLOCK) as out:
            for block in response.iter_raw():  # as they arrive: the deadline is checked between them
                got += len(block)
                if got > size:
                    raise CorruptObject(f"registry {self.ref.registry}: {name} is longer than the {size} bytes "
                                        "its manifest gives")
                sha.update(block)
                out.write(block)
                advance(len(block))
                self.remaining()
        if "sha256:" + sha.hexdigest() != digest or got != size:
            raise CorruptObject(f"registry {self.ref.registry}: {name} does not match its digest {digest} "
                                f"(sha256:{sha.hexdigest()[:16]}... over {got} of {size} bytes): the registry sent "
                                "something else")
        os.replace(part, dest)


def _basic(credentials: Credentials) -> str:
    token = base64.b64encode(f"{credentials.username}:{credentials.password}".encode()).decode()
    return f"Basic {token}"


def _check_status(response: httpx.Response, ref: Reference, url: httpx.URL) -> None:
    if response.status_code == 200:
        return
    if response.status_code == 404:
        raise NotFound(f"registry {ref.registry}: {ref.repository}@{url.path.rsplit('/', 1)[-1][:80]} not found")
    if response.status_code == 403:
        raise RegistryAuthError(f"registry {ref.registry} denied access to {ref.repository} (403)")
    raise RegistryError(f"registry {ref.registry}: GET {url.path[:200]} answered {response.status_code}")


# manifests --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """An image manifest as fetched: its bytes (kept as they are: the layout stores them), its digest, and what it names."""

    data: bytes
    digest: str
    media_type: str
    config: Descriptor
    layers: list[Descriptor]


def fetch_manifest(session: Session) -> Manifest:
    """The image manifest of the session's reference: an index is resolved
    to its linux/amd64 manifest (fetched by digest)."""
    ref = session.ref
    data, kind = session.read_json(session.url("manifests", ref.reference), accept=ACCEPT, digest=ref.digest)
    doc = _json(data, f"{ref}: manifest")
    if _is_index(doc, kind):
        chosen = _amd64(doc, ref)
        data, kind = session.read_json(session.url("manifests", chosen), accept=ACCEPT, digest=chosen)
        doc = _json(data, f"{ref}: manifest {chosen}")
        if _is_index(doc, kind):
            raise CorruptObject(f"{ref}: the linux/amd64 entry of its index is another index")
    return _manifest(doc, data, kind, ref)


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise CorruptObject(f"{what} is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptObject(f"{what} is not a JSON object")
    return doc


def _is_index(doc: dict[str, Any], kind: str) -> bool:
    return doc.get("mediaType") in INDEX_TYPES or kind in INDEX_TYPES or "manifests" in doc


def _amd64(index: dict[str, Any], ref: Reference) -> str:
    entries = index.get("manifests")
    if not isinstance(entries, list):
        raise CorruptObject(f"{ref}: its index has no list of manifests")
    for entry in entries:
        platform = entry.get("platform") if isinstance(entry, dict) else None
        if isinstance(platform, dict) and platform.get("os") == "linux" and platform.get("architecture") == "amd64":
            return _descriptor(entry, f"{ref}: index entry").digest
    found = sorted({f"{(e.get('platform') or {}).get('os')}/{(e.get('platform') or {}).get('architecture')}"
                    for e in entries if isinstance(e, dict) and isinstance(e.get("platform"), dict)})
    raise InvalidInput(f"no linux/amd64 image in {ref} (it has {', '.join(found)[:200] or 'no platforms'})")


def _descriptor(doc: Any, what: str) -> Descriptor:
    if not isinstance(doc, dict):
        raise CorruptObject(f"{what}: not a descriptor")
    digest, size, media = doc.get("digest"), doc.get("size"), doc.get("mediaType", "")
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise CorruptObject(f"{what}: digest {str(digest)[:80]!r} is not sha256:<64 hex>")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CorruptObject(f"{what}: size {str(size)[:40]!r} is not a byte count")
    if not isinstance(media, str):
        raise CorruptObject(f"{what}: mediaType is not a string")
    return Descriptor(media, digest, size)


def _manifest(doc: dict[str, Any], data: bytes, kind: str, ref: Reference) -> Manifest:
    if doc.get("schemaVersion") != 2:
        raise InvalidInput(f"{ref}: manifest schema {str(doc.get('schemaVersion'))[:20]} is not supported (2 is)")
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers or len(layers) > MAX_LAYERS:
        raise CorruptObject(f"{ref}: the manifest names no layers, or more than {MAX_LAYERS}")
    config = _descriptor(doc.get("config"), f"{ref}: config")
    parsed = [_descriptor(d, f"{ref}: layer {n}") for n, d in enumerate(layers, 1)]
    for n, layer in enumerate(parsed, 1):
        if layer.media_type not in LAYER_TYPES:
            raise InvalidInput(f"{ref}: layer {n} ({layer.digest[:19]}) has media type {layer.media_type[:80]!r}, "
                               "not a tar layer this node unpacks")
    media = doc.get("mediaType") if doc.get("mediaType") in MANIFEST_TYPES else (
        kind if kind in MANIFEST_TYPES else MANIFEST_TYPES[0])
    return Manifest(data, "sha256:" + hashlib.sha256(data).hexdigest(), str(media), config, parsed)


def _check_config(data: bytes, manifest: Manifest, ref: Reference) -> None:
    """The config is for linux/amd64 and describes as many layers as the manifest."""
    config = _json(data, f"{ref}: image config")
    os_, arch = config.get("os", "linux"), config.get("architecture", "amd64")
    if (os_, arch) != ("linux", "amd64"):
        raise InvalidInput(f"no linux/amd64 image in {ref}: it is {str(os_)[:20]}/{str(arch)[:20]}")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") if isinstance(config.get("rootfs"), dict) else None
    if isinstance(diff_ids, list) and len(diff_ids) != len(manifest.layers):
        raise CorruptObject(f"{ref}: its config names {len(diff_ids)} layers, its manifest {len(manifest.layers)}")


# pulls ------------------------------------------------------------------------------------
@dataclass
class Fetched:
    """An image fetched into an OCI layout: what a pull downloaded and what it reused."""

    reference: Reference
    layout: Path
    digest: str  # the image manifest's
    layers: int
    reused: int  # the first layers the store had a disk of: not fetched
    fetched_blobs: int = 0  # layers and config downloaded
    fetched_bytes: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"source": str(self.reference), "digest": self.digest, "layers": self.layers,
                "reused_layers": self.reused, "fetched_layers": self.layers - self.reused,
                "fetched_blobs": self.fetched_blobs, "fetched_bytes": self.fetched_bytes}


@contextmanager
def fetched_image(store: Store, ref: Reference, *, build_root: Path, credentials: Credentials | None = None,
                  insecure: bool = False, timeout: float = REQUEST_TIMEOUT, deadline: float | None = None,
                  max_bytes: int = DEFAULT_MAX_BYTES, progress: Callable[[int], None] = lambda n: None,
                  on_total: Callable[[int], None] = lambda n: None) -> Iterator[Fetched]:
    """`ref` fetched into an OCI layout directory under `build_root` (removed
    on the way out): its manifest and config, and the layers after the
    longest prefix the store has a disk of. `progress`/`on_total` count
    layer bytes; `deadline` is a time.monotonic() the pull must end by."""
    build_root.mkdir(parents=True, exist_ok=True)
    layout = Path(tempfile.mkdtemp(prefix="pull-", dir=build_root))
    session = Session(ref, credentials=credentials, insecure=insecure, timeout=timeout, deadline=deadline)
    try:
        yield _fetch(session, store, layout, max_bytes, progress, on_total)
    finally:
        session.close()
        shutil.rmtree(layout, ignore_errors=True)


def _fetch(session: Session, store: Store, layout: Path, max_bytes: int, progress: Callable[[int], None],
           on_total: Callable[[int], None]) -> Fetched:
    ref = session.ref
    manifest = fetch_manifest(session)
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    config, _ = session.read_json(session.url("blobs", manifest.config.digest), digest=manifest.config.digest)
    _check_config(config, manifest, ref)
    reused = known_layers(store, [d.digest for d in manifest.layers])
    wanted = manifest.layers[reused:]
    if sum(d.size for d in wanted) > max_bytes:
        raise InvalidInput(f"{ref}: its layers are larger than {max_bytes} bytes (--max-unpacked)")
    on_total(sum(d.size for d in wanted))
    fetched = Fetched(ref, layout, manifest.digest, len(manifest.layers), reused, 1, len(config))
    for n, layer in enumerate(manifest.layers[reused:], reused + 1):
        dest = blobs / layer.digest.split(":", 1)[1]
        if not dest.exists():  # an image may hold one layer twice
            session.download(layer.digest, layer.size, dest, f"layer {n} ({layer.digest[:19]})", progress)
            fetched.fetched_blobs += 1
            fetched.fetched_bytes += layer.size
    (blobs / manifest.config.digest.split(":", 1)[1]).write_bytes(config)
    _write_layout(layout, manifest)
    return fetched


def _write_layout(layout: Path, manifest: Manifest) -> None:
    (layout / "blobs" / "sha256" / manifest.digest.split(":", 1)[1]).write_bytes(manifest.data)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    index = {"schemaVersion": 2, "manifests": [{"mediaType": manifest.media_type, "digest": manifest.digest,
                                                "size": len(manifest.data),
                                                "platform": {"architecture": "amd64", "os": "linux"}}]}
    (layout / "index.json").write_text(json.dumps(index))


def import_fetched(store: Store, fetched: Fetched, name: str | None, *, build_root: Path,
                   max_bytes: int = DEFAULT_MAX_BYTES, **import_options: Any) -> ImportResult:
    """The fetched image as the ext4 disk image `name` (None: unnamed, the
    caller publishes it), built on the store's disk of the reused layers."""
    return import_oci(store, fetched.layout, name, build_root=build_root, max_bytes=max_bytes,
                      absent=fetched.reused, source=str(fetched.reference), **import_options)


def pull_image(store: Store, ref: Reference, name: str | None, *, build_root: Path,
               credentials: Credentials | None = None, insecure: bool = False, deadline: float | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES, note: Callable[[str], None] = lambda s: None,
               **import_options: Any) -> tuple[Fetched, ImportResult]:
    """Fetch `ref` and import it as `name`: both steps, for callers without a terminal (the API's builds)."""
    with fetched_image(store, ref, build_root=build_root, credentials=credentials, insecure=insecure,
                       deadline=deadline, max_bytes=max_bytes) as fetched:
        note(summary(fetched))
        result = import_fetched(store, fetched, name, build_root=build_root, max_bytes=max_bytes, **import_options)
    return fetched, result


def summary(fetched: Fetched) -> str:
    """What a pull fetched and what it reused, in one line."""
    reused = f"; reused {fetched.reused} already in the store" if fetched.reused else ""
    return (f"{fetched.reference} ({fetched.digest[:19]}): fetched {fetched.layers - fetched.reused} of "
            f"{fetched.layers} layers and the config, {fetched.fetched_bytes} bytes{reused}")
