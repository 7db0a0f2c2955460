"""Egress rules, pure: which allowDomains patterns are acceptable, which host a pattern
admits, and which resolved addresses a sandbox may never reach. The proxy (proxy.py)
asks these questions; nothing here touches the network."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# Suffixes under which anyone can get a name: a wildcard on one of them admits the
# whole internet's worth of strangers (and an exfiltration channel). Not the whole
# Public Suffix List, the multi-label ones agents meet most.
SHARED_SUFFIXES = frozenset({
    "co.uk", "org.uk", "ac.uk", "gov.uk", "me.uk", "com.au", "net.au", "org.au", "co.jp", "ne.jp", "or.jp",
    "com.br", "com.cn", "com.mx", "co.nz", "co.in", "co.za", "com.tr", "com.tw", "com.sg", "com.hk", "co.kr",
    "github.io", "githubusercontent.com", "gitlab.io", "appspot.com", "herokuapp.com", "cloudfront.net",
    "amazonaws.com", "s3.amazonaws.com", "azurewebsites.net", "blob.core.windows.net", "blogspot.com",
    "pages.dev", "workers.dev", "vercel.app", "netlify.app", "web.app", "firebaseapp.com", "ngrok.io",
    "ngrok-free.app", "trycloudflare.com", "duckdns.org", "no-ip.org", "glitch.me", "repl.co", "fly.dev",
    "onrender.com", "deno.dev", "r2.dev", "supabase.co",
})
# Link-local metadata endpoints and the NAT64 prefix that embeds IPv4 addresses.
_ALWAYS_FORBIDDEN: tuple[tuple[IPNetwork, str], ...] = (
    (ipaddress.ip_network("169.254.0.0/16"), "link-local"),
    (ipaddress.ip_network("fe80::/10"), "link-local"),
    (ipaddress.ip_network("fd00:ec2::/32"), "metadata"),
    (ipaddress.ip_network("100.100.100.200/32"), "metadata"),
    (ipaddress.ip_network("64:ff9b::/96"), "nat64"),
    (ipaddress.ip_network("64:ff9b:1::/48"), "nat64"),
    # Prefixes that embed or tunnel to other addresses, and a deprecated local scope.
    (ipaddress.ip_network("2002::/16"), "6to4"),
    (ipaddress.ip_network("2001::/32"), "teredo"),
    (ipaddress.ip_network("::/96"), "ipv4-compatible"),
    (ipaddress.ip_network("fec0::/10"), "site-local"),
)
# Domains under which anyone gets names at any depth (buckets, tunnels, user content):
# no wildcard below them at all, only exact names.
SHARED_PARENTS = frozenset({
    "amazonaws.com", "googleapis.com", "googleusercontent.com", "appspot.com", "cloudfront.net",
    "azureedge.net", "azurewebsites.net", "windows.net", "github.io", "github.dev", "githubusercontent.com",
    "ngrok.io", "ngrok.app", "ngrok-free.app", "trycloudflare.com", "workers.dev", "pages.dev", "r2.dev",
    "vercel.app", "netlify.app", "herokuapp.com", "fly.dev", "onrender.com", "web.app", "firebaseapp.com",
})


def parse_ip(host: str) -> IPAddress | None:
    """The address a host string spells literally (IPv6 with or without brackets), or
    None for a name. Mapped IPv4-in-IPv6 is unwrapped: ::ffff:127.0.0.1 is loopback."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def normalize_host(host: str) -> str:
    """Lower case, no trailing dot; IP literals in their canonical spelling."""
    host = host.strip()
    ip = parse_ip(host)
    if ip is not None:
        return str(ip)
    return host.strip().rstrip(".").lower()


def is_hostname(name: str) -> bool:
    if not name or len(name) > 253:
        return False
    labels = name.split(".")
    # An all-numeric last label is IPv4 shorthand to a resolver (127.1, 2130706433).
    if labels[-1].isdigit() or labels[-1].startswith("0x"):
        return False
    return all(_LABEL_RE.fullmatch(label) for label in labels)


def normalize_pattern(pattern: str) -> str:
    """An allowDomains entry in its canonical form, or ValueError saying why not:
    an exact host name, `*.suffix` with a suffix of at least two labels that is not a
    shared public suffix, or an exact IP literal."""
    p = pattern.strip()
    if not p:
        raise ValueError("empty pattern")
    if "://" in p:
        raise ValueError("a domain, not a URL: no scheme")
    if "/" in p:
        raise ValueError("a domain, not a URL: no path")
    ip = parse_ip(p)
    if ip is not None:
        return str(ip)
    if ":" in p:
        raise ValueError("no port: a pattern names hosts, every port of them")
    p = p.rstrip(".").lower()
    if p.startswith("*."):
        suffix = p[2:]
        if "*" in suffix:
            raise ValueError("only one leading '*.' wildcard is allowed")
        if not is_hostname(suffix):
            raise ValueError(f"{suffix!r} is not a valid host name")
        if "." not in suffix:
            raise ValueError(f"'*.{suffix}' would admit a whole top-level domain")
        if suffix in SHARED_SUFFIXES:
            raise ValueError(f"'{suffix}' is a public suffix: '*.{suffix}' would admit anyone's names")
        for parent in SHARED_PARENTS:
            if suffix.endswith("." + parent):
                raise ValueError(f"names below '{parent}' belong to anyone: list exact names, not '*.{suffix}'")
        return p
    if "*" in p:
        raise ValueError("a wildcard is only allowed as a leading '*.'")
    if not is_hostname(p):
        raise ValueError(f"{p!r} is not a valid host name")
    return p


