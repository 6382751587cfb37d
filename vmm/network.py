"""Sandbox networks: a namespace per sandbox, NAT to the node's uplink.

    node's namespace                                  namespace strata-<sid>
    uplink <- masquerade (table ip strata)            eth0 OUTSIDE = pool slot S, .2 of its /30
              stv* -> stv* dropped                      | nft table inet strata (vmm/egress.py):
              into stv*: replies only                   |   :53 -> GATEWAY:dns_port, egress rules,
              from stv*: the resolver only              |   snat 172.16.0.2 -> OUTSIDE, counters
    stvS GATEWAY (.1 of slot S) ====== veth ======    eth0
    resolver 0.0.0.0:dns_port (vmm/resolver.py)        tap0 172.16.0.1/30 ---- guest eth0 172.16.0.2/30
    domain gate 0.0.0.0:gate_port (vmm/domain_gate.py)

Every guest sees the same link (its address, gateway and both MACs), so a
snapshot restores into any namespace unchanged and the guest's network is
up the moment it resumes: there is nothing in the guest to reconfigure.
What differs between sandboxes, forks included, is the namespace's outside
address, which is what other hosts, the rules and the counters see; the
guest's MAC never leaves its namespace's private link.

What no guest reaches (`blocked`, vmm/egress.py's blocked_ranges): the
private ranges of config network.blocked, the node's own addresses (read
when the node prepares) and those its object store's endpoint resolves to,
less config network.open, plus the pool. The same set is each namespace's
@blocked and what the domain gate never dials.

Slots are leased by files <root>/slots/<S>, created with O_EXCL so two
processes never take one, holding the sandbox id and its rules. A lease is
taken before anything is created and dropped after everything is removed,
so `reconcile` finds everything a crashed process left.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from layerstore.errors import NotFound, StrataError

from .durable import write_durably
from .egress import DEFAULT_BLOCKED, GUEST, GUEST_GATEWAY, Egress, blocked_ranges, ruleset

log = logging.getLogger(__name__)

GUEST_MAC, TAP_MAC = "02:53:54:00:00:02", "02:53:54:00:00:01"
GUEST_PREFIX = 30
HOST_PREFIX = "stv"  # the node's end of each sandbox's link: stv<slot>
DEFAULT_POOL = "10.201.0.0/16"
DEFAULT_DNS_PORT = 10053
DEFAULT_GATE_PORT = 10054


class NetworkError(StrataError):
    """The node could not set up or change a sandbox's network."""


class PoolExhausted(NetworkError):
    """Every slot of the address pool is leased."""


@dataclass(frozen=True)
class Link:
    sid: str
    slot: int
    netns: str
    gateway: str  # the node's end: the resolver listens here
    outside: str  # the sandbox's address as the world sees it


def guest_cmdline() -> str:
    """Kernel parameter the initramfs reads to bring the guest's eth0 up."""
    return f"strata.net={GUEST}/{GUEST_PREFIX},{GUEST_GATEWAY}"


