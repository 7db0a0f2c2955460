"""Warm sandboxes and leases for real: commands in a leased sandbox are each a call of
their own (events, artifacts, timeout), nothing of one command's processes survives into
the next, a lease is its principal's alone, a released or expired lease's sandbox is
destroyed, and after a drain or a restart no sandbox remains."""

from __future__ import annotations

import hashlib
import json
import signal
import threading
import time

import pytest

from sandboxd.pools.supervisor import READY_TIMEOUT_S
from sandboxd_testing import TIME_SCALE
from sandboxd_client import errors
from sandboxd_contract.canonical import file_accesses

from .conftest import BACKENDS, BUSYBOX_IMAGE, call, leftover_sandboxes, nsjail_sandbox_ids, sh, wait_for
from .test_tenants import ALICE, BOB, client_as


@pytest.fixture
def pooled(spare_daemon):
    return spare_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, socket_mode=0o666,
                        pools={"min_idle": 1, "max_size": 2}).start()


def leased(ws, lease, argv, policy=None, adapter="docker"):
    c = call(ws, argv, policy)
    c["runtime"].update({"leaseId": lease.lease_id, "adapter": adapter})
    return c


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_commands_in_a_lease_are_calls_of_their_own_and_leave_nothing_running(pooled, adapter):
    d = pooled
    ws = d.new_workspace({"a.txt": "hello\n"})
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws), adapter=adapter)
        assert lease.lease_id.startswith("lease_") and lease.backend == adapter
        first = c.run(leased(ws, lease, sh("cat /workspace/a.txt; sleep 300 & echo $! > /tmp/bg; echo started"),
                             adapter=adapter))
        assert first.result.status == "success" and first.stdout == b"hello\nstarted\n"
        # The background sleep died with its command; the sandbox's tmp is the lease's.
        second = c.run(leased(ws, lease, sh("kill -0 $(cat /tmp/bg) 2>/dev/null && echo alive || echo gone; "
                                             "ls /proc | grep -c '^[0-9]'"), adapter=adapter))
        lines = second.stdout.decode().split()
        assert lines[0] == "gone", second.stdout
        # init, the supervisor, the shell and ls (or its grep): nothing left over.
        assert int(lines[1]) <= 5, second.stdout
        for out in (first, second):
            types = [e.type for e in c.get_trace(out.tool_call_id)]
            assert types[:5] == ["ToolCallRequested", "ToolArgsValidated", "ToolPolicyChecked", "ToolSandboxPrepared",
                                 "ToolCallStarted"]
            assert c.list_artifacts(out.tool_call_id)
        # Its own timeout, and the lease still works afterwards.
        slow = c.run(leased(ws, lease, ["sleep", "30"], {"process": {"timeoutMs": 300}}, adapter=adapter))
        assert slow.result.timed_out and slow.result.status == "error"
        # A command that never stops writing still ends at its timeout (the wait that
        # serves its pipes is never kept busy past it). Scaled: in the emulated guest,
        # 300 ms went by before `yes` had written anything.
        flood = c.run(leased(ws, lease, ["yes"], {"process": {"timeoutMs": int(500 * TIME_SCALE),
                                                               "maxStdoutBytes": 65536}}, adapter=adapter))
        assert flood.result.timed_out and flood.result.stdout_truncated, (flood.result, len(flood.stdout))
        assert c.run(leased(ws, lease, ["echo", "still here"], adapter=adapter)).stdout == b"still here\n"
        c.release_sandbox(lease.lease_id)
        with pytest.raises(errors.NotFound):
            c.run(leased(ws, lease, ["true"], adapter=adapter))


def test_a_new_lease_gets_a_fresh_sandbox(pooled):
    d = pooled
    ws = d.new_workspace()
    with d.client() as c:
        one = c.acquire_sandbox(str(ws))
        c.run(leased(ws, one, sh("echo secret-state > /tmp/left-behind")))
        c.release_sandbox(one.lease_id)
        # (The released sandbox counts against the pool's maximum until it is removed.)
        two = c.acquire_sandbox(str(ws), wait_ms=20_000)
        assert two.sandbox_id != one.sandbox_id
        out = c.run(leased(ws, two, sh("cat /tmp/left-behind 2>/dev/null || echo clean")))
        assert out.stdout == b"clean\n"
        c.release_sandbox(two.lease_id)


