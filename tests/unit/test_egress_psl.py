"""sandboxd.policy.egress_rules and the Public Suffix List: a wildcard on a public suffix (ICANN or
private section, as the bundled publicsuffixlist has it) admits anyone's names, and an
exact public suffix is nobody's host; both are refused with a reason. The list is
parsed once, on first use, never at import. Pure code."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from sandboxd.policy import egress_rules as egress
from sandboxd.core.errors import InvalidArgument
from sandboxd.policy.egress_rules import (SHARED_SUFFIXES, is_public_suffix, match_host, normalize_pattern,
                                          public_suffix, public_suffix_below)
from sandboxd.policy.models import NetworkPolicy, _resolve_domains

# The red-team's examples, then ICANN, private-section and wildcard-rule (*.run.app,
# *.compute.amazonaws.com) suffixes, and tunnels/catchers the list does not name.
WILDCARDS_REFUSED = [
    "*.run.app", "*.ngrok.dev", "*.devtunnels.ms", "*.webhook.site",
    "*.co.uk", "*.com.au", "*.gov.uk", "*.ac.jp", "*.com.ru", "*.k12.ca.us",
    "*.github.io", "*.vercel.app", "*.blogspot.com", "*.ngrok-free.app", "*.ngrok-free.dev", "*.pages.dev",
    "*.herokuapp.com", "*.netlify.app", "*.azurewebsites.net", "*.cloudfunctions.net", "*.surge.sh",
    "*.a.run.app", "*.x.run.app", "*.us-east-1.compute.amazonaws.com", "*.s3.amazonaws.com",
    "*.oastify.com", "*.interact.sh", "*.loca.lt", "*.pipedream.net", "*.glitch.me", "*.x.devtunnels.ms",
]


@pytest.mark.parametrize("pattern", WILDCARDS_REFUSED)
def test_wildcards_on_public_registration_suffixes_are_refused(pattern):
    with pytest.raises(ValueError) as info:
        normalize_pattern(pattern)
    why = str(info.value)
    assert "public suffix" in why or "belong to anyone" in why, why
    with pytest.raises(ValueError):
        normalize_pattern(pattern.upper() + ".")


@pytest.mark.parametrize("suffix", ["run.app", "ngrok.dev", "co.uk", "github.io", "vercel.app", "a.run.app",
                                    "com.au.", "CO.UK"])
def test_exact_public_suffixes_are_refused(suffix):
    with pytest.raises(ValueError, match="is a public suffix"):
        normalize_pattern(suffix)


# The short built-in list this replaced: each entry still refused as a wildcard.
FORMER_BUILTIN = [
    "co.uk", "org.uk", "ac.uk", "gov.uk", "me.uk", "com.au", "net.au", "org.au", "co.jp", "ne.jp", "or.jp",
    "com.br", "com.cn", "com.mx", "co.nz", "co.in", "co.za", "com.tr", "com.tw", "com.sg", "com.hk", "co.kr",
    "github.io", "githubusercontent.com", "gitlab.io", "appspot.com", "herokuapp.com", "cloudfront.net",
    "amazonaws.com", "s3.amazonaws.com", "azurewebsites.net", "blob.core.windows.net", "blogspot.com",
    "pages.dev", "workers.dev", "vercel.app", "netlify.app", "web.app", "firebaseapp.com", "ngrok.io",
    "ngrok-free.app", "trycloudflare.com", "duckdns.org", "no-ip.org", "glitch.me", "repl.co", "fly.dev",
    "onrender.com", "deno.dev", "r2.dev", "supabase.co",
]


@pytest.mark.parametrize("suffix", FORMER_BUILTIN)
def test_every_suffix_of_the_former_builtin_list_is_still_refused(suffix):
    with pytest.raises(ValueError):
        normalize_pattern(f"*.{suffix}")


@pytest.mark.parametrize("pattern", ["example.co.uk", "*.example.co.uk", "owner.github.io", "svc-abc.a.run.app",
                                     "*.example.com", "api.example.com", "pypi.org", "*.pythonhosted.org",
                                     "*.files.test", "allowed.test", "webhook.site", "localhost",
                                     # single labels are an operator's host-table names, never refused as TLDs
                                     "app", "dev", "com"])
def test_one_owners_names_are_accepted(pattern):
    assert normalize_pattern(pattern) == pattern


def test_is_public_suffix_sections_and_unknown_names():
    assert is_public_suffix("co.uk")  # ICANN
    assert is_public_suffix("github.io")  # private section
    assert is_public_suffix("x.run.app")  # a wildcard rule
    assert not is_public_suffix("example.com")
    assert not is_public_suffix("example.test")
    assert not is_public_suffix("localhost")  # unknown: not assumed public
    assert not is_public_suffix("www.ck")  # an exception rule (!www.ck)
    assert is_public_suffix("foo.ck")


def test_matching_needs_no_list():
    # The hot path (match_host, per request) never consults the list.
    egress._public_suffixes.cache_clear()
    assert match_host("a.example.com", ["*.example.com"]) == "*.example.com"
    assert egress._public_suffixes.cache_info().currsize == 0


def test_the_list_is_parsed_once_and_not_at_import():
    code = ("import sys; import sandboxd.policy.egress_rules as e; assert 'publicsuffixlist' not in sys.modules; "
            "e.normalize_pattern('*.example.com'); e.normalize_pattern('example.org'); "
            "assert 'publicsuffixlist' in sys.modules; i = e._public_suffixes.cache_info(); "
            "assert i.misses == 1 and i.hits >= 1, i")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=egress.__file__.rsplit("/sandboxd/", 1)[0])


# ------------------------------------------------------------------ the private section, and below a wildcard

# Platforms whose customers each get names (the red-team's, then others): `*.<platform>`
# admits every customer. Each with the suffix and section the reason must name: the
# platform itself, or a public suffix below it (Railway lists up.railway.app, AWS the
# regional names under on.aws); firebaseio.com is in no section of the list, so sandboxd
# names it itself.
PLATFORM_WILDCARDS = [
    ("*.railway.app", "up.railway.app", "Public Suffix List, private section"),
    ("*.firebaseio.com", "firebaseio.com", "sandboxd's own list of shared suffixes"),
    ("*.on.aws", ".on.aws", "Public Suffix List, private section"),
    ("*.github.io", "github.io", "Public Suffix List, private section"),
    ("*.herokuapp.com", "herokuapp.com", "Public Suffix List, private section"),
    ("*.fastly.net", "freetls.fastly.net", "Public Suffix List, private section"),
    ("*.co.uk", "co.uk", "Public Suffix List, ICANN section"),
]


@pytest.mark.parametrize("pattern, suffix, listed", PLATFORM_WILDCARDS)
def test_a_wildcard_on_or_above_a_public_suffix_is_refused_naming_the_suffix_and_section(pattern, suffix, listed):
    with pytest.raises(ValueError) as info:
        normalize_pattern(pattern)
    why = str(info.value)
    assert "public suffix" in why and listed in why, why
    named = re.search(r"'([^']+)'(?: is|,) a public suffix", why)
    assert named is not None and named.group(1).endswith(suffix), why


@pytest.mark.parametrize("pattern, suffix, listed", PLATFORM_WILDCARDS)
def test_the_refusal_is_invalid_argument_naming_the_field(pattern, suffix, listed):
    net = NetworkPolicy.model_validate({"egress": "allowlist", "allowDomains": ["ok.test", "api.example.com",
                                                                                "*.example.org", pattern]})
    with pytest.raises(InvalidArgument) as info:
        _resolve_domains(net)
    assert info.value.field == "policy.network.allowDomains[3]"
    assert info.value.status == "INVALID_ARGUMENT"
    assert pattern in info.value.message and listed in info.value.message


@pytest.mark.parametrize("exact", ["myapp.railway.app", "railway.app", "app.up.railway.app", "mydb.firebaseio.com",
                                   "x.on.aws", "abc.lambda-url.us-east-1.on.aws", "owner.github.io",
                                   "myapp.herokuapp.com", "*.myapp.up.railway.app", "*.svc.lambda-url.us-east-1.on.aws"])
def test_one_owners_names_under_a_platform_are_accepted(exact):
    assert normalize_pattern(exact) == exact


def test_the_private_section_is_loaded_from_the_bundled_copy():
    # The pinned copy inside publicsuffixlist, both sections: a list read without its
    # private part would answer these "not public" and let the wildcards through.
    for name, section in [("github.io", "private"), ("herokuapp.com", "private"), ("up.railway.app", "private"),
                          ("co.uk", "ICANN"), ("com", "ICANN")]:
        found = public_suffix(name)
        assert found is not None and found.section == section, (name, found)
    below = public_suffix_below("railway.app")
    assert below is not None and (below.name, below.section) == ("up.railway.app", "private")
    on_aws = public_suffix_below("on.aws")
    assert on_aws is not None and on_aws.name.endswith(".on.aws") and on_aws.section == "private"
    assert public_suffix_below("example.com") is None
    assert "firebaseio.com" in SHARED_SUFFIXES and public_suffix("firebaseio.com") is not None


def test_no_network_at_runtime():
    # The list comes from the installed package's file; the loader opens nothing else.
    code = ("import socket\n"
            "def refuse(*a, **k): raise AssertionError('network access')\n"
            "socket.socket.connect = refuse; socket.getaddrinfo = refuse\n"
            "import sandboxd.policy.egress_rules as e\n"
            "assert e.public_suffix_below('railway.app').name == 'up.railway.app'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=egress.__file__.rsplit("/sandboxd/", 1)[0])


def test_the_proxy_checks_the_patterns_again_where_it_uses_them(tmp_path):
    # Admission refuses these; a pattern that reached the proxy some other way is still
    # never turned into a rule (the endpoint is not opened).
    from sandboxd.egress.proxy import EgressProxy
    proxy = EgressProxy(socket_dir=tmp_path, host_overrides={}, system_dns=False)
    try:
        assert proxy.rules(("allowed.test", "*.Example.COM."), True).patterns == ("allowed.test", "*.example.com")
        for pattern in ("*.railway.app", "*.github.io", "*.com"):
            with pytest.raises(ValueError):
                proxy.rules(("allowed.test", pattern), True)
    finally:
        proxy.stop()
