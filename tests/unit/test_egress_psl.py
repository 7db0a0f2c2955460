"""sandboxd.policy.egress_rules and the Public Suffix List: a wildcard on a public suffix (ICANN or
private section, as the bundled publicsuffixlist has it) admits anyone's names, and an
exact public suffix is nobody's host; both are refused with a reason. The list is
parsed once, on first use, never at import. Pure code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sandboxd.policy import egress_rules as egress
from sandboxd.policy.egress_rules import is_public_suffix, match_host, normalize_pattern

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
            "assert (i.misses, i.hits) == (1, 1), i")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=egress.__file__.rsplit("/sandboxd/", 1)[0])
