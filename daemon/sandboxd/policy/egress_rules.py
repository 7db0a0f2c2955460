"""Egress rules, pure: which allowDomains patterns are acceptable, which host a pattern
admits, and which resolved addresses a sandbox may never reach. The proxy (proxy.py)
asks these questions; nothing here touches the network."""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# What the Public Suffix List (publicsuffixlist, loaded lazily by _public_suffixes) does
# not name. Kept under its old name: suffixes under which anyone gets a name one label
# down, refused like a public suffix (as a wildcard and as an exact name).
# firebaseio.com: each Realtime Database is <name>.firebaseio.com.
SHARED_SUFFIXES = frozenset({"glitch.me", "firebaseio.com"})
# Link-local metadata endpoints and the prefixes that embed or tunnel to IPv4 addresses
# (refused whole: a translator or relay picks the real destination).
_ALWAYS_FORBIDDEN: tuple[tuple[IPNetwork, str], ...] = (
    (ipaddress.ip_network("169.254.0.0/16"), "link-local"),
    (ipaddress.ip_network("fe80::/10"), "link-local"),
    (ipaddress.ip_network("fd00:ec2::/32"), "metadata"),
    (ipaddress.ip_network("100.100.100.200/32"), "metadata"),
    (ipaddress.ip_network("64:ff9b::/96"), "nat64"),
    (ipaddress.ip_network("64:ff9b:1::/48"), "nat64"),
    (ipaddress.ip_network("::ffff:0:0:0/96"), "siit"),
    (ipaddress.ip_network("2002::/16"), "6to4"),
    (ipaddress.ip_network("2001::/32"), "teredo"),
    (ipaddress.ip_network("::/96"), "ipv4-compatible"),
    (ipaddress.ip_network("fec0::/10"), "site-local"),
)
# Domains under which anyone gets names at any depth (buckets, tunnels, request catchers,
# user content), in the PSL or not: no wildcard on or below them, only exact names.
SHARED_PARENTS = frozenset({
    "amazonaws.com", "googleapis.com", "googleusercontent.com", "appspot.com", "cloudfront.net",
    "azureedge.net", "azurewebsites.net", "windows.net", "github.io", "github.dev", "githubusercontent.com",
    "ngrok.io", "ngrok.app", "ngrok.dev", "ngrok-free.app", "ngrok-free.dev", "trycloudflare.com", "workers.dev",
    "pages.dev", "r2.dev", "vercel.app", "netlify.app", "herokuapp.com", "fly.dev", "onrender.com", "web.app",
    "firebaseapp.com", "run.app",
    # Tunnels and out-of-band catchers the PSL does not list.
    "devtunnels.ms", "webhook.site", "pipedream.net", "oastify.com", "burpcollaborator.net", "interact.sh",
    "oast.fun", "oast.pro", "oast.live", "oast.site", "oast.online", "oast.me", "loca.lt", "localtunnel.me",
    "serveo.net", "serveousercontent.com", "localhost.run", "lhr.life", "requestcatcher.com", "beeceptor.com",
    "requestbin.net", "requestrepo.com", "pinggy.link", "pinggy.online", "pinggy.net", "bore.pub", "playit.gg",
    "ply.gg", "zrok.io", "loophole.site", "smee.io", "dnslog.cn", "ceye.io", "gitpod.io", "codesandbox.io",
    "azurecontainerapps.io",
})


@dataclass(frozen=True)
class PublicSuffix:
    """A public suffix and where it is listed: "ICANN" or "private" (the two sections of
    the Public Suffix List), "sandboxd" (SHARED_SUFFIXES), "" if the list does not say."""

    name: str
    section: str

    def listed(self) -> str:
        """Where it is listed, as a reason says it."""
        return {"sandboxd": "sandboxd's own list of shared suffixes", "": "Public Suffix List"}.get(
            self.section, f"Public Suffix List, {self.section} section")

    def describe(self) -> str:
        return f"'{self.name}' is a public suffix ({self.listed()})"