def test_a_lease_is_its_principals_alone(pooled):
    d = pooled
    ws = d.new_workspace(uid=ALICE)
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        lease = alice.acquire_sandbox(str(ws))
        with pytest.raises(errors.PermissionDenied) as refused:  # her workspace, checked before any lease
            bob.run(leased(ws, lease, ["true"]))
        assert "workspace" in refused.value.message and lease.lease_id not in refused.value.message
        with pytest.raises(errors.NotFound):
            bob.release_sandbox(lease.lease_id)
        assert alice.run(leased(ws, lease, ["true"])).result.status == "success"
        alice.release_sandbox(lease.lease_id)
        # The lease is on the log under its id: who held which sandbox, and how it ended.
        trace = alice.get_trace(lease.lease_id)
        assert [e.type for e in trace] == ["SandboxLeased", "SandboxLeaseEnded"]
        assert '"principal":"alice"' in trace[0].payload_json and lease.sandbox_id in trace[0].payload_json
        assert '"reason":"released"' in trace[1].payload_json
        with pytest.raises(errors.NotFound):
            bob.get_trace(lease.lease_id)


def test_a_call_must_match_the_lease_sandbox_policy(pooled):
    d = pooled
    ws = d.new_workspace()
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws), {"filesystem": {"writeRoots": ["/workspace"]}})
        with pytest.raises(errors.FailedPrecondition) as exc:
            c.run(leased(ws, lease, ["true"]))  # read-only policy: another sandbox
        assert "runtime.leaseId" in exc.value.message
        ok = c.run(leased(ws, lease, sh("echo x > /workspace/out.txt"), {"filesystem": {"writeRoots": ["/workspace"]},
                                                                         "process": {"timeoutMs": 5000}}))
        assert ok.result.status == "success" and (ws / "out.txt").read_text() == "x\n"
        c.release_sandbox(lease.lease_id)


def test_the_pool_never_exceeds_its_maximum_and_waiters_get_released_sandboxes(pooled):
    d = pooled
    ws = d.new_workspace()
    with d.client() as c:
        held = [c.acquire_sandbox(str(ws)) for _ in range(2)]
        with pytest.raises(errors.ResourceExhausted):
            c.acquire_sandbox(str(ws))
        threading.Timer(0.5, c.release_sandbox, args=(held[0].lease_id,)).start()
        waited = c.acquire_sandbox(str(ws), wait_ms=20_000)
        assert waited.lease_id not in {h.lease_id for h in held}
        [status] = c.list_pools()
        assert status.leased == 2 and status.idle + status.leased <= 2
        for lease in (held[1], waited):
            c.release_sandbox(lease.lease_id)


def containers_throughout(docker_engine, d, action):
    """`action()`'s value, and how many of `d`'s containers there were at each moment
    while it ran (a count only at the end misses a moment over the maximum)."""
    counts, done = [], threading.Event()

    def count():  # the low-level list: no inspect per container
        while not done.is_set():
            counts.append(len(docker_engine.api.containers(
                all=True, filters={"label": f"sandboxd.daemon_id={d.daemon_id}"})))

    counter = threading.Thread(target=count)
    counter.start()
    try:
        return action(), counts
    finally:
        done.set()
        counter.join()


def test_a_pool_made_again_after_a_drain_counts_the_drained_ones_until_they_are_gone(pooled, docker_engine):
    d = pooled  # at most 2 sandboxes
    ws = d.new_workspace()
    with d.client() as c:
        held = [c.acquire_sandbox(str(ws)) for _ in range(2)]

        def drain_and_acquire():  # both leases end; their removal runs on threads, from now
            assert c.drain_pools(held[0].pool_key) == 2
            return [c.acquire_sandbox(str(ws), wait_ms=20_000) for _ in range(2)]

        again, counts = containers_throughout(docker_engine, d, drain_and_acquire)
        # The new pool under the same key made them only once the drained ones were gone.
        assert len(counts) > 5 and max(counts) <= 2, counts
        for old in held:
            assert not docker_engine.api.containers(all=True, filters={"label": f"sandboxd.sandbox_id={old.sandbox_id}"})
        for lease in again:
            c.release_sandbox(lease.lease_id)


