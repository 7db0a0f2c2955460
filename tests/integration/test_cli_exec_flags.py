"""`sandboxctl exec -e/-w/--network/--read-only` as a user runs them, on both backends:
what the command sees in its sandbox. The "outside world" of --network is the servers of
egress_hosts.py, in a network namespace this module makes."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from sandboxd_testing import make_daemon

from .conftest import BACKENDS, DAEMON_ENV, public_tmpdir, stop_and_clean
from .egress_hosts import RemoteHosts
from .test_cli import SANDBOXCTL, ctl

FETCH = """
import json, urllib.request
def status(url):
    try:
        return urllib.request.urlopen(url, timeout=20).status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return 0
print(json.dumps([status("http://allowed.test/"), status("http://other.test/")]))
"""


@pytest.mark.parametrize("adapter", BACKENDS)
def test_env_flags(daemon, workspace, adapter):
    p = ctl(daemon, "exec", "--adapter", adapter, "--workspace", str(workspace), "-e", "GREETING=hi there",
            "--env", "EMPTY=", "--", "sh", "-c", 'echo "$GREETING|$EMPTY|${EMPTY+set}"')
    assert (p.returncode, p.stdout) == (0, b"hi there||set\n"), p.stderr


@pytest.mark.parametrize("adapter", BACKENDS)
def test_write_roots_relative_and_absolute(daemon, adapter):
    ws = daemon.new_workspace({"out/.keep": "", "logs/.keep": "", "README.md": "readable\n"})
    script = ("echo a > /workspace/out/a && echo b > logs/b && cat README.md && "
              "if echo c > /workspace/c 2>/dev/null; then echo WROTE-OUTSIDE; fi")
    p = ctl(daemon, "exec", "--adapter", adapter, "--workspace", str(ws), "-w", "out", "--write", "/workspace/logs",
            "--", "sh", "-c", script)
    assert (p.returncode, p.stdout) == (0, b"readable\n"), p.stderr
    assert (ws / "out" / "a").read_text() == "a\n" and (ws / "logs" / "b").read_text() == "b\n"
    assert not (ws / "c").exists()


@pytest.mark.parametrize("adapter", BACKENDS)
def test_read_only(daemon, adapter, tmp_path):
    ws = daemon.new_workspace({"README.md": "readable\n", "out/.keep": ""})
    p = ctl(daemon, "exec", "--adapter", adapter, "--workspace", str(ws), "--read-only", "--",
            "sh", "-c", "cat README.md; touch /workspace/out/x")
    assert p.returncode != 0 and p.stdout == b"readable\n"
    assert not (ws / "out" / "x").exists()
    # A policy file that writes somewhere: refused before anything runs, naming both.
    policy = tmp_path / "policy.yaml"
    policy.write_text("filesystem:\n  readRoots: [/workspace]\n  writeRoots: [out]\n")
    refused = ctl(daemon, "exec", "--adapter", adapter, "--workspace", str(ws), "--policy", str(policy),
                  "--read-only", "--", "touch", "/workspace/out/y")
    assert refused.returncode == 125
    assert b"--read-only" in refused.stderr and b"policy.filesystem.writeRoots" in refused.stderr
    assert not (ws / "out" / "y").exists()


@pytest.fixture(scope="module")
def hosts():
    workdir = public_tmpdir("sandboxd-cli-hosts-")
    h = RemoteHosts(workdir, tag="c", subnet="10.215").start()
    yield h
    h.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def egress_daemon(docker_engine, hosts):
    base = public_tmpdir("sandboxd-cli-egress-")
    d = make_daemon(base, env=DAEMON_ENV, egress=hosts.daemon_egress_settings()).start()
    yield d
    stop_and_clean(d, docker_engine, base)


def fetched(d, adapter: str, *flags: str) -> tuple[list[int], dict]:
    """(statuses of allowed.test and other.test from inside, the call's result)."""
    ws = d.new_workspace()
    result_file = ws.parent / f"{ws.name}-result.json"
    p = subprocess.run([SANDBOXCTL, "--socket", str(d.socket), "exec", "--adapter", adapter, "--workspace", str(ws),
                        "--result-json", str(result_file), *flags, "--", "python3", "-c", FETCH],
                       capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), json.loads(result_file.read_text())


@pytest.mark.parametrize("adapter", BACKENDS)
def test_network_flag(egress_daemon, hosts, adapter):
    assert fetched(egress_daemon, adapter, "--network", "none")[0] == [0, 0]
    statuses, result = fetched(egress_daemon, adapter, "--network", "allowed.test,*.allowed.test")
    assert statuses == [200, 403]
    assert result["effectsObserved"]["externalCalls"] == ["allowed.test:80"]
    statuses, result = fetched(egress_daemon, adapter, "--network", "open")
    assert statuses == [200, 200]
    assert result["effectsObserved"]["externalCalls"] == ["allowed.test:80", "other.test:80"]


def test_a_network_flag_against_the_policy_file_runs_nothing(egress_daemon, tmp_path):
    ws = egress_daemon.new_workspace()
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"network": {"egress": "allowlist", "allowDomains": ["allowed.test"]}}))
    before = ctl(egress_daemon, "audit", "--json").stdout
    p = ctl(egress_daemon, "exec", "--workspace", str(ws), "--policy", str(policy), "--network", "open", "--",
            "true")
    assert p.returncode == 125
    assert b"--network open" in p.stderr and b"policy.network.egress" in p.stderr
    assert ctl(egress_daemon, "audit", "--json").stdout == before  # nothing reached the daemon
