"""sandboxd.policy.egress_rules: every IPv6 form that embeds an IPv4 address is refused (SIIT,
IPv4-compatible, NAT64 well-known and local-use, 6to4, Teredo) and its IPv4 address is
judged by the rule of a plain one; IPv4-mapped addresses are the IPv4 address they
carry. Also the textual forms of IPv4 a sandbox may name as a host. Pure code."""

from __future__ import annotations

from ipaddress import IPv4Address, ip_address, ip_network

import pytest

from sandboxd.policy.egress_rules import (
    EgressRules,
    decide_address,
    decide_host,
    embedded_ipv4,
    forbidden_reason,
    normalize_host,
    parse_ip,
)


def teredo(client: str) -> str:
    """A Teredo address (server 65.54.227.120, no flags, port 0) for `client`: its last
    32 bits are the client address complemented."""
    c = int(IPv4Address(client)) ^ 0xFFFFFFFF
    return str(ip_address((0x20010000 << 96) | (0x4136E378 << 64) | (0xFFFF << 32) | c))


def six_to_four(v4: str) -> str:
    return str(ip_address((0x2002 << 112) | (int(IPv4Address(v4)) << 80) | 1))


def nat64_local(v4: str, prefix_len: int) -> str:
    """`v4` inside 64:ff9b:1::/48 at one RFC 6052 prefix length (the u octet, bits
    64-71, stays zero)."""
    b = bytearray((0x0064FF9B0001 << 80).to_bytes(16, "big"))
    v = IPv4Address(v4).packed
    if prefix_len == 96:
        b[12:16] = v
    elif prefix_len == 64:
        b[9:13] = v
    elif prefix_len == 56:
        b[7:8], b[9:12] = v[:1], v[1:]
    else:
        b[6:8], b[9:11] = v[:2], v[2:]
    return str(ip_address(bytes(b)))