def test_a_sandbox_busy_at_a_drain_counts_against_a_pool_made_again_until_it_is_gone(pooled, docker_engine):
    """A drained lease's command runs to its end, and its sandbox goes after it: until
    then it still counts against the pool's maximum, for a pool made again too."""
    d = pooled  # at most 2 sandboxes
    ws = d.new_workspace()
    with d.client() as c:
        held = [c.acquire_sandbox(str(ws)) for _ in range(2)]
        busy: dict = {}
        command = threading.Thread(target=lambda: busy.update(out=c.run(leased(
            ws, held[0], sh("echo up; sleep 3"), {"process": {"timeoutMs": 20_000}}))))
        command.start()
        [container] = docker_engine.api.containers(filters={"label": f"sandboxd.sandbox_id={held[0].sandbox_id}"})
        assert wait_for(lambda: any("sleep 3" in " ".join(p) for p in docker_engine.api.top(container["Id"])["Processes"]),
                        10)

        def drain_and_acquire():
            assert c.drain_pools(held[0].pool_key) == 2
            return [c.acquire_sandbox(str(ws), wait_ms=30_000) for _ in range(2)]

        again, counts = containers_throughout(docker_engine, d, drain_and_acquire)
        command.join(30)
        assert busy["out"].result.status == "success"  # the drain let it finish
        assert len(counts) > 5 and max(counts) <= 2, counts
        for lease in again:
            c.release_sandbox(lease.lease_id)


def test_a_caller_waiting_on_a_drained_pool_is_told_to_acquire_again(pooled, docker_engine):
    """A caller waiting at the pool's maximum when the pool is drained gets ABORTED
    (retryable), not a sandbox made in a pool being emptied; acquiring again takes the
    pool made again under that key."""
    d = pooled  # at most 2 sandboxes
    ws = d.new_workspace()
    with d.client() as c:
        held = [c.acquire_sandbox(str(ws)) for _ in range(2)]
        outcome: dict = {}

        def wait_for_one():
            try:
                outcome["lease"] = c.acquire_sandbox(str(ws), wait_ms=20_000)
            except errors.SandboxdClientError as exc:
                outcome["error"] = exc

        waiter = threading.Thread(target=wait_for_one)
        waiter.start()
        time.sleep(0.5)  # it waits at the maximum
        assert "lease" not in outcome and "error" not in outcome
        assert c.drain_pools(held[0].pool_key) == 2
        waiter.join(20)
        assert isinstance(outcome.get("error"), errors.Aborted), outcome
        again = c.acquire_sandbox(str(ws), wait_ms=20_000)
        assert again.sandbox_id not in {h.sandbox_id for h in held}
        c.release_sandbox(again.lease_id)


def test_a_released_sandbox_counts_against_the_maximum_until_it_is_gone(pooled, docker_engine):
    d = pooled  # at most 2 sandboxes
    ws = d.new_workspace()
    with d.client() as c:
        held = [c.acquire_sandbox(str(ws)) for _ in range(2)]

        def release_and_acquire():  # removed on a thread, from now
            c.release_sandbox(held[0].lease_id)
            return c.acquire_sandbox(str(ws), wait_ms=20_000)

        waited, counts = containers_throughout(docker_engine, d, release_and_acquire)
        # Made only once the released one was gone: never three containers at once.
        assert len(counts) > 3 and max(counts) <= 2, counts
        assert not docker_engine.api.containers(all=True, filters={"label": f"sandboxd.sandbox_id={held[0].sandbox_id}"})
        for lease in (held[1], waited):
            c.release_sandbox(lease.lease_id)


def test_an_expired_lease_is_reclaimed(pooled, docker_engine):
    d = pooled
    ws = d.new_workspace()
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws), lease_ms=500)
        gone = wait_for(lambda: not docker_engine.api.containers(
            filters={"label": f"sandboxd.sandbox_id={lease.sandbox_id}"}), timeout_s=15)
        assert gone
        with pytest.raises(errors.NotFound):
            c.run(leased(ws, lease, ["true"]))


def test_drain_and_restart_leave_no_sandbox(spare_daemon, docker_engine):
    d = spare_daemon(pools={"min_idle": 2, "max_size": 3}).start()
    ws = d.new_workspace()
    with d.client() as c:
        c.acquire_sandbox(str(ws))
        assert wait_for(lambda: c.list_pools() and c.list_pools()[0].idle == 2, timeout_s=20)
        assert c.drain_pools() == 3
    assert wait_for(lambda: not leftover_sandboxes(docker_engine, d), timeout_s=20)
    with d.client() as c:
        held = c.acquire_sandbox(str(ws))
        assert leftover_sandboxes(docker_engine, d)
    # A crash leaves them behind; the restarted daemon removes them by label.
    d.stop(signal.SIGKILL)
    assert leftover_sandboxes(docker_engine, d)
    d.start()
    assert wait_for(lambda: not _leased_containers(docker_engine, d), timeout_s=20)
    with d.client() as c:  # and the lease the killed run held ends on the record
        trace = c.get_trace(held.lease_id)
        assert [e.type for e in trace] == ["SandboxLeased", "SandboxLeaseEnded"]
        assert '"reason":"daemon-restarted"' in trace[1].payload_json
        assert c.verify_log().ok
    d.stop()
    assert not leftover_sandboxes(docker_engine, d)


