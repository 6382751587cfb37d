"""The domain gate: a sandbox's HTTP and TLS checked by the name it asks for.

An address the resolver opened for an allowed name (vmm/resolver.py) may
serve other names too (a CDN, shared hosting). So when a sandbox's rules
deny the internet and allow domains, its namespace sends each new TCP
connection to port 80 or 443 of an address no CIDR rule allows to this gate
instead (vmm/egress.py). The gate reads the name the guest asks for, the
Host header of HTTP or the server name (SNI) of a TLS ClientHello, refuses
a name no domain rule allows, and otherwise resolves the name itself,
connects to it on the protocol's port and relays bytes both ways. The
address the guest dialled is not used: a guest cannot reach one name by
asking another's address.

    guest -> 93.184.216.34:443 --dnat--> gate: ClientHello SNI "api.example.com"
          allowed by *.example.com -> resolve -> connect :443 -> relay

Never dialled: loopback, the node's own addresses, the sandbox pool and
the blocked ranges (Network.blocked: the same set the namespaces drop),
whatever a name resolves to.

A connection takes an OS thread, two while it relays, so what one guest
can hold is bounded: at most `per_sandbox` connections of one sandbox at
once and `max_connections` of all (more are closed at accept, before a
thread is started), and the request head must arrive whole within one
deadline (`head_timeout`), however it is trickled: a guest sending a byte a
second holds a connection for that long, not for as long as it likes.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

from layerstore.errors import StrataError

from .network import Network
from .shares import Shares

log = logging.getLogger(__name__)

MAX_HEAD = 16 << 10  # the most read before the name must be known
HEAD_TIMEOUT = 5.0  # seconds for the whole request head (Host or SNI), however it is trickled
DIAL_TIMEOUT = 10.0  # seconds to connect to the name, every address of it together
MAX_CONNECTIONS = 512  # connections of all sandboxes at once
PER_SANDBOX = 64  # connections of one sandbox at once
TLS_HANDSHAKE = 0x16


def tls_server_name(data: bytes) -> str | None:
    """The SNI host name of a TLS ClientHello record at the start of `data`
    (None: not one, incomplete, or without a name)."""
    try:
        if data[0] != TLS_HANDSHAKE or data[5] != 1:  # handshake record, ClientHello
            return None
        end = 5 + struct.unpack("!H", data[3:5])[0]
        pos = 5 + 4 + 2 + 32  # record header, handshake header, version, random
        pos += 1 + data[pos]  # session id
        pos += 2 + struct.unpack("!H", data[pos:pos + 2])[0]  # cipher suites
        pos += 1 + data[pos]  # compression methods
        extensions_end = pos + 2 + struct.unpack("!H", data[pos:pos + 2])[0]
        pos += 2
        while pos + 4 <= min(extensions_end, end):
            kind, size = struct.unpack("!HH", data[pos:pos + 4])
            pos += 4
            if kind == 0:  # server_name: list length, then (type 0 = host_name, length, name)
                if data[pos + 2] == 0:
                    length = struct.unpack("!H", data[pos + 3:pos + 5])[0]
                    return data[pos + 5:pos + 5 + length].decode("ascii").lower()
                return None
            pos += size
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def http_host(data: bytes) -> str | None:
    """The Host header's name (no port) of an HTTP/1 request head in `data`."""
    head, sep, _ = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"host":
            host = value.strip().decode("ascii", "replace").lower()
            return host.rsplit(":", 1)[0] if not host.endswith("]") else None
    return None


class DomainGate:
    def __init__(self, network: Network, lookup: Callable[[str], list[str]], *, port: int,
                 max_connections: int = MAX_CONNECTIONS, per_sandbox: int = PER_SANDBOX,
                 head_timeout: float = HEAD_TIMEOUT, dial_timeout: float = DIAL_TIMEOUT) -> None:
        self.network = network
        self.lookup = lookup  # name -> IPv4 addresses (the resolver's own answer)
        self.port = port
        self.max_connections, self.per_sandbox = max_connections, per_sandbox
        self.head_timeout, self.dial_timeout = head_timeout, dial_timeout
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._shares = Shares()  # source address -> its open connections
        self._stopped = threading.Event()

    def start(self) -> None:
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind(("0.0.0.0", self.port))
        except OSError as exc:
            raise StrataError(f"the domain gate cannot listen on port {self.port}: {exc} "
                              "(config network.gate_port)") from None
        self._listener.listen(128)
        self._listener.settimeout(0.5)
        threading.Thread(target=self._accept, daemon=True, name="strata-domain-gate").start()

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if not self._from_pool(peer[0]) or not self._take(peer[0]):
                conn.close()  # not a sandbox, or over a cap: refused, not queued, no thread
                continue
            threading.Thread(target=self._serve, args=(conn, peer[0]), daemon=True).start()

    def _from_pool(self, source: str) -> bool:
        """Sandboxes come from the pool (their namespace's address); anyone
        else reaching this port is closed before it costs a thread or a slot."""
        try:
            return ipaddress.ip_address(source) in self.network.pool
        except ValueError:
            return False

    def _take(self, source: str) -> bool:
        """A connection slot for `source`, if it and the node are under their caps."""
        return self._shares.take(source, each=self.per_sandbox, total=self.max_connections) is None

    def _serve(self, conn: socket.socket, source: str) -> None:
        try:
            with conn:
                owner = self.network.owner(source)
                if owner is None:
                    return
                link, rules = owner
                head, name, port = self._read_name(conn)
                if name is None or not rules.allows_name(name):
                    log.info("domain gate: sandbox %s asked for %r: not allowed", link.sid, name)
                    return
                upstream = self._dial(name, port)
                if upstream is None:
                    return
                with upstream:
                    upstream.sendall(head)
                    _relay(conn, upstream)
        except OSError:  # a timeout included: the head's deadline passed
            pass
        finally:
            self._shares.give(source)

    def _read_name(self, conn: socket.socket) -> tuple[bytes, str | None, int]:
        """The head read so far, the name it asks for and its port, all by one deadline."""
        deadline = time.monotonic() + self.head_timeout
        head = b""
        while len(head) < MAX_HEAD:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(left)
            block = conn.recv(MAX_HEAD - len(head))
            if not block:
                break
            head += block
            if head[0] == TLS_HANDSHAKE:
                if len(head) >= 5 and len(head) >= 5 + struct.unpack("!H", head[3:5])[0]:
                    return head, tls_server_name(head), 443
            elif b"\r\n\r\n" in head:
                return head, http_host(head), 80
        return head, None, 0

    def _dial(self, name: str, port: int) -> socket.socket | None:
        deadline = time.monotonic() + self.dial_timeout
        for address in self.lookup(name):
            if not self._may_dial(address):
                log.warning("domain gate: %s resolves to %s, which sandboxes never reach", name, address)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                return socket.create_connection((address, port), timeout=left)
            except OSError:
                continue
        return None

    def _may_dial(self, address: str) -> bool:
        ip = ipaddress.ip_address(address)
        if ip.is_loopback or ip.is_unspecified or ip in self.network.pool:
            return False
        if any(ip in ipaddress.ip_network(block) for block in self.network.blocked):
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # one of the node's own addresses?
            try:
                probe.bind((address, 0))
                return False
            except OSError:
                return True


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides are done."""
    a.settimeout(None)
    b.settimeout(None)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while block := src.recv(1 << 16):
                dst.sendall(block)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    other = threading.Thread(target=pump, args=(b, a), daemon=True)
    other.start()
    pump(a, b)
    other.join()
