"""Pure parts of pools/: how a pool is keyed, how a sandbox's leftover processes
are found on either cgroup layout, and how long a new sandbox's supervisor is waited for."""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sandboxd.core.errors import Aborted, SandboxdError
from sandboxd.core.metrics import Histogram
from sandboxd.core.settings import DaemonSettings, PoolSettings
from sandboxd.ledger import events as ev
from sandboxd.policy.models import canonical_json
from sandboxd.policy.preflight import HostPlan
from sandboxd.pools import supervisor
from sandboxd.pools.builder import WarmSandboxBuilder
from sandboxd.pools.metrics import render_pool_metrics
from sandboxd.pools.template import BuiltSandbox, template_key
from sandboxd.pools.warm import (Lease, Pool, WarmSandbox, lease_seconds, leases_held, removed, retire, sweep_idle,
                                 unused, wants_refill)
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.sandbox.spec import Attachments
from sandboxd.secrets.broker import ResolvedSecret
from sandboxd.sandbox.protocol import ExitStatus
from sandboxd.sandbox.protocol import SandboxHandle
from sandboxd.core.errors import InternalError
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.pools.leftovers import sandbox_processes, sandbox_task_count
from sandboxd.pools.template import PER_COMMAND, policy_class, pool_key
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
    spec = SimpleNamespace(cgroup_dir="sandboxd/sbx-1")
    assert sandbox_processes(spec, str(tmp_path)) == {10, 11, 12}


def test_leftovers_are_read_from_the_unified_hierarchy_on_a_v2_host(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    _tree(tmp_path, "sandboxd/sbx-2", {"": [], "abc": [20], "abc/x/y": [21, 22]})
    assert sandbox_processes(SimpleNamespace(cgroup="sandboxd/sbx-2"), str(tmp_path)) == {20, 21, 22}


def test_the_task_count_is_the_subtree_s_pids_current(tmp_path):
    _tree(tmp_path / "pids", "sandboxd/sbx-3", {"": [], "docker-abc": [30, 31]})
    (tmp_path / "pids" / "sandboxd" / "sbx-3" / "pids.current").write_text("2\n")
    spec = SimpleNamespace(cgroup_dir="sandboxd/sbx-3")
    assert sandbox_task_count(spec, str(tmp_path)) == 2
    assert sandbox_task_count(SimpleNamespace(cgroup_dir="sandboxd/gone"), str(tmp_path)) is None
    assert sandbox_task_count(SimpleNamespace(), str(tmp_path)) is None


def test_leftovers_are_unknown_without_a_cgroup(tmp_path):
    assert sandbox_processes(SimpleNamespace(cgroup_dir="nope"), str(tmp_path)) is None
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
    monkeypatch.setattr(supervisor, "READY_TIMEOUT_S", 0.3)
    listener, handle, spool = _waiting(tmp_path)
    begun = time.monotonic()
    with pytest.raises(InternalError, match=r"sbx-ready did not call in within 0 s: .*still starting"):
        supervisor.await_supervisor(listener, _Sandbox(None), handle, spool)
    assert 0.3 <= time.monotonic() - begun < 2


def test_a_sandbox_that_ends_first_is_reported_at_once_not_at_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "READY_TIMEOUT_S", 30.0)
    listener, handle, spool = _waiting(tmp_path)
    begun = time.monotonic()
    with pytest.raises(InternalError, match=r"sbx-ready ended before its supervisor called in \(exit code 3\)"):
        supervisor.await_supervisor(listener, _Sandbox(0.2), handle, spool)
    assert time.monotonic() - begun < 2


def test_a_supervisor_that_calls_in_is_taken(tmp_path):
    listener, handle, spool = _waiting(tmp_path)
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    caller.connect(str(tmp_path / "control.sock"))
    conn = supervisor.await_supervisor(listener, _Sandbox(None), handle, spool)
    caller.sendall(b"R")
    assert conn.recv(16) == b"R"


# -- a pool's accounting ---------------------------------------------------------------