def _leased_containers(docker_engine, d) -> list:
    """Containers of the earlier run: the new run's own warm sandboxes do not count."""
    return [c for c in docker_engine.api.containers(all=True, filters={"label": f"sandboxd.daemon_id={d.daemon_id}"})
            if c["Labels"].get("sandboxd.tool_call_id", "").startswith("pool:")
            and c["Created"] < d.started_at]


def test_sandboxctl_pool_and_exec_with_a_lease(pooled):
    from .test_cli import ctl

    d = pooled
    ws = d.new_workspace()
    lease_id = ctl(d, "pool", "acquire", "--workspace", str(ws)).stdout.decode().strip()
    assert lease_id.startswith("lease_")
    p = ctl(d, "exec", "--lease", lease_id, "--workspace", str(ws), "--", "sh", "-c", "echo warm; exit 3")
    assert (p.returncode, p.stdout) == (3, b"warm\n")
    table = ctl(d, "pool", "ls").stdout.decode().splitlines()
    assert table[0].split()[:4] == ["POOL", "BACKEND", "IDLE", "LEASED"] and "docker" in table[1]
    assert ctl(d, "pool", "release", lease_id).returncode == 0
    assert ctl(d, "exec", "--lease", lease_id, "--workspace", str(ws), "--", "true").returncode == 125
    assert b"destroyed" in ctl(d, "pool", "drain").stdout


def test_a_created_pool_is_warm_before_its_first_lease(pooled):
    from .test_cli import ctl

    d = pooled
    ws = d.new_workspace()
    key = ctl(d, "pool", "create", "--workspace", str(ws), "--adapter", "nsjail").stdout.decode().strip()
    assert key.startswith("pool-")
    with d.client() as c:
        assert wait_for(lambda: [p.idle for p in c.list_pools() if p.pool_key == key] == [1], timeout_s=20)
        warm = {s for s in nsjail_sandbox_ids(d.daemon_id) if s.startswith("sbx-")}
        lease = c.acquire_sandbox(str(ws), adapter="nsjail")
        # The lease got the sandbox that was already warm, not a new one.
        assert lease.pool_key == key and lease.sandbox_id in warm
        c.release_sandbox(lease.lease_id)


def test_a_principal_past_its_lease_quota_is_refused_without_hurting_others(spare_daemon):
    d = spare_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, socket_mode=0o666,
                     pools={"min_idle": 0, "max_size": 4}, quotas={"leases": 1}).start()
    alice_ws, bob_ws = d.new_workspace(uid=ALICE), d.new_workspace(uid=BOB)
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        held = alice.acquire_sandbox(str(alice_ws))
        with pytest.raises(errors.ResourceExhausted) as exc:
            alice.acquire_sandbox(str(alice_ws))
        assert "alice" in exc.value.message and "quota" in exc.value.message
        theirs = bob.acquire_sandbox(str(bob_ws))
        assert bob.run(leased(bob_ws, theirs, ["true"])).result.status == "success"
        for c, lease in ((alice, held), (bob, theirs)):
            c.release_sandbox(lease.lease_id)



def test_concurrent_acquires_never_take_more_than_the_lease_quota(spare_daemon):
    d = spare_daemon(pools={"min_idle": 0, "max_size": 4}, quotas={"leases": 1}).start()
    ws = d.new_workspace()
    outcomes: list = []

    def acquire():
        with d.client() as c:
            try:
                outcomes.append(c.acquire_sandbox(str(ws)))
            except errors.ResourceExhausted as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=acquire) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    granted = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(granted) == 1 and len(outcomes) == 4, outcomes
    with d.client() as c:
        c.release_sandbox(granted[0].lease_id)


