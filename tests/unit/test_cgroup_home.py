"""Where the jails' cgroups go (backends/cgroup_home.py): the plan from the host's
cgroup version, the daemon's own cgroup and systemd's delegation, and the daemon's move
into its leaf, on fake hierarchies in a temporary directory. The real thing runs under
systemd in tests/integration/test_systemd_unit.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxd.backends import cgroups
from sandboxd.backends.cgroup_home import (TOP_LEVEL, CgroupHome, PlacementRefused, delegated_to_us, own_cgroup,
                                           plan_home, settle)
from sandboxd.backends.cgroups import V2, CgroupUnavailable

UNIT = "system.slice/sandboxd.service"


def touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_v2_line_of_proc_self_cgroup_names_the_daemons_cgroup():
    assert own_cgroup("0::/system.slice/sandboxd.service\n") == UNIT
    assert own_cgroup("0::/\n") == ""
    hybrid = "12:pids:/user.slice\n4:memory:/user.slice\n1:name=systemd:/x\n0::/user.slice/session-1.scope\n"
    assert own_cgroup(hybrid) == "user.slice/session-1.scope"
    assert own_cgroup("4:memory:/\n3:pids:/\n") is None


def test_a_delegated_cgroup_holds_the_jails_below_it_beside_the_daemons_leaf():
    home = plan_home("v2", UNIT, delegated=True, placement="auto")
    assert (home.top, home.base, home.daemon_leaf) == (f"{UNIT}/sandboxes", UNIT, f"{UNIT}/daemon")
    assert plan_home("v2", UNIT, delegated=True, placement="delegated") == home


def test_without_delegation_the_jails_go_to_the_top_and_the_reason_is_said():
    for own, why in ((UNIT, "not delegated"), ("", "root cgroup")):
        home = plan_home("v2", own, delegated=False, placement="auto")
        assert (home.top, home.base, home.daemon_leaf) == (TOP_LEVEL, "", "")
        assert why in home.how
    assert plan_home("v1", None, delegated=False, placement="auto").top == TOP_LEVEL
    assert plan_home("v2", UNIT, delegated=True, placement="top") == CgroupHome(
        how=f"at the top of the hierarchy ({TOP_LEVEL}), as nsjail.cgroup_placement says")


def test_asking_for_delegation_where_there_is_none_is_refused_by_name():
    with pytest.raises(PlacementRefused, match=r"cgroup \(/system.slice/sandboxd.service\) is not delegated.*"
                                               r"Delegate=yes"):
        plan_home("v2", UNIT, delegated=False, placement="delegated")
    with pytest.raises(PlacementRefused, match="only on cgroup v2"):
        plan_home("v1", None, delegated=False, placement="delegated")


def test_systemds_delegate_xattr_marks_a_delegated_cgroup(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        os.setxattr(tmp_path / "a", "trusted.delegate", b"1")
    except OSError as exc:
        pytest.fail(f"this filesystem takes no trusted xattrs as root: {exc}")
    os.setxattr(tmp_path / "b", "trusted.delegate", b"0")
    assert delegated_to_us(str(tmp_path), "a")
    assert not delegated_to_us(str(tmp_path), "b")
    assert not delegated_to_us(str(tmp_path), "missing")


def test_settle_moves_the_daemon_into_its_leaf(tmp_path):
    touch(tmp_path / UNIT / "cgroup.procs", "")
    home = plan_home("v2", UNIT, delegated=True, placement="auto")
    settle(home, str(tmp_path))
    assert (tmp_path / UNIT / "daemon" / "cgroup.procs").read_text() == str(os.getpid())


def test_settle_refuses_a_delegated_cgroup_shared_with_another_process(tmp_path):
    touch(tmp_path / UNIT / "cgroup.procs", "4242\n")
    with pytest.raises(PlacementRefused, match=r"holds other processes too \(pids 4242\).*only process"):
        settle(plan_home("v2", UNIT, delegated=True, placement="auto"), str(tmp_path))


def test_settle_at_the_top_changes_nothing(tmp_path):
    settle(CgroupHome(), str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_v2_layout_with_a_base_writes_nothing_above_it(tmp_path, monkeypatch):
    touch(tmp_path / "cgroup.controllers", "cpu memory pids\n")
    touch(tmp_path / "cgroup.subtree_control", "")
    touch(tmp_path / "system.slice" / "cgroup.subtree_control", "")
    touch(tmp_path / UNIT / "cgroup.controllers", "cpu memory pids\n")
    touch(tmp_path / UNIT / "cgroup.subtree_control", "")
    writes = []
    real_write = cgroups._write
    monkeypatch.setattr(cgroups, "_write", lambda path, value: (writes.append((path, value)), real_write(path, value)))
    layout = V2(str(tmp_path), base=UNIT)
    touch(tmp_path / UNIT / "sandboxes" / "cgroup.subtree_control", "")
    touch(tmp_path / UNIT / "sandboxes" / "d" / "cgroup.subtree_control", "")
    layout.make(f"{UNIT}/sandboxes/d/sbx-1")
    assert writes == [(f"{tmp_path}/{p}/cgroup.subtree_control", "+memory +pids +cpu")
                      for p in (UNIT, f"{UNIT}/sandboxes", f"{UNIT}/sandboxes/d")]
    with pytest.raises(OSError, match="not below the daemon's delegated cgroup"):
        layout.make("sandboxd-nsjail/d/sbx-2")


def test_a_v2_layout_with_a_base_reads_the_controllers_offered_to_the_base(tmp_path):
    touch(tmp_path / "cgroup.controllers", "cpu memory pids\n")
    touch(tmp_path / UNIT / "cgroup.controllers", "memory\n")
    with pytest.raises(CgroupUnavailable, match=rf"{UNIT} does not offer pids, cpu \(the daemon's delegated"):
        V2(str(tmp_path), base=UNIT).check(f"{UNIT}/sandboxes")
