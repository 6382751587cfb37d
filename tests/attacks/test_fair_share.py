"""Rows: one team's long requests against everyone else's short ones
(api/limits.py), what the data plane reads before it knows who is asking,
and credentials that are not ASCII (api/routes/envd.py, api/teams.py).
Raw sockets, so nothing between the test and the node fixes up a request."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from urllib.parse import quote

import httpx
import pytest

from tests.attacks.lab import ALPHA, BETA, Lab, status_of
from tests.test_api_teams import Held, envelope, exec_request, stream_request
from tests.test_envd import HUGE, SEND_AT_MOST, post_head, push_body, rss

LONG = 600  # what team beta holds at once: the number, more than the node's 512 short-request threads


@pytest.fixture(scope="module")
def beta_box(lab: Lab) -> Iterator[dict]:
    """A running sandbox of team beta's whose ports are private (they need its traffic token)."""
    assert lab.beta.put("/images/guest:beta-fair", content=(lab.guest / "rootfs.ext4").read_bytes()).status_code == 201
    r = lab.beta.post("/sandboxes", json={"templateID": "guest:beta-fair", "timeout": 1800,
                                          "network": {"allowPublicTraffic": False}})
    assert r.status_code == 201, r.text
    yield r.json()
    with contextlib.suppress(httpx.HTTPError):  # a node stuck by a row above would not answer: that row says so
        lab.beta.delete(f"/sandboxes/{r.json()['sandboxID']}", timeout=30)  # ends what beta still holds in it


def test_600_long_requests_leave_another_team_answered(lab: Lab, beta_box: dict) -> None:
    """attacker: team beta, with its own sandbox.  target: the node's worker
    threads, which every team's requests share.  attempt: 600 long requests
    at once and held (a process stream, 20 execs of `sleep 600`, 579
    attaches that stay quiet for an hour).  must: alpha's list, info, exec,
    create and kill are answered all the while; beta's requests past
    team_max_streams (256 by default) are refused at once naming it; none is
    a 5xx."""
    held = Held(lab.node.port)
    alpha = httpx.Client(base_url=lab.node.url, headers={"X-API-Key": ALPHA}, timeout=60)
    try:
        start = held.open(stream_request(beta_box, "Start", {"process": {"cmd": "/bin/sh",
                                                                         "args": ["-c", "sleep 3000"]}}))
        pid = held.started_pid(start[0])
        held.open(exec_request(beta_box, BETA, "sleep 600"), 20)
        held.open(stream_request(beta_box, "Connect", {"process": {"pid": pid}}), LONG - 21)
        streams = LONG - 20
        held.wait(lambda h: h.count(b'"start"') + h.count(b"resource_exhausted") >= streams, 120)
        sid = lab.sandbox["sandboxID"]
        assert alpha.get("/v2/sandboxes").status_code == 200
        assert alpha.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert alpha.post(f"/sandboxes/{sid}/exec", json={"command": "echo mine"}).json()["output"] == "mine\n"
        r = alpha.post("/sandboxes", json={"templateID": "guest:alpha", "timeout": 120})
        assert r.status_code == 201, r.text
        assert alpha.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204
        assert held.count(b'"start"') + held.count(b"resource_exhausted") == streams
        refused = [reply for reply in held.replies.values() if b"team_max_streams" in reply]
        assert refused and all(b"resource_exhausted" in r or status_of(r) == 429 for r in refused)
        assert held.count(b"resource_exhausted") <= len(refused) and LONG - len(refused) <= 256
        assert sum(status_of(r) >= 500 or b'"internal"' in r for r in held.replies.values()) == 0
    finally:
        held.close()
        alpha.close()


def test_streams_whose_client_left_give_their_places_back_at_once(lab: Lab, beta_box: dict) -> None:
    """attacker: team beta.  target: its places among long requests (and the
    threads behind them), which a stream held until its next keepalive (up
    to 120 s) after its client had gone.  attempt: every place beta has free
    taken by quiet process streams asking for an hourly keepalive, all left
    at once, then as many again.  must: those are all served within 30 s (a
    stream whose client left is woken and let go, not waited out)."""
    held = Held(lab.node.port)
    try:
        start = serve_all(held, stream_request(beta_box, "Start", {
            "process": {"cmd": "/bin/sh", "args": ["-c", "sleep 3000"]}}), 1, within=60)
        assert len(start) == 1
        attach = stream_request(beta_box, "Connect", {"process": {"pid": held.started_pid(start[0])}})
        first = serve_all(held, attach, 255, within=30, each=5)  # what the rows before left busy stays so
        assert len(first) >= 128, len(first)
        for s in first:
            held.drop(s)
        assert len(serve_all(held, attach, len(first), within=30)) == len(first)
    finally:
        held.close()


def serve_all(held: Held, request: bytes, count: int, *, within: float, each: float = 0.5) -> list[socket.socket]:
    """Up to `count` streams running at once: each refused one asked again,
    `each` seconds apart, until `within` seconds pass (the node may take a
    moment to see a client go); the sockets of those running."""
    deadline = time.monotonic() + within
    running: list[socket.socket] = []
    while len(running) < count and time.monotonic() < deadline:
        batch = held.open(request, count - len(running))
        held.wait(lambda h: all(b'"start"' in h.replies[s] or b"resource_exhausted" in h.replies[s]
                                or status_of(h.replies[s]) == 429 for s in batch), 60)
        for s in batch:
            if b'"start"' in held.replies[s]:
                running.append(s)
            else:
                held.drop(s)
        time.sleep(each)
    return running


