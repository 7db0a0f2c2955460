"""calls/reservations.py: a writer runs alone on its workspace; nested workspaces count
as one; siblings do not touch."""

from __future__ import annotations

import pytest

from sandboxd.calls.reservations import WorkspaceReservations, conflicting_holder
from sandboxd.core.errors import Aborted, FailedPrecondition
from sandboxd.policy.preflight import Bind, HostPlan


def plan(workspace: str, writes: bool) -> HostPlan:
    return HostPlan(workspace=workspace, uid=1000, gid=1000,
                    binds=(Bind("/workspace", workspace, not writes),), masks=())


def test_readers_share_and_a_writer_runs_alone():
    assert conflicting_holder({"r1": ("/w/a", False)}, "/w/a", False) is None
    assert conflicting_holder({"r1": ("/w/a", False)}, "/w/a", True) == "r1"
    assert conflicting_holder({"w1": ("/w/a", True)}, "/w/a", False) == "w1"


def test_nested_workspaces_count_as_one_and_siblings_are_apart():
    assert conflicting_holder({"w1": ("/w/a", True)}, "/w/a/b", False) == "w1"
    assert conflicting_holder({"w1": ("/w/a/b", True)}, "/w/a", False) == "w1"
    assert conflicting_holder({"r1": ("/w/a/b", False)}, "/w/a", True) == "r1"
    assert conflicting_holder({"w1": ("/w/a", True)}, "/w/ab", True) is None  # a prefix is not a parent
    assert conflicting_holder({"w1": ("/w/a", True)}, "/w/b", True) is None


def test_reservations_are_held_until_released_and_refused_at_shutdown():
    r = WorkspaceReservations()
    r.reserve("tc_1", plan("/w/a", writes=True))
    with pytest.raises(Aborted) as info:
        r.reserve("tc_2", plan("/w/a/sub", writes=False))
    assert "tc_1" in info.value.message and info.value.field == "workspace"
    r.reserve("tc_3", plan("/w/b", writes=True))
    r.release("tc_1")
    r.reserve("tc_2", plan("/w/a/sub", writes=False))
    r.close()
    with pytest.raises(FailedPrecondition):
        r.reserve("tc_4", plan("/w/c", writes=False))