class Network:
    def __init__(self, root: Path, *, pool: str = DEFAULT_POOL, dns_port: int = DEFAULT_DNS_PORT,
                 gate_port: int = DEFAULT_GATE_PORT, blocked: Iterable[str] = DEFAULT_BLOCKED,
                 opened: Iterable[str] = (), endpoints: Iterable[str] = (), max_connections: int = 0,
                 bandwidth: int = 0) -> None:
        """`blocked` (config network.blocked) less `opened` (network.open) is
        what no guest reaches, with the node's own addresses and those of
        `endpoints` (URLs or host names: the object store's, the peers')."""
        self.slots = root / "slots"
        self.slots.mkdir(parents=True, exist_ok=True)
        self.pool = ipaddress.ip_network(pool)
        if self.pool.version != 4 or self.pool.prefixlen > 29:
            raise NetworkError(f"network pool {pool} must be an IPv4 network of /29 or larger")
        self.size = self.pool.num_addresses // 4
        self.dns_port = dns_port
        self.gate_port = gate_port
        self.base_blocked, self.opened, self.endpoints = tuple(blocked), tuple(opened), tuple(endpoints)
        self._blocked: tuple[str, ...] | None = None
        self.limits = {"max_connections": max_connections, "bandwidth": bandwidth}
        self._prepared = False

    # the node -------------------------------------------------------------------------
    def prepare(self) -> None:
        """The node's side: forwarding on, the node's table (re)made. Done
        by `strata serve` at start and before the first attach of any process."""
        _run(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        self.refresh_blocked()
        port, pool = self.dns_port, self.pool
        _run(["nft", "-f", "-"], stdin=f"""table ip strata {{}}
delete table ip strata
table ip strata {{
  chain filter_forward {{ type filter hook forward priority filter; policy accept;
    iifname "{HOST_PREFIX}*" oifname "{HOST_PREFIX}*" drop
    iifname "{HOST_PREFIX}*" ip saddr != {pool} drop
    oifname "{HOST_PREFIX}*" ct state established,related accept
    oifname "{HOST_PREFIX}*" drop
  }}
  chain filter_input {{ type filter hook input priority filter; policy accept;
    iifname "{HOST_PREFIX}*" ct state established,related accept
    iifname "{HOST_PREFIX}*" meta l4proto {{ tcp, udp }} th dport {port} accept
    iifname "{HOST_PREFIX}*" tcp dport {self.gate_port} accept
    iifname "{HOST_PREFIX}*" drop
  }}
  chain nat_out {{ type nat hook postrouting priority srcnat;
    ip saddr {pool} oifname != "{HOST_PREFIX}*" masquerade
  }}
}}
""")
        self._prepared = True

    @property
    def blocked(self) -> tuple[str, ...]:
        """The CIDRs no guest reaches, whatever its rules (worked out on first use, again by `prepare`)."""
        if self._blocked is None:
            return self.refresh_blocked()
        return self._blocked

    def refresh_blocked(self) -> tuple[str, ...]:
        """Read the node's addresses and resolve the endpoints again: the
        blocked set of the namespaces built from now on."""
        addresses = own_addresses() + endpoint_addresses(self.endpoints)
        self._blocked = blocked_ranges(self.base_blocked, addresses=addresses, opened=self.opened,
                                       always=(str(self.pool),))
        return self._blocked

    def reconcile(self, live: set[str]) -> list[str]:
        """Remove every network whose sandbox is not in `live` (a kill or a
        node that died midway). Returns their sandbox ids."""
        gone = []
        for slot, sid, _rules in self._leases():
            if sid not in live:
                self._remove(slot, sid)
                gone.append(sid)
        return gone

    # one sandbox ----------------------------------------------------------------------
    def attach(self, sid: str, rules: Egress) -> Link:
        """Lease a slot and build the sandbox's namespace, link and rules."""
        if not self._prepared:
            self.prepare()
        link = self._lease(sid, rules)
        try:
            self._build(link, rules)
        except BaseException:
            self._remove(link.slot, sid)
            raise
        return link

    def detach(self, sid: str) -> None:
        """Remove the sandbox's network and free its slot (nothing leased: nothing to do)."""
        for slot, owner, _rules in self._leases():
            if owner == sid:
                self._remove(slot, sid)

    def link(self, sid: str) -> Link:
        for slot, owner, _rules in self._leases():
            if owner == sid:
                return self._link(slot, sid)
        raise NotFound(f"sandbox {sid} has no network")

    def update(self, sid: str, rules: Egress) -> None:
        """Swap the sandbox's rules in place (one nft transaction); learned
        addresses of allowed domains stay unless the domains changed."""
        link = self.link(sid)
        old = self.rules(link.slot)
        script = ruleset(rules, gateway=link.gateway, outside=link.outside, dns_port=self.dns_port,
                         gate_port=self.gate_port, blocked=self.blocked, replace=True)
        if old is None or old.domains != rules.domains:
            script += "flush set inet strata learned\n"
        _run(["ip", "netns", "exec", link.netns, "nft", "-f", "-"], stdin=script)
        write_durably(self.slots / str(link.slot), _lease_record(sid, rules))

    def owner(self, address: str) -> tuple[Link, Egress] | None:
        """The sandbox whose outside address is `address` (what the resolver sees), and its rules."""
        try:
            offset = int(ipaddress.ip_address(address)) - int(self.pool.network_address)
        except ValueError:
            return None
        slot, host = divmod(offset, 4)
        if host != 2 or not 0 <= slot < self.size:
            return None
        try:
            data = json.loads((self.slots / str(slot)).read_text())
            return self._link(slot, data["sid"]), Egress.of(data["rules"])
        except (OSError, ValueError, KeyError, StrataError):
            return None

    def rules(self, slot: int) -> Egress | None:
        try:
            return Egress.of(json.loads((self.slots / str(slot)).read_text())["rules"])
        except (OSError, ValueError, KeyError, StrataError):
            return None

    def learn(self, link: Link, addresses: list[str], ttl: int) -> None:
        """Let the sandbox reach `addresses` (its resolver's answer for an
        allowed domain) for `ttl` seconds."""
        elements = ", ".join(f"{a} timeout {ttl}s" for a in addresses)
        _run(["ip", "netns", "exec", link.netns, "nft", "add", "element", "inet", "strata", "learned",
              f"{{ {elements} }}"])

    def counters(self, sid: str) -> dict[str, int]:
        """Bytes and packets the guest sent and received (all of them, denied ones too)."""
        link = self.link(sid)
        out = _run(["ip", "netns", "exec", link.netns, "nft", "-j", "list", "counters", "table", "inet", "strata"])
        result: dict[str, int] = {}
        for item in json.loads(out).get("nftables", []):
            counter = item.get("counter")
            if counter:
                result[f"{counter['name']}_bytes"] = int(counter["bytes"])
                result[f"{counter['name']}_packets"] = int(counter["packets"])
        return result

    # slots and namespaces -------------------------------------------------------------
    def _link(self, slot: int, sid: str) -> Link:
        base = int(self.pool.network_address) + 4 * slot
        return Link(sid, slot, f"strata-{sid}", str(ipaddress.ip_address(base + 1)),
                    str(ipaddress.ip_address(base + 2)))

    def _leases(self) -> list[tuple[int, str, dict]]:
        leases = []
        for path in self.slots.iterdir():
            try:
                data = json.loads(path.read_text())
                leases.append((int(path.name), str(data["sid"]), data.get("rules") or {}))
            except (OSError, ValueError, KeyError):
                continue  # one being written: its taker finishes or reconcile removes it
        return sorted(leases)

    def _lease(self, sid: str, rules: Egress) -> Link:
        taken = {int(p.name) for p in self.slots.iterdir() if p.name.isdigit()}
        for slot in range(self.size):
            if slot in taken:
                continue
            try:
                fd = os.open(self.slots / str(slot), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue  # another process took it just now
            try:
                os.write(fd, _lease_record(sid, rules))
                os.fsync(fd)
            finally:
                os.close(fd)
            return self._link(slot, sid)
        raise PoolExhausted(f"the network pool {self.pool} has no free address: all {self.size} "
                            "sandbox slots are leased (config network.pool sets a larger one)")

    def _build(self, link: Link, rules: Egress) -> None:
        """Three processes: the namespace and the node's end, the namespace's
        inside, its rules (what a boot or restore pays, bench/network.py)."""
        host_if = f"{HOST_PREFIX}{link.slot}"
        node_side = (f"netns add {link.netns}\nlink add {host_if} type veth peer name eth0 netns {link.netns}\n"
                     f"addr add {link.gateway}/30 dev {host_if}\nlink set {host_if} up\n")
        try:
            _run(["ip", "-b", "-"], stdin=node_side)
        except NetworkError:  # a leftover of a namespace that died uncleanly: remove it, once
            self._remove(link.slot, link.sid, keep_lease=True)
            _run(["ip", "-b", "-"], stdin=node_side)
        _run(["ip", "-n", link.netns, "-b", "-"], stdin=(
            f"link set lo up\nlink set eth0 up\naddr add {link.outside}/30 dev eth0\n"
            f"route add default via {link.gateway}\ntuntap add dev tap0 mode tap\n"
            f"link set tap0 address {TAP_MAC}\naddr add {GUEST_GATEWAY}/{GUEST_PREFIX} dev tap0\nlink set tap0 up\n"))
        script = ruleset(rules, gateway=link.gateway, outside=link.outside, dns_port=self.dns_port,
                         gate_port=self.gate_port, blocked=self.blocked, replace=False, **self.limits)
        _run(["ip", "netns", "exec", link.netns, "sh", "-c", "sysctl -qw net.ipv4.ip_forward=1 && nft -f -"],
             stdin=script)

    def _remove(self, slot: int, sid: str, *, keep_lease: bool = False) -> None:
        subprocess.run(["ip", "link", "del", f"{HOST_PREFIX}{slot}"], capture_output=True)
        subprocess.run(["ip", "netns", "del", f"strata-{sid}"], capture_output=True)
        if not keep_lease:
            (self.slots / str(slot)).unlink(missing_ok=True)


def own_addresses() -> list[str]:
    """The IPv4 addresses of this thread's network namespace (the node's)."""
    out = _run(["ip", "-j", "-4", "addr", "show"])
    return [info["local"] for link in json.loads(out or "[]") for info in link.get("addr_info", ())
            if "local" in info]


def endpoint_addresses(endpoints: Iterable[str]) -> list[str]:
    """The IPv4 addresses `endpoints` (URLs, HOST or HOST:PORT) resolve to
    now. One that does not resolve is logged and left out: the private
    ranges still cover it, unless it is public."""
    addresses: list[str] = []
    for endpoint in (e.strip() for e in endpoints if e and e.strip()):
        host = urlsplit(endpoint if "//" in endpoint else f"//{endpoint}").hostname
        if not host:
            continue
        try:
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            log.warning("sandbox networks: cannot resolve %s (%s) to block it for guests: %s", host, endpoint, exc)
            continue
        addresses += sorted({str(info[4][0]) for info in infos})
    return addresses


def _lease_record(sid: str, rules: Egress) -> bytes:
    return json.dumps({"sid": sid, "rules": rules.as_record()}).encode()


def _run(argv: list[str], *, stdin: str | None = None) -> str:
    try:
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetworkError(f"{argv[0]} is not installed (apt-get install iproute2 nftables)") from None
    except subprocess.TimeoutExpired:
        raise NetworkError(f"{' '.join(argv[:4])} did not finish in 30 s") from None
    if result.returncode != 0:
        raise NetworkError(f"{' '.join(argv[:5])}: {result.stderr.strip()[:500]}")
    return result.stdout
