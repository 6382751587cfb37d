"""Rows: one team against another's sandbox through the control plane, the
node's metrics and the data plane. Another team's sandbox answers exactly as
a missing one, and nothing lists its id."""

from __future__ import annotations

import httpx
import pytest

from tests.attacks.lab import Lab

ACTIONS = [  # (method, path after /sandboxes/{id}, body)
    ("GET", "", None), ("DELETE", "", None), ("POST", "/pause", None), ("POST", "/resume", {"timeout": 60}),
    ("POST", "/connect", {"timeout": 60}), ("POST", "/timeout", {"timeout": 60}), ("POST", "/refreshes", {}),
    ("POST", "/fork", {"count": 1}), ("POST", "/exec", {"command": "cat /etc/hostname"}),
    ("GET", "/logs", None), ("GET", "/metrics", None), ("PUT", "/network", {"allowOut": ["0.0.0.0/0"]}),
    ("POST", "/snapshots", {"name": "stolen"}),
]


@pytest.mark.parametrize("method,action,body", ACTIONS, ids=[f"{m} {a or '/'}" for m, a, _ in ACTIONS])
def test_another_teams_sandbox_is_missing(lab: Lab, method: str, action: str, body: dict | None) -> None:
    """attacker: team beta, knowing alpha's sandbox id.  target: alpha's
    sandbox.  attempt: every control-plane action on it.  must: 404 with the
    message a missing sandbox gets; alpha's sandbox still runs."""
    sid = lab.sandbox["sandboxID"]
    r = lab.beta.request(method, f"/sandboxes/{sid}{action}", json=body)
    assert r.status_code == 404, r.text
    assert sid in r.json()["message"] and "not found" in r.json()["message"]
    assert lab.alpha.get(f"/sandboxes/{sid}").json()["state"] == "running"


@pytest.mark.parametrize("path", ["/metrics", "/v2/sandboxes", "/sandboxes", "/sandboxes/metrics?sandbox_ids={sid}",
                                  "/snapshots", "/templates", "/images", "/admin/sandboxes",
                                  "/v2/sandboxes?template=guest:alpha",
                                  "/v2/sandboxes?startedAfter=2000-01-01T00:00:00Z&state=running,paused"])
def test_no_listing_names_another_teams_sandbox(lab: Lab, path: str) -> None:
    """attacker: team beta.  target: alpha's sandbox id (with public ports
    by default, the id is what reaches alpha's services).  attempt: every
    listing, the node's Prometheus metrics included, and the v2 listing
    filtered by alpha's template or a start time before alpha's.  must: alpha's id
    appears nowhere beta can read."""
    sid = lab.sandbox["sandboxID"]
    r = lab.beta.get(path.format(sid=sid))
    if "{sid}" in path:  # asked by id: answered as a missing one, which names only what was asked
        assert r.status_code == 404 and r.json()["message"] == f"sandbox {sid} not found", r.text
        return
    assert r.status_code in (200, 403), r.text
    assert sid not in r.text


def test_the_data_plane_wants_the_sandboxs_own_token(lab: Lab) -> None:
    """attacker: team beta, with its own key but not alpha's sandbox token.
    target: alpha's guest through envd's data plane.  attempt: reading a
    file with beta's API key, with no token, with a wrong one.  must: 401,
    nothing read."""
    sid = lab.sandbox["sandboxID"]
    for headers in ({"X-API-Key": lab.beta.headers["X-API-Key"]}, {}, {"X-Access-Token": "0" * 32}):
        r = httpx.get(f"{lab.node.url}/files", params={"path": "/etc/hostname"},
                      headers={"E2b-Sandbox-Id": sid, **headers})
        assert r.status_code == 401, r.text


def test_another_teams_idempotency_key_makes_the_attackers_own_sandbox(lab: Lab) -> None:
    """attacker: team beta.  target: the sandbox alpha created with an
    Idempotency-Key (a retry with the key returns it, token and all).
    attempt: beta's create with alpha's key and alpha's exact request, then
    with its own template.  must: the first is 404 (alpha's template is
    unknown to beta), the second a new sandbox of beta's; never alpha's id
    or token; alpha's retry still returns alpha's."""
    request = {"templateID": "guest:alpha", "timeout": 120}
    key = {"Idempotency-Key": "alpha-job-1"}
    first = lab.alpha.post("/v2/sandboxes", json=request, headers=key)
    assert first.status_code == 201, first.text
    same = lab.beta.post("/v2/sandboxes", json=request, headers=key)
    mine = lab.beta.post("/v2/sandboxes", json={**request, "templateID": lab.own_image(lab.beta, "guest:beta-idem")},
                         headers=key)
    try:
        assert mine.status_code == 201 and mine.json()["sandboxID"] != first.json()["sandboxID"], mine.text
        assert same.status_code == 404 and first.json()["sandboxID"] not in same.text  # alpha's template: unknown
        assert first.json()["envdAccessToken"] not in mine.text + same.text
        again = lab.alpha.post("/v2/sandboxes", json=request, headers=key)
        assert again.json()["sandboxID"] == first.json()["sandboxID"]
    finally:
        lab.alpha.delete(f"/sandboxes/{first.json()['sandboxID']}")
        if mine.status_code == 201:
            lab.beta.delete(f"/sandboxes/{mine.json()['sandboxID']}")


