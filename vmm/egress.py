"""A sandbox's egress rules, and the nftables ruleset that enforces them.

Rules follow E2B's network options:

    internet  (allow_internet_access)  False = deny every address not allowed below
    allow     (network.allowOut)       CIDRs, IPs and domains (example.com, *.example.com)
    deny      (network.denyOut)        CIDRs and IPs

Allow beats deny, as in E2B: an address in both is reachable. A domain rule
allows the addresses the node's resolver hands the guest for a name that
matches it, for as long as the answer's TTL (at least MIN_TTL): the
addresses are learned per answer, never by resolving the name once at create.
Domains only matter where something denies (`internet` off or a deny rule):
everything else is reachable anyway.

With `internet` off, HTTP and TLS (ports 80 and 443) to an address no CIDR
rule allows also pass the domain gate (vmm/domain_gate.py), which checks the
Host header or the TLS server name against the domain rules and connects to
that name itself: an address learned for an allowed name does not open the
other names it serves.

Addresses the node blocks for every sandbox beat every rule, allow rules and
learned domain addresses included, and the domain gate never dials them
(`blocked_ranges`): by default every range a cloud host has private
neighbours in (DEFAULT_BLOCKED: RFC 1918, CGNAT, loopback, link-local and its
metadata service, 0/8, multicast, reserved; config `network.blocked`), plus
the node's own addresses and those of its object store's endpoint, less the
ranges the operator opens (config `network.open`), plus always the sandbox
pool (another sandbox). The guest's own link (172.16.0.0/30, inside
172.16/12) never reaches these rules: its DNS and the domain gate are
accepted at the node's end of the namespace's link before them, and the
node's port proxy comes in from the outside, not through `egress`.

The rules are enforced in the sandbox's own network namespace (vmm/network.py),
on every packet the guest sends, so a change applies to the next packet:
connections already open to an address now denied stop; an address newly
allowed is reachable at once.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from layerstore.errors import InvalidInput

GUEST, GUEST_GATEWAY = "172.16.0.2", "172.16.0.1"  # the guest's link, the same in every sandbox (vmm/network.py)
MAX_RULES = 1000
MIN_TTL = 30  # seconds a resolved address of an allowed domain stays allowed, at least
DNS_RATE = 100  # DNS packets per second (and burst) one sandbox sends the node's resolver, at most
DEFAULT_BLOCKED = (  # what no sandbox reaches unless the operator opens it (config network.blocked's default)
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # RFC 1918: a VPC, a Docker network, the office
    "100.64.0.0/10",  # carrier-grade NAT, and some clouds' internal services
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local, where clouds put their metadata service
    "224.0.0.0/4", "240.0.0.0/4",  # multicast; reserved and broadcast
)
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_DOMAIN = re.compile(rf"^(\*\.)?({_LABEL}\.)*{_LABEL}\.?$")


@dataclass(frozen=True)
class Egress:
    internet: bool = True
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @classmethod
    def parse(cls, internet: bool = True, allow: Any = (), deny: Any = ()) -> Egress:
        """Validated rules; InvalidInput names the first bad one (nothing is applied)."""
        if not isinstance(internet, bool):
            raise InvalidInput("allow_internet_access must be true or false")
        return cls(internet, tuple(_rules(allow, "allowOut", domains=True)), tuple(_rules(deny, "denyOut")))

    @classmethod
    def of(cls, record: dict[str, Any] | None) -> Egress:
        """From a sandbox record's `network` field (None: the defaults)."""
        record = record or {}
        return cls.parse(record.get("internet", True), record.get("allow", ()), record.get("deny", ()))

    def as_record(self) -> dict[str, Any]:
        return {"internet": self.internet, "allow": list(self.allow), "deny": list(self.deny)}

    @property
    def allowed_nets(self) -> list[str]:
        return [r for r in self.allow if not _is_domain(r)]

    @property
    def domains(self) -> list[str]:
        return [r for r in self.allow if _is_domain(r)]

    @property
    def gated(self) -> bool:
        """Web traffic goes through the domain gate: domains are allowed and the rest denied."""
        return bool(self.domains) and not self.internet

    def allows_name(self, name: str) -> bool:
        """Does a domain rule cover `name` (a DNS query name)?"""
        name = name.rstrip(".").lower()
        for rule in self.domains:
            rule = rule.rstrip(".")
            if rule.startswith("*.") and (name.endswith(rule[1:]) or name == rule[2:]):
                return True
            if name == rule:
                return True
        return False