@dataclass(frozen=True)
class _SuffixList:
    matcher: Any  # publicsuffixlist.PublicSuffixList over the same text
    exact: dict[str, str]  # a rule's name -> its section
    wildcard: dict[str, str]  # the base of each `*.base` rule -> its section
    # Each name a public suffix lies strictly below -> the first such suffix (the list's order).
    below: dict[str, PublicSuffix]


def _ascii(rule: str) -> str:
    return rule if rule.isascii() else ".".join(label.encode("idna").decode("ascii") for label in rule.split("."))


@functools.lru_cache(maxsize=1)
def _public_suffixes() -> _SuffixList:
    """The Public Suffix List bundled with publicsuffixlist (a pinned copy: nothing is
    fetched), parsed once on first use (~50 ms), never at import. Both sections count:
    the private one is where platforms list the names their customers get. Only names
    the list holds are public (accept_unknown=False): a single-label host of the
    operator's table is not one. A list without both sections is refused outright, never
    read as one with fewer suffixes."""
    from publicsuffixlist import PSLFILE, PublicSuffixList
    with open(PSLFILE, encoding="utf-8") as f:
        lines = f.read().splitlines()
    exact: dict[str, str] = {}
    wildcard: dict[str, str] = {}
    below: dict[str, PublicSuffix] = {}
    section = ""
    for line in lines:
        line = line.strip()
        if line in ("// ===BEGIN ICANN DOMAINS===", "// ===BEGIN PRIVATE DOMAINS==="):
            section = "ICANN" if "ICANN" in line else "private"
            continue
        if line.startswith("// ===END "):
            section = ""
            continue
        if not line or line.startswith("//") or line.startswith("!"):
            continue  # an exception rule (!www.ck) makes a name not public
        if not section:
            raise RuntimeError(f"the bundled Public Suffix List has a rule outside its sections: {line[:80]!r}")
        rule = _ascii(line.split()[0].lower())
        base = rule[2:] if rule.startswith("*.") else rule
        (wildcard if rule.startswith("*.") else exact).setdefault(base, section)
        # `*.base` makes base public too (the list's linter requires it), so base is the
        # shallowest public name of either kind of rule.
        labels = base.split(".")
        for i in range(1, len(labels) - 1):
            below.setdefault(".".join(labels[i:]), PublicSuffix(base, section))
    sections = set(exact.values()) | set(wildcard.values())
    if sections != {"ICANN", "private"}:
        raise RuntimeError(f"the bundled Public Suffix List lacks a section (found: {sorted(sections)})")
    return _SuffixList(PublicSuffixList(lines, accept_unknown=False), exact, wildcard, below)


def public_suffix(name: str) -> PublicSuffix | None:
    """`name` (normalized) as a public suffix, if anyone can register names directly
    under it: a suffix of the Public Suffix List (ICANN or private section) or of
    SHARED_SUFFIXES; else None."""
    if name in SHARED_SUFFIXES:
        return PublicSuffix(name, "sandboxd")
    psl = _public_suffixes()
    if not psl.matcher.is_public(name):
        return None
    parent = name.partition(".")[2]
    return PublicSuffix(name, psl.exact.get(name) or psl.wildcard.get(name) or psl.wildcard.get(parent) or "")


def is_public_suffix(name: str) -> bool:
    return public_suffix(name) is not None


