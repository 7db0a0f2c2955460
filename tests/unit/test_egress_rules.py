"""sandboxd.policy.egress_rules: allowDomains patterns, host matching, forbidden addresses and the
parsers of the host's own addresses. Pure code: nothing is resolved or contacted (the
public addresses below are only parsed)."""

from __future__ import annotations

import dataclasses
import ipaddress
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

import pytest

from sandboxd.policy.egress_rules import (
    SHARED_PARENTS,
    SHARED_SUFFIXES,
    Decision,
    EgressRules,
    decide_address,
    decide_host,
    forbidden_reason,
    is_hostname,
    match_host,
    normalize_host,
    normalize_pattern,
    parse_fib_trie_local,
    parse_if_inet6,
    parse_ip,
)

# 63 + 1 + 63 + 1 + 63 + 1 + 61 = 253 characters: the longest valid name.
LONGEST_NAME = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
assert len(LONGEST_NAME) == 253


# ------------------------------------------------------------------ parse_ip


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1", IPv4Address("127.0.0.1")),
    ("93.184.216.34", IPv4Address("93.184.216.34")),
    ("::1", IPv6Address("::1")),
    ("[::1]", IPv6Address("::1")),
    ("2606:4700::1", IPv6Address("2606:4700::1")),
    ("[2606:4700:0:0:0:0:0:1]", IPv6Address("2606:4700::1")),
    ("2606:4700::ABCD", IPv6Address("2606:4700::abcd")),
    # Mapped IPv4-in-IPv6 is unwrapped to the IPv4 address it carries.
    ("::ffff:127.0.0.1", IPv4Address("127.0.0.1")),
    ("[::ffff:127.0.0.1]", IPv4Address("127.0.0.1")),
    ("::FFFF:7f00:1", IPv4Address("127.0.0.1")),
    ("::ffff:169.254.169.254", IPv4Address("169.254.169.254")),
])
def test_parse_ip_literals(text, expected):
    got = parse_ip(text)
    assert got == expected
    assert type(got) is type(expected)


@pytest.mark.parametrize("text", [
    "", "example.com", "localhost", "[::1", "::1]", "[example.com]", "1.2.3.256", "1.2.3", "127.1",
    "0x7f000001", "2130706433", "::1::2", "[::1]:443", "127.0.0.1:80", " 127.0.0.1x",
])
def test_parse_ip_names_and_junk_are_not_addresses(text):
    assert parse_ip(text) is None


# ------------------------------------------------------------------ normalize_host


@pytest.mark.parametrize("host, expected", [
    ("example.com", "example.com"),
    ("Example.COM", "example.com"),
    ("example.com.", "example.com"),
    ("API.Example.Com.", "api.example.com"),
    ("  host.test  ", "host.test"),
    ("127.0.0.1", "127.0.0.1"),
    ("[::1]", "::1"),
    ("::FFFF:127.0.0.1", "127.0.0.1"),
    ("[::ffff:93.184.216.34]", "93.184.216.34"),
    ("2606:4700:0:0:0:0:0:1", "2606:4700::1"),
    ("[2606:4700:0000::0001]", "2606:4700::1"),
    ("2001:DB8::A", "2001:db8::a"),
    # Surrounding whitespace goes before the literal is parsed: the canonical address,
    # not a name that merely spells one.
    (" [::1] ", "::1"),
    ("\t::FFFF:127.0.0.1\n", "127.0.0.1"),
    ("  2606:4700:0:0::1  ", "2606:4700::1"),
    (" 93.184.216.34\r\n", "93.184.216.34"),
])
def test_normalize_host(host, expected):
    assert normalize_host(host) == expected


@pytest.mark.parametrize("host", ["Example.COM.", "[::FFFF:127.0.0.1]", "2606:4700:0::1", "a.b.c",
                                  " [::ffff:127.0.0.1] ", "  Host.Test.  "])
def test_normalize_host_is_idempotent(host):
    once = normalize_host(host)
    assert normalize_host(once) == once


# ------------------------------------------------------------------ is_hostname


