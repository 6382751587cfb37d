"""vmm/domain_gate.py's parsers on real input (a ClientHello from Python's
own TLS stack), and what it never dials. The gate itself runs for real with
guests in tests/test_network.py."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from vmm.domain_gate import DomainGate, http_host, tls_server_name
from vmm.network import Network


def client_hello(server_hostname: str | None) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_server_name_of_a_real_client_hello() -> None:
    hello = client_hello("API.Example.com")
    assert tls_server_name(hello) == "api.example.com"
    assert tls_server_name(client_hello(None)) is None  # no SNI
    assert tls_server_name(hello[:40]) is None  # cut short
    assert tls_server_name(b"\x16\x03\x01\x00\x05garbage") is None
    assert tls_server_name(b"GET / HTTP/1.1\r\n") is None


@pytest.mark.parametrize("head,host", [
    (b"GET / HTTP/1.1\r\nHost: Web.Test:8080\r\nAccept: */*\r\n\r\n", "web.test"),
    (b"GET / HTTP/1.1\r\nhost:web.test\r\n\r\nbody", "web.test"),
    (b"GET / HTTP/1.0\r\nAccept: */*\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: web.test\r\n", None),  # the head is not over
])
def test_http_host(head: bytes, host: str | None) -> None:
    assert http_host(head) == host


def test_never_dialled(tmp_path: Path) -> None:
    gate = DomainGate(Network(tmp_path, pool="10.201.0.0/16"), lambda name: [], port=0)
    assert not gate._may_dial("127.0.0.1")
    assert not gate._may_dial("10.201.3.2")  # another sandbox
    assert not gate._may_dial("169.254.169.254")  # blocked by default
    assert gate._may_dial("192.0.2.7")  # TEST-NET-1: nobody's own address