def _warm(sandbox_id="sbx-1", *, idle_since=0.0, dead=False):
    built = BuiltSandbox(sandbox_id, _policy(), HostPlan("/srv/ws", 1000, 1000, (), ()), "img", "sha256:abc",
                         SimpleNamespace(name="docker"), None, Attachments())
    return WarmSandbox(sandbox_id, "pool-k", built, SandboxHandle(sandbox_id, "engine", None), None, None,
                       idle_since=idle_since, dead=dead)


def _pool(**counts):
    template = SimpleNamespace(plan=HostPlan("/srv/ws", 1000, 1000, (), ()), image="img",
                               backend=SimpleNamespace(name="docker"), policy=_policy(), secrets=())
    return Pool("pool-k", template, last_used=0.0, **counts)


def test_a_retired_sandbox_counts_once_until_it_is_removed():
    pool, ws = _pool(), _warm()
    pool.idle.append(ws)
    pool.idle.remove(ws)
    retire(pool, ws)
    retire(pool, ws)  # its lease ended, then its command: still one removal
    assert (pool.size, pool.destroying, pool.destroyed, ws.retired_from) == (1, 1, 1, pool)
    removed(pool)
    assert (pool.size, pool.destroyed) == (0, 1)
    orphan = _warm("sbx-2")
    retire(None, orphan)  # a sandbox of no pool counts nowhere
    assert orphan.retired and orphan.retired_from is None


def test_a_drained_predecessor_counts_against_its_successor_until_it_is_empty():
    old = _pool(destroying=2)
    new = _pool(creating=1, predecessor=old)
    assert new.size == 3
    old.destroying = 0
    assert new.size == 1 and new.predecessor is None


def test_idle_sandboxes_go_when_ended_broken_stale_or_drained():
    pool = _pool()
    fresh, stale, broken, ended = _warm("a", idle_since=95.0), _warm("b", idle_since=0.0), _warm("c", dead=True, idle_since=95.0), _warm("d", idle_since=95.0)
    ended.handle.output_closed.set()
    pool.idle = [fresh, stale, broken, ended]
    assert sweep_idle(pool, 100.0, 10.0) == [stale, broken, ended]
    assert pool.idle == [fresh]
    pool.draining = True
    assert sweep_idle(pool, 100.0, 10.0) == [fresh] and pool.idle == []


def test_a_pool_refills_to_its_minimum_within_its_maximum_and_retires_when_unused():
    settings = PoolSettings(min_idle=2, max_size=3, idle_ttl_s=10.0)
    pool = _pool(creating=1)
    assert wants_refill(pool, settings)  # one idle counted as being made: one short
    pool.idle = [_warm("a")]
    assert not wants_refill(pool, settings)
    pool.creating, pool.destroying = 0, 2
    assert not wants_refill(pool, settings)  # one short, but no room: 1 idle + 2 being removed
    assert unused(_pool(), 11.0, 10.0) and not unused(_pool(), 9.0, 10.0)
    assert not unused(_pool(creating=1), 11.0, 10.0)
    leased = _pool()
    leased.leased["lease_1"] = object()
    assert not unused(leased, 11.0, 10.0)
    draining = _pool(draining=True)
    assert not unused(draining, 11.0, 10.0) and not wants_refill(draining, settings)


def test_a_lease_lasts_as_asked_up_to_the_maximum_and_counts_against_its_principal():
    settings = PoolSettings(default_lease_s=600.0, max_lease_s=900.0)
    assert lease_seconds(0, settings) == 600.0
    assert lease_seconds(1500, settings) == 1.5
    assert lease_seconds(3_600_000, settings) == 900.0
    leases = [SimpleNamespace(principal="alice"), SimpleNamespace(principal="bob"), SimpleNamespace(principal="alice")]
    assert leases_held(leases, {"alice": 1}, "alice") == 3
    assert leases_held(leases, {"alice": 1}, "bob") == 1
    assert leases_held([], {}, "carol") == 0


def test_a_template_is_keyed_as_its_parts():
    template = _pool().template
    assert template_key(template) == pool_key("/srv/ws", "img", "docker", 1000, 1000, _policy())