@pytest.mark.parametrize("name", [
    "a", "localhost", "example.com", "a.b.example.com", "a-b.example", "xn--bcher-kva.example",
    "0.example", "9gag.com", "a" * 63 + ".com", LONGEST_NAME,
    # Numeric labels are fine anywhere but last; a last label merely containing digits,
    # or "0x" not at its start, is a name.
    "127.0.0.example", "1.2.3.4.example", "a.b1", "a.1b", "a.0a", "a.x0x1", "0x7f.example",
])
def test_is_hostname_accepts(name):
    assert is_hostname(name)


@pytest.mark.parametrize("name", [
    "",
    "-a.com",  # a label may not start with a hyphen
    "a-.com",  # ... nor end with one
    "a..b",  # empty label
    "a.",  # trailing dot: is_hostname wants a normalized name
    ".a",
    "a_b.com",
    "Example.com",  # upper case: is_hostname wants a normalized name
    "a" * 64 + ".com",  # label longer than 63
    LONGEST_NAME + "d",  # 254 characters
    "*.example.com",
    "exa mple.com",
    "bücher.example",
    "a/b",
    "a:b",
])
def test_is_hostname_rejects(name):
    assert not is_hostname(name)


@pytest.mark.parametrize("name", [
    # A resolver reads an all-digit (or 0x) last label as IPv4 shorthand: 127.1 is
    # 127.0.0.1, 2130706433 and 0x7f000001 are too. None of them is a host name.
    "127.1", "127.0.1", "127.0.0.1", "1.2.3.4", "0.0.1", "2130706433", "0", "a.123", "example.0",
    "0x7f000001", "0x7f.1", "127.0x1", "a.0x1f", "0x",
])
def test_is_hostname_rejects_ipv4_shorthand(name):
    assert not is_hostname(name)


# ------------------------------------------------------------------ normalize_pattern


@pytest.mark.parametrize("pattern, expected", [
    ("example.com", "example.com"),
    ("Example.COM", "example.com"),
    ("example.com.", "example.com"),
    ("  api.example.com  ", "api.example.com"),
    ("localhost", "localhost"),
    ("*.example.com", "*.example.com"),
    ("*.Example.Com.", "*.example.com"),
    ("*.example.co.uk", "*.example.co.uk"),  # below a shared suffix: one owner's names
    ("93.184.216.34", "93.184.216.34"),
    ("[2606:4700::1]", "2606:4700::1"),
    ("2606:4700:0:0::1", "2606:4700::1"),
    ("::ffff:93.184.216.34", "93.184.216.34"),
    (" 10.0.0.1 ", "10.0.0.1"),
    (LONGEST_NAME.upper() + ".", LONGEST_NAME),
])
def test_normalize_pattern_accepts(pattern, expected):
    assert normalize_pattern(pattern) == expected
    # Canonical forms are fixed points.
    assert normalize_pattern(expected) == expected


@pytest.mark.parametrize("pattern, why", [
    ("", "empty pattern"),
    ("   ", "empty pattern"),
    ("http://example.com", "no scheme"),
    ("https://example.com/", "no scheme"),
    ("ftp://*.example.com", "no scheme"),
    ("example.com/path", "no path"),
    ("example.com/", "no path"),
    ("*.example.com/x", "no path"),
    ("example.com:443", "no port"),
    ("*.example.com:443", "no port"),
    ("93.184.216.34:80", "no port"),
    ("[2606:4700::1]:443", "no port"),
    ("*", "only allowed as a leading '*.'"),
    ("*example.com", "only allowed as a leading '*.'"),
    ("a*.example.com", "only allowed as a leading '*.'"),
    ("a.*.example.com", "only allowed as a leading '*.'"),
    ("example.*", "only allowed as a leading '*.'"),
    ("*.*.example.com", "only one leading '*.'"),
    ("*.a.*.example.com", "only one leading '*.'"),
    ("*.com", "whole top-level domain"),
    ("*.COM.", "whole top-level domain"),
    ("*.localhost", "whole top-level domain"),
    ("*.co.uk", "public suffix"),
    ("*.CO.UK", "public suffix"),
    ("*.co.uk.", "public suffix"),
    ("*.github.io", "public suffix"),
    ("*.s3.amazonaws.com", "public suffix"),
    ("*.", "only allowed as a leading"),  # the trailing dot goes first, leaving a bare "*"
    ("*..example.com", "not a valid host name"),
    ("*.exa_mple.com", "not a valid host name"),
    ("*.-x.example.com", "not a valid host name"),
    ("exa_mple.com", "not a valid host name"),
    ("-bad.example.com", "not a valid host name"),
    ("bad-.example.com", "not a valid host name"),
    ("a..b.com", "not a valid host name"),
    ("exa mple.com", "not a valid host name"),
    ("bücher.example", "not a valid host name"),
    ("a" * 64 + ".com", "not a valid host name"),
    (LONGEST_NAME + "d", "not a valid host name"),
    ("*." + LONGEST_NAME + "d", "not a valid host name"),
    # IPv4 shorthand is neither an IP literal nor a name, and no wildcard ends in one.
    ("127.1", "not a valid host name"),
    ("2130706433", "not a valid host name"),
    ("0x7f000001", "not a valid host name"),
    ("0x7f.1", "not a valid host name"),
    ("*.0.0.1", "not a valid host name"),
    ("*.216.34", "not a valid host name"),
    ("*.example.0x1", "not a valid host name"),
    ("*.1", "not a valid host name"),
])
def test_normalize_pattern_rejects(pattern, why):
    with pytest.raises(ValueError) as info:
        normalize_pattern(pattern)
    assert why in str(info.value)


