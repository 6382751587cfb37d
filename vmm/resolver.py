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
on a fixed pool of threads; one that fails gets SERVFAIL, never a crash.

One guest must not deny DNS to the others, so what it can hold is bounded:
- at most `per_sandbox` of its queries (UDP, or TCP connections) are queued
  or being answered at once; more are dropped at once (a stub resolver
  retries), as is anything past the node's bound of `max_queued` waiting;
- an upstream lookup has one deadline (`timeout`) for all the upstream
  servers together, and a TCP query one deadline (`tcp_timeout`) for
  reading it whole, so a query a black hole never answers, or a guest
  trickling a TCP query a byte a second, holds a worker for a bounded time;
- the guest's namespace limits the rate of its DNS packets (vmm/egress.py),
  so a flood does not fill this resolver's one UDP socket for everyone.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
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
from .shares import Shares

log = logging.getLogger(__name__)

HOSTS_TTL = 60
MAX_TCP_QUERY = 65535
TCP_TIMEOUT = 5.0  # seconds to read a whole TCP query, however it is trickled
WORKERS = 32
PER_SANDBOX = 8  # queries (or TCP connections) of one sandbox queued or being answered at once
MAX_QUEUED = 512  # queries waiting for a worker, all sandboxes together


def system_nameservers(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [line.split()[1] for line in lines if line.startswith("nameserver") and len(line.split()) > 1]


class Resolver:
    def __init__(self, network: Network, *, port: int, hosts: dict[str, str] | None = None,
                 upstream: list[str] | None = None, timeout: float = 3.0, workers: int = WORKERS,
                 per_sandbox: int = PER_SANDBOX, max_queued: int = MAX_QUEUED,
                 tcp_timeout: float = TCP_TIMEOUT) -> None:
        """`timeout`: one upstream lookup, all servers together; the rest: see the module's docstring."""
        self.network = network
        self.port = port
        self.hosts = {name.lower().rstrip("."): address for name, address in (hosts or {}).items()}
        self.upstream = list(upstream if upstream is not None else system_nameservers())
        self.timeout = timeout
        self.tcp_timeout = tcp_timeout
        self.workers, self.per_sandbox = workers, per_sandbox
        self._jobs: queue.Queue[tuple[str, Callable[[], None]]] = queue.Queue(maxsize=max_queued)
        self._shares = Shares()  # source address -> its queries queued or being answered
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
        for i in range(self.workers):
            threading.Thread(target=self._work, daemon=True, name=f"strata-dns-{i}").start()
        threading.Thread(target=self._serve_udp, daemon=True, name="strata-dns-udp").start()
        threading.Thread(target=self._serve_tcp, daemon=True, name="strata-dns-tcp").start()

    def stop(self) -> None:
        self._stopped.set()
        self._udp.close()
        self._tcp.close()

    # admission ------------------------------------------------------------------------
    def _submit(self, address: str, job: Callable[[], None]) -> bool:
        """Queue `job` for the sandbox at `address` unless it already holds its
        share or the queue is full (False: the caller drops the query).
        Every address outside the pool (no sandbox, refused anyway) shares one
        share, so spoofed sources cannot fill the queue."""
        source = address if _within(address, self.network.pool) else "outside"
        if self._shares.take(source, each=self.per_sandbox) is not None:
            return False
        try:
            self._jobs.put_nowait((source, job))
        except queue.Full:
            self._shares.give(source)
            return False
        return True

    def _work(self) -> None:
        while not self._stopped.is_set():
            try:
                source, job = self._jobs.get(timeout=0.5)  # `source` as _submit counted it
            except queue.Empty:
                continue
            try:
                job()
            except Exception:  # noqa: BLE001 - one query's failure must not end a worker
                log.exception("resolver: a query from %s failed", source)
            finally:
                self._shares.give(source)

    # transports -----------------------------------------------------------------------
    def _serve_udp(self) -> None:
        while not self._stopped.is_set():
            try:
                wire, peer = self._udp.recvfrom(4096)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self._submit(peer[0], lambda wire=wire, peer=peer: self._reply_udp(wire, peer))  # else dropped

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
            if not self._submit(peer[0], lambda conn=conn, source=peer[0]: self._reply_tcp(conn, source)):
                conn.close()

    def _reply_tcp(self, conn: socket.socket, source: str) -> None:
        with conn:
            deadline = time.monotonic() + self.tcp_timeout
            try:
                size = struct.unpack("!H", _recv_exactly(conn, 2, deadline))[0]
                reply = self.answer(_recv_exactly(conn, size, deadline), source, tcp=True)
                if reply is not None:
                    conn.settimeout(self.tcp_timeout)  # sendall's timeout is for all of it
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
        """Ask the upstream servers in turn within one deadline (`timeout`):
        each gets an equal share of what is left, so a dead first server
        leaves time for the next, and many dead ones do not add up."""
        last: Exception | None = None
        deadline = time.monotonic() + self.timeout
        for i, server in enumerate(self.upstream):
            share = (deadline - time.monotonic()) / (len(self.upstream) - i)
            if share <= 0:
                break
            host, _, port = server.partition(":")
            try:  # dnspython's timeout is the whole exchange's (connect, send, every receive)
                if tcp:
                    return dns.query.tcp(query, host, port=int(port or 53), timeout=share)
                # a truncated (TC) answer goes back as it is: the guest retries over TCP
                return dns.query.udp(query, host, port=int(port or 53), timeout=share, ignore_unexpected=True)
            except (dns.exception.DNSException, OSError) as exc:
                last = exc
        raise dns.exception.Timeout() if last is None else last


def _within(address: str, pool: ipaddress.IPv4Network) -> bool:
    try:
        return ipaddress.ip_address(address) in pool
    except ValueError:
        return False


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


def _recv_exactly(conn: socket.socket, size: int, deadline: float) -> bytes:
    """`size` bytes, all of them by `deadline` (time.monotonic), however they are trickled."""
    data = b""
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("a TCP query was not read whole in time")
        conn.settimeout(left)
        block = conn.recv(size - len(data))
        if not block:
            raise ValueError("connection closed mid-query")
        data += block
    return data
