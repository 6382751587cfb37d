"""vmm/egress.py: parsing E2B's rules and the nftables script that enforces
them (run for real by tests/test_network.py; checked here by nft itself when
it is installed)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from layerstore.config import NodeConfig
from layerstore.errors import InvalidInput
from vmm.egress import DEFAULT_BLOCKED, Egress, blocked_ranges, ruleset
from vmm.network import Network, own_addresses


def test_rules_are_normalised_and_classified() -> None:
    rules = Egress.parse(False, ["10.0.0.1", "192.168.0.0/16", "Example.COM", "*.pypi.org"], ["0.0.0.0/0"])
    assert rules.allowed_nets == ["10.0.0.1/32", "192.168.0.0/16"]
    assert rules.domains == ["example.com", "*.pypi.org"]
    assert rules.deny == ("0.0.0.0/0",)
    assert Egress.of(rules.as_record()) == rules
    assert Egress.of(None) == Egress()


@pytest.mark.parametrize("name,allowed", [
    ("example.com", True), ("example.com.", True), ("www.example.com", False),
    ("files.pypi.org", True), ("a.b.pypi.org", True), ("pypi.org", True), ("evilpypi.org", False),
])
def test_domain_matching(name: str, allowed: bool) -> None:
    assert Egress.parse(True, ["example.com", "*.pypi.org"]).allows_name(name) is allowed


@pytest.mark.parametrize("allow,deny,named", [
    (["10.0.0.300"], [], "10.0.0.300"), (["exa mple.com"], [], "exa mple.com"), ([], ["example.com"], "example.com"),
    (["::1"], [], "IPv4 only"), ([], ["10.0.0.0/33"], "10.0.0.0/33"), (["-bad.com"], [], "-bad.com"),
])
def test_bad_rules_name_themselves(allow: list[str], deny: list[str], named: str) -> None:
    with pytest.raises(InvalidInput, match=named.replace(".", r"\.").replace("/", "/")):
        Egress.parse(True, allow, deny)


def test_bad_shapes() -> None:
    with pytest.raises(InvalidInput, match="allowOut must be a list"):
        Egress.parse(True, "10.0.0.1")
    with pytest.raises(InvalidInput, match="allow_internet_access"):
        Egress.parse("yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="at most"):
        Egress.parse(True, [], ["10.0.0.1"] * 1001)


def test_scripts_say_what_the_rules_say() -> None:
    rules = Egress.parse(False, ["10.0.0.1", "example.com"], ["10.0.0.0/8"])
    full = ruleset(rules, gateway="10.201.0.1", outside="10.201.0.2", dns_port=10053, gate_port=10054, blocked=("169.254.0.0/16",),
                   replace=False)
    assert "elements = { 10.0.0.1/32 }" in full and "elements = { 10.0.0.0/8 }" in full
    assert "snat ip to 10.201.0.2" in full and "dnat ip to 10.201.0.1:10053" in full
    egress = full[full.index("chain egress"):]
    # order is the semantics: blocked, then allow (beats deny), then deny, then the default
    assert egress.index("@blocked") < egress.index("@allow") < egress.index("@learned") < egress.index("@deny")
    assert [line.strip() for line in egress.splitlines() if line.strip() not in ("", "}")][-1] == "drop"
    update = ruleset(Egress.parse(True), gateway="10.201.0.1", outside="10.201.0.2", dns_port=10053, gate_port=10054, blocked=(),
                     replace=True)
    assert "flush set inet strata allow" in update and "add element" not in update
    assert update.strip().endswith("add rule inet strata egress accept")


@pytest.mark.skipif(shutil.which("nft") is None or os.geteuid() != 0, reason="nft -c needs nftables and root")
def test_nft_accepts_the_scripts() -> None:
    rules = Egress.parse(False, ["10.0.0.1", "*.example.com"], ["10.0.0.0/8", "172.16.5.5"])
    full = ruleset(rules, gateway="10.201.0.1", outside="10.201.0.2", dns_port=10053, gate_port=10054, blocked=("169.254.0.0/16",),
                   replace=False)
    result = subprocess.run(["nft", "-c", "-f", "-"], input=full, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_limits_are_in_the_table_only_when_set() -> None:
    args = dict(gateway="10.201.0.1", outside="10.201.0.2", dns_port=10053, gate_port=10054, blocked=(), replace=False)
    plain = ruleset(Egress(), **args)  # type: ignore[arg-type]
    assert "ct count" not in plain and "bytes/second" not in plain  # (the DNS packet rate is always there)
    assert "limit rate" not in ruleset(Egress(), dns_rate=0, **args)  # type: ignore[arg-type]
    limited = ruleset(Egress(), max_connections=50, bandwidth=1 << 20, **args)  # type: ignore[arg-type]
    assert "ct count over 50 drop" in limited and limited.count("limit rate over 1048576 bytes/second") == 2
    if shutil.which("nft") and os.geteuid() == 0:
        result = subprocess.run(["nft", "-c", "-f", "-"], input=limited, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_the_domain_gate_only_when_domains_are_allowed_and_the_rest_denied() -> None:
    args = dict(gateway="10.201.0.1", outside="10.201.0.2", dns_port=10053, gate_port=10054, blocked=(), replace=False)
    for rules, gated in ((Egress.parse(False, ["example.com"]), True), (Egress.parse(True, ["example.com"]), False),
                         (Egress.parse(False, ["10.0.0.1"]), False)):
        nat_in = ruleset(rules, **args).split("chain nat_in")[1].split("\n  }")[0]  # type: ignore[arg-type]
        assert ("dnat ip to 10.201.0.1:10054" in nat_in) is gated and rules.gated is gated
        update = ruleset(rules, **{**args, "replace": True})  # type: ignore[arg-type]
        assert ("dnat ip to 10.201.0.1:10054" in update) is gated and "flush chain inet strata nat_in" in update


def _covered(blocked: tuple[str, ...], address: str) -> bool:
    return any(ipaddress.ip_address(address) in ipaddress.ip_network(net) for net in blocked)


def test_the_default_blocks_every_private_range() -> None:
    """Finding 10: guests reached private networks (a cloud VPC, the compose
    deployment's S3 server) because only link-local was blocked."""
    blocked = blocked_ranges(DEFAULT_BLOCKED)
    for address in ("10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1", "100.64.0.1", "100.127.255.254",
                    "127.0.0.1", "169.254.169.254", "0.1.2.3", "224.0.0.1", "239.255.255.250", "240.0.0.1",
                    "255.255.255.255"):
        assert _covered(blocked, address), address
    for address in ("8.8.8.8", "172.32.0.1", "172.15.255.255", "100.128.0.1", "192.0.2.7", "11.0.0.1"):
        assert not _covered(blocked, address), address


def test_opened_ranges_are_carved_out_but_the_pool_never() -> None:
    blocked = blocked_ranges(DEFAULT_BLOCKED, addresses=["203.0.113.5", "10.99.0.11"], opened=["10.99.0.12/31"],
                             always=["10.201.0.0/16"])
    assert _covered(blocked, "203.0.113.5") and _covered(blocked, "10.99.0.11")  # the node's own, the store's
    assert not _covered(blocked, "10.99.0.12") and not _covered(blocked, "10.99.0.13")  # opened by the operator
    assert _covered(blocked, "10.99.0.14") and _covered(blocked, "10.99.0.10")
    wide = blocked_ranges(DEFAULT_BLOCKED, opened=["10.0.0.0/8"], always=["10.201.0.0/16"])
    assert not _covered(wide, "10.1.2.3") and _covered(wide, "10.201.3.2")  # other sandboxes stay blocked
    assert blocked_ranges((), opened=["10.0.0.0/8"]) == ()


def test_the_config_default_is_the_code_default(tmp_path: Path) -> None:
    (tmp_path / "empty.toml").write_text("")
    config = NodeConfig.load({"STRATA_STORE": "/s", "STRATA_CONFIG": str(tmp_path / "empty.toml")})
    assert set(config.network_blocked) == set(DEFAULT_BLOCKED) and config.network_open == ()
    with pytest.raises(InvalidInput, match="STRATA_NETWORK_OPEN"):
        NodeConfig.load({"STRATA_STORE": "/s", "STRATA_CONFIG": str(tmp_path / "empty.toml"),
                         "STRATA_NETWORK_OPEN": "10.0.0.300/8"})


def test_allow_rules_never_open_a_blocked_range() -> None:
    """allowOut naming a private range is accepted as a rule, but @blocked is
    dropped before @allow and the domain gate is never offered a blocked address."""
    rules = Egress.parse(False, ["192.168.0.0/16", "10.0.0.0/8", "example.com"])
    script = ruleset(rules, gateway="10.201.0.1", outside="10.201.0.2", dns_port=10053, gate_port=10054,
                     blocked=blocked_ranges(DEFAULT_BLOCKED), replace=False)
    egress = script[script.index("chain egress"):]
    assert egress.index("@blocked drop") < egress.index("@allow accept")
    assert "ip daddr != @blocked dnat ip to 10.201.0.1:10054" in script
    # DNS and the gate at the node's end of the link come before the blocked ranges (10.201.0.1 is in 10/8)
    assert egress.index("th dport 10053 accept") < egress.index("@blocked drop")
    assert egress.index("tcp dport 10054 accept") < egress.index("@blocked drop")


def test_a_sandboxs_dns_packets_are_rate_limited() -> None:
    """Finding 9: a guest flooding DNS fills the resolver's one socket for
    everyone; its namespace drops what is over the rate first."""
    args = dict(gateway="10.201.0.1", outside="10.201.0.2", dns_port=10053, gate_port=10054, blocked=(),
                replace=False)
    script = ruleset(Egress(), **args)  # type: ignore[arg-type]
    egress = script[script.index("chain egress"):]
    assert "udp dport 10053 limit rate over" in egress
    assert egress.index("limit rate over") < egress.index("th dport 10053 accept")
    if shutil.which("nft") and os.geteuid() == 0:
        result = subprocess.run(["nft", "-c", "-f", "-"], input=script, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_a_networks_blocked_set_has_the_nodes_own_addresses_and_its_endpoints(tmp_path: Path) -> None:
    """The node's own addresses (whatever they are, public ones too) and the
    addresses its store's endpoint resolves to are blocked, with no private
    range to cover them; what the operator opens is carved out; the pool stays."""
    network = Network(tmp_path / "a", blocked=(), endpoints=("http://198.51.100.10:8333", "", "localhost:9"))
    for address in [*own_addresses(), "198.51.100.10", "10.201.3.2"]:
        assert _covered(network.blocked, address), address
    assert not _covered(network.blocked, "198.51.100.11")
    opened = Network(tmp_path / "b", endpoints=("198.51.100.10",), opened=("198.51.100.10/32", "10.0.0.0/8"))
    assert not _covered(opened.blocked, "198.51.100.10") and not _covered(opened.blocked, "10.1.2.3")
    assert _covered(opened.blocked, "10.201.3.2") and _covered(opened.blocked, "192.168.1.1")
