"""The escape probe (escape_probe.py, run inside sandboxes) and what every sandbox must
make of it, on either backend."""

from __future__ import annotations

from pathlib import Path

PROBE = (Path(__file__).parent / "escape_probe.py").read_bytes()
# What the seccomp profile lets a sandbox do among the probes; everything else is denied.
ALLOWED = {"socket_af_inet_stream", "socket_af_inet_dgram", "socket_af_inet6_stream", "socket_af_unix_stream",
           "socket_af_unix_dgram", "socket_af_netlink_route", "socketpair_af_unix"}


def assert_denied_without_kill(probes: dict) -> None:
    """The allowed probes worked; every other one failed with an error the program can
    handle (an errno), never by a signal."""
    assert ALLOWED < set(probes) and len(probes) > len(ALLOWED) + 10
    for name, outcome in probes.items():
        if name in ALLOWED:
            assert outcome["ok"], (name, outcome)
        else:
            assert not outcome["ok"] and outcome["errno"] > 0, (name, outcome)