def _is_domain(rule: str) -> bool:
    return not rule[:1].isdigit() and ":" not in rule


def _rules(value: Any, field: str, *, domains: bool = False) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, str) for r in value):
        raise InvalidInput(f"{field} must be a list of strings")
    if len(value) > MAX_RULES:
        raise InvalidInput(f"{field} has {len(value)} rules; at most {MAX_RULES}")
    out = []
    for rule in value:
        rule = rule.strip().lower()
        if _is_domain(rule) and domains:
            if not _DOMAIN.match(rule) or len(rule) > 253:
                raise InvalidInput(f"{field}: {rule!r} is not a CIDR, an IP address or a domain")
            out.append(rule)
            continue
        try:
            net = ipaddress.ip_network(rule, strict=False)
        except ValueError:
            what = "a CIDR, an IP address or a domain" if domains else "a CIDR or an IP address"
            raise InvalidInput(f"{field}: {rule!r} is not {what}") from None
        if net.version != 4:
            raise InvalidInput(f"{field}: {rule!r}: sandboxes have IPv4 only")
        out.append(str(net))
    return out


def blocked_ranges(base: Iterable[str], *, addresses: Iterable[str] = (), opened: Iterable[str] = (),
                   always: Iterable[str] = ()) -> tuple[str, ...]:
    """The CIDRs no sandbox reaches: `base` (config network.blocked) and
    `addresses` (the node's own, its store's endpoint), less the `opened`
    ranges (config network.open: what the operator lets sandboxes reach there),
    plus `always` (the sandbox pool, which nothing opens). Collapsed, so the
    nftables set and the domain gate's checks are the same short list."""
    nets = [ipaddress.ip_network(net, strict=False) for net in base]
    nets += [ipaddress.ip_network(f"{address}/32") for address in addresses]
    for hole in (ipaddress.ip_network(net, strict=False) for net in opened):
        nets = [piece for net in nets for piece in _without(net, hole)]
    nets += [ipaddress.ip_network(net, strict=False) for net in always]
    return tuple(str(net) for net in ipaddress.collapse_addresses(n for n in nets if n.version == 4))


def _without(net: ipaddress.IPv4Network, hole: ipaddress.IPv4Network) -> list[ipaddress.IPv4Network]:
    """`net` less `hole` (two IPv4 networks that overlap are nested)."""
    if not net.overlaps(hole):
        return [net]
    if hole.supernet_of(net):
        return []
    return list(net.address_exclude(hole))