def test_pools_are_capped_per_principal_and_retire_when_unused(spare_daemon, docker_engine):
    d = spare_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, socket_mode=0o666,
                     pools={"min_idle": 1, "max_size": 2, "idle_ttl_s": 3}, quotas={"pools": 1}).start()
    first, second = d.new_workspace(uid=ALICE), d.new_workspace(uid=ALICE)
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        key = alice.create_pool(str(first), adapter="nsjail").pool_key
        assert alice.create_pool(str(first), adapter="nsjail").pool_key == key  # the same pool again
        for attempt in (lambda: alice.create_pool(str(second), adapter="nsjail"),
                        lambda: alice.acquire_sandbox(str(second), adapter="nsjail")):
            with pytest.raises(errors.ResourceExhausted) as exc:
                attempt()
            assert "alice has 1 pools, its quota" in exc.value.message
        # Another principal is not held to alice's count.
        bob_key = bob.create_pool(str(d.new_workspace(uid=BOB)), adapter="nsjail").pool_key
        # Each sees its own pools; an admin sees all.
        assert [p.pool_key for p in alice.list_pools()] == [key]
        assert [p.pool_key for p in bob.list_pools()] == [bob_key]
        with d.client() as admin:
            assert wait_for(lambda: {p.pool_key: p.idle for p in admin.list_pools()} == {key: 1, bob_key: 1},
                            timeout_s=20)
            # Unused for its idle TTL, a pool stops refilling and goes, sandboxes and all.
            assert wait_for(lambda: admin.list_pools() == [], timeout_s=20)
        assert wait_for(lambda: not [s for s in nsjail_sandbox_ids(d.daemon_id) if s.startswith("sbx-")], timeout_s=20)
        # Its slot is free again.
        assert alice.create_pool(str(second), adapter="nsjail").pool_key != key



def test_the_daemon_keeps_at_most_max_pools(spare_daemon):
    d = spare_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, socket_mode=0o666,
                     pools={"min_idle": 0, "max_size": 2, "max_pools": 1}).start()
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        alice.create_pool(str(d.new_workspace(uid=ALICE)), adapter="nsjail")
        with pytest.raises(errors.ResourceExhausted) as exc:
            bob.acquire_sandbox(str(d.new_workspace(uid=BOB)), adapter="nsjail")
        assert "its maximum of 1 pools" in exc.value.message
        with d.client() as admin:
            assert admin.drain_pools() == 0  # nothing warm (min_idle 0): the pool just goes
        lease = bob.acquire_sandbox(str(d.new_workspace(uid=BOB)), adapter="nsjail")
        bob.release_sandbox(lease.lease_id)


def test_a_graceful_stop_leaves_no_warm_sandbox_on_either_backend(spare_daemon, docker_engine):
    d = spare_daemon(pools={"min_idle": 2, "max_size": 3}).start()
    ws = d.new_workspace()
    with d.client() as c:
        for adapter in ("docker", "nsjail"):
            c.acquire_sandbox(str(ws), adapter=adapter)
        # Refills are under way (min_idle 2) while the daemon stops.
        wait_for(lambda: sum(p.idle for p in c.list_pools()) >= 1, timeout_s=20)
    d.stop()
    assert not leftover_sandboxes(docker_engine, d)


def test_pool_metrics_on_the_prometheus_endpoint(spare_daemon):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = spare_daemon(pools={"min_idle": 1, "max_size": 2}, metrics_address=f"127.0.0.1:{port}").start()
    ws = d.new_workspace()
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws))
        c.run(leased(ws, lease, ["true"]))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        c.release_sandbox(lease.lease_id)
    assert f'sandboxd_pool_leased_sandboxes{{pool="{lease.pool_key}",backend="docker"}} 1' in text
    assert 'sandboxd_pool_created_total{pool="' in text and "sandboxd_calls_running 0" in text
    assert "sandboxd_calls_expired_total 0" in text  # no retention period: nothing expires
    lag = [line for line in text.splitlines() if line.startswith("sandboxd_audit_index_lag_events ")]
    assert len(lag) == 1 and int(lag[0].split()[1]) >= 0
    assert "sandboxd_pool_acquire_seconds_count 1" in text
    assert str(ws) not in text  # pools are named by key: no workspace paths leave this way


def test_a_crashed_warm_sandbox_is_replaced(spare_daemon, docker_engine):
    d = spare_daemon(pools={"min_idle": 1, "max_size": 3}).start()
    ws = d.new_workspace()
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws))
        assert wait_for(lambda: c.list_pools()[0].idle == 1, timeout_s=20)
        [pool] = c.list_pools()
        idle = [x for x in docker_engine.api.containers(filters={"label": f"sandboxd.daemon_id={d.daemon_id}"})
                if x["Labels"]["sandboxd.sandbox_id"] != lease.sandbox_id]
        assert len(idle) == 1
        docker_engine.api.kill(idle[0]["Id"])  # the idle sandbox dies under the pool
        assert wait_for(lambda: c.list_pools()[0].destroyed >= pool.destroyed + 1 and c.list_pools()[0].idle == 1,
                        timeout_s=20)
        # The leased one crashes too: the lease says so, and a new lease works.
        docker_engine.api.kill([x for x in docker_engine.api.containers(
            filters={"label": f"sandboxd.sandbox_id={lease.sandbox_id}"})][0]["Id"])
        broken = c.run(leased(ws, lease, ["true"]))
        assert broken.result.status == "error" and "supervisor" in broken.result.error.message
        with pytest.raises(errors.FailedPrecondition) as exc:
            c.run(leased(ws, lease, ["true"]))
        assert "is gone" in exc.value.message
        c.release_sandbox(lease.lease_id)
        fresh = c.acquire_sandbox(str(ws))
        assert c.run(leased(ws, fresh, ["echo", "ok"])).stdout == b"ok\n"
        c.release_sandbox(fresh.lease_id)