@pytest.mark.parametrize("suffix", sorted(SHARED_SUFFIXES))
def test_every_shared_suffix_is_refused_as_a_wildcard_but_allowed_below(suffix):
    assert is_hostname(suffix) and "." in suffix
    with pytest.raises(ValueError, match="public suffix"):
        normalize_pattern(f"*.{suffix}")
    with pytest.raises(ValueError, match="public suffix"):
        normalize_pattern(f"*.{suffix.upper()}.")
    # An exact name on it is fine; one owner's wildcard too, unless anyone can get names
    # at any depth below it (a SHARED_PARENT: buckets, tunnels, user content).
    assert normalize_pattern(f"owner.{suffix}") == f"owner.{suffix}"
    if any(suffix == p or suffix.endswith("." + p) for p in SHARED_PARENTS):
        with pytest.raises(ValueError, match="belong to anyone"):
            normalize_pattern(f"*.owner.{suffix}")
    else:
        assert normalize_pattern(f"*.owner.{suffix}") == f"*.owner.{suffix}"


@pytest.mark.parametrize("pattern", ["*.someone.github.io", "*.x.storage.googleapis.com", "*.abc.ngrok.app",
                                     "*.x.y.amazonaws.com", "*.amazonaws.com", "*.devtunnels.ms", "*.x.webhook.site"])
def test_no_wildcard_below_a_shared_parent(pattern):
    with pytest.raises(ValueError, match="belong to anyone"):
        normalize_pattern(pattern)
    exact = pattern[2:]
    assert normalize_pattern(exact) == exact


@pytest.mark.parametrize("pattern", ["*.s3.us-east-1.amazonaws.com", "*.us-east-1.amazonaws.com"])
def test_no_wildcard_on_a_public_suffix_below_a_shared_parent(pattern):
    # Both rules refuse these; the Public Suffix List's is checked first. The exact
    # names are public suffixes too (a bucket is a name below them).
    with pytest.raises(ValueError, match="public suffix"):
        normalize_pattern(pattern)
    with pytest.raises(ValueError, match="public suffix"):
        normalize_pattern(pattern[2:])


# ------------------------------------------------------------------ match_host


WILDCARD = ["*.example.com"]