def test_a_sandbox_remembers_every_secret_any_command_was_given():
    ws = _warm()
    assert ws.remember_secrets([ResolvedSecret("token", b"one")]) == {"token": b"one"}
    again = ws.remember_secrets([ResolvedSecret("token", b"one"), ResolvedSecret("token", b"two"),
                                 ResolvedSecret("token", b"three")])
    assert again == {"token": b"one", "token#2": b"two", "token#3": b"three"}


def test_lease_events_write_the_payloads_the_log_has_always_hashed():
    ws = _warm("sbx-9")
    lease = Lease("lease_1", "alice", ws, 0.0, "pool-k")
    leased = lease.leased_event()
    assert leased.type == ev.SANDBOX_LEASED
    assert canonical_json(leased.payload) == canonical_json({
        "principal": "alice", "sandboxId": "sbx-9", "poolKey": "pool-k", "backend": "docker",
        "workspace": "/srv/ws", "image": "img", "imageDigest": "sha256:abc", "expiresAt": "1970-01-01T00:00:00Z"})
    ended = lease.ended_event("expired")
    assert (ended.type, ended.payload) == (ev.SANDBOX_LEASE_ENDED, {"reason": "expired", "sandboxId": "sbx-9"})


def test_pool_metrics_name_pools_by_key_and_backend_only():
    text = render_pool_metrics([{"poolKey": "pool-k", "backend": "docker", "workspace": "/srv/secret-ws",
                                 "idle": 1, "leased": 2, "created": 5, "destroyed": 3}], Histogram())
    assert 'sandboxd_pool_leased_sandboxes{pool="pool-k",backend="docker"} 2' in text.splitlines()
    assert 'sandboxd_pool_destroyed_total{pool="pool-k",backend="docker"} 3' in text.splitlines()
    assert "sandboxd_pool_acquire_seconds_count 0" in text.splitlines()
    assert "/srv/secret-ws" not in text


# -- the supervisor's messages ---------------------------------------------------------

def test_a_command_message_is_its_fields_each_ended_by_nul():
    assert supervisor.command_message("/w", ("sh", "-c", "x"), {"A": "1"}, "/tmp", ()) == b"/w\x003\x00sh\x00-c\x00x\x001\x00A=1\x00"
    with_files = supervisor.command_message("/w", ("true",), {}, "/tmp/t", ("a.json", "b"))
    assert with_files == b"/w\x001\x00true\x000\x002\x00/tmp/t\x00a.json\x00b\x00"
    assert supervisor.command_message("/w", ("\udcff",), {}, "/tmp", ()) == b"/w\x001\x00\xff\x000\x00"


def test_only_an_exit_answer_carries_a_status():
    assert supervisor.exit_answer(b"X 256") == 256
    assert supervisor.exit_answer(b"") is None
    assert supervisor.exit_answer(b"P 12") is None


# -- making a warm sandbox, and unwinding a half-made one ---------------------------------

class _Holders:
    """Workspace reservations that record who holds what (and refuse when told to)."""

    def __init__(self, refuse: bool = False):
        self.held: dict[str, str] = {}
        self.refuse = refuse

    def reserve(self, owner, plan):
        if self.refuse:
            raise Aborted("call c-1 is using this workspace")
        self.held[owner] = plan.workspace

    def release(self, owner):
        self.held.pop(owner, None)