@pytest.mark.parametrize("adapter", BACKENDS)
def test_a_warm_sandbox_that_cannot_start_is_refused_at_once_with_its_reason(spare_daemon, docker_engine, adapter):
    # One pid: the sandbox's init cannot fork its supervisor. The acquire says so when
    # the sandbox ends, not after the supervisor's whole wait, and leaves nothing behind.
    d = spare_daemon(pools={"min_idle": 0, "max_size": 2}).start()
    ws = d.new_workspace()
    with d.client() as c:
        begun = time.monotonic()
        with pytest.raises(errors.Internal) as exc:
            c.acquire_sandbox(str(ws), {"process": {"maxPids": 1}}, adapter=adapter)
        assert time.monotonic() - begun < READY_TIMEOUT_S / 2
        # tini's fork (or, on nsjail, nsjail's own clone: it counts in the cgroup too) hit the
        # limit. Rarely (once in hundreds here), dockerd loses the race with a container that
        # ends at once and answers its start with an error of its own (docker/for-linux#647):
        # still refused at once, with the engine's reason.
        assert "temporarily unavailable" in exc.value.message or (
            adapter == "docker" and "cannot start an already running container" in exc.value.message), \
            exc.value.message
        assert wait_for(lambda: not leftover_sandboxes(docker_engine, d), timeout_s=20)
        # The pool is usable with a policy that lets the sandbox start.
        lease = c.acquire_sandbox(str(ws), adapter=adapter)
        assert c.run(leased(ws, lease, ["echo", "ok"], adapter=adapter)).stdout == b"ok\n"
        c.release_sandbox(lease.lease_id)