@pytest.mark.parametrize("host, patterns, expected", [
    ("a.example.com", WILDCARD, "*.example.com"),
    ("a.b.example.com", WILDCARD, "*.example.com"),
    ("x-1.deep.er.example.com", WILDCARD, "*.example.com"),
    ("example.com", WILDCARD, None),  # the wildcard admits names below, not the suffix itself
    ("badexample.com", WILDCARD, None),
    ("example.com.evil.test", WILDCARD, None),
    ("a.example.com.evil.test", WILDCARD, None),
    ("a.example.co", WILDCARD, None),
    ("example.com", ["example.com"], "example.com"),
    ("a.example.com", ["example.com"], None),  # an exact name does not admit its subdomains
    ("xexample.com", ["example.com"], None),
    ("93.184.216.34", ["93.184.216.34"], "93.184.216.34"),
    ("93.184.216.35", ["93.184.216.34"], None),
    ("2606:4700::1", ["2606:4700::1"], "2606:4700::1"),
    ("2606:4700::2", ["2606:4700::1"], None),
    # IP literals only match themselves, never through a wildcard that spells their tail.
    ("93.184.216.34", ["*.216.34"], None),
    ("93.184.216.34", ["*.184.216.34"], None),
    ("127.0.0.1", ["*.0.0.1"], None),
    ("a.test", [], None),
    ("a.test", ["b.test", "*.c.test"], None),
])
def test_match_host(host, patterns, expected):
    assert match_host(host, patterns) == expected


def test_match_host_returns_the_first_admitting_pattern():
    assert match_host("a.example.com", ["other.test", "*.example.com", "a.example.com"]) == "*.example.com"
    assert match_host("a.example.com", ["a.example.com", "*.example.com"]) == "a.example.com"
    assert match_host("a.b.example.com", ["*.b.example.com", "*.example.com"]) == "*.b.example.com"


def test_match_host_accepts_any_iterable():
    assert match_host("a.example.com", (p for p in ["*.example.com"])) == "*.example.com"


def test_wildcard_patterns_over_ip_shaped_suffixes_never_admit_ip_literals():
    # normalize_pattern refuses such a pattern; one that reaches the rules anyway
    # (not through normalize_pattern) must still never admit an address.
    with pytest.raises(ValueError, match="not a valid host name"):
        normalize_pattern("*.0.0.1")
    pattern = "*.0.0.1"
    assert match_host("127.0.0.1", [pattern]) is None
    assert decide_host("127.0.0.1", EgressRules((pattern,), deny_private=False)).allowed is False
    # ...nor a name that is IPv4 shorthand: it is not a host name at all.
    assert decide_host("10.0.0.1", EgressRules((pattern,), deny_private=False)).rule == "not-allowlisted"
    assert decide_host("0.1", EgressRules((pattern,), deny_private=False)).rule == "bad-host"


# ------------------------------------------------------------------ forbidden_reason

ALWAYS_FORBIDDEN = [
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("::1", "loopback"),
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:127.1.2.3", "loopback"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("::ffff:0.0.0.0", "unspecified"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"),
    ("ff0e::101", "multicast"),
    ("169.254.169.254", "link-local"),  # the cloud metadata endpoint
    ("169.254.0.1", "link-local"),
    ("169.254.255.255", "link-local"),
    ("::ffff:169.254.169.254", "link-local"),
    ("fe80::1", "link-local"),
    ("febf:ffff::1", "link-local"),
    ("fd00:ec2::254", "metadata"),  # AWS IPv6 metadata endpoint
    ("fd00:ec2::1", "metadata"),
    ("100.100.100.200", "metadata"),  # Alibaba Cloud metadata, inside 100.64.0.0/10
    ("::ffff:100.100.100.200", "metadata"),
    ("64:ff9b::7f00:1", "nat64"),  # 127.0.0.1 through NAT64
    ("64:ff9b::a9fe:a9fe", "nat64"),  # 169.254.169.254 through NAT64
    ("64:ff9b::5db8:d822", "nat64"),  # even a public address: the prefix is refused whole
    ("64:ff9b:1::1", "nat64"),
    ("64:ff9b:1:ffff::1", "nat64"),
]

PRIVATE = [
    "10.0.0.1", "10.255.255.254", "172.16.0.1", "172.31.255.254", "192.168.0.1", "192.168.255.254",
    "100.64.0.1", "100.127.255.254",  # shared address space (carrier-grade NAT)
    "100.100.100.199", "100.100.100.201",  # the metadata address is exact, its neighbours only private
    "192.0.2.1", "198.18.0.1",  # documentation, benchmarking
    "fc00::1", "fd12:3456:789a::1", "fdff:ffff::1", "2001:db8::1",
    "::ffff:10.0.0.1", "::ffff:192.168.1.1",
]

