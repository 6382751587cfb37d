"""Images pulled from OCI registries (layerstore/registry.py, `strata image
pull`, a build's registry `fromImage`) against a real registry: Debian's
`docker-registry` on loopback, without auth, with htpasswd basic auth and
with the Bearer token flow, images pushed by `skopeo` from OCI layouts
written here. A proxy in front of a registry counts what is fetched and
can make the registry lie about a blob."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from layerstore.errors import InvalidInput
from layerstore.registry import is_registry_ref, parse_reference
from tests.conftest import IN_CI, ROOT
from tests.oci_images import CONFIG, layer, write_oci, write_oci_index
from tests.registry_server import PACKAGES, PASSWORD, USER, Proxy, Registry, missing_tools, sha256

L1 = layer([("dir", "etc"), ("file", "etc/hello", b"hello from layer 1\n")])
L2 = layer([("file", "etc/two", b"layer 2\n"), ("file", "etc/big", os.urandom(300_000))])
L3 = layer([("file", "etc/three", b"layer 3\n")])


@pytest.fixture(scope="module")
def tools() -> None:
    missing = missing_tools()
    if missing:
        message = f"{', '.join(missing)} not installed (apt-get install {PACKAGES})"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def open_registry(tools: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry(tmp_path_factory.mktemp("registry-open"))
    yield reg
    reg.close()


@pytest.fixture
def proxy(open_registry: Registry) -> Iterator[Proxy]:
    p = Proxy(open_registry.host)
    yield p
    p.close()


def pushed(reg: Registry, tmp_path: Path, repo_tag: str, layers: list[bytes]) -> Path:
    layout = write_oci(tmp_path / f"layout-{repo_tag.replace('/', '-').replace(':', '-')}", layers)
    reg.push(layout, repo_tag)
    return layout


def strata(tmp_path: Path, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    full.update(HOME=str(tmp_path / "home"), STRATA_STORE=str(tmp_path / "store"),
                STRATA_STATE_DIR=str(tmp_path / "state"), **env)
    return subprocess.run([str(ROOT / ".venv/bin/strata"), *args], env=full, input=stdin, capture_output=True,
                          text=True, timeout=300)


def pull(tmp_path: Path, ref: str, *args: str, stdin: str = "", **env: str) -> dict:
    r = strata(tmp_path, "image", "pull", ref, "--json", *args, stdin=stdin, **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def refs(tmp_path: Path) -> list[str]:
    r = strata(tmp_path, "image", "ls", "--json")
    assert r.returncode == 0, r.stderr
    return [row["ref"] for row in json.loads(r.stdout)]


def file_in(tmp_path: Path, ref: str, path: str) -> str:
    """A file of image `ref`, read from its exported ext4 disk."""
    disk = tmp_path / f"export-{ref.replace(':', '-')}.img"
    assert strata(tmp_path, "image", "export", ref, str(disk)).returncode == 0
    r = subprocess.run(["debugfs", "-R", f"cat {path}", str(disk)], capture_output=True, text=True)
    disk.unlink()
    return r.stdout


def blob_requests(proxy: Proxy) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in proxy.requests if "/blobs/" in p)


# references ---------------------------------------------------------------------------------
def test_references_are_parsed_into_parts_and_anything_odd_is_refused() -> None:
    r = parse_reference("127.0.0.1:5000/team/app:1")
    assert (r.host, r.port, r.repository, r.tag, r.digest) == ("127.0.0.1", 5000, "team/app", "1", "")
    assert r.registry == "127.0.0.1:5000" and r.default_name() == "app:1"
    digest = "sha256:" + "ab" * 32
    r = parse_reference(f"ghcr.io/org/tool@{digest}")
    assert r.reference == digest and r.default_name() == f"tool:sha256-{'ab' * 32}" and r.port is None
    assert parse_reference("localhost/x").reference == "latest"
    assert parse_reference("docker.io/alpine:3").repository == "library/alpine"
    for bad in ("app:1", "team/app:1", "http://host.io/a", "host.io/a/../b", "host.io/A", "host.io/a b",
                "host.io:99999/a", "host.io:0/a", "host.io/a@sha256:abc", "host.io/a:-x", "ho_st.io/a",
                "host.io/a?x=1", "host.io/a#f", "host.io//a", "host.io/a/", "host.io/a\n", "héllo.io/a", ""):
        with pytest.raises(InvalidInput):
            parse_reference(bad)
    assert is_registry_ref("ghcr.io/a") and is_registry_ref("localhost/a") and is_registry_ref("h:5000/a")
    assert not is_registry_ref("app:1") and not is_registry_ref("team/app:1")


def test_a_public_registry_cannot_send_the_client_inside() -> None:
    """A redirect or token realm from a registry at a public address may go
    to another public host (a CDN), never to an internal one, however it is
    written: an address, an IPv4 shorthand, an IPv4-mapped IPv6 address, or
    a name whose addresses include an internal one. No request is made to
    find out (names resolve through the stand-in resolver here)."""
    from layerstore.registry import RegistryError, Session

    names = {"registry.example": ["93.184.215.14"], "cdn.example": ["93.184.215.15", "2606:2800:21f::1"],
             "rebind.example": ["93.184.215.16", "127.0.0.1"], "meta.example": ["169.254.169.254"]}
    session = Session(parse_reference("registry.example/team/app:1"), resolve=lambda name: names.get(name, []))
    base = session.url("blobs", "sha256:" + "ab" * 32)
    try:
        assert session._target(base, "https://cdn.example/blob?sig=1").host == "cdn.example"
        for inside in ("https://169.254.169.254/latest/meta-data", "https://10.0.0.5/x", "https://127.0.0.1:8080/",
                       "https://[::1]/x", "https://localhost/x", "https://0.0.0.0/x", "http://cdn.example/x",
                       "file:///etc/passwd", "https://127.1/x", "https://0x7f.1/x", "https://2130706433/x",
                       "https://[::ffff:127.0.0.1]/x", "https://rebind.example/x", "https://meta.example/x"):
            with pytest.raises(RegistryError):
                session._target(base, inside)
    finally:
        session.close()


# pulls --------------------------------------------------------------------------------------
def test_pull_by_tag_then_by_digest(open_registry: Registry, tmp_path: Path) -> None:
    pushed(open_registry, tmp_path, "team/app:1", [L1, L2])
    first = pull(tmp_path, f"{open_registry.host}/team/app:1")
    assert first["ref"] == "app:1" and first["layers"] == 2 and first["fetched_layers"] == 2
    assert file_in(tmp_path, "app:1", "/etc/hello") == "hello from layer 1\n"
    assert file_in(tmp_path, "app:1", "/etc/two") == "layer 2\n"
    r = strata(tmp_path, "image", "inspect", "app:1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["missing_chunks"] == 0
    by_digest = pull(tmp_path, f"{open_registry.host}/team/app@{first['digest']}", "--as", "app:pinned")
    assert by_digest["digest"] == first["digest"] and by_digest["fetched_layers"] == 0
    assert by_digest["reused_layers"] == 2 and by_digest["new_chunks"] == 0  # the same disk
    assert file_in(tmp_path, "app:pinned", "/etc/two") == "layer 2\n"
    r = strata(tmp_path, "image", "pull", f"{open_registry.host}/team/app@sha256:{'0' * 64}")
    assert r.returncode == 1 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_new_version_fetches_only_the_layers_the_store_lacks(proxy: Proxy, open_registry: Registry,
                                                                tmp_path: Path) -> None:
    pushed(open_registry, tmp_path, "team/svc:1", [L1, L2])
    pushed(open_registry, tmp_path, "team/svc:2", [L1, L2, L3])
    v1 = pull(tmp_path, f"{proxy.host}/team/svc:1")
    assert v1["fetched_layers"] == 2 and v1["fetched_blobs"] == 3  # two layers and the config
    proxy.requests.clear()
    v2 = pull(tmp_path, f"{proxy.host}/team/svc:2")
    assert (v2["layers"], v2["reused_layers"], v2["fetched_layers"], v2["fetched_blobs"]) == (3, 2, 1, 2)
    config = [p for p in blob_requests(proxy) if p != sha256(L3)]
    assert blob_requests(proxy) == sorted([sha256(L3), *config]) and len(config) == 1  # L1, L2 never asked for
    assert v2["fetched_bytes"] == len(L3) + len(json.dumps(CONFIG).encode())
    assert file_in(tmp_path, "svc:2", "/etc/three") == "layer 3\n"
    assert file_in(tmp_path, "svc:2", "/etc/hello") == "hello from layer 1\n"
    assert v2["new_chunks"] < v1["new_chunks"]  # built on v1's disk: its blocks stay where they were


def test_an_index_is_resolved_to_linux_amd64(open_registry: Registry, tmp_path: Path) -> None:
    amd = layer([("dir", "etc"), ("file", "etc/arch", b"amd64\n")])
    arm = layer([("dir", "etc"), ("file", "etc/arch", b"arm64\n")])
    s390 = layer([("dir", "etc"), ("file", "etc/arch", b"s390x\n")])
    open_registry.push(write_oci_index(tmp_path / "multi", [("arm64", [arm]), ("amd64", [amd])]), "team/multi:1",
                       all_images=True)
    got = pull(tmp_path, f"{open_registry.host}/team/multi:1")
    assert file_in(tmp_path, "multi:1", "/etc/arch") == "amd64\n" and got["fetched_layers"] == 1
    open_registry.push(write_oci_index(tmp_path / "other", [("arm64", [arm]), ("s390x", [s390])]),
                       "team/other:1", all_images=True)
    r = strata(tmp_path, "image", "pull", f"{open_registry.host}/team/other:1")
    assert r.returncode == 1 and "no linux/amd64 image in" in r.stderr and "arm64" in r.stderr, r.stderr
    assert "other:1" not in refs(tmp_path)


@pytest.mark.parametrize("what", ["layer", "config"])
def test_a_registry_that_lies_about_a_blob_publishes_nothing(proxy: Proxy, open_registry: Registry,
                                                             tmp_path: Path, what: str) -> None:
    layout = pushed(open_registry, tmp_path, f"team/lie-{what}:1", [L1, L2])
    manifest = json.loads((layout / "blobs" / "sha256" / json.loads(
        (layout / "index.json").read_text())["manifests"][0]["digest"].split(":")[1]).read_text())
    target = manifest["layers"][1]["digest"] if what == "layer" else manifest["config"]["digest"]
    proxy.corrupt.add(target)
    r = strata(tmp_path, "image", "pull", f"{proxy.host}/team/lie-{what}:1")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "does not match its digest" in r.stderr and target[:19] in r.stderr
    if what == "layer":
        assert "layer 2 (" in r.stderr
    assert refs(tmp_path) == []  # neither the image nor a strata-oci chain
    assert not list((tmp_path / "state" / "build").iterdir())  # the fetched layout is gone


# auth -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("auth", ["basic", "bearer"])
def test_credentials(tools: None, tmp_path: Path, auth: str) -> None:
    reg = Registry(tmp_path / "registry", auth=auth)
    try:
        pushed(reg, tmp_path, "team/private:1", [L1])
        ref = f"{reg.host}/team/private:1"
        for password in ("wrong-password", ""):
            r = strata(tmp_path, "image", "pull", ref, *(["--username", USER, "--password-stdin"] if password else []),
                       stdin=password + "\n")
            assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert f"registry {reg.host}" in r.stderr and PASSWORD not in r.stderr
            assert ("username and password" in r.stderr), r.stderr
        assert refs(tmp_path) == []
        got = pull(tmp_path, ref, "--username", USER, "--password-stdin", stdin=PASSWORD + "\n")
        assert got["fetched_layers"] == 1 and file_in(tmp_path, "private:1", "/etc/hello") == "hello from layer 1\n"
        got = pull(tmp_path, ref, "--as", "private:env", STRATA_REGISTRY_USERNAME=USER,
                   STRATA_REGISTRY_PASSWORD=PASSWORD)
        assert got["reused_layers"] == 1
        if reg.token is not None:
            assert reg.token.requests, "the Bearer flow asked the token service"
    finally:
        reg.close()


# the API --------------------------------------------------------------------------------------
@pytest.fixture
def node(tools: None, tmp_path: Path, guest: Path) -> Iterator[tuple[object, Registry, Proxy]]:
    from tests.node_server import NodeServer

    reg = Registry(tmp_path / "registry", auth="basic")
    outsider = Proxy(reg.host)  # the same registry under an address the node's config does not name
    srv = NodeServer(tmp_path / "node", guest, STRATA_REGISTRIES=f"example.org,{reg.host}")
    try:
        srv.start()
        yield srv, reg, outsider
    finally:
        srv.cleanup()
        outsider.close()
        reg.close()


def start_build(client: httpx.Client, name: str, body: dict) -> tuple[str, httpx.Response]:
    r = client.post("/v3/templates", json={"name": name})
    assert r.status_code == 202, r.text
    build_id = r.json()["buildID"]
    return build_id, client.post(f"/v2/templates/{name}/builds/{build_id}", json=body)


def wait_build(client: httpx.Client, name: str, build_id: str) -> dict:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = client.get(f"/templates/{name}/builds/{build_id}/status", params={"limit": 1000}).json()
        if status["status"] in ("ready", "error"):
            return status
        time.sleep(0.5)
    raise AssertionError(f"build {build_id} did not end")


def busybox_layer() -> bytes:
    busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
    return layer([("dir", "bin"), ("file", "bin/busybox", busybox, 0o755), ("symlink", "bin/sh", "busybox"),
                  ("dir", "root"), ("dir", "srv"), ("dir", "etc"), ("file", "etc/hello", b"from the registry\n")])


def test_a_build_from_a_registry_image(node: tuple, tmp_path: Path) -> None:
    srv, reg, outsider = node
    pushed(reg, tmp_path, "team/base:1", [busybox_layer()])
    creds = {"type": "registry", "username": USER, "password": PASSWORD}
    _, r = start_build(srv.client, "not-allowed", {"fromImage": f"{outsider.host}/team/base:1",
                                                   "fromImageRegistry": creds})
    assert r.status_code == 400 and "registries" in r.json()["message"] and outsider.requests == [], r.text
    _, r = start_build(srv.client, "aws", {"fromImage": f"{reg.host}/team/base:1", "fromImageRegistry": {
        "type": "aws", "awsAccessKeyId": "x", "awsSecretAccessKey": "y", "awsRegion": "z"}})
    assert r.status_code == 400 and "'aws' is not supported" in r.json()["message"], r.text
    assert "registry" in r.json()["message"]
    build_id, r = start_build(srv.client, "wrong", {"fromImage": f"{reg.host}/team/base:1", "fromImageRegistry": {
        **creds, "password": "nope"}})
    assert r.status_code == 202, r.text
    status = wait_build(srv.client, "wrong", build_id)
    assert status["status"] == "error" and f"registry {reg.host}" in status["reason"]["message"], status
    assert "base:1" not in [i["ref"] for i in srv.client.get("/images").json()]
    build_id, r = start_build(srv.client, "from-registry", {
        "fromImage": f"{reg.host}/team/base:1", "fromImageRegistry": creds,
        "steps": [{"type": "RUN", "args": ["grep -q 'from the registry' /etc/hello"]}]})  # the pulled files
    assert r.status_code == 202, r.text
    status = wait_build(srv.client, "from-registry", build_id)
    assert status["status"] == "ready", status
    assert any("fetched 1 of 1 layers" in line for line in status["logs"]), status["logs"]
    assert "base:1" in [i["ref"] for i in srv.client.get("/images").json()]  # kept as the team's image