def ruleset(rules: Egress, *, gateway: str, outside: str, dns_port: int, gate_port: int, blocked: tuple[str, ...],
            replace: bool, max_connections: int = 0, bandwidth: int = 0, dns_rate: int = DNS_RATE) -> str:
    """The sandbox namespace's nftables script (`nft -f -`), one transaction.

        guest 172.16.0.2 --tap0--> [ns: dnat :53 -> node resolver; egress chain; snat -> outside] --eth0--> node

    `gateway` is the node's end of the namespace's link (where the resolver
    listens on `dns_port` and the domain gate, vmm/domain_gate.py, on
    `gate_port`), `outside` the namespace's own address. With
    `replace` the filter sets and the nat_in and egress chains are swapped in place
    (learned domain addresses are kept unless the domains changed: the caller
    flushes them then), otherwise the whole table is created, with the
    node's limits: at most `max_connections` open connections from the
    guest, `bandwidth` bytes per second each way (0: none; packets over
    either are dropped, which TCP senders slow down for). DNS over UDP to
    the resolver is limited to `dns_rate` packets a second (0: none), so
    one guest flooding cannot fill the resolver's one socket for every
    sandbox (vmm/resolver.py caps what it queues per sandbox).
    """
    sets = {"allow": rules.allowed_nets, "deny": list(rules.deny), "blocked": list(blocked)}
    verdict = "accept" if rules.internet else "drop"
    flood = ([f"ip daddr {gateway} udp dport {dns_port} limit rate over {dns_rate}/second burst {dns_rate} packets "
              "drop"] if dns_rate else [])
    egress = [*flood, f"ip daddr {gateway} meta l4proto {{ tcp, udp }} th dport {dns_port} accept",
              f"ip daddr {gateway} tcp dport {gate_port} accept",
              "ip daddr @blocked drop", "ip daddr @allow accept", "ip daddr @learned accept",
              "ip daddr @deny drop", verdict]
    nat_in = [f"iifname \"tap0\" meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gateway}:{dns_port}",
              # the node reaches the guest's ports at the namespace's own address (api's port proxy)
              f"iifname \"eth0\" ip daddr {outside} dnat ip to {GUEST}"]
    if rules.gated:  # web traffic to addresses no CIDR allows goes through the domain gate
        nat_in.append(f"iifname \"tap0\" tcp dport {{ 80, 443 }} ip daddr != @allow ip daddr != @blocked "
                      f"dnat ip to {gateway}:{gate_port}")
    if replace:
        lines = []
        for name, members in sets.items():
            lines.append(f"flush set inet strata {name}")
            if members:
                lines.append(f"add element inet strata {name} {{ {', '.join(members)} }}")
        for chain, chain_rules in (("nat_in", nat_in), ("egress", egress)):
            lines.append(f"flush chain inet strata {chain}")
            lines += [f"add rule inet strata {chain} {rule}" for rule in chain_rules]
        return "\n".join(lines) + "\n"
    body = []
    for name, members in sets.items():
        elements = f" elements = {{ {', '.join(members)} }};" if members else ""
        body.append(f"  set {name} {{ type ipv4_addr; flags interval; auto-merge;{elements} }}")
    body += [
        "  set learned { type ipv4_addr; flags timeout; }",
        "  counter sent { }",
        "  counter received { }",
        "  chain nat_in { type nat hook prerouting priority dstnat;",
        *[f"    {rule}" for rule in nat_in],
        "  }",
        "  chain nat_out { type nat hook postrouting priority srcnat;",
        f"    oifname \"eth0\" snat ip to {outside}",
        "  }",
        "  chain filter_forward { type filter hook forward priority filter; policy drop;",
        "    iifname \"tap0\" counter name \"sent\"",
        "    oifname \"tap0\" counter name \"received\"",
        *([f"    iifname \"tap0\" ct state new ct count over {max_connections} drop"] if max_connections else []),
        *([f"    iifname \"tap0\" limit rate over {bandwidth} bytes/second burst {bandwidth} bytes drop",
           f"    oifname \"tap0\" limit rate over {bandwidth} bytes/second burst {bandwidth} bytes drop"]
          if bandwidth else []),
        "    iifname \"eth0\" oifname \"tap0\" ct state established,related accept",
        "    iifname \"eth0\" oifname \"tap0\" ct status dnat accept",
        "    iifname \"tap0\" oifname \"eth0\" ct direction reply accept",  # answers to the node's port proxy
        "    iifname \"tap0\" oifname \"eth0\" meta nfproto ipv4 jump egress",
        "  }",
        "  chain filter_input { type filter hook input priority filter; policy accept;",
        "    iifname \"tap0\" ct state established,related accept",
        "    iifname \"tap0\" drop",
        "  }",
        "  chain egress {",
        *[f"    {rule}" for rule in egress],
        "  }",
    ]
    return "table inet strata {\n" + "\n".join(body) + "\n}\n"