# The IPv4 addresses a sandbox must never reach, whatever the policy: each with its reason.
FORBIDDEN_V4 = [("127.0.0.1", "loopback"), ("127.1.2.3", "loopback"), ("169.254.169.254", "link-local"),
                ("100.100.100.200", "metadata"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast")]

FORMS = {
    "siit": lambda v4: f"::ffff:0:{v4}",
    "ipv4-compatible": lambda v4: f"::{v4}",
    "nat64": lambda v4: f"64:ff9b::{v4}",
    "6to4": six_to_four,
    "teredo": teredo,
}


# (:: is IPv6's own unspecified address, not an IPv4-compatible form of 0.0.0.0.)
EMBEDDED_CASES = [(kind, v4, inner) for kind in sorted(FORMS) for v4, inner in FORBIDDEN_V4
                  if (kind, v4) != ("ipv4-compatible", "0.0.0.0")]


@pytest.mark.parametrize("deny_private", [False, True])
@pytest.mark.parametrize("kind, v4, inner", EMBEDDED_CASES)
def test_every_embedded_form_of_a_forbidden_ipv4_is_refused_naming_it(kind, v4, inner, deny_private):
    addr = ip_address(FORMS[kind](v4))
    assert (kind, IPv4Address(v4)) in embedded_ipv4(addr)
    assert forbidden_reason(addr, deny_private=deny_private) == f"{kind} (embeds {v4}, {inner})"
    decision = decide_address(addr, EgressRules((), deny_private=deny_private))
    assert (decision.allowed, decision.rule) == (False, "never-reachable")
    assert v4 in decision.reason and inner in decision.reason


@pytest.mark.parametrize("deny_private", [False, True])
@pytest.mark.parametrize("v4, inner", FORBIDDEN_V4)
@pytest.mark.parametrize("prefix_len", [48, 56, 64, 96])
def test_nat64_local_use_prefix_at_every_prefix_length(prefix_len, v4, inner, deny_private):
    addr = ip_address(nat64_local(v4, prefix_len))
    assert ("nat64", IPv4Address(v4)) in embedded_ipv4(addr)
    reason = forbidden_reason(addr, deny_private=deny_private)
    assert reason is not None and reason.startswith("nat64")


@pytest.mark.parametrize("text", ["::ffff:0:127.0.0.1", "[::ffff:0:127.0.0.1]", "::FFFF:0:7F00:1", "0:0:0:0:ffff:0:7f00:1",
                                  "::ffff:0:169.254.169.254", "::ffff:0:7f00:1%lo", "::ffff:0:100.100.100.200"])
def test_siit_literals_of_loopback_and_metadata_are_refused_the_red_team_finding(text):
    # The finding: these passed denyPrivateNetworks (Python calls ::ffff:0:0:0/96 global).
    ip = parse_ip(normalize_host(text))
    assert ip is not None
    for deny_private in (False, True):
        decision = decide_address(ip, EgressRules((), deny_private=deny_private, any_host=True))
        assert not decision.allowed and decision.rule == "never-reachable", decision


@pytest.mark.parametrize("kind", sorted(FORMS))
@pytest.mark.parametrize("deny_private", [False, True])
def test_embedded_forms_are_refused_whole_even_around_a_public_ipv4(kind, deny_private):
    # A translator or relay picks the real destination: the prefix is refused whole.
    addr = ip_address(FORMS[kind]("93.184.216.34"))
    assert forbidden_reason(addr, deny_private=deny_private) == kind
    assert forbidden_reason(ip_address("93.184.216.34"), deny_private=deny_private) is None


@pytest.mark.parametrize("kind", sorted(FORMS))
def test_embedded_private_ipv4_is_named_under_deny_private(kind):
    addr = ip_address(FORMS[kind]("10.0.0.1"))
    assert forbidden_reason(addr, deny_private=True) == f"{kind} (embeds 10.0.0.1, private)"
    assert forbidden_reason(addr, deny_private=False) == kind
    # An exempted mirror network does not lift the prefix's refusal.
    assert forbidden_reason(addr, deny_private=True, exempt=(ip_network("10.0.0.0/8"),)) == kind


@pytest.mark.parametrize("kind", sorted(FORMS))
def test_embedded_own_address_is_named(kind):
    own = frozenset({ip_address("198.51.100.7")})
    addr = ip_address(FORMS[kind]("198.51.100.7"))
    assert forbidden_reason(addr, deny_private=False, own_addresses=own) == f"{kind} (embeds 198.51.100.7, daemon host)"


def test_mapped_addresses_are_judged_as_their_ipv4_address():
    assert embedded_ipv4(ip_address("::ffff:127.0.0.1")) == [("ipv4-mapped", IPv4Address("127.0.0.1"))]
    assert forbidden_reason(ip_address("::ffff:127.0.0.1"), deny_private=False) == "loopback"
    assert forbidden_reason(ip_address("::ffff:93.184.216.34"), deny_private=True) is None
    assert forbidden_reason(ip_address("::ffff:10.0.0.1"), deny_private=True) == "private"


@pytest.mark.parametrize("addr", ["::1", "::", "2606:4700::1", "fe80::1", "fd00::1", "127.0.0.1", "8.8.8.8",
                                  "64:ff9a::7f00:1", "2003::7f00:1", "2001:1::7f00:1"])
def test_addresses_embedding_nothing(addr):
    assert embedded_ipv4(ip_address(addr)) == []


def test_the_ipv6_own_reason_wins_when_the_embedded_address_is_harmless():
    # fe80::/10 is link-local whatever its last 32 bits say.
    assert forbidden_reason(ip_address("fe80::5efe:808:808"), deny_private=False) == "link-local"


@pytest.mark.parametrize("reason_word, addr", [("an ipv4-compatible", "::808:808"), ("a siit", "::ffff:0:808:808"),
                                               ("a nat64", "64:ff9b::808:808")])
def test_decision_text_reads_well(reason_word, addr):
    decision = decide_address(ip_address(addr), EgressRules((), deny_private=True))
    assert decision.reason == f"{addr}, {reason_word} address"


# ------------------------------------------------------------------ textual IPv4 forms as hosts

# What a resolver (inet_aton) would read as 127.0.0.1 or 169.254.169.254: never looked
# up, never matched against a pattern, refused as a bad host (the proxy normalizes
# first, as here).
SHORTHAND = ["127.1", "127.0.1", "0x7f.1", "0X7F.1", "0x7f000001", "0X7F000001", "2130706433", "017700000001",
             "0177.0.0.1", "0177.1", "127.0.0.01", "127.000.000.001", "0x7f.0x0.0x0.0x1", "0x7f.0.0.0x1",
             "127.1.", "2130706433.", "0xa9fea9fe", "2852039166", "0251.0376.0251.0376", "169.254.43518",
             "127.0.0.1.0", "1.2.3.4.5"]


@pytest.mark.parametrize("text", SHORTHAND)
@pytest.mark.parametrize("any_host", [False, True])
def test_ipv4_shorthand_hosts_are_refused_before_resolution(text, any_host):
    host = normalize_host(text)
    assert parse_ip(host) is None
    rules = EgressRules(("127.0.0.1", "169.254.169.254", "*.example.com"), deny_private=True, any_host=any_host)
    decision = decide_host(host, rules)
    assert (decision.allowed, decision.rule) == (False, "bad-host")


@pytest.mark.parametrize("text, canonical", [("127.0.0.1.", "127.0.0.1"), (" [::ffff:0:127.0.0.1] ", "::ffff:0:7f00:1"),
                                             ("[::127.0.0.1]", "::7f00:1"), ("::FFFF:127.0.0.1", "127.0.0.1"),
                                             ("[64:FF9B::7F00:1]", "64:ff9b::7f00:1")])
def test_literal_forms_normalize_to_one_spelling_and_are_refused(text, canonical):
    host = normalize_host(text)
    assert host == canonical
    ip = parse_ip(host)
    assert ip is not None
    assert not decide_address(ip, EgressRules((), deny_private=False, any_host=True)).allowed
