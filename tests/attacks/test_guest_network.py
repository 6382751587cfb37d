"""Rows: what a guest reaches from its sandbox network (vmm/network.py,
vmm/egress.py) and how far it can deny DNS and the domain gate to other
sandboxes (vmm/resolver.py, vmm/domain_gate.py).

Real parts, no VM: a node namespace on a hub bridge (tests/netns.py), the
real Network building each sandbox's namespace and nftables, the real
resolver and domain gate listening in the node's namespace. The guest is a
namespace of its own wired to the sandbox namespace's `tap0` by a veth pair
(where a VM's tap would be), with the guest's address 172.16.0.2. Targets
live on the hub, in ranges a cloud host has nearby:

    hub br0: 10.99.0.1 (a private network)  192.168.77.1  100.64.77.1 (CGNAT)
             172.20.77.1 (a Docker network)  198.51.100.10 (the S3 endpoint)
             198.51.100.11 (a public web host: what every guest may reach)
    node:    10.99.0.11 and 203.0.113.5 (the node's own addresses)

Nothing leaves the namespaces this module makes."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import dns.rdatatype
import pytest

from tests.netns import Lab, ip
from tests.sockets import trickled_until_closed
from vmm.domain_gate import DomainGate
from vmm.egress import GUEST, GUEST_GATEWAY, Egress
from vmm.network import Link, Network
from vmm.resolver import Resolver

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
                                reason="sandbox networks need root, iproute2 (ip) and nftables (nft)")

PUBLIC, STORE = "198.51.100.11", "198.51.100.10"
PRIVATE = {"rfc1918-10": "10.99.0.1", "rfc1918-192.168": "192.168.77.1", "cgnat-100.64": "100.64.77.1",
           "rfc1918-172.16 (docker)": "172.20.77.1"}
NODE_OWN = ("10.99.0.11", "203.0.113.5")
HOSTS = {"public.test": PUBLIC, "internal.test": "192.168.77.1", "store.test": STORE}
BLACK_HOLE = ("10.99.0.1", 5353)  # the resolver's upstream: bound, never answers


@dataclass
class Guest:
    sid: str
    netns: str  # the guest's own namespace (where a VM would be)
    link: Link


class World:
    """The namespaces, the targets, the node's Network, resolver and gate."""

    def __init__(self, tmp: Path) -> None:
        self.tag = f"g{os.getpid() % 10000}"
        self.lab = Lab(self.tag)
        self.count = itertools.count()
        self.guests: list[Guest] = []
        self.lab.add_node("node")
        self._addresses()
        self.servers = [self.web("hub"), self.web("node")]
        with self.lab.inside("hub"):
            self.hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.hole.bind(BLACK_HOLE)
        with self.lab.inside("node"):  # sockets and threads made here belong to the node's namespace
            self.network = Network(tmp / "network", endpoints=(f"http://{STORE}:8333",))
            self.network.prepare()
            self.resolver = Resolver(self.network, port=self.network.dns_port, hosts=HOSTS,
                                     upstream=[f"{BLACK_HOLE[0]}:{BLACK_HOLE[1]}"], timeout=2.0)
            self.resolver.start()
            self.gate = DomainGate(self.network, self.resolver.lookup, port=self.network.gate_port)
            self.gate.start()

    def _addresses(self) -> None:
        hub = self.lab.hub
        for cidr in ("192.168.77.1/24", "100.64.77.1/24", "172.20.77.1/24", f"{STORE}/24", f"{PUBLIC}/24"):
            ip("-n", hub, "addr", "add", cidr, "dev", "br0")
        node = self.lab.nodes["node"]
        ip("-n", node, "addr", "add", "203.0.113.5/32", "dev", "lo")
        ip("-n", node, "route", "add", "default", "via", self.lab.addrs["hub"])

    def web(self, where: str) -> socket.socket:
        """A web server on port 80 of every address of `where`: it answers with the address it was reached at."""
        with self.lab.inside(where):
            server = socket.create_server(("0.0.0.0", 80), backlog=1024)
            threading.Thread(target=_serve_web, args=(server,), daemon=True).start()
        return server

    def sandbox(self, rules: Egress) -> Guest:
        """A sandbox network whose tap0 is a veth to a guest namespace at 172.16.0.2."""
        sid = f"{self.tag}x{next(self.count)}"
        with self.lab.inside("node"):
            link = self.network.attach(sid, rules)
        guest = Guest(sid, f"st-{self.tag}-{sid}", link)
        self.lab.nodes[sid] = guest.netns  # lab.inside(sid) enters it; lab.destroy removes it
        self.guests.append(guest)
        ip("netns", "add", guest.netns)
        ip("-n", link.netns, "link", "del", "tap0")
        ip("-n", link.netns, "link", "add", "tap0", "type", "veth", "peer", "name", "eth0", "netns", guest.netns)
        ip("-n", link.netns, "addr", "add", f"{GUEST_GATEWAY}/30", "dev", "tap0")
        ip("-n", link.netns, "link", "set", "tap0", "up")
        for args in (("link", "set", "lo", "up"), ("addr", "add", f"{GUEST}/30", "dev", "eth0"),
                     ("link", "set", "eth0", "up"), ("route", "add", "default", "via", GUEST_GATEWAY)):
            ip("-n", guest.netns, *args)
        return guest

    def close(self) -> None:
        with self.lab.inside("node"):
            for guest in self.guests:
                self.network.detach(guest.sid)
        self.gate.stop()
        self.resolver.stop()
        self.hole.close()
        for server in self.servers:
            server.close()
        self.lab.destroy()


