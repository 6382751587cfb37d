"""vmm/domain_gate.py's parsers on real input (a ClientHello from Python's
own TLS stack), and what it never dials. The gate itself runs for real with
guests in tests/test_network.py."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.sockets import closed_within, trickled_until_closed
from vmm.domain_gate import MAX_CONNECTIONS, DomainGate, http_host, tls_server_name
from vmm.egress import Egress
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


def test_names_resolving_into_private_ranges_are_never_dialled(tmp_path: Path) -> None:
    """Finding 10: the gate refuses what the namespace's rules block, the same
    complete set: private ranges, the store's endpoint, unless opened."""
    gate = DomainGate(Network(tmp_path / "a", endpoints=("http://198.51.100.10:8333",)), lambda name: [], port=0)
    for address in ("10.1.2.3", "172.16.5.5", "172.31.0.1", "192.168.1.1", "100.64.0.1", "0.1.2.3", "224.0.0.1",
                    "240.0.0.1", "198.51.100.10"):
        assert not gate._may_dial(address), address
    assert gate._may_dial("198.51.100.11")
    opened = DomainGate(Network(tmp_path / "b", opened=("10.99.0.12/31",)), lambda name: [], port=0)
    assert opened._may_dial("10.99.0.12") and not opened._may_dial("10.99.0.14")
    assert not opened._may_dial("10.201.0.2")  # the pool: never, whatever is opened


# the gate on loopback: sandboxes are slots of a pool in 127/8 (slot S asks from 127.201.0.<4S+2>)
SANDBOX_A, SANDBOX_B = "127.201.0.2", "127.201.0.6"


@pytest.fixture()
def gate(tmp_path: Path) -> Iterator[tuple[DomainGate, list[str]]]:
    network = Network(tmp_path, pool="127.201.0.0/29")
    for slot, sid in ((0, "sba"), (1, "sbb")):
        rules = Egress.parse(False, ["*.test"]).as_record()
        (network.slots / str(slot)).write_text(json.dumps({"sid": sid, "rules": rules}))
    asked: list[str] = []

    def lookup(name: str) -> list[str]:
        asked.append(name)
        return []  # nothing to dial: what the test watches is whether the gate got as far as asking

    gate = DomainGate(network, lookup, port=free_port())
    gate.start()
    try:
        yield gate, asked
    finally:
        gate.stop()


def _connect(port: int, source: str) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    return conn


def test_a_slow_loris_is_cut_off_by_one_deadline(gate: tuple[DomainGate, list[str]]) -> None:
    """Finding 9: a guest trickling its request head one byte at a time held
    a slot for as long as it liked (the timeout was per recv)."""
    g, asked = gate
    head = b"GET / HTTP/1.1\r\nHost: slow.test" + b"x" * 100
    with _connect(g.port, SANDBOX_A) as conn:
        assert trickled_until_closed(conn, head), "the gate kept a trickling connection open"  # at most ~25 s
    assert asked == []


def test_one_sandbox_cannot_take_every_slot(gate: tuple[DomainGate, list[str]]) -> None:
    """Finding 9: 512 slots for the whole node; one sandbox's idle connections
    took them all and every other sandbox's web traffic was refused."""
    g, asked = gate
    flood = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            flood.append(_connect(g.port, SANDBOX_A))
        # the last of the flood is over any cap: once it is closed, the gate has seen all of them
        assert closed_within(flood[-1], 10)
        with _connect(g.port, SANDBOX_B) as victim:
            victim.sendall(b"GET / HTTP/1.1\r\nHost: victim.test\r\n\r\n")
            assert closed_within(victim, 10)  # lookup answered nothing to dial
        assert "victim.test" in asked, "another sandbox's request never reached the gate's lookup"
    finally:
        for conn in flood:
            conn.close()
