"""Escape probes: each tries to leave the sandbox and must fail safely."""

from __future__ import annotations

import json

from ..probes import ALLOWED, PROBE, assert_denied_without_kill
from .conftest import DAEMON_SECRET, call, sh


def test_syscall_probes_are_denied_without_killing(client, workspace):
    out = client.run(call(workspace, ["python3", "-"], stdin=PROBE))
    assert out.result.exit_code == 0, out.stderr
    assert_denied_without_kill(json.loads(out.stdout))


def test_docker_socket_and_host_are_unreachable(client, workspace, daemon):
    script = (
        "ls -l /var/run/docker.sock /run/docker.sock 2>&1; "
        f"ls {daemon.socket} 2>&1; ls {daemon.state_dir} 2>&1; "
        "cat /proc/1/environ 2>&1 | tr '\\0' '\\n'; "
        "cat /etc/shadow 2>&1 | head -1; "
        "echo x > /proc/sysrq-trigger 2>&1; "
        "mkdir /tmp/m && mount -t tmpfs none /tmp/m 2>&1; "
        "chroot / true 2>&1; "
        "echo done"
    )
    out = client.run(call(workspace, sh(script)))
    text = out.stdout.decode()
    assert "docker.sock" in text and "No such file" in text
    assert DAEMON_SECRET not in text
    assert text.strip().endswith("done")
    assert "srw" not in text, "no socket may be visible"


def test_setuid_binaries_give_no_privilege(client, workspace):
    out = client.run(call(workspace, sh("su -c id root 2>&1; id -u")))
    assert out.stdout.strip().splitlines()[-1] == b"1000"