PUBLIC = [
    "93.184.216.34", "8.8.8.8", "1.1.1.1", "11.0.0.1",
    "172.15.255.255", "172.32.0.0", "100.63.255.255", "100.128.0.0", "192.167.255.255", "192.169.0.0",
    "2606:4700::1", "2001:4860:4860::8888", "::ffff:93.184.216.34",
    "64:ff9a::1", "64:ff9b:0:0:1::1",  # just outside the NAT64 prefixes
]


@pytest.mark.parametrize("deny_private", [False, True])
@pytest.mark.parametrize("addr, reason", ALWAYS_FORBIDDEN)
def test_always_forbidden_whatever_the_policy(addr, reason, deny_private):
    got = forbidden_reason(ip_address(addr), deny_private=deny_private)
    # A prefix refused whole also names the IPv4 address inside when that is refused too.
    assert got == reason or got.startswith(reason + " (embeds "), got


@pytest.mark.parametrize("addr", PRIVATE)
def test_private_forbidden_only_with_deny_private(addr):
    ip = ip_address(addr)
    assert forbidden_reason(ip, deny_private=True) == "private"
    assert forbidden_reason(ip, deny_private=False) is None


@pytest.mark.parametrize("deny_private", [False, True])
@pytest.mark.parametrize("addr", PUBLIC)
def test_public_addresses_pass(addr, deny_private):
    assert forbidden_reason(ip_address(addr), deny_private=deny_private) is None


OWN = frozenset({ip_address("192.0.2.2"), ip_address("172.17.0.1"), ip_address("fd00::2"),
                 ip_address("93.184.216.34")})


@pytest.mark.parametrize("deny_private", [False, True])
@pytest.mark.parametrize("addr", ["192.0.2.2", "172.17.0.1", "fd00::2", "93.184.216.34", "::ffff:172.17.0.1"])
def test_own_addresses_forbidden(addr, deny_private):
    assert forbidden_reason(ip_address(addr), deny_private=deny_private, own_addresses=OWN) == "daemon host"


def test_own_addresses_are_exact_not_networks():
    assert forbidden_reason(ip_address("93.184.216.35"), deny_private=False, own_addresses=OWN) is None
    assert forbidden_reason(ip_address("172.17.0.2"), deny_private=False, own_addresses=OWN) is None
    assert forbidden_reason(ip_address("172.17.0.2"), deny_private=True, own_addresses=OWN) == "private"


def test_fixed_reasons_take_precedence_over_own_and_private():
    own = frozenset({ip_address("127.0.0.1"), ip_address("fe80::1")})
    assert forbidden_reason(ip_address("127.0.0.1"), deny_private=True, own_addresses=own) == "loopback"
    assert forbidden_reason(ip_address("fe80::1"), deny_private=True, own_addresses=own) == "link-local"
    # fd00:ec2::/32 is inside fc00::/7: named for what it is, refused without deny_private.
    assert forbidden_reason(ip_address("fd00:ec2::254"), deny_private=True) == "metadata"
    # 100.100.100.200 is inside 100.64.0.0/10: metadata, not private, and refused without deny_private.
    assert forbidden_reason(ip_address("100.100.100.200"), deny_private=True) == "metadata"
    assert forbidden_reason(ip_address("100.100.100.200"), deny_private=False,
                            own_addresses=frozenset({ip_address("100.100.100.200")})) == "metadata"


MIRROR = (ip_network("10.1.0.0/16"), ip_network("fd12:3456::/32"))


@pytest.mark.parametrize("addr", ["10.1.2.3", "10.1.255.255", "::ffff:10.1.2.3", "fd12:3456::7"])
def test_exempt_networks_pass_under_deny_private(addr):
    assert forbidden_reason(ip_address(addr), deny_private=True, exempt=MIRROR) is None


@pytest.mark.parametrize("addr", ["10.2.0.1", "10.0.255.255", "fd12:3457::1"])
def test_exempt_networks_are_exact(addr):
    assert forbidden_reason(ip_address(addr), deny_private=True, exempt=MIRROR) == "private"