def test_a_lease_that_expires_mid_command_ends_after_the_command(pooled, docker_engine):
    d = pooled
    ws = d.new_workspace()
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws), lease_ms=1000)
        out = c.run(leased(ws, lease, sh("sleep 2; echo finished"), {"process": {"timeoutMs": 10_000}}))
        # The command ran to its end (its own timeout governs it), then the sandbox went.
        assert out.result.status == "success" and out.stdout == b"finished\n"
        assert wait_for(lambda: not docker_engine.api.containers(
            filters={"label": f"sandboxd.sandbox_id={lease.sandbox_id}"}), timeout_s=15)
        with pytest.raises(errors.NotFound):
            c.run(leased(ws, lease, ["true"]))


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_a_command_cannot_reach_or_impersonate_its_supervisor(pooled, adapter):
    """The supervisor's channel was accepted once, before any command ran: a command
    cannot connect a second one, cannot take the supervisor's descriptors, and whatever
    it tries, the next command still runs under the real supervisor."""
    d = pooled
    ws = d.new_workspace()
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws), adapter=adapter)
        out = c.run(leased(ws, lease, ["python3", "-c", """
import os, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.connect("/dev/sandboxd/control.sock"); print("connected")
except OSError as e:
    print("connect", type(e).__name__)
def comm(p):
    try:
        return open(f"/proc/{p}/comm").read().strip()
    except OSError:
        return ""
sup = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != 1 and comm(p) == "shim"]
print("supervisors", len(sup))
for pid in sup:
    try:
        print("fds", os.listdir(f"/proc/{pid}/fd"))
    except OSError as e:
        print("fds", type(e).__name__)
    try:
        os.unlink("/dev/sandboxd/control.sock"); print("unlinked")
    except OSError as e:
        print("unlink", type(e).__name__)
"""], adapter=adapter))
        lines = out.stdout.decode().split("\n")
        assert lines[0] == "connect ConnectionRefusedError", (out.stdout, out.stderr)
        # Docker's /proc shows the supervisor but not its descriptors; nsjail's (hidepid)
        # does not even show it.
        assert lines[1] in ("supervisors 1", "supervisors 0"), out.stdout
        if lines[1] == "supervisors 1":
            assert lines[2] == "fds PermissionError", out.stdout
            assert lines[3].startswith("unlink ") and lines[3] != "unlinked"
        after = c.run(leased(ws, lease, ["echo", "real supervisor"], adapter=adapter))
        assert after.stdout == b"real supervisor\n" and after.result.exit_code == 0
        c.release_sandbox(lease.lease_id)


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_a_process_hidden_from_the_supervisor_never_reaches_the_next_command(pooled, adapter):
    import os as _os

    d = pooled
    ws = d.new_workspace()
    marker = f"hide-and-seek-{adapter}"
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws), adapter=adapter)
        c.run(leased(ws, lease, ["python3", "-c", f"""
import ctypes, os, time, sys
if os.fork() == 0:
    os.setsid()
    # Its output elsewhere: what is tested is the next command, not this one's end.
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: invisible under hidepid
    sys.argv[0] = "{marker}"
    time.sleep(60)
"""], adapter=adapter))

        def sleeper_alive() -> bool:
            for pid in filter(str.isdigit, _os.listdir("/proc")):
                try:
                    if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                        return True
                except OSError:
                    pass
            return False

        try:
            after = c.run(leased(ws, lease, ["true"], adapter=adapter))
            # Ran: then the leftover was killed first (by the supervisor, or by the daemon
            # from the sandbox's cgroup when the supervisor could not see it).
            assert after.result.status == "success" and not sleeper_alive()
        except errors.FailedPrecondition as exc:
            # Or the sandbox was retired because the leftover survived its scan.
            assert "is gone" in exc.message
        c.release_sandbox(lease.lease_id)


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_each_leased_command_records_its_own_file_accesses(pooled, adapter):
    ws = pooled.new_workspace({"a.txt": "a\n", "b.txt": "b\n"})
    policy = {"filesystem": {"writeRoots": ["/workspace"]}}
    with pooled.client() as c:
        lease = c.acquire_sandbox(str(ws), policy, adapter=adapter)
        first = c.run(leased(ws, lease, sh("cat /workspace/a.txt; echo one > /workspace/out.txt"), policy, adapter))
        second = c.run(leased(ws, lease, sh("cat /workspace/b.txt; rm /workspace/out.txt"), policy, adapter))
        quiet = c.run(leased(ws, lease, ["cat", "/workspace/a.txt"], {**policy, "audit": {"recordFileAccess": False}},
                             adapter))
        # The sandbox's watch stayed on through the quiet command: none of it is this one's.
        fourth = c.run(leased(ws, lease, ["cat", "/workspace/b.txt"], policy, adapter))
        c.release_sandbox(lease.lease_id)

        def recorded(out):
            return [a for e in c.get_trace(out.tool_call_id) if e.type == "FileAccessObserved"
                    for a in file_accesses(json.loads(e.payload_json))]

        assert first.result.status == second.result.status == "success", (first.stderr, second.stderr)
        assert list(first.result.effects_observed.reads) == ["/workspace/a.txt"]
        assert list(first.result.effects_observed.writes) == ["/workspace/out.txt"]
        assert list(second.result.effects_observed.reads) == ["/workspace/b.txt"]
        assert list(second.result.effects_observed.deletes) == ["/workspace/out.txt"]
        one = "sha256:" + hashlib.sha256(b"one\n").hexdigest()
        assert {"path": "/workspace/out.txt", "operation": "delete", "sha256Before": one} in recorded(second)
        assert recorded(quiet) == [] and list(quiet.result.effects_observed.reads) == []
        assert [(a["path"], a["operation"]) for a in recorded(fourth)] == [("/workspace/b.txt", "read")]


def test_a_lease_records_the_image_its_sandbox_was_made_from_after_a_retag(pooled, docker_engine):
    # A pool keeps making sandboxes from a tag; when the tag moves, the sandboxes made
    # after it run the new image, and their leases' records must say so (not the digest
    # the pool was first made with).
    tag = "sandboxd/retag-test:latest"
    default = docker_engine.images.get("sandboxd/default:latest")
    busybox = docker_engine.images.get(BUSYBOX_IMAGE)
    default.tag(tag)
    d = pooled
    ws = d.new_workspace()

    def warm(c) -> bool:
        return any(p.idle >= 1 for p in c.list_pools())

    def recorded_digest(c, lease) -> str:
        event = next(e for e in c.get_trace(lease.lease_id) if e.type == "SandboxLeased")
        return json.loads(event.payload_json)["imageDigest"]

    try:
        with d.client() as c:
            first = c.acquire_sandbox(str(ws), image=tag)
            assert wait_for(lambda: warm(c), 60)  # a second sandbox, made before the retag
            busybox.tag(tag)
            c.release_sandbox(first.lease_id)
            second = c.acquire_sandbox(str(ws), image=tag)  # the warm one: still the old image
            c.release_sandbox(second.lease_id)
            assert wait_for(lambda: warm(c), 60)  # made after the retag
            third = c.acquire_sandbox(str(ws), image=tag)
            command = leased(ws, third, sh("test -d /usr/lib/python3* && echo debian || echo busybox"))
            command["runtime"]["image"] = tag
            ran = c.run(command)
            c.release_sandbox(third.lease_id)
            assert [recorded_digest(c, lease) for lease in (first, second, third)] == [default.id, default.id,
                                                                                        busybox.id]
            assert ran.stdout == b"busybox\n"
            policy_checked = next(e for e in c.get_trace(ran.tool_call_id) if e.type == "ToolPolicyChecked")
            assert json.loads(policy_checked.payload_json)["imageDigest"] == busybox.id
    finally:
        docker_engine.images.remove(tag, noprune=True)