@pytest.mark.parametrize("path, kind", [("/filesystem.Filesystem/Stat", "application/json"),
                                        ("/process.Process/Start", "application/connect+json"),
                                        ("/files?path=/root/big", "application/octet-stream"),
                                        ("/sandboxes", "application/json")])
def test_an_anonymous_20_gib_body_is_refused_unread(lab: Lab, path: str, kind: str) -> None:
    """attacker: anyone, no token, no key.  target: the node's memory.
    attempt: a 20 GiB body (Content-Length declared, bytes sent as fast as
    the node takes them) to the data plane of alpha's sandbox, and to the
    API.  must: refused (401) while the body is still being sent, the
    connection closed, the node's memory no larger."""
    assert lab.node.proc is not None
    before = rss(lab.node.proc.pid)
    got, sent = push_body(lab.node.port, post_head(path, {"E2b-Sandbox-Id": lab.sandbox["sandboxID"],
                                                          "Content-Type": kind}, length=HUGE))
    assert status_of(got) == 401 or b'"unauthenticated"' in got, got[:300]
    assert sent < SEND_AT_MOST, f"the node read {sent >> 20} MiB of an anonymous body"
    assert rss(lab.node.proc.pid) - before < 64 << 20


NON_ASCII = {"utf-8": "é".encode() * 24, "latin-1": b"\xe9" * 24, "key-and-more": ALPHA.encode() + b"\xff"}


def ask(lab: Lab, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", lab.node.port), timeout=60) as s:
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def get(path: str, headers: dict[str, bytes]) -> bytes:
    lines = [f"GET {path} HTTP/1.1".encode(), b"Connection: close",
             *(k.encode() + b": " + v for k, v in headers.items())]
    return b"\r\n".join(lines) + b"\r\n\r\n"


@pytest.fixture(scope="module")
def upload_path(lab: Lab) -> str:
    """The path of a real upload link of team beta's, without its query."""
    assert lab.beta.post("/v3/templates", json={"name": "fair-share"}).status_code == 202
    r = lab.beta.get(f"/templates/fair-share/files/{'ab' * 32}")
    assert r.status_code == 201, r.text
    return httpx.URL(r.json()["url"]).path


def attempt(lab: Lab, where: str, value: bytes, *, private_sid: str, upload: Callable[[], str]) -> bytes:
    """The request of one row below, with `value` as its credential; the reply."""
    data_plane = {"E2b-Sandbox-Id": lab.sandbox["sandboxID"].encode(), "Content-Type": b"application/json",
                  "Connection": b"close"}
    path, body = "/filesystem.Filesystem/Stat", b'{"path": "/etc/hostname"}'
    if where == "api-key":
        return ask(lab, get("/v2/sandboxes", {"Host": b"node", "X-API-Key": value}))
    if where == "traffic-token":
        host = f"8000-{private_sid}.strata.local".encode()
        return ask(lab, get("/", {"Host": host, "e2b-traffic-access-token": value}))
    if where == "upload-token":
        query = f"team=beta&expires=99999999999&token={quote(value, safe='')}"
        return ask(lab, post_head(f"{upload()}?{query}", {"Connection": b"close"}, length=4, method="PUT") + b"tar!")
    if where in ("basic-user", "sandbox-id"):  # no token: who and which sandbox, named in bytes that are not ASCII
        named = {"Authorization": b"Basic " + value} if where == "basic-user" else {"E2b-Sandbox-Id": value}
        return ask(lab, post_head(path, {**data_plane, **named}, length=len(body)) + body)
    if where == "access-token-stream":
        path, body = "/process.Process/Start", envelope({"process": {"cmd": "/bin/true"}})
        data_plane["Content-Type"] = b"application/connect+json"
    if where == "access-token-files":
        path, body = "/files?path=/root/planted", b"planted"
        data_plane["Content-Type"] = b"application/octet-stream"
    header = "X-API-Key" if where == "api-key-on-data-plane" else "X-Access-Token"
    return ask(lab, post_head(path, {**data_plane, header: value}, length=len(body)) + body)


@pytest.mark.parametrize("raw", sorted(NON_ASCII))
@pytest.mark.parametrize("where", ["api-key", "api-key-on-data-plane", "access-token", "access-token-stream",
                                   "access-token-files", "traffic-token", "upload-token", "basic-user",
                                   "sandbox-id"])
def test_a_non_ascii_credential_is_refused_never_500(lab: Lab, beta_box: dict, where: str, raw: str,
                                                     request: pytest.FixtureRequest) -> None:
    """attacker: anyone.  target: every comparison of a credential.
    attempt: a key or token that is not ASCII (UTF-8, Latin-1 bytes, a real
    key with a byte more) in X-API-Key (API and data plane), X-Access-Token
    (unary, stream, /files), e2b-traffic-access-token (a private port), an
    upload link's `token`, and beside no token the user (Authorization:
    Basic) or the sandbox (E2b-Sandbox-Id).  must: 401, 403 or 404 (a
    stream: its end message says unauthenticated), never a 5xx."""
    reply = attempt(lab, where, NON_ASCII[raw], private_sid=beta_box["sandboxID"],
                    upload=lambda: request.getfixturevalue("upload_path"))
    streamed = where == "access-token-stream" and status_of(reply) == 200 and b'"unauthenticated"' in reply
    assert status_of(reply) in (401, 403, 404) or streamed, reply[:400]