def match_host(host: str, patterns: Iterable[str]) -> str | None:
    """The first pattern that admits `host` (both normalized), else None. `*.x.y`
    admits any name below x.y, not x.y itself; an IP literal only matches itself."""
    is_ip = parse_ip(host) is not None
    for p in patterns:
        if p == host:
            return p
        if not is_ip and p.startswith("*.") and host.endswith(p[1:]) and len(host) > len(p) - 1:
            return p
    return None


def forbidden_reason(ip: IPAddress, *, deny_private: bool, own_addresses: frozenset[IPAddress] = frozenset(),
                     exempt: tuple[IPNetwork, ...] = ()) -> str | None:
    """Why a sandbox may not reach `ip`, or None. Loopback, link-local, metadata,
    multicast, unspecified, tunnelling prefixes and the daemon host's own addresses are
    refused whatever the policy or the operator's exemptions say; with deny_private,
    every other address that is not globally routable is, unless the operator exempts
    its network (an internal mirror)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    for net, reason in _ALWAYS_FORBIDDEN:
        if ip.version == net.version and ip in net:
            return reason
    if ip in own_addresses:
        return "daemon host"
    if deny_private and not ip.is_global and not any(ip in net for net in exempt):
        return "private"
    return None


@dataclass(frozen=True)
class EgressRules:
    """What one sandbox may reach through the proxy."""

    patterns: tuple[str, ...]
    deny_private: bool
    own_addresses: frozenset[IPAddress] = frozenset()
    exempt: tuple[IPNetwork, ...] = ()
    # egress 'open' through the proxy: any name or IP literal; only addresses are checked.
    any_host: bool = False


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rule: str  # the pattern that admitted the host, or the rule that refused it
    reason: str = ""


def decide_host(host: str, rules: EgressRules) -> Decision:
    """The name check, before anything is resolved: a name not admitted is never looked up."""
    if not host:
        return Decision(False, "no-host", "the request names no host")
    if parse_ip(host) is None and not is_hostname(host):
        return Decision(False, "bad-host", f"{host!r} is not a valid host name")
    if rules.any_host:
        return Decision(True, "open")
    rule = match_host(host, rules.patterns)
    if rule is None:
        kind = "IP address" if parse_ip(host) is not None else "host"
        return Decision(False, "not-allowlisted", f"{kind} {host} is not in allowDomains")
    return Decision(True, rule)


def decide_address(ip: IPAddress, rules: EgressRules) -> Decision:
    """The address check, after resolution and before connecting to exactly that address."""
    reason = forbidden_reason(ip, deny_private=rules.deny_private, own_addresses=rules.own_addresses,
                              exempt=rules.exempt)
    if reason is None:
        return Decision(True, "address-allowed")
    rule = "deny-private-networks" if reason == "private" else "never-reachable"
    return Decision(False, rule, f"{ip}, a {reason} address")


# ---------------------------------------------------------------- the host's own addresses


def parse_fib_trie_local(text: str) -> set[IPAddress]:
    """IPv4 addresses of /proc/net/fib_trie entries marked `/32 host LOCAL`."""
    out: set[IPAddress] = set()
    last = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("|--"):
            last = s[3:].strip()
        elif s == "/32 host LOCAL" and last:
            try:
                out.add(ipaddress.ip_address(last))
            except ValueError:
                pass
    return out


def parse_if_inet6(text: str) -> set[IPAddress]:
    """Addresses of /proc/net/if_inet6 (32 hex digits per line)."""
    out: set[IPAddress] = set()
    for line in text.splitlines():
        parts = line.split()
        if parts and len(parts[0]) == 32:
            try:
                out.add(ipaddress.IPv6Address(int(parts[0], 16)))
            except ValueError:
                pass
    return out


def host_addresses() -> frozenset[IPAddress]:
    """Every address of the daemon host's network namespace."""
    out: set[IPAddress] = set()
    for path, parse in (("/proc/net/fib_trie", parse_fib_trie_local), ("/proc/net/if_inet6", parse_if_inet6)):
        try:
            with open(path, encoding="ascii") as f:
                out |= parse(f.read())
        except OSError:
            pass
    return frozenset(out)
