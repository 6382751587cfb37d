"""Rows: where a proxied request goes (api/proxy.py). The gateway and the
node's port proxy build each upstream URL from their own scheme, host and
port; a request target that is not origin-form is refused before routing.
Raw sockets, since no HTTP client sends these targets."""

from __future__ import annotations

import pytest

from tests.attacks.lab import BAIT, BETA, Lab, raw, status_of

TARGETS = {
    "userinfo": b"@127.0.0.1:{bait}/",
    "userinfo-after-path": b"/x@127.0.0.1:{bait}/",  # a path: stays one, and on the node
    "absolute-form": b"http://127.0.0.1:{bait}/",
    "authority-form": b"127.0.0.1:{bait}",
    "network-path": b"//127.0.0.1:{bait}/",
    "backslashes": b"/\\\\127.0.0.1:{bait}/",
    "asterisk": b"*",
    "overlong": b"/" + b"a" * 9000,
}
REFUSED = {400, 404, 414, 431}  # 404 only for the path that is a path


def attempt(lab: Lab, port: int, target: bytes, *, host: bytes, method: bytes = b"GET") -> bytes:
    request = (method + b" " + target.replace(b"{bait}", str(lab.bait.port).encode()) + b" HTTP/1.1\r\nHost: "
               + host + b"\r\nX-API-Key: " + BETA.encode() + b"\r\nConnection: close\r\n\r\n")
    return raw(port, request)


@pytest.mark.parametrize("form", sorted(TARGETS))
def test_gateway_fetches_no_address_a_request_names(lab: Lab, form: str) -> None:
    """attacker: anyone, no key needed.  target: the gateway's upstream URL.
    attempt: a request target naming another host (`@host:port/`, absolute-
    or authority-form, `//host`, backslashes, `*`, overlong).  must: 400/414,
    the bait is never reached, nothing of it is answered."""
    port = int(lab.gateway.url.rsplit(":", 1)[1])
    before = lab.bait.hits
    reply = attempt(lab, port, TARGETS[form], host=b"gw.example", method=b"CONNECT" if "authority" in form else b"GET")
    assert status_of(reply) in REFUSED, reply[:300]
    assert BAIT not in reply and lab.bait.hits == before


@pytest.mark.parametrize("form", sorted(TARGETS))
def test_port_proxy_reaches_only_the_sandbox(lab: Lab, form: str) -> None:
    """attacker: anyone who knows a sandbox's port URL.  target: the node's
    port proxy (`{port}-{id}.{domain}`).  attempt: a request target naming
    another host, so the URL built from the sandbox's address points past it.
    must: 400/414 (the path that stays a path reaches the sandbox's port and
    nothing else), the bait is never reached."""
    port = int(lab.node.url.rsplit(":", 1)[1])
    before = lab.bait.hits
    host = f"8000-{lab.sandbox['sandboxID']}.strata.local".encode()
    reply = attempt(lab, port, TARGETS[form], host=host, method=b"CONNECT" if "authority" in form else b"GET")
    assert status_of(reply) in REFUSED | {502}, reply[:300]  # 502: nothing listens on the sandbox's port 8000
    assert BAIT not in reply and lab.bait.hits == before


@pytest.mark.parametrize("where", ["gateway", "node"])
def test_control_characters_never_reach_a_target(lab: Lab, where: str) -> None:
    """attacker: anyone.  target: the request line's parser, then the proxy.
    attempt: CR/LF and a NUL inside the target (a second request smuggled
    into the upstream).  must: refused; the bait is never reached."""
    url = lab.gateway.url if where == "gateway" else lab.node.url
    port = int(url.rsplit(":", 1)[1])
    before = lab.bait.hits
    for target in (b"/a\r\nGET http://127.0.0.1:{bait}/ HTTP/1.1\r\nX: y", b"/a\x00@127.0.0.1:{bait}/"):
        reply = attempt(lab, port, target, host=b"gw.example")
        assert status_of(reply) in REFUSED | {0}, reply[:300]  # 0: the server hung up on it
        assert BAIT not in reply
    assert lab.bait.hits == before


def test_an_origin_form_request_still_passes(lab: Lab) -> None:
    """attacker: none (the control row).  target: the gateway.  attempt: a
    plain `GET /v2/sandboxes` with alpha's key.  must: answered by the node,
    listing alpha's sandbox: the refusals above are not a gateway that
    refuses everything."""
    port = int(lab.gateway.url.rsplit(":", 1)[1])
    request = (b"GET /v2/sandboxes?limit=10 HTTP/1.1\r\nHost: gw.example\r\nX-API-Key: "
               + lab.alpha.headers["X-API-Key"].encode() + b"\r\nConnection: close\r\n\r\n")
    reply = raw(port, request)
    assert status_of(reply) == 200 and lab.sandbox["sandboxID"].encode() in reply, reply[:300]