def test_exempt_only_lifts_the_private_rule_never_the_fixed_refusals():
    # An exempted corporate /8 must not make the daemon host or the metadata service reachable.
    assert forbidden_reason(ip_address("127.0.0.1"), deny_private=True,
                            exempt=(ip_network("127.0.0.0/8"),)) == "loopback"
    assert forbidden_reason(ip_address("172.17.0.1"), deny_private=True, own_addresses=OWN,
                            exempt=(ip_network("172.17.0.0/16"),)) == "daemon host"
    assert forbidden_reason(ip_address("169.254.169.254"), deny_private=True,
                            exempt=(ip_network("169.254.0.0/16"),)) == "link-local"
    assert forbidden_reason(ip_address("10.1.2.3"), deny_private=True, exempt=(ip_network("10.0.0.0/8"),)) is None


def test_exempt_networks_of_the_other_family_do_not_apply():
    v6_only = (ip_network("::/0"),)
    assert forbidden_reason(ip_address("10.0.0.1"), deny_private=True, exempt=v6_only) == "private"
    v4_only = (ip_network("0.0.0.0/0"),)
    assert forbidden_reason(ip_address("fd00::1"), deny_private=True, exempt=v4_only) == "private"
    # ...but a mapped address is judged as the IPv4 address it carries.
    assert forbidden_reason(ip_address("::ffff:10.0.0.1"), deny_private=True, exempt=v4_only) is None


# ------------------------------------------------------------------ EgressRules, decide_host


def test_egress_rules_defaults_and_immutability():
    rules = EgressRules(("example.com",), deny_private=True)
    assert rules.own_addresses == frozenset()
    assert rules.exempt == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rules.deny_private = False  # type: ignore[misc]
    assert EgressRules(("a",), True) == EgressRules(("a",), True)
    assert hash(EgressRules(("a",), True)) == hash(EgressRules(("a",), True))


RULES = EgressRules(("api.example.com", "*.example.org", "93.184.216.34", "2606:4700::1"), deny_private=True)


@pytest.mark.parametrize("host, rule", [
    ("api.example.com", "api.example.com"),
    ("a.example.org", "*.example.org"),
    ("a.b.example.org", "*.example.org"),
    ("93.184.216.34", "93.184.216.34"),
    ("2606:4700::1", "2606:4700::1"),
])
def test_decide_host_allowed(host, rule):
    assert decide_host(host, RULES) == Decision(True, rule)
    assert decide_host(host, RULES).reason == ""


@pytest.mark.parametrize("host, rule, reason", [
    ("", "no-host", "the request names no host"),
    ("bad_host.example.com", "bad-host", "'bad_host.example.com' is not a valid host name"),
    ("a..example.org", "bad-host", "'a..example.org' is not a valid host name"),
    ("-x.example.org", "bad-host", "'-x.example.org' is not a valid host name"),
    ("example.com", "not-allowlisted", "host example.com is not in allowDomains"),
    ("www.api.example.com", "not-allowlisted", "host www.api.example.com is not in allowDomains"),
    ("example.org", "not-allowlisted", "host example.org is not in allowDomains"),
    ("badexample.org", "not-allowlisted", "host badexample.org is not in allowDomains"),
    ("93.184.216.35", "not-allowlisted", "IP address 93.184.216.35 is not in allowDomains"),
    ("2606:4700::2", "not-allowlisted", "IP address 2606:4700::2 is not in allowDomains"),
    ("127.0.0.1", "not-allowlisted", "IP address 127.0.0.1 is not in allowDomains"),
])
def test_decide_host_refused(host, rule, reason):
    decision = decide_host(host, RULES)
    assert decision == Decision(False, rule, reason)


def test_decide_host_checks_names_only_not_addresses():
    # The name check admits an allowlisted IP literal even if it is loopback: the
    # address check that follows is what refuses it.
    rules = EgressRules(("127.0.0.1",), deny_private=False)
    assert decide_host("127.0.0.1", rules).allowed
    assert decide_address(ip_address("127.0.0.1"), rules) == Decision(
        False, "never-reachable", "127.0.0.1, a loopback address")


# ------------------------------------------------------------------ decide_address


@pytest.mark.parametrize("addr", ["93.184.216.34", "2606:4700::1", "::ffff:93.184.216.34"])
def test_decide_address_public(addr):
    assert decide_address(ip_address(addr), RULES) == Decision(True, "address-allowed", "")


