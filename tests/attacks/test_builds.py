"""Rows: template builds (api/builds.py). A COPY step names its files by
hash only, uploads belong to the uploading team and arrive through signed,
expiring links, a tar is checked before it is kept, and a build's sandbox
counts like any other."""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from tests import hostile_tars
from tests.attacks.lab import Lab
from tests.memory import peak_rss, reset_peak

HASH = hashlib.sha256(b"the files alpha's next build copies").hexdigest()


def tar_of(files: dict[str, bytes], *, kind: bytes = tarfile.REGTYPE) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.type = (len(data) if kind == tarfile.REGTYPE else 0), kind
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return out.getvalue()


def request_build(client: httpx.Client, name: str) -> str:
    r = client.post("/v3/templates", json={"name": name})
    assert r.status_code == 202, r.text
    return r.json()["buildID"]


def link(client: httpx.Client, name: str, files_hash: str = HASH) -> dict:
    r = client.get(f"/templates/{name}/files/{files_hash}")
    assert r.status_code == 201, r.text
    return r.json()


def wait_build(client: httpx.Client, name: str, build_id: str, *, until: tuple[str, ...] = ("ready", "error"),
               seen: str = "") -> dict:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = client.get(f"/templates/{name}/builds/{build_id}/status", params={"limit": 1000}).json()
        if status["status"] in until or (seen and any(seen in line for line in status["logs"])):
            return status
        time.sleep(0.5)
    raise AssertionError(f"build {build_id} never got to {until} / {seen!r}")


def alpha_tar_path(lab: Lab, team: str = "alpha", files_hash: str = HASH) -> Path:
    team_dir = hashlib.blake2b(team.encode(), digest_size=16).hexdigest()
    return lab.node.tmp / "state" / "template-files" / team_dir / f"{files_hash}.tar"


@pytest.mark.parametrize("how", ["absolute", "dot-dot"])
def test_a_copy_step_names_no_host_file(lab: Lab, tmp_path: Path, how: str) -> None:
    """attacker: team beta.  target: a host file outside the upload directory.
    attempt: a COPY step whose filesHash is `/path/secret` or `../../path/secret`,
    so the build copies the host's `secret.tar` into beta's guest.  must: 400,
    the build never starts."""
    secret = tmp_path / "secret.tar"
    secret.write_bytes(tar_of({"secret": b"the host's own file\n"}))
    named = str(secret)[:-len(".tar")]
    files_hash = named if how == "absolute" else "../" * 12 + named.lstrip("/")
    build_id = request_build(lab.beta, f"steal-{how}")
    r = lab.beta.post(f"/v2/templates/steal-{how}/builds/{build_id}",
                      json={"fromTemplate": "none", "steps": [{"type": "COPY", "args": ["secret", "/root/"],
                                                               "filesHash": files_hash}]})
    assert r.status_code == 400, r.text
    assert "filesHash" in r.json()["message"]
    assert lab.beta.get(f"/templates/steal-{how}/builds/{build_id}/status").json()["status"] == "waiting"


def test_another_teams_upload_is_not_yours(lab: Lab) -> None:
    """attacker: team beta.  target: the files alpha's next build copies.
    attempt: beta asks for an upload link for the hash alpha's SDK will ask
    for and uploads its own tar there first, then again after alpha's.
    must: alpha is still told to upload (present: false), alpha's tar is
    alpha's bytes, beta's writes land in beta's own space."""
    request_build(lab.alpha, "alpha-files")
    request_build(lab.beta, "beta-files")
    beta_link = link(lab.beta, "beta-files")
    planted = tar_of({"app.py": b"print('beta was here')\n"})
    assert httpx.put(beta_link["url"], content=planted).status_code == 200
    alpha_link = link(lab.alpha, "alpha-files")
    assert alpha_link["present"] is False and alpha_link["url"] != beta_link["url"]
    mine = tar_of({"app.py": b"print('alpha')\n"})
    assert httpx.put(alpha_link["url"], content=mine).status_code == 200
    assert link(lab.alpha, "alpha-files")["present"] is True
    assert httpx.put(beta_link["url"], content=planted).status_code == 200  # beta's link: beta's own space
    assert alpha_tar_path(lab).read_bytes() == mine
    assert alpha_tar_path(lab, "beta").read_bytes() == planted


