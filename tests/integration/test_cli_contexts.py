"""Named contexts of the client config file against a daemon's mutual-TLS listener: the
TLS files are given once (`context set`), then every command finds them by name, by
$SANDBOXD_CONTEXT, or as the current context. The principal is the certificate's."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from .conftest import call
from .test_cli import SANDBOXCTL
from .test_mtls import pki, tls_daemon  # noqa: F401 - fixtures
from .test_tenants import ALICE


def run(config, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("SANDBOXD_SOCKET", "SANDBOXD_CONTEXT")}
    environ["SANDBOXD_CLIENT_CONFIG"] = str(config)
    return subprocess.run([SANDBOXCTL, *args], capture_output=True, timeout=120, env={**environ, **(env or {})})


@pytest.fixture
def config(tmp_path):
    return tmp_path / "conf" / "client.yaml"


def test_contexts_over_mutual_tls(tls_daemon, pki, config):  # noqa: F811
    d = tls_daemon
    ws = d.new_workspace({"who.txt": "alice's\n"}, uid=ALICE)
    made = run(config, "context", "set", "alice", "--tcp", d.tcp_target, "--tls-ca", str(pki["ca"][0]),
               "--tls-cert", str(pki["alice"][0]), "--tls-key", str(pki["alice"][1]))
    assert made.returncode == 0, made.stderr
    assert run(config, "context", "set", "local", "--socket", str(d.socket)).returncode == 0

    # By name: no TLS flag on the command.
    p = run(config, "--context", "alice", "exec", "--workspace", str(ws), "--result-json",
            str(config.parent / "r.json"), "--", "cat", "/workspace/who.txt")
    assert (p.returncode, p.stdout) == (0, b"alice's\n"), p.stderr
    call_id = json.loads((config.parent / "r.json").read_text())["toolCallId"]
    trace = run(config, "trace", call_id, "--json", "--context", "alice")  # after the command too
    assert trace.returncode == 0 and '"principal": "alice"' in trace.stdout.decode()

    # Root's call on the socket is not alice's: her context's ps does not list it.
    with d.client() as root:
        stream = root.execute(call(d.new_workspace(uid=ALICE + 1), ["sleep", "30"]))
        events = iter(stream)
        root_call = next(events).tool_call_id
        try:
            assert root_call in run(config, "--context", "local", "ps", "-q").stdout.decode()
            assert run(config, "ps", "-q", env={"SANDBOXD_CONTEXT": "alice"}).stdout == b""
            # As the current context.
            assert run(config, "context", "use", "alice").returncode == 0
            assert yaml.safe_load(config.read_text())["current_context"] == "alice"
            assert run(config, "ps", "-q").stdout == b""
            listed = run(config, "context", "ls").stdout.decode().splitlines()
            assert any(line.split()[:2] == ["*", "alice"] for line in listed)
            assert root_call in run(config, "ps", "-q", "--socket", str(d.socket)).stdout.decode()
            mine = run(config, "logs", call_id)
            assert (mine.returncode, mine.stdout) == (0, b"alice's\n")
            theirs = run(config, "logs", root_call)
            assert theirs.returncode == 1 and b"NOT_FOUND" in theirs.stderr
        finally:
            stream.cancel()

    # Both a context and a socket: refused, nothing sent.
    both = run(config, "--context", "alice", "--socket", str(d.socket), "ps")
    assert both.returncode == 125 and b"--context" in both.stderr