def public_suffix_below(name: str) -> PublicSuffix | None:
    """A public suffix lying strictly below `name` (normalized), if any: a wildcard on
    `name` would admit names registered under it (`*.railway.app` admits anyone's
    `x.up.railway.app`)."""
    for shared in sorted(SHARED_SUFFIXES):
        if shared.endswith("." + name):
            return PublicSuffix(shared, "sandboxd")
    return _public_suffixes().below.get(name)


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
    an exact host name that is not a public suffix, `*.suffix` with a suffix of at
    least two labels that is not a public suffix, has none below it, and is not on or
    below a SHARED_PARENT, or an exact IP literal. The reason names the suffix and the
    list (and section) that holds it."""
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
        public = public_suffix(suffix)
        if public is not None:
            raise ValueError(f"{public.describe()}: '*.{suffix}' would admit anyone's names")
        for parent in SHARED_PARENTS:
            if suffix == parent or suffix.endswith("." + parent):
                raise ValueError(f"names below '{parent}' belong to anyone: list exact names, not '*.{suffix}'")
        public = public_suffix_below(suffix)
        if public is not None:
            raise ValueError(f"'*.{suffix}' would admit anyone's names under '{public.name}', a public suffix "
                             f"({public.listed()}): list exact names, or a wildcard on one owner's name")
        return p
    if "*" in p:
        raise ValueError("a wildcard is only allowed as a leading '*.'")
    if not is_hostname(p):
        raise ValueError(f"{p!r} is not a valid host name")
    public = public_suffix(p) if "." in p else None
    if public is not None:
        raise ValueError(f"{public.describe()}, not one owner's host: name a host below it")
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


_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


def embedded_ipv4(ip: IPAddress) -> list[tuple[str, ipaddress.IPv4Address]]:
    """The IPv4 addresses an IPv6 address carries, with the form that carries each:
    ipv4-mapped (::ffff:a.b.c.d), siit (::ffff:0:a.b.c.d), ipv4-compatible (::a.b.c.d),
    nat64 (64:ff9b::/96; in 64:ff9b:1::/48 at every RFC 6052 prefix length, since the
    operator's is unknown), 6to4 (2002:AABB:CCDD::) and teredo (the client address, its
    bits complemented). Empty for an IPv4 address or an IPv6 address with none."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    n = int(ip)
    low = ipaddress.IPv4Address(n & 0xFFFFFFFF)
    top96 = n >> 32
    if top96 == 0xFFFF:
        return [("ipv4-mapped", low)]
    if top96 == 0xFFFF0000:
        return [("siit", low)]
    if top96 == 0 and n > 1:  # not :: nor ::1, which are IPv6's own
        return [("ipv4-compatible", low)]
    if top96 == 0x64FF9B << 64:
        return [("nat64", low)]
    if ip in _NAT64_LOCAL:
        # RFC 6052 2.2: 32 bits after the prefix, skipping bits 64-71 (the u octet).
        b = n.to_bytes(16, "big")
        spans = (b[12:16], b[9:13], b[7:8] + b[9:12], b[6:8] + b[9:11])  # /96, /64, /56, /48
        return [("nat64", ipaddress.IPv4Address(x)) for x in spans]
    if ip.sixtofour is not None:
        return [("6to4", ip.sixtofour)]
    if ip.teredo is not None:
        return [("teredo", ip.teredo[1])]
    return []


def _plain_reason(ip: IPAddress, *, deny_private: bool, own_addresses: frozenset[IPAddress],
                  exempt: tuple[IPNetwork, ...]) -> str | None:
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


def forbidden_reason(ip: IPAddress, *, deny_private: bool, own_addresses: frozenset[IPAddress] = frozenset(),
                     exempt: tuple[IPNetwork, ...] = ()) -> str | None:
    """Why a sandbox may not reach `ip`, or None. Loopback, link-local, metadata,
    multicast, unspecified, tunnelling prefixes and the daemon host's own addresses are
    refused whatever the policy or the operator's exemptions say; with deny_private,
    every other address that is not globally routable is, unless the operator exempts
    its network (an internal mirror). An IPv4-mapped address is the IPv4 address it
    carries; every other form that embeds one (embedded_ipv4) is refused whole, and
    when the IPv4 address inside would be refused too the reason says so."""
    def plain(address: IPAddress) -> str | None:
        return _plain_reason(address, deny_private=deny_private, own_addresses=own_addresses, exempt=exempt)

    embedded = embedded_ipv4(ip)
    if embedded and embedded[0][0] == "ipv4-mapped":
        return plain(embedded[0][1])
    # Scope ids (fe80::1%eth0) play no part in which address it is.
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = ipaddress.IPv6Address(int(ip))
    own = plain(ip)
    for kind, v4 in embedded:
        inner = plain(v4)
        if inner is not None:
            return f"{kind} (embeds {v4}, {inner})"
    if own is None and embedded:  # fail closed: a form with no prefix entry of its own
        return embedded[0][0]
    return own


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
    article = "an" if reason[0] in "aeiou" else "a"
    return Decision(False, rule, f"{ip}, {article} {reason} address")


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
