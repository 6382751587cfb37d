"""Rows: generated requests across the data plane, which the node's OpenAPI
document (and so schemathesis, test_whole_api.py) does not describe:
envd's Connect RPCs and /files, with messages of every shape hypothesis
makes, on a sandbox of the attacker's own and with the attacker's token on
another team's sandbox."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.attacks.lab import Lab

RPCS = [("process.Process", m) for m in ("Start", "Connect", "List", "SendInput", "SendSignal", "CloseStdin",
                                         "Update")] + \
       [("filesystem.Filesystem", m) for m in ("Stat", "MakeDir", "Move", "ListDir", "Remove", "WatchDir",
                                               "CreateWatcher", "GetWatcherEvents", "RemoveWatcher")]
STREAMING = {"Start", "Connect", "WatchDir"}
SECRET = "alpha-data-plane-secret-93be"

scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64) | st.floats(allow_nan=False) | st.text(max_size=30)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8), inner, max_size=3), max_leaves=8)
paths = st.sampled_from(["/root", "/root/x", "/tmp", "", ".", "..", "/root/../etc/shadow", "/proc/self/mem",
                         "/dev/vda", "relative", "/root/\x00nul", "/" + "a" * 5000]) | st.text(max_size=40)
process = st.fixed_dictionaries({}, optional={
    "cmd": st.sampled_from(["/bin/true", "/bin/sh", "/bin/cat", "no-such-command"]) | st.text(max_size=20),
    "args": st.lists(st.text(max_size=20), max_size=3) | values,
    "envs": st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3) | values,
    "cwd": paths, "pid": st.integers(-5, 2**40) | values, "tag": st.text(max_size=10) | values})
messages = st.fixed_dictionaries({}, optional={
    "path": paths | values, "source": paths, "destination": paths, "depth": st.integers(-3, 2**40) | values,
    "recursive": values, "watcherId": st.text(max_size=20) | values,
    "process": process | values, "signal": st.sampled_from(["SIGNAL_SIGTERM", "SIGNAL_SIGKILL", "SIGNAL_X", 9, -1])
    | values, "input": st.fixed_dictionaries({}, optional={"stdin": st.text(max_size=20) | values,
                                                          "pty": st.text(max_size=20)}) | values,
    "pty": st.fixed_dictionaries({}, optional={"size": st.fixed_dictionaries(
        {"cols": st.integers(-1, 2**33) | values, "rows": st.integers(-1, 2**33) | values})}) | values,
    "stdin": values, "tag": values}) | values


@pytest.fixture(scope="module")
def beta_sandbox(lab: Lab) -> Iterator[dict]:
    """A sandbox of beta's for the fuzzing to wreck (it may remove its files or kill its processes)."""
    ref = lab.own_image(lab.beta, "guest:beta-fuzz")
    r = lab.beta.post("/sandboxes", json={"templateID": ref, "timeout": 900})
    assert r.status_code == 201, r.text
    yield r.json()
    lab.beta.delete(f"/sandboxes/{r.json()['sandboxID']}", timeout=60)


@pytest.fixture(scope="module")
def alpha_secret(lab: Lab) -> str:
    r = lab.alpha.post(f"/sandboxes/{lab.sandbox['sandboxID']}/exec", json={"command": f"echo {SECRET} > /root/dp"})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return SECRET


def call(client: httpx.Client, sandbox: str, token: str, service: str, method: str,
         message: Any) -> tuple[int, list[str]]:
    """One RPC's status, and the problems in its answer: a 5xx, an `internal` code, a secret shown."""
    headers = {"E2b-Sandbox-Id": sandbox, "X-Access-Token": token, "Keepalive-Ping-Interval": "1",
               "Connect-Timeout-Ms": "2000"}
    body = json.dumps(message).encode()
    if method in STREAMING:
        headers["Content-Type"] = "application/connect+json"
        body = struct.pack(">BI", 0, len(body)) + body
    else:
        headers["Content-Type"] = "application/json"
    text = b""
    with client.stream("POST", f"/{service}/{method}", content=body, headers=headers) as r:
        for chunk in r.iter_bytes():
            text += chunk
            if len(text) > 1 << 16 or method == "WatchDir" and text.count(b"keepalive") >= 1:
                break  # a watch never ends by itself: its start and a keepalive are enough
        status = r.status_code
    problems = [f"{status}"] if status >= 500 else []
    if b'"internal"' in text:
        problems.append("internal")
    if SECRET.encode() in text:
        problems.append("secret")
    code = 200 if status == 200 and b'"error"' not in text else 400 if status == 200 else status
    return code, [f"{method} {json.dumps(message)[:200]}: {p}: {text[:200]!r}" for p in problems]


def test_generated_rpcs_on_the_attackers_own_sandbox(lab: Lab, beta_sandbox: dict, alpha_secret: str) -> None:
    """attacker: team beta, with its own sandbox and its token.  target: the
    node's envd translation (api/envd.py, api/routes/envd.py) and the guest
    agent behind it.  attempt: every RPC with generated messages (wrong
    types, huge numbers, path tricks, nested junk).  must: no 5xx, no
    `internal` error, alpha's file never shown; the node answers alpha
    after."""
    found: list[str] = []
    statuses: set[int] = set()
    client = httpx.Client(base_url=lab.node.url, timeout=30)

    @settings(max_examples=120, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(rpc=st.sampled_from(RPCS), message=messages)
    def one(rpc: tuple[str, str], message: Any) -> None:
        status, problems = call(client, beta_sandbox["sandboxID"], beta_sandbox["envdAccessToken"], *rpc, message)
        statuses.add(status)
        found.extend(problems)

    try:
        one()
    finally:
        client.close()
    assert found == [], "\n".join(found[:10])
    assert {200, 400} <= statuses, statuses  # both answers and refusals: the messages reached real work
    assert lab.alpha.get(f"/sandboxes/{lab.sandbox['sandboxID']}").json()["state"] == "running"


def test_generated_rpcs_with_the_attackers_token_on_another_sandbox(lab: Lab, beta_sandbox: dict,
                                                                    alpha_secret: str) -> None:
    """attacker: team beta, its own sandbox's token.  target: alpha's
    sandbox.  attempt: every RPC and /files with generated messages, beta's
    token and alpha's sandbox id.  must: each refused as unauthenticated,
    nothing of alpha's shown."""
    client = httpx.Client(base_url=lab.node.url, timeout=30)
    seen: list[tuple[str, int, bytes]] = []

    @settings(max_examples=60, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(rpc=st.sampled_from(RPCS), message=messages)
    def one(rpc: tuple[str, str], message: Any) -> None:
        headers = {"E2b-Sandbox-Id": lab.sandbox["sandboxID"], "X-Access-Token": beta_sandbox["envdAccessToken"],
                   "Content-Type": "application/json"}
        r = client.post(f"/{rpc[0]}/{rpc[1]}", content=json.dumps(message), headers=headers)
        seen.append((rpc[1], r.status_code, r.content))

    try:
        one()
        for path in ("/root/dp", "/etc/hostname"):
            r = client.get("/files", params={"path": path}, headers={
                "E2b-Sandbox-Id": lab.sandbox["sandboxID"], "X-Access-Token": beta_sandbox["envdAccessToken"]})
            seen.append(("files", r.status_code, r.content))
    finally:
        client.close()
    wrong = [(m, s, body[:200]) for m, s, body in seen if s != 401 or SECRET.encode() in body]
    assert len(seen) > 40 and wrong == [], wrong[:5]