@pytest.mark.parametrize("addr, rule, word", [
    ("127.0.0.1", "never-reachable", "loopback"),
    ("::1", "never-reachable", "loopback"),
    ("169.254.169.254", "never-reachable", "link-local"),
    ("fd00:ec2::254", "never-reachable", "metadata"),
    ("100.100.100.200", "never-reachable", "metadata"),
    ("64:ff9b::a9fe:a9fe", "never-reachable", "nat64"),
    ("224.0.0.251", "never-reachable", "multicast"),
    ("0.0.0.0", "never-reachable", "unspecified"),
    ("10.0.0.1", "deny-private-networks", "private"),
    ("100.64.0.1", "deny-private-networks", "private"),
    ("fc00::1", "deny-private-networks", "private"),
])
def test_decide_address_refused(addr, rule, word):
    decision = decide_address(ip_address(addr), RULES)
    assert (decision.allowed, decision.rule) == (False, rule)
    assert decision.reason.startswith(f"{addr}, a")
    assert word in decision.reason


def test_decide_address_loopback_reason_text():
    assert decide_address(ip_address("127.0.0.1"), RULES) == Decision(
        False, "never-reachable", "127.0.0.1, a loopback address")
    assert decide_address(ip_address("10.0.0.1"), RULES) == Decision(
        False, "deny-private-networks", "10.0.0.1, a private address")


def test_decide_address_uses_every_field_of_the_rules():
    own = frozenset({ip_address("198.51.100.7")})
    rules = EgressRules((), deny_private=False, own_addresses=own)
    decision = decide_address(ip_address("198.51.100.7"), rules)
    assert (decision.allowed, decision.rule) == (False, "never-reachable")
    assert "daemon host" in decision.reason
    assert decide_address(ip_address("10.0.0.1"), rules).allowed  # deny_private False
    strict = dataclasses.replace(rules, deny_private=True)
    assert decide_address(ip_address("10.0.0.1"), strict).rule == "deny-private-networks"
    # exempt never covers an own address
    exempted = dataclasses.replace(rules, exempt=(ip_network("198.51.100.0/24"),))
    assert not decide_address(ip_address("198.51.100.7"), exempted).allowed
    exempted_strict = dataclasses.replace(strict, exempt=(ip_network("10.0.0.0/8"),))
    assert decide_address(ip_address("10.0.0.1"), exempted_strict).allowed


@pytest.mark.parametrize("deny_private", [False, True])
def test_decide_address_own_address_reason_reads_well(deny_private):
    # forbidden_reason says "daemon host"; decide_address adds the one "address".
    rules = EgressRules((), deny_private=deny_private, own_addresses=OWN)
    for addr in ("198.51.100.7", "172.17.0.1", "fd00::2", "93.184.216.34"):
        own = dataclasses.replace(rules, own_addresses=rules.own_addresses | {ip_address(addr)})
        assert decide_address(ip_address(addr), own) == Decision(
            False, "never-reachable", f"{addr}, a daemon host address")
    # A mapped address is judged as the IPv4 address it carries.
    mapped = decide_address(ip_address("::ffff:172.17.0.1"), rules)
    assert (mapped.allowed, mapped.rule) == (False, "never-reachable")
    assert mapped.reason.endswith(", a daemon host address") and "address address" not in mapped.reason


def test_decide_address_metadata_reason_without_deny_private():
    rules = EgressRules(("*.example.com",), deny_private=False)
    assert decide_address(ip_address("100.100.100.200"), rules) == Decision(
        False, "never-reachable", "100.100.100.200, a metadata address")
    assert decide_address(ip_address("100.100.100.201"), rules).allowed


@pytest.mark.parametrize("host", ["127.1", "0x7f.1", "2130706433", "0x7f000001", "10.1", "a.0"])
def test_decide_host_refuses_ipv4_shorthand_as_a_bad_host(host):
    # Never looked up: a resolver would take it for an address nobody allowlisted.
    rules = EgressRules(("*.example.com", "127.0.0.1"), deny_private=False)
    assert decide_host(host, rules) == Decision(False, "bad-host", f"{host!r} is not a valid host name")


# ------------------------------------------------------------------ the host's own addresses