@pytest.fixture
def building(tmp_path):
    runtime = Path(tempfile.mkdtemp(prefix="sbxp-", dir="/tmp"))  # a socket path stays under 108 bytes
    workspace = tmp_path / "roots" / "ws"
    workspace.mkdir(parents=True)
    settings = DaemonSettings(workspace_roots=(tmp_path / "roots",), state_dir=tmp_path / "state",
                              socket_path=tmp_path / "run" / "sandboxd.sock", runtime_dir=runtime,
                              secrets_dir=tmp_path / "secrets", default_backend="fake", limits=LIMITS,
                              file_watch=False, daemon_id="sd-parts")
    backend, holders = FakeBackend(deadline_slack_s=None), _Holders()
    builder = WarmSandboxBuilder(settings, daemon_id="sd-parts", shim=None, proxy=None, workspaces=holders,
                                 resolve_image=lambda b, image: "sha256:" + "0" * 64,
                                 staging_dir=lambda sandbox_id: runtime / "mounts" / sandbox_id)
    template = SimpleNamespace(plan=HostPlan(str(workspace), 0, 0, (), ()), image="img", backend=backend,
                               policy=_policy(), secrets=())
    try:
        yield SimpleNamespace(builder=builder, backend=backend, holders=holders, template=template,
                              settings=settings)
    finally:
        backend.close()
        shutil.rmtree(runtime, ignore_errors=True)


def _leftovers(settings):
    """Control sockets and spool directories still on the host."""
    sockets = list((settings.runtime_dir / "control").glob("*")) if (settings.runtime_dir / "control").exists() else []
    spools = list(settings.spool_dir.glob("sbx-*")) if settings.spool_dir.exists() else []
    return sockets + spools


def test_a_warm_sandbox_is_made_ready_and_removed_whole(building):
    ws = building.builder.build(building.template, "pool-k")
    assert building.backend.live == [ws.sandbox_id]
    assert building.holders.held == {f"pool:{ws.sandbox_id}": building.template.plan.workspace}
    assert ws.prepared.image_digest == "sha256:" + "0" * 64 and ws.prepared.policy == building.template.policy
    assert not list((building.settings.runtime_dir / "control").glob("*"))  # the listener is gone once taken
    building.builder.destroy(ws)
    assert building.backend.live == [] and building.holders.held == {}
    assert _leftovers(building.settings) == []


@pytest.mark.parametrize("step", ["create", "start"])
def test_a_half_made_sandbox_is_unwound(building, step):
    building.backend.fail(step)
    with pytest.raises(SandboxdError):
        building.builder.build(building.template, "pool-k")
    assert building.backend.live == [] and building.backend.destroyed == (1 if step == "start" else 0)
    assert building.holders.held == {} and _leftovers(building.settings) == []


def test_a_refused_workspace_makes_no_sandbox(building):
    building.holders.refuse = True
    with pytest.raises(Aborted):
        building.builder.build(building.template, "pool-k")
    assert building.backend.created == 0 and _leftovers(building.settings) == []


# ------------------------------------------------------------------ OOM kills of a warm sandbox


def _oom_control(directory: Path, kills: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")


def test_v1_oom_kills_are_summed_over_the_sandbox_subtree(tmp_path):
    from sandboxd.pools.leftovers import oom_kill_files, oom_kills

    # Docker: the limit (and its count) is on the container's cgroup below the sandbox's parent.
    _oom_control(tmp_path / "memory" / "sandboxd" / "sbx-1", 0)
    _oom_control(tmp_path / "memory" / "sandboxd" / "sbx-1" / "engine-id", 2)
    _oom_control(tmp_path / "memory" / "sandboxd" / "sbx-2", 5)  # another sandbox's
    spec = SimpleNamespace(cgroup_dir="sandboxd/sbx-1")
    assert oom_kills(oom_kill_files(spec, str(tmp_path))) == 2


def test_v2_oom_kills_are_the_top_cgroups_hierarchical_count(tmp_path):
    from sandboxd.pools.leftovers import oom_kill_files, oom_kills

    top = tmp_path / "sandboxd-nsjail" / "sd-1" / "sbx-1"
    (top / "child").mkdir(parents=True)
    (top / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n")
    (top / "child" / "memory.events").write_text("oom_kill 1\n")  # counted in the top's already
    assert oom_kills(oom_kill_files(SimpleNamespace(cgroup="sandboxd-nsjail/sd-1/sbx-1"), str(tmp_path))) == 1
    assert oom_kills(oom_kill_files(SimpleNamespace(cgroup="gone"), str(tmp_path))) == 0
    assert oom_kill_files(SimpleNamespace(), str(tmp_path)) == ()
