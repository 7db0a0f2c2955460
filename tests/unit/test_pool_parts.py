"""Pure parts of pools.py: how a pool is keyed, and how a sandbox's leftover processes
are found on either cgroup layout."""

from __future__ import annotations

from types import SimpleNamespace

from sandboxd.pools import PER_COMMAND, policy_class, pool_key, sandbox_processes, sandbox_task_count
from sandboxd.policy import parse_call, resolve_policy

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