# /proc/net/fib_trie of a host with docker0 (172.17.0.1) and eth0 (192.0.2.2): both
# the Main and the Local table list the local addresses.
FIB_TRIE = """\
Main:
  +-- 0.0.0.0/0 3 0 4
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 172.17.0.0/16 2 0 2
        +-- 172.17.0.0/31 1 0 0
           |-- 172.17.0.0
              /16 link UNICAST
           |-- 172.17.0.1
              /32 host LOCAL
        |-- 172.17.255.255
           /32 link BROADCAST
     +-- 192.0.2.0/24 2 0 2
        +-- 192.0.2.0/30 2 0 2
           |-- 192.0.2.0
              /24 link UNICAST
           |-- 192.0.2.2
              /32 host LOCAL
        |-- 192.0.2.255
           /32 link BROADCAST
Local:
  +-- 0.0.0.0/0 3 0 4
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 172.17.0.0/16 2 0 2
        +-- 172.17.0.0/31 1 0 0
           |-- 172.17.0.0
              /16 link UNICAST
           |-- 172.17.0.1
              /32 host LOCAL
        |-- 172.17.255.255
           /32 link BROADCAST
     +-- 192.0.2.0/24 2 0 2
        +-- 192.0.2.0/30 2 0 2
           |-- 192.0.2.0
              /24 link UNICAST
           |-- 192.0.2.2
              /32 host LOCAL
        |-- 192.0.2.255
           /32 link BROADCAST
"""

IF_INET6 = """\
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
00000000000000000000000000000001 01 80 10 80       lo
fe800000000000000042bbfffe9005e1 05 40 20 80  docker0
fd000000000000000000000000000002 04 40 00 82     eth0
"""


def test_parse_fib_trie_local_finds_the_local_host_addresses():
    assert parse_fib_trie_local(FIB_TRIE) == {IPv4Address("127.0.0.1"), IPv4Address("172.17.0.1"),
                                              IPv4Address("192.0.2.2")}


def test_parse_fib_trie_local_skips_networks_broadcasts_and_junk():
    text = """\
Local:
  +-- 0.0.0.0/0 3 0 5
     |-- 10.0.0.0
        /8 host LOCAL
     |-- 10.0.0.5
        /32 link BROADCAST
        /32 host LOCAL
     |-- 10.255.255.255
        /32 link BROADCAST
     |-- not-an-address
        /32 host LOCAL
     |-- 203.0.113.9
        /32 host LOCAL
"""
    assert parse_fib_trie_local(text) == {IPv4Address("10.0.0.5"), IPv4Address("203.0.113.9")}


@pytest.mark.parametrize("text", ["", "Main:\n", "   /32 host LOCAL\n", "garbage\n|--\n/32 host LOCAL\n"])
def test_parse_fib_trie_local_empty(text):
    assert parse_fib_trie_local(text) == set()


def test_parse_if_inet6_finds_every_address():
    assert parse_if_inet6(IF_INET6) == {IPv6Address("fe80::fc:ff:fe00:1"), IPv6Address("::1"),
                                        IPv6Address("fe80::42:bbff:fe90:5e1"), IPv6Address("fd00::2")}


def test_parse_if_inet6_skips_malformed_lines():
    text = ("\n"
            "fe80000000000000000000000000001 04 40 20 80 short\n"  # 31 digits
            "zz800000000000000000000000000001 04 40 20 80 nothex\n"
            "2606470000000000000000000000000100 04 00 00 80 long\n"  # 34 digits
            "26064700000000000000000000000001 07 40 00 80 eth1\n")
    assert parse_if_inet6(text) == {IPv6Address("2606:4700::1")}
    assert parse_if_inet6("") == set()


def test_parsed_own_addresses_are_refused():
    own = frozenset(parse_fib_trie_local(FIB_TRIE) | parse_if_inet6(IF_INET6))
    rules = EgressRules(("*.example.com",), deny_private=False, own_addresses=own)
    for addr in ("172.17.0.1", "192.0.2.2", "fd00::2"):
        assert decide_address(ip_address(addr), rules).rule == "never-reachable", addr
    assert decide_address(ip_address("172.17.0.2"), rules).allowed
    assert isinstance(next(iter(own)), (ipaddress.IPv4Address, ipaddress.IPv6Address))
