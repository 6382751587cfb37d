"""vmm/resolver.py over real sockets on loopback: who may ask, local names,
forwarding to an upstream server (a second real DNS server on loopback),
addresses learned for allowed domains, and garbage that gets nothing back.
Network.learn is the one part replaced (it needs a sandbox namespace;
tests/test_network.py runs it for real)."""

from __future__ import annotations

import ipaddress
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from tests.conftest import free_port
from tests.sockets import trickled_until_closed
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


# --- finding 9: one sandbox cannot deny DNS to the others --------------------------------


class BlackHoles:
    """UDP sockets on loopback that never answer: upstream servers a lookup
    waits on until its deadline."""

    def __init__(self, count: int) -> None:
        self.sockets = []
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            self.sockets.append(sock)
        self.servers = [f"127.0.0.1:{s.getsockname()[1]}" for s in self.sockets]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def sandboxes(tmp_path: Path, count: int) -> Recording:
    """A network whose first `count` slots are leased (slot S asks from 127.201.<S // 64>.<4 (S % 64) + 2>)."""
    network = Recording(tmp_path)
    network.pool = ipaddress.ip_network("127.201.0.0/22")
    network.size = network.pool.num_addresses // 4
    for slot in range(count):
        (network.slots / str(slot)).write_text(json.dumps({"sid": f"sb{slot}", "rules": {}}))
    return network


def source_of(slot: int) -> str:
    return str(ipaddress.ip_address("127.201.0.2") + 4 * slot)


def flood(port: int, source: str, count: int, name: str = "flood.test") -> socket.socket:
    """`count` queries sent at once from `source`, none waited for (the socket is the caller's to close)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((source, 0))
    for i in range(count):
        sock.sendto(dns.message.make_query(f"n{i}.{name}", dns.rdatatype.A).to_wire(), ("127.0.0.1", port))
    return sock


def ask_as_a_stub(port: int, name: str, source: str, *, tries: int = 3) -> list[str] | None:
    """The addresses of `name`, asking again after 3 s without an answer, as a
    guest's stub resolver does (a flood on loopback can fill the socket's
    buffer, which a sandbox's namespace rate limit keeps from happening)."""
    for _ in range(tries):
        try:
            reply = dns.query.udp(dns.message.make_query(name, dns.rdatatype.A), "127.0.0.1", port=port,
                                  timeout=3, source=source)
        except dns.exception.Timeout:
            continue
        return [r.address for rrset in reply.answer for r in rrset]
    return None


def test_a_flooding_sandbox_does_not_starve_another(tmp_path: Path) -> None:
    """300 queries a black hole never answers, from one sandbox: another
    sandbox's query is still answered (it waited behind all 300 on 8 workers)."""
    network, holes = sandboxes(tmp_path, 2), BlackHoles(1)
    resolver = Resolver(network, port=free_port(), hosts={"web.test": "10.99.0.12"}, upstream=holes.servers,
                        timeout=2.0)
    resolver.start()
    try:
        with flood(resolver.port, source_of(0), 300):
            assert ask_as_a_stub(resolver.port, "web.test", source=source_of(1)) == ["10.99.0.12"]
    finally:
        resolver.stop()
        holes.close()


def test_the_queue_is_bounded(tmp_path: Path) -> None:
    """64 sandboxes asking at once, each within its own cap: what is over the
    node's bound is dropped at once, not queued (it was queued without bound)."""
    network, holes = sandboxes(tmp_path, 64), BlackHoles(1)
    resolver = Resolver(network, port=free_port(), upstream=holes.servers, timeout=1.0, workers=2, max_queued=8)
    resolver.start()
    socks = []
    try:
        for slot in range(64):
            socks.append(flood(resolver.port, source_of(slot), 1))
        answered = 0
        deadline = time.monotonic() + 12
        poller, by_fd = select.poll(), {sock.fileno(): sock for sock in socks}
        for sock in socks:
            poller.register(sock, select.POLLIN)
        while time.monotonic() < deadline:
            for fd, _event in poller.poll(500):
                sock = by_fd[fd]
                assert dns.message.from_wire(sock.recv(4096)).rcode() == dns.rcode.SERVFAIL
                answered += 1
        assert 1 <= answered <= 2 + 8  # the workers' and the queue's, no more
    finally:
        for sock in socks:
            sock.close()
        resolver.stop()
        holes.close()


def test_one_deadline_for_the_whole_upstream_lookup(tmp_path: Path) -> None:
    """20 upstream servers that never answer: the guest gets SERVFAIL within
    the lookup's deadline, not after 20 of them (each had the whole timeout)."""
    network, holes = sandboxes(tmp_path, 1), BlackHoles(20)
    resolver = Resolver(network, port=free_port(), upstream=holes.servers, timeout=1.0)
    resolver.start()
    try:
        query = dns.message.make_query("slow.test", dns.rdatatype.A)
        reply = dns.query.udp(query, "127.0.0.1", port=resolver.port, timeout=8, source=source_of(0))
        assert reply.rcode() == dns.rcode.SERVFAIL
        assert resolver.lookup("slow.test") == []  # the domain gate's lookups: the same deadline
    finally:
        resolver.stop()
        holes.close()


def test_a_tcp_query_trickled_is_cut_off(setup: tuple[Recording, int]) -> None:
    """A TCP query sent one byte at a time held a worker as long as the guest
    liked (the timeout was per recv); the whole read has one deadline."""
    _network, port = setup
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.201.0.2", 0)) as conn:
        conn.sendall(b"\x00\x60")  # 96 bytes to come; ~24 s of trickling, never finished
        assert trickled_until_closed(conn, b"\x00" * 95), "the resolver kept a trickling TCP query open"
    assert ask(port, "web.test").answer[0][0].address == "10.99.0.12"


def test_a_sandbox_holding_tcp_connections_does_not_starve_another(tmp_path: Path) -> None:
    """Slow TCP queries from one sandbox take at most its own share of the workers."""
    network = sandboxes(tmp_path, 2)
    resolver = Resolver(network, port=free_port(), hosts={"web.test": "10.99.0.12"}, upstream=[])
    resolver.start()
    held = []
    try:
        for _ in range(40):  # far more than there are workers; each sends half a length prefix and waits
            conn = socket.create_connection(("127.0.0.1", resolver.port), timeout=5,
                                            source_address=(source_of(0), 0))
            conn.sendall(b"\x00")
            held.append(conn)
        time.sleep(1)  # not a bound: lets the accept loop (it polls) take every one of them before the query
        reply = ask(resolver.port, "web.test", source=source_of(1))
        assert [r.address for r in reply.answer[0]] == ["10.99.0.12"]
    finally:
        for conn in held:
            conn.close()
        resolver.stop()


def test_addresses_outside_the_pool_share_one_share(tmp_path: Path) -> None:
    """Nothing but sandboxes is answered (REFUSED), and all the rest of the
    world together holds one sandbox's share of the queue: spoofed sources
    cannot fill it."""
    resolver = Resolver(sandboxes(tmp_path, 1), port=free_port(), upstream=[], per_sandbox=2)
    release = threading.Event()
    try:  # not started: nothing takes the jobs off the queue
        assert resolver._submit("127.0.0.1", release.wait) and resolver._submit("192.0.2.1", release.wait)
        assert not resolver._submit("198.51.100.7", release.wait)  # a third address outside: over the share
        assert resolver._submit(source_of(0), release.wait)  # a sandbox still has its own
    finally:
        release.set()
        resolver.stop()