def test_a_sandbox_of_a_shared_template_cannot_predict_anothers_randomness(lab: Lab) -> None:
    """attacker: team beta, starting sandboxes from the public template alpha
    starts from too.  target: the random bytes alpha's sandbox makes (keys,
    tokens), which every restore of one snapshot would share with the same
    kernel random state.  attempt: read /dev/urandom in beta's sandbox
    right after alpha reads in its own.  must: different bytes."""
    from tests.attacks.test_images import strata

    r = lab.alpha.post("/sandboxes", json={"templateID": "guest:alpha", "timeout": 600})
    assert r.status_code == 201, r.text
    source = r.json()["sandboxID"]
    made = [source]
    try:  # /dev/random answers once the kernel's random state is ready: it is what the snapshot then keeps
        assert lab.alpha.post(f"/sandboxes/{source}/exec", json={"command": "head -c 1 /dev/random | wc -c"}
                              ).json()["output"] == "1\n"
        r = lab.alpha.post(f"/sandboxes/{source}/snapshots", json={})
        assert r.status_code == 201, r.text
        strata(lab.node.env, "template", "create", "shared-random", "--snapshot", r.json()["snapshotID"], "--public",
               "--json")
        read = "head -c 32 /dev/urandom | md5sum"
        seen = []
        for client in (lab.alpha, lab.beta):
            r = client.post("/sandboxes", json={"templateID": "shared-random", "timeout": 600})
            assert r.status_code == 201, r.text
            sid = r.json()["sandboxID"]
            made.append(sid)
            seen.append(client.post(f"/sandboxes/{sid}/exec", json={"command": read}).json()["output"])
        assert len(set(seen)) == 2 and all(len(s.split()[0]) == 32 for s in seen), seen
    finally:
        for sid, client in zip(made, (lab.alpha, lab.alpha, lab.beta)):
            client.delete(f"/sandboxes/{sid}")


def test_a_teams_key_reads_no_chunk_by_its_digest(lab: Lab) -> None:
    """attacker: team beta, knowing (or guessing) the digest of a chunk of alpha's data.
    target: the peer endpoint `GET /chunks/{digest}` (api/routes/peers.py), which serves any
    chunk the node's store holds.  attempt: fetch a chunk of alpha's image with beta's key.
    must: 403 naming the admin key, no byte of it; the admin key a peer presents gets it."""
    from tests.node_server import ADMIN_KEY

    chunk = next((lab.node.tmp / "store").rglob("chunks/*/*"))
    digest = chunk.name
    r = lab.beta.get(f"/chunks/{digest}")
    assert r.status_code == 403 and "admin key" in r.text and chunk.read_bytes()[:64] not in r.content, r.text
    peer = httpx.get(f"{lab.node.url}/chunks/{digest}", headers={"X-API-Key": ADMIN_KEY}, timeout=30)
    assert peer.status_code == 200 and peer.content == chunk.read_bytes()


def test_a_teams_names_are_its_own_with_every_tag(lab: Lab) -> None:
    """attacker: team beta.  target: names team alpha holds: its template `app` and the tags
    alpha will give it, and its image `shadow:v1`.  attempt: make template `app:prod` (as a
    new template, and by tagging one of beta's own as it), make template `shadow:v1`, and upload
    an image under the name of a template of alpha's.  must: 409 naming the name each time,
    nothing written; alpha then tags `app:prod` itself and its `shadow:v1` still boots its own
    image."""
    alpha_image = lab.own_image(lab.alpha, "guest:alpha")
    beta_image = lab.own_image(lab.beta, "guest:beta")
    assert lab.alpha.post("/templates", json={"name": "app", "image": alpha_image}).status_code == 201
    assert lab.alpha.put("/images/shadow:v1", content=(lab.guest / "rootfs.ext4").read_bytes()).status_code == 201
    assert lab.beta.post("/templates", json={"name": "beta-own", "image": beta_image}).status_code == 201
    attempts = [lab.beta.post("/templates", json={"name": "app:prod", "image": beta_image}),
                lab.beta.post("/templates/tags", json={"target": "beta-own", "tags": ["x"]}),  # control: its own
                lab.beta.post("/templates", json={"name": "shadow:v1", "image": beta_image}),
                lab.beta.put("/images/app:v9", content=b"\0" * 4096)]
    codes = [r.status_code for r in attempts]
    assert codes == [409, 201, 409, 409], [r.text for r in attempts]
    assert all("another team" in r.json()["message"] for r in attempts if r.status_code == 409)
    beta_names = {t["templateID"] for t in lab.beta.get("/templates").json()}
    assert "app:prod" not in beta_names and "shadow:v1" not in beta_names
    r = lab.alpha.post("/templates/tags", json={"target": "app", "tags": ["prod"]})
    assert r.status_code == 201, r.text
    r = lab.alpha.post("/sandboxes", json={"templateID": "shadow:v1", "timeout": 60})
    assert r.status_code == 201 and r.json()["templateID"] == "shadow:v1", r.text
    assert lab.alpha.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204
