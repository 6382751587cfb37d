"""vmm/egress.py: parsing E2B's rules and the nftables script that enforces
them (run for real by tests/test_network.py; checked here by nft itself when
it is installed)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from layerstore.errors import InvalidInput
from vmm.egress import Egress, ruleset


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
    assert "ct count" not in plain and "limit rate" not in plain
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