def test_an_idle_warm_container_killed_outside_the_daemon_is_replaced(pooled, docker_engine):
    """An idle sandbox can end without its supervisor's connection saying so (dockerd
    killed or restarted around it): the upkeep asks the engine, removes it and refills."""
    d = pooled
    ws = d.new_workspace()
    with d.client() as c:
        c.release_sandbox(c.acquire_sandbox(str(ws)).lease_id)
        assert wait_for(lambda: c.list_pools() and c.list_pools()[0].idle == 1, timeout_s=30)
        idle = [x for x in docker_engine.api.containers(filters={"label": f"sandboxd.daemon_id={d.daemon_id}"})]
        assert len(idle) == 1
        docker_engine.api.kill(idle[0]["Id"])
        gone = lambda: not [x for x in docker_engine.api.containers(  # noqa: E731
            all=True, filters={"label": f"sandboxd.daemon_id={d.daemon_id}"}) if x["Id"] == idle[0]["Id"]]
        assert wait_for(gone, timeout_s=20), "the dead warm sandbox was never removed"
        assert wait_for(lambda: c.list_pools()[0].idle == 1, timeout_s=30)
        lease = c.acquire_sandbox(str(ws))
        assert c.run(leased(ws, lease, ["true"])).result.status == "success"


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_an_oom_kill_in_a_leased_command_leaves_the_lease_usable(pooled, adapter):
    # A call's sandbox ends whole at an OOM kill (backends/oom_guard.py); a lease's
    # sandbox outlives one command's, with what it keeps in /tmp.
    d = pooled
    ws = d.new_workspace({})
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws), adapter=adapter)
        assert c.run(leased(ws, lease, sh("echo kept > /tmp/state"), adapter=adapter)).result.status == "success"
        bomb = sh("python3 -c 'a = []\nwhile True: a.append(bytearray(8 << 20))'")
        killed = c.run(leased(ws, lease, bomb, adapter=adapter)).result
        # The command's OOM kill is its own, not one from an earlier command in the sandbox.
        assert killed.oom_killed and killed.status == "error" and killed.error.code == "OOM_KILLED", killed
        quiet = c.run(leased(ws, lease, ["true"], adapter=adapter)).result
        assert quiet.status == "success" and not quiet.oom_killed, quiet
        after = c.run(leased(ws, lease, ["cat", "/tmp/state"], adapter=adapter))
        assert after.result.status == "success" and after.stdout == b"kept\n", after.result
        c.release_sandbox(lease.lease_id)


def test_a_writable_pool_keeps_no_idle_sandbox_holding_the_workspace(pooled):
    # Writers run alone on a workspace: an idle warm sandbox that may write it would
    # refuse every other call on it (ABORTED) until its idle TTL.
    d = pooled
    ws = d.new_workspace({"a.txt": "x\n"})
    writable = {"filesystem": {"writeRoots": ["/workspace"]}}
    with d.client() as c:
        lease = c.acquire_sandbox(str(ws), writable)
        assert c.run(leased(ws, lease, ["touch", "/workspace/b"], writable)).result.status == "success"
        c.release_sandbox(lease.lease_id)
        wait_for(lambda: not any(p.leased or p.idle for p in c.list_pools()), timeout_s=30)
        time.sleep(1.5)  # a refill would have begun by now (the pools' loop runs every second)
        assert not any(p.idle for p in c.list_pools())
        fresh = c.run(call(ws, ["cat", "/workspace/a.txt"]))
        assert fresh.result.status == "success" and fresh.stdout == b"x\n", fresh.result
        again = c.acquire_sandbox(str(ws), writable)  # made at acquire instead
        assert c.run(leased(ws, again, ["ls", "/workspace/b"], writable)).result.status == "success"
        c.release_sandbox(again.lease_id)