def _serve_web(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=_answer_web, args=(conn,), daemon=True).start()


def _answer_web(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(5)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < 8192:
                block = conn.recv(4096)
                if not block:
                    return
                head += block
            conn.sendall(f"HTTP/1.0 200 OK\r\n\r\nreached {conn.getsockname()[0]}".encode())
        except OSError:
            pass


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("guest-network"))
    try:
        yield w
    finally:
        w.close()


def reach(world: World, guest: Guest, address: str, *, port: int = 80, host: str = "x.test") -> str | None:
    """What the guest gets from http://address:port/ (Host: `host`), None if
    nothing within a few seconds (a blocked packet is dropped, not refused)."""
    try:
        with world.lab.inside(guest.sid):
            conn = socket.create_connection((address, port), timeout=3)
        with conn:
            conn.sendall(f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            reply = b""
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                block = conn.recv(4096)
                if not block:
                    break
                reply += block
    except OSError:
        return None
    body = reply.partition(b"\r\n\r\n")[2].decode()
    return body or None


def resolve(world: World, guest: Guest, name: str, *, server: str = GUEST_GATEWAY) -> list[str] | None:
    """The guest's lookup of `name` (whatever server it names, the node's
    resolver answers), asked again after 3 s without an answer as a stub
    resolver does; None: no answer to any of 3."""
    query = dns.message.make_query(name, dns.rdatatype.A)
    for _ in range(3):
        try:
            with world.lab.inside(guest.sid):
                reply = dns.query.udp(query, server, timeout=3)
        except (OSError, dns.exception.DNSException):
            continue
        return [r.address for rrset in reply.answer for r in rrset]
    return None


# --- finding 10: the default egress policy --------------------------------------------------------


@pytest.mark.parametrize("target", sorted(PRIVATE))
def test_a_guest_cannot_reach_private_networks(world: World, target: str) -> None:
    """attacker: root in a guest, default rules (internet allowed).  target: a
    private network beside the node (a cloud VPC, a Docker network, CGNAT).
    attempt: connect to an address in 10/8, 192.168/16, 100.64/10, 172.16/12.
    must: dropped; the same guest still reaches a public address."""
    guest = world.sandbox(Egress())
    assert reach(world, guest, PUBLIC) == f"reached {PUBLIC}"
    assert reach(world, guest, PRIVATE[target]) is None


def test_a_guest_cannot_reach_the_object_store(world: World) -> None:
    """attacker: root in a guest, default rules.  target: the node's S3
    endpoint (config s3.endpoint; SeaweedFS with its default credentials in
    the compose deployment), here at a public-looking address.  attempt:
    connect to the endpoint's address.  must: dropped, while a public address
    next to it is reached."""
    guest = world.sandbox(Egress())
    assert reach(world, guest, PUBLIC) == f"reached {PUBLIC}"
    assert reach(world, guest, STORE) is None


@pytest.mark.parametrize("address", NODE_OWN)
def test_a_guest_cannot_reach_the_node(world: World, address: str) -> None:
    """attacker: root in a guest.  target: the node's own addresses (its API,
    its other services).  attempt: connect to port 80 of each.  must: dropped;
    the node's resolver at the guest's gateway still answers."""
    guest = world.sandbox(Egress())
    assert resolve(world, guest, "public.test") == [PUBLIC]
    assert reach(world, guest, address) is None


def test_a_guest_cannot_reach_another_sandbox(world: World) -> None:
    """attacker: root in guest A.  target: sandbox B's guest (its outside
    address 10.201.x).  attempt: connect to B's address, where the node's port
    proxy reaches B's port 80.  must: dropped for A; the node itself still
    reaches B's port, and A's DNS (to any server, port 53) still works."""
    a, b = world.sandbox(Egress()), world.sandbox(Egress())
    server = world.web(b.sid)
    try:
        with world.lab.inside("node"):  # the node's port proxy: the sandbox's address, dnat to the guest
            conn = socket.create_connection((b.link.outside, 80), timeout=5)
        with conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert conn.recv(4096).endswith(f"reached {GUEST}".encode())
        assert reach(world, a, b.link.outside) is None
        assert resolve(world, a, "public.test", server="192.0.2.53") == [PUBLIC]  # any server: the node answers
    finally:
        server.close()


def test_allow_rules_cannot_open_a_blocked_range(world: World) -> None:
    """attacker: a caller with a key, setting the rules of its sandbox.
    target: private networks and the object store.  attempt: allowOut naming
    10.0.0.0/8, 192.168.0.0/16 and the S3 endpoint's address, internet denied.
    must: still dropped (blocked beats every rule); the public address the same
    rules allow is reached, one they do not allow is not."""
    rules = Egress.parse(False, ["10.0.0.0/8", "192.168.0.0/16", STORE, PUBLIC])
    guest = world.sandbox(rules)
    assert reach(world, guest, PUBLIC) == f"reached {PUBLIC}"
    for address in ("10.99.0.1", "192.168.77.1", STORE):
        assert reach(world, guest, address) is None, address
    with world.lab.inside("node"):  # the same through a live update
        world.network.update(guest.sid, Egress.parse(True, ["0.0.0.0/0"]))
    assert reach(world, guest, "192.168.77.1") is None and reach(world, guest, STORE) is None


def test_the_domain_gate_refuses_names_resolving_into_blocked_ranges(world: World) -> None:
    """attacker: root in a guest whose rules allow *.test, internet denied.
    target: a private address and the object store, through the domain gate.
    attempt: HTTP to an allowed public address with Host names that resolve
    to 192.168.77.1 and to the S3 endpoint.  must: refused by the gate, while
    Host public.test is relayed."""
    guest = world.sandbox(Egress.parse(False, ["*.test"]))
    assert reach(world, guest, PUBLIC, host="public.test") == f"reached {PUBLIC}"
    assert reach(world, guest, PUBLIC, host="internal.test") is None
    assert reach(world, guest, PUBLIC, host="store.test") is None


# --- finding 9: one sandbox cannot deny DNS or the gate to the others -----------------------------


def test_a_guest_flooding_dns_does_not_starve_another_sandbox(world: World) -> None:
    """attacker: root in guest A.  target: the node's resolver, shared by every
    sandbox.  attempt: 300 queries at once for names whose upstream never
    answers.  must: sandbox B's lookup is still answered."""
    a, b = world.sandbox(Egress()), world.sandbox(Egress())
    with world.lab.inside(a.sid):
        flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with flood:
        for i in range(300):
            flood.sendto(dns.message.make_query(f"n{i}.flood.test", dns.rdatatype.A).to_wire(), (GUEST_GATEWAY, 53))
        assert resolve(world, b, "public.test") == [PUBLIC]


def test_a_slow_loris_on_the_gate_does_not_block_another_sandbox(world: World) -> None:
    """attacker: root in guest A, rules allow *.test, internet denied (its web
    traffic goes through the gate).  target: the domain gate's connections,
    shared by every sandbox.  attempt: 520 connections to port 80 that never
    send a request head.  must: sandbox B's request through the gate passes."""
    a, b = world.sandbox(Egress.parse(False, ["*.test"])), world.sandbox(Egress.parse(False, ["*.test"]))
    held = []
    try:
        with world.lab.inside(a.sid):
            for _ in range(520):
                try:
                    held.append(socket.create_connection((PUBLIC, 80), timeout=3))
                except OSError:
                    break  # refused or dropped: the gate (or the namespace) has had enough
        assert reach(world, b, PUBLIC, host="public.test") == f"reached {PUBLIC}"
    finally:
        for conn in held:
            conn.close()


def test_a_guest_trickling_its_request_is_cut_off_by_the_gate(world: World) -> None:
    """attacker: root in a guest whose web traffic goes through the gate.
    target: a gate connection held open.  attempt: the request head one byte
    every quarter second, never finished.  must: the gate closes it within
    its handshake deadline (not after the guest stops)."""
    guest = world.sandbox(Egress.parse(False, ["*.test"]))
    head = b"GET / HTTP/1.1\r\nHost: public.test" + b"x" * 100
    with world.lab.inside(guest.sid):
        conn = socket.create_connection((PUBLIC, 80), timeout=3)
    with conn:
        assert trickled_until_closed(conn, head), "the gate kept a trickling connection open"  # ~30 s at most
