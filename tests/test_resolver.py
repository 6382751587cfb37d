"""vmm/resolver.py over real sockets on loopback: who may ask, local names,
forwarding to an upstream server (a second real DNS server on loopback),
addresses learned for allowed domains, and garbage that gets nothing back.
Network.learn is the one part replaced (it needs a sandbox namespace;
tests/test_network.py runs it for real)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from tests.conftest import free_port
from vmm.egress import Egress
from vmm.network import Link, Network
from vmm.resolver import Resolver


class Recording(Network):
    def __init__(self, root: Path) -> None:
        super().__init__(root, pool="127.201.0.0/29")
        self.learned: list[tuple[str, list[str], int]] = []

    def learn(self, link: Link, addresses: list[str], ttl: int) -> None:
        self.learned.append((link.sid, addresses, ttl))


def upstream_server(port: int) -> Iterator[None]:
    """A tiny authoritative server: every A question is 192.0.2.7 with TTL 5."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", port))
    sock.settimeout(0.2)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                wire, peer = sock.recvfrom(4096)
            except OSError:
                continue
            query = dns.message.from_wire(wire)
            reply = dns.message.make_response(query)
            reply.answer.append(dns.rrset.from_text(query.question[0].name, 5, "IN", "A", "192.0.2.7"))
            sock.sendto(reply.to_wire(), peer)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sock.close()


@pytest.fixture()
def setup(tmp_path: Path) -> Iterator[tuple[Recording, int]]:
    network = Recording(tmp_path)
    # slot 0's outside address is 127.201.0.2: a sandbox asks from there
    (network.slots / "0").write_text(json.dumps({"sid": "sb1", "rules": Egress.parse(
        False, ["*.example.com"]).as_record()}))
    up, port = free_port(), free_port()
    gen = upstream_server(up)
    next(gen)
    resolver = Resolver(network, port=port, hosts={"web.test": "10.99.0.12"}, upstream=[f"127.0.0.1:{up}"])
    resolver.start()
    try:
        yield network, port
    finally:
        resolver.stop()
        gen.close()


def ask(port: int, name: str, source: str = "127.201.0.2", *, tcp: bool = False) -> dns.message.Message:
    query = dns.message.make_query(name, dns.rdatatype.A)
    if tcp:
        return dns.query.tcp(query, "127.0.0.1", port=port, timeout=5, source=source)
    return dns.query.udp(query, "127.0.0.1", port=port, timeout=5, source=source)


def test_local_names_and_who_may_ask(setup: tuple[Recording, int]) -> None:
    network, port = setup
    reply = ask(port, "web.test")
    assert [r.address for r in reply.answer[0]] == ["10.99.0.12"]
    assert ask(port, "WEB.test.", tcp=True).answer[0][0].address == "10.99.0.12"
    assert ask(port, "web.test", source="127.0.0.1").rcode() == dns.rcode.REFUSED  # not a sandbox
    assert ask(port, "web.test", source="127.201.0.6").rcode() == dns.rcode.REFUSED  # a slot nobody holds
    assert network.learned == []  # web.test is not an allowed domain of sb1


def test_forwarded_and_learned(setup: tuple[Recording, int]) -> None:
    network, port = setup
    reply = ask(port, "api.example.com")
    assert reply.answer[0][0].address == "192.0.2.7"
    assert network.learned == [("sb1", ["192.0.2.7"], 30)]  # TTL 5 raised to MIN_TTL
    ask(port, "other.org")  # forwarded, not allowed: nothing learned
    assert len(network.learned) == 1


def test_garbage_gets_nothing_and_the_server_goes_on(setup: tuple[Recording, int]) -> None:
    _network, port = setup
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.201.0.2", 0))
        sock.settimeout(0.5)
        sock.sendto(b"\x00\x01garbage", ("127.0.0.1", port))
        with pytest.raises(socket.timeout):
            sock.recvfrom(4096)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"\x00")  # a TCP query cut short
    assert ask(port, "web.test").answer[0][0].address == "10.99.0.12"


def test_without_upstream_unknown_names_do_not_exist(tmp_path: Path) -> None:
    network = Recording(tmp_path)
    (network.slots / "0").write_text(json.dumps({"sid": "sb1", "rules": {}}))
    resolver = Resolver(network, port=free_port(), upstream=[])
    try:
        resolver.start()
        assert ask(resolver.port, "nowhere.test").rcode() == dns.rcode.NXDOMAIN
    finally:
        resolver.stop()