@pytest.mark.parametrize("forgery", ["token", "team", "expires", "expired", "non-ascii", "none"])
def test_a_forged_or_expired_link_writes_nothing(lab: Lab, forgery: str) -> None:
    """attacker: anyone holding (or guessing) an upload link.  target: a
    team's upload space.  attempt: the link with its token, team or expiry
    changed, an expired one, a non-ASCII token, none.  must: 404 before the
    body is read, nothing written."""
    request_build(lab.beta, "forged")
    files_hash = hashlib.sha256(forgery.encode()).hexdigest()
    url = httpx.URL(link(lab.beta, "forged", files_hash)["url"])
    params = dict(url.params)
    if forgery == "token":
        params["token"] = params["token"][::-1]
    elif forgery == "team":
        params["team"] = "alpha"
    elif forgery == "expires":
        params["expires"] = str(int(params["expires"]) + 86400 * 365)
    elif forgery == "expired":
        params["expires"] = "1000"
    elif forgery == "non-ascii":
        params["token"] = "é" * 64
    else:
        params = {}
    r = httpx.put(url.copy_with(params=params), content=tar_of({"x": b"forged"}))
    assert r.status_code == 404, r.text
    for team in ("alpha", "beta"):
        assert not alpha_tar_path(lab, team, files_hash).exists()


@pytest.mark.parametrize("content", ["not-a-tar", "dot-dot", "absolute", "device"])
def test_a_hostile_tar_is_not_kept(lab: Lab, content: str) -> None:
    """attacker: team beta.  target: the node's upload space and the build
    that reads it.  attempt: a body that is no tar, or a tar with `../`
    or absolute names or a device node.  must: 400, nothing kept."""
    request_build(lab.beta, "hostile")
    files_hash = hashlib.sha256(content.encode()).hexdigest()
    body = {"not-a-tar": b"\x00garbage" * 1000,
            "dot-dot": tar_of({"../../escape": b"x"}),
            "absolute": tar_of({"/etc/cron.d/escape": b"x"}),
            "device": tar_of({"dev": b""}, kind=tarfile.CHRTYPE)}[content]
    r = httpx.put(link(lab.beta, "hostile", files_hash)["url"], content=body)
    assert r.status_code == 400, r.text
    assert link(lab.beta, "hostile", files_hash)["present"] is False


@pytest.mark.parametrize("shape", ["pax-bomb", "longname-bomb", "keyword-scan", "header-chain"])
def test_a_tar_header_bomb_is_refused_unread(lab: Lab, tmp_path: Path, shape: str) -> None:
    """attacker: team beta.  target: the node's memory and CPU (api/builds.py
    check_tar reads every uploaded tar).  attempt: a gzip tar of ~250 KiB
    whose headers attack the reader (tests/hostile_tars.py): a pax or GNU
    longname header declaring 256 MiB, pax records whose parse is quadratic,
    5,000 headers chained before one member.  must: 400 naming the bound,
    nothing kept, the node's peak memory grows by less than 64 MiB."""
    request_build(lab.beta, "bomb")
    body = hostile_tars.write(tmp_path / "bomb.tar.gz", shape).read_bytes()
    files_hash = hashlib.sha256(body).hexdigest()
    reset_peak(lab.node.proc.pid)
    before = peak_rss(lab.node.proc.pid)
    r = httpx.put(link(lab.beta, "bomb", files_hash)["url"], content=body, timeout=120)
    grown = peak_rss(lab.node.proc.pid) - before
    print(f"{shape}: a {len(body):,}-byte upload; the node's peak memory grew by {grown >> 20} MiB")
    assert r.status_code == 400 and "refused" in r.json()["message"], r.text
    assert link(lab.beta, "bomb", files_hash)["present"] is False
    assert grown < 64 << 20, f"the node's peak memory grew by {grown >> 20} MiB"


@pytest.mark.parametrize("key", ["strata.build", "strata.pool", "strata.anything"])
def test_reserved_metadata_cannot_hide_a_sandbox(lab: Lab, key: str) -> None:
    """attacker: team beta.  target: the node's capacity and the listing.
    attempt: a create with the metadata key that marks a build's (or the
    pool's) sandbox, which is neither listed nor counted.  must: 400,
    nothing created."""
    before = len(lab.node.admin.get("/admin/sandboxes").json())
    r = lab.beta.post("/sandboxes", json={"templateID": "guest:alpha", "metadata": {key: "x"}})
    assert r.status_code == 400, r.text
    assert len(lab.node.admin.get("/admin/sandboxes").json()) == before


