"""The sandboxes' DNS resolver: the only name server a guest can reach.

Each sandbox namespace redirects the guest's port-53 traffic, whatever
server it names, to this resolver on the node (vmm/network.py), which
knows the asking sandbox by its outside address. It answers the names the
node is configured with (`network.hosts`) itself and forwards the rest to
the upstream servers. An answer for a name a domain rule of the sandbox
allows (vmm/egress.py) lets the sandbox reach the answer's addresses for
their TTL (at least MIN_TTL) before the guest sees it, so a connection made
right after the lookup is never refused; nothing is resolved ahead of time.

Queries from anywhere but a sandbox are refused. Every query is answered
on a small pool of threads; one that fails gets SERVFAIL, never a crash.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dns.exception
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from layerstore.errors import StrataError

from .egress import MIN_TTL
from .network import Network

log = logging.getLogger(__name__)

HOSTS_TTL = 60
MAX_TCP_QUERY = 65535
TCP_TIMEOUT = 5.0


def system_nameservers(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [line.split()[1] for line in lines if line.startswith("nameserver") and len(line.split()) > 1]


class Resolver:
    def __init__(self, network: Network, *, port: int, hosts: dict[str, str] | None = None,
                 upstream: list[str] | None = None, timeout: float = 3.0, workers: int = 8) -> None:
        self.network = network
        self.port = port
        self.hosts = {name.lower().rstrip("."): address for name, address in (hosts or {}).items()}
        self.upstream = list(upstream if upstream is not None else system_nameservers())
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="strata-dns")
        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._stopped = threading.Event()

    def start(self) -> None:
        """Listen on every address of the node's namespace, port `port` (UDP and TCP)."""
        for sock in (self._udp, self._tcp):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", self.port))
            except OSError as exc:
                raise StrataError(f"the sandboxes' resolver cannot listen on port {self.port}: {exc} "
                                  "(config network.dns_port)") from None
        self._tcp.listen(64)
        self._tcp.settimeout(0.5)
        self._udp.settimeout(0.5)
        threading.Thread(target=self._serve_udp, daemon=True, name="strata-dns-udp").start()
        threading.Thread(target=self._serve_tcp, daemon=True, name="strata-dns-tcp").start()

    def stop(self) -> None:
        self._stopped.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._udp.close()
        self._tcp.close()

    # transports -----------------------------------------------------------------------
    def _serve_udp(self) -> None:
        while not self._stopped.is_set():
            try:
                wire, peer = self._udp.recvfrom(4096)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self._pool.submit(self._reply_udp, wire, peer)

    def _reply_udp(self, wire: bytes, peer: tuple[str, int]) -> None:
        reply = self.answer(wire, peer[0])
        if reply is not None:
            try:
                self._udp.sendto(reply, peer)
            except OSError:
                pass

    def _serve_tcp(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._tcp.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self._pool.submit(self._reply_tcp, conn, peer[0])

    def _reply_tcp(self, conn: socket.socket, source: str) -> None:
        with conn:
            conn.settimeout(TCP_TIMEOUT)
            try:
                size = struct.unpack("!H", _recv_exactly(conn, 2))[0]
                reply = self.answer(_recv_exactly(conn, size), source, tcp=True)
                if reply is not None:
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
            except (OSError, ValueError):
                pass

    # one query ------------------------------------------------------------------------
    def answer(self, wire: bytes, source: str, *, tcp: bool = False) -> bytes | None:
        """The reply to one query from `source` (None: not even a query)."""
        try:
            query = dns.message.from_wire(wire)
        except (dns.exception.DNSException, ValueError):
            return None
        owner = self.network.owner(source)
        if owner is None or len(query.question) != 1:
            return _response(query, dns.rcode.REFUSED).to_wire()
        link, rules = owner
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        try:
            if name in self.hosts:
                response = self._local(query, name, question.rdtype)
            elif self.upstream:
                response = self._forward(query, tcp)
            else:
                response = _response(query, dns.rcode.NXDOMAIN)
            if rules.domains and rules.allows_name(name):
                addresses, ttl = _addresses(response)
                if addresses:
                    self.network.learn(link, addresses, max(ttl, MIN_TTL))
            return response.to_wire()
        except (dns.exception.DNSException, OSError, StrataError) as exc:
            log.warning("resolver: %s for sandbox %s: %s", name, link.sid, exc)
            return _response(query, dns.rcode.SERVFAIL).to_wire()

    def lookup(self, name: str) -> list[str]:
        """IPv4 addresses of `name` as a guest would be told them (the domain gate dials these)."""
        name = name.lower().rstrip(".")
        if name in self.hosts:
            return [self.hosts[name]]
        if not self.upstream:
            return []
        try:
            response = self._forward(dns.message.make_query(name, dns.rdatatype.A), tcp=False)
        except (dns.exception.DNSException, OSError):
            return []
        return _addresses(response)[0]

    def _local(self, query: dns.message.Message, name: str, rdtype: int) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA | dns.flags.RA
        if rdtype == dns.rdatatype.A:
            response.answer.append(dns.rrset.from_text(query.question[0].name, HOSTS_TTL, dns.rdataclass.IN,
                                                       dns.rdatatype.A, self.hosts[name]))
        return response

    def _forward(self, query: dns.message.Message, tcp: bool) -> dns.message.Message:
        last: Exception | None = None
        for server in self.upstream:
            host, _, port = server.partition(":")
            try:
                if tcp:
                    return dns.query.tcp(query, host, port=int(port or 53), timeout=self.timeout)
                # a truncated (TC) answer goes back as it is: the guest retries over TCP
                return dns.query.udp(query, host, port=int(port or 53), timeout=self.timeout,
                                     ignore_unexpected=True)
            except (dns.exception.DNSException, OSError) as exc:
                last = exc
        raise dns.exception.Timeout() if last is None else last


def _addresses(response: dns.message.Message) -> tuple[list[str], int]:
    addresses, ttl = [], None
    for rrset in response.answer:
        if rrset.rdtype == dns.rdatatype.A:
            addresses += [r.address for r in rrset]
            ttl = rrset.ttl if ttl is None else min(ttl, rrset.ttl)
    return addresses, ttl or 0


def _response(query: dns.message.Message, rcode: int) -> dns.message.Message:
    response = dns.message.make_response(query)
    response.set_rcode(rcode)
    return response


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        block = conn.recv(size - len(data))
        if not block:
            raise ValueError("connection closed mid-query")
        data += block
    return data
