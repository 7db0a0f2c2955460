"""When the nsjail backend makes its next spawn slot: not while a call that took one is
still running and another slot is ready (the slot's cgroup move holds the kernel's
cgroup mutex through an RCU grace period, stalling that call's renames and rmdirs), but
at once when none is ready, and never later than DEFER_MAX_S after the take. The
decision alone, with placeholder slots: making real ones is the integration tests'."""

from __future__ import annotations

import threading
import time

import pytest

from sandboxd.backends.nsjail.slots import SlotPool


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(SlotPool, "DEFER_MAX_S", 1.0)
    p = SlotPool(2)
    p._wanted.add("d1")
    return p


def next_in_thread(pool: SlotPool) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        with pool._cond:
            out["id"] = pool._next()
            out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_slot_is_made_at_once_when_no_call_runs(pool):
    pool._ready["d1"] = [object()]
    t, out = next_in_thread(pool)
    t.join(0.5)
    assert out.get("id") == "d1"


def test_a_slot_is_made_at_once_when_none_is_ready_even_while_a_call_runs(pool):
    pool._running["sbx-a"] = time.monotonic()
    t, out = next_in_thread(pool)
    t.join(0.5)
    assert out.get("id") == "d1"


def test_while_a_call_runs_and_a_slot_is_ready_the_refill_waits_for_its_end(pool):
    pool._ready["d1"] = [object()]
    pool._running["sbx-a"] = time.monotonic()
    t, out = next_in_thread(pool)
    t.join(0.2)
    assert "id" not in out  # deferred
    ended = time.monotonic()
    pool.done("sbx-a")
    t.join(0.5)
    assert out.get("id") == "d1" and out["at"] - ended < 0.3


def test_a_call_that_never_ends_defers_the_refill_at_most_defer_max_s(pool):
    pool._ready["d1"] = [object()]
    taken = pool._running["sbx-pool-member"] = time.monotonic()  # a pool's long-lived sandbox
    t, out = next_in_thread(pool)
    t.join(3)
    assert out.get("id") == "d1"
    assert 1.0 <= out["at"] - taken < 1.5
    assert pool._running == {}


def test_a_full_pool_makes_nothing_and_closing_ends_the_wait(pool):
    pool._ready["d1"] = [object(), object()]
    t, out = next_in_thread(pool)
    t.join(0.2)
    assert "id" not in out
    with pool._cond:
        pool._closed = True
        pool._cond.notify_all()
    t.join(0.5)
    assert out == {"id": None, "at": out["at"]}


def test_nsjails_host_errors_reach_callers_only_as_the_daemons():
    import subprocess

    from sandboxd.backends.cgroups import CgroupUnavailable
    from sandboxd.backends.nsjail.errors import host_step
    from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, InternalError

    with pytest.raises(InternalError, match="cannot start nsjail: .*No such file"):
        with host_step("start nsjail"):
            open("/nonexistent/sandboxd/nsjail")
    with pytest.raises(BackendUnavailable, match="cannot run nsjail: /bin/nsjail did not finish in 30 s"):
        with host_step("run nsjail", fault=BackendUnavailable):
            raise subprocess.TimeoutExpired(["/bin/nsjail", "-C"], 30)
    with pytest.raises(BackendUnavailable, match="cannot use the host's cgroups: no memory"):
        with host_step("use the host's cgroups", fault=BackendUnavailable):
            raise CgroupUnavailable("no memory")
    with pytest.raises(FailedPrecondition):  # the daemon's own pass as they are
        with host_step("prepare the jail"):
            raise FailedPrecondition("out of reach")