def test_a_build_holds_a_place_of_its_team(lab: Lab) -> None:
    """attacker: team gamma, allowed one sandbox.  target: the node's
    capacity and gamma's quota.  attempt: a build (whose sandbox was not
    counted) running while gamma creates a sandbox.  must: the create is
    429 while the build runs; once it is done, gamma's place is free."""
    lab.own_image(lab.gamma, "guest:gamma")
    build_id = request_build(lab.gamma, "gamma-tpl")
    r = lab.gamma.post(f"/v2/templates/gamma-tpl/builds/{build_id}",
                       json={"fromImage": "guest:gamma", "steps": [{"type": "RUN", "args": ["sleep 6"]}]})
    assert r.status_code == 202, r.text
    wait_build(lab.gamma, "gamma-tpl", build_id, seen="step 1")
    refused = lab.gamma.post("/sandboxes", json={"templateID": "guest:gamma"})
    assert refused.status_code == 429 and "team_max_sandboxes" in refused.json()["message"], refused.text
    assert wait_build(lab.gamma, "gamma-tpl", build_id)["status"] == "ready"
    r = lab.gamma.post("/sandboxes", json={"templateID": "gamma-tpl"})
    assert r.status_code == 201, r.text
    assert lab.gamma.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204


def test_a_waiting_build_cannot_take_a_template_made_since(lab: Lab) -> None:
    """attacker: team beta.  target: a template alpha creates while beta's
    build of the same name runs (the name was free when beta asked).
    attempt: beta's build finishes after alpha's create.  must: the build
    fails naming the conflict; alpha's template is alpha's, unchanged."""
    lab.own_image(lab.beta, "guest:beta")
    build_id = request_build(lab.beta, "contested")
    r = lab.beta.post(f"/v2/templates/contested/builds/{build_id}",
                      json={"fromImage": "guest:beta", "steps": [{"type": "RUN", "args": ["sleep 4"]}]})
    assert r.status_code == 202, r.text
    made = lab.alpha.post("/templates", json={"name": "contested", "image": "guest:alpha"})
    assert made.status_code == 201, made.text
    status = wait_build(lab.beta, "contested", build_id)
    assert status["status"] == "error" and "another team" in status["reason"]["message"], status
    assert "contested" in {t["templateID"] for t in lab.alpha.get("/templates").json()}  # still alpha's
    assert "contested" not in {t["templateID"] for t in lab.beta.get("/templates").json()}


@pytest.mark.parametrize("image", ["127.0.0.1:{port}/team/app:1", "localhost:{port}/x:1", "169.254.169.254/latest:1",
                                   "10.0.0.1:5000/x@sha256:" + "ab" * 32])
def test_a_build_fetches_from_no_registry_the_node_was_not_told_of(lab: Lab, image: str) -> None:
    """attacker: team beta.  target: an address the node reaches and beta does
    not (the bait on the node's loopback, cloud metadata, a private host).
    attempt: a template build whose fromImage names it as a registry, with
    and without credentials.  must: 400 naming the `registries` setting
    before any request; the bait sees none."""
    hits = lab.bait.hits
    for auth in ({}, {"fromImageRegistry": {"type": "registry", "username": "u", "password": "p"}}):
        build_id = request_build(lab.beta, "pulled")
        r = lab.beta.post(f"/v2/templates/pulled/builds/{build_id}",
                          json={"fromImage": image.format(port=lab.bait.port), "steps": [], **auth})
        assert r.status_code == 400 and "registries" in r.json()["message"], r.text
    assert lab.bait.hits == hits


def test_build_requests_cannot_grow_the_nodes_memory_without_end(lab: Lab) -> None:
    """attacker: team delta.  target: the node's memory (api/builds.py kept
    every build it was asked for, with up to 40 MB of logs each, for ever).
    attempt: 300 build requests never started.  must: 429 naming the cap
    once delta holds MAX_TEAM_BUILDS; another team still gets its build."""
    from api.builds import MAX_TEAM_BUILDS

    codes = [lab.delta.post("/v3/templates", json={"name": "flood"}).status_code for _ in range(300)]
    assert codes[:MAX_TEAM_BUILDS] == [202] * MAX_TEAM_BUILDS and set(codes[MAX_TEAM_BUILDS:]) == {429}, codes
    r = lab.delta.post("/v3/templates", json={"name": "flood"})
    assert r.status_code == 429 and "builds on this node" in r.json()["message"], r.text
    assert lab.alpha.post("/v3/templates", json={"name": "alpha-still"}).status_code == 202
