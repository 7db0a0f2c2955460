"""Pure parts of pools.py: how a pool is keyed, how a sandbox's leftover processes
are found on either cgroup layout, and how long a new sandbox's supervisor is waited for."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

from sandboxd.pools import manager as pools
from sandboxd.sandbox.protocol import ExitStatus
from sandboxd.sandbox.protocol import SandboxHandle
from sandboxd.core.errors import InternalError
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.pools.manager import PER_COMMAND, policy_class, pool_key, sandbox_processes, sandbox_task_count
from sandboxd.policy.models import parse_call, resolve_policy

from .conftest import LIMITS, call_dict


def _policy(**policy):
    return resolve_policy(parse_call(call_dict(policy=policy)), LIMITS, {})


def _tree(root, rel, procs):
    """procs: {relative cgroup dir: [pids]} under root/rel."""
    for sub, pids in procs.items():
        d = root / rel / sub if sub else root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))


def test_leftovers_are_read_from_the_v1_pids_hierarchy(tmp_path):
    (tmp_path / "memory").mkdir()
    _tree(tmp_path / "pids", "sandboxd/sbx-1", {"": [], "docker-abc": [10, 11], "docker-abc/inner": [12]})
    spec = SimpleNamespace(cgroup_parent="/sandboxd/sbx-1")
    assert sandbox_processes(spec, str(tmp_path)) == {10, 11, 12}


def test_leftovers_are_read_from_the_unified_hierarchy_on_a_v2_host(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    _tree(tmp_path, "sandboxd/sbx-2", {"": [], "abc": [20], "abc/x/y": [21, 22]})
    assert sandbox_processes(SimpleNamespace(cgroup="sandboxd/sbx-2"), str(tmp_path)) == {20, 21, 22}


def test_the_task_count_is_the_subtree_s_pids_current(tmp_path):
    _tree(tmp_path / "pids", "sandboxd/sbx-3", {"": [], "docker-abc": [30, 31]})
    (tmp_path / "pids" / "sandboxd" / "sbx-3" / "pids.current").write_text("2\n")
    spec = SimpleNamespace(cgroup_parent="/sandboxd/sbx-3")
    assert sandbox_task_count(spec, str(tmp_path)) == 2
    assert sandbox_task_count(SimpleNamespace(cgroup_parent="/sandboxd/gone"), str(tmp_path)) is None
    assert sandbox_task_count(SimpleNamespace(), str(tmp_path)) is None


def test_leftovers_are_unknown_without_a_cgroup(tmp_path):
    assert sandbox_processes(SimpleNamespace(cgroup_parent="/nope"), str(tmp_path)) is None
    assert sandbox_processes(SimpleNamespace(), str(tmp_path)) is None


def test_per_command_fields_do_not_change_the_pool():
    base = _policy()
    per_command = _policy(process={"timeoutMs": 1234, "maxStdoutBytes": 100},
                          audit={"recordFileAccess": False, "recordCommand": False})
    assert policy_class(base) == policy_class(per_command)
    assert not set(PER_COMMAND) & set(policy_class(base))
    key = pool_key("/srv/ws", "img", "docker", 1000, 1000, base)
    assert key == pool_key("/srv/ws", "img", "docker", 1000, 1000, per_command)


def test_what_fixes_the_sandbox_changes_the_pool():
    base = _policy()
    key = pool_key("/srv/ws", "img", "docker", 1000, 1000, base)
    assert key != pool_key("/srv/ws", "img", "nsjail", 1000, 1000, base)
    assert key != pool_key("/srv/other", "img", "docker", 1000, 1000, base)
    assert key != pool_key("/srv/ws", "img", "docker", 1000, 1000, _policy(filesystem={"writeRoots": ["/workspace"]}))
    assert key != pool_key("/srv/ws", "img", "docker", 1000, 1000, _policy(process={"maxMemoryMb": 64}))


class _Sandbox:
    """What _await_supervisor asks of a backend: whether the sandbox has ended, and how."""

    def __init__(self, ends_after_s: float | None):
        self.ends_at = None if ends_after_s is None else time.monotonic() + ends_after_s

    def wait(self, handle, timeout_s):
        return self.ends_at is not None and time.monotonic() >= self.ends_at

    def collect(self, handle):
        return ExitStatus(exit_code=3, signal="", oom_killed=False), None


def _waiting(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "control.sock"))
    listener.listen(1)
    spool = OutputSpool(tmp_path / "spool", {STDOUT: 1024, STDERR: 1024}, 256)
    spool.write(STDERR, b"supervisor: still starting\n")
    return listener, SandboxHandle("sbx-ready", "engine-1", None), spool


def test_a_supervisor_that_never_calls_in_is_given_up_at_the_ready_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(pools, "READY_TIMEOUT_S", 0.3)
    listener, handle, spool = _waiting(tmp_path)
    begun = time.monotonic()
    with pytest.raises(InternalError, match=r"sbx-ready did not call in within 0 s: .*still starting"):
        pools._await_supervisor(listener, _Sandbox(None), handle, spool)
    assert 0.3 <= time.monotonic() - begun < 2


def test_a_sandbox_that_ends_first_is_reported_at_once_not_at_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(pools, "READY_TIMEOUT_S", 30.0)
    listener, handle, spool = _waiting(tmp_path)
    begun = time.monotonic()
    with pytest.raises(InternalError, match=r"sbx-ready ended before its supervisor called in \(exit code 3\)"):
        pools._await_supervisor(listener, _Sandbox(0.2), handle, spool)
    assert time.monotonic() - begun < 2


def test_a_supervisor_that_calls_in_is_taken(tmp_path):
    listener, handle, spool = _waiting(tmp_path)
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    caller.connect(str(tmp_path / "control.sock"))
    conn = pools._await_supervisor(listener, _Sandbox(None), handle, spool)
    caller.sendall(b"R")
    assert conn.recv(16) == b"R"
