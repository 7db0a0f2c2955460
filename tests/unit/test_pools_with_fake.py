"""Pools and leases over the FakeBackend, whose warm sandboxes run a fake supervisor
that speaks the shim's control protocol (sandbox/fake_supervisor.py): a lease's
commands run in one sandbox, cancellation and timeouts keep it, and the pool's
accounting (quotas, its maximum, a failed create) is checked against the fake's own
counts of what it made and removed. No dockerd, no process."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from sandboxd.calls.executor import CallExecutor
from sandboxd.calls.janitor import Janitor
from sandboxd.calls.prepare import resolve_allowed_image, staging_dir
from sandboxd.calls.reservations import WorkspaceReservations
from sandboxd.core.errors import BackendUnavailable, ResourceExhausted, SandboxdError
from sandboxd.core.settings import DaemonSettings, PoolSettings, QuotaSettings
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.events import EventLog
from sandboxd.ledger.store import Database
from sandboxd.policy.principal import Principal
from sandboxd.pools import CommandSpec, LeaseSandbox, PoolManager
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.sandbox.protocol import ExitStatus, Process, Sandbox
from sandboxd_testing import prepared_call, wait_for

from .conftest import LIMITS, WORKSPACE_GID, WORKSPACE_UID

ALICE = Principal("alice", WORKSPACE_UID, admin=False)
ROOT = Principal("root", 0, admin=True)
DAEMON_ID = "sd-fake-pools"


@dataclass
class PoolDaemon:
    executor: CallExecutor
    pools: PoolManager
    backend: FakeBackend
    events: EventLog
    workspace: Path

    def acquire(self, caller: Principal = ALICE, wait_ms: int = 0) -> str:
        lease = self.executor.acquire(prepared_call(self.workspace, ["true"]), caller, 60_000, wait_ms)
        return str(lease.lease_id)

    def leased(self, lease_id: str, argv: list[str], **extra: Any) -> dict[str, Any]:
        return prepared_call(self.workspace, argv, runtime={"image": "sandboxd/default:latest", "leaseId": lease_id},
                             **extra)

    def run(self, lease_id: str, argv: list[str], **extra: Any) -> dict[str, Any]:
        answer = self.executor.submit(self.leased(lease_id, argv, **extra), ALICE).finished()
        assert answer is not None
        return answer[0]

    def types(self, log_id: str) -> list[str]:
        return [e.type for e in self.events.for_call(log_id)]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[PoolDaemon]:
    """Built as main.build_daemon does, with pools and without gRPC or engines."""
    roots = tmp_path / "roots"
    workspace = roots / "alice"
    workspace.mkdir(parents=True)
    os.chown(workspace, WORKSPACE_UID, WORKSPACE_GID)
    # Control sockets live here: a Unix socket's path must stay under 108 bytes.
    runtime = Path(tempfile.mkdtemp(prefix="sbxf-", dir="/tmp"))
    settings = DaemonSettings(
        workspace_roots=(roots,), state_dir=tmp_path / "state", socket_path=tmp_path / "run" / "sandboxd.sock",
        runtime_dir=runtime, secrets_dir=tmp_path / "secrets", default_backend="fake", limits=LIMITS,
        file_watch=False, daemon_id=DAEMON_ID, quotas=QuotaSettings(leases=2),
        pools=PoolSettings(min_idle=0, max_size=2))
    db = Database(settings.db_path)
    events = EventLog(db)
    backend = FakeBackend(deadline_slack_s=None)
    reservations, janitor = WorkspaceReservations(), Janitor(None)
    pools = PoolManager(settings, daemon_id=DAEMON_ID, shim=None, proxy=None, db=db, events=events,
                        checkpoint_soon=janitor.checkpoint_soon, workspaces=reservations,
                        resolve_image=partial(resolve_allowed_image, settings.allowed_images),
                        staging_dir=partial(staging_dir, settings.runtime_dir))
    executor = CallExecutor(settings, db, events, FileArtifactStore(settings.blob_dir, db), {"fake": backend},
                            DAEMON_ID, pools=pools, reservations=reservations, janitor=janitor)
    try:
        yield PoolDaemon(executor, pools, backend, events, workspace)
    finally:
        executor.shutdown(5.0)
        pools.shutdown(5.0)
        db.close()
        shutil.rmtree(runtime, ignore_errors=True)


def gone(daemon: PoolDaemon, count: int) -> bool:
    """Whether `count` sandboxes were removed and none is left."""
    return wait_for(lambda: daemon.backend.destroyed == count and not daemon.backend.live, 5.0)


def test_a_leases_commands_run_in_its_one_sandbox(daemon):
    lease_id = daemon.acquire()
    assert daemon.backend.created == 1 and len(daemon.backend.live) == 1
    sandbox_id = daemon.backend.live[0]
    assert daemon.types(lease_id) == [ev.SANDBOX_LEASED]
    first = daemon.run(lease_id, ["echo", "one"])
    assert (first["status"], first["stdoutPreview"]) == ("success", "one\n")
    second = daemon.run(lease_id, ["echo-err", "two", ";", "exit", "3"])
    assert (second["exitCode"], second["stderrPreview"], second["error"]["code"]) == (3, "two\n", "NONZERO_EXIT")
    prepared = [e.payload for e in daemon.events.for_call(second["toolCallId"]) if e.type == ev.SANDBOX_PREPARED]
    assert prepared[0]["sandboxId"] == sandbox_id and prepared[0]["leaseId"] == lease_id
    assert daemon.backend.created == 1  # a command makes no sandbox
    daemon.pools.release(lease_id, ALICE)
    assert gone(daemon, 1)  # a released lease's sandbox is destroyed, never reused
    assert daemon.types(lease_id) == [ev.SANDBOX_LEASED, ev.SANDBOX_LEASE_ENDED]


def test_a_cancelled_or_timed_out_command_leaves_the_sandbox_to_its_lease(daemon):
    lease_id = daemon.acquire()
    run = daemon.executor.submit(daemon.leased(lease_id, ["echo", "partial", ";", "sleep", "30"]), ALICE)
    assert wait_for(lambda: ev.STARTED in daemon.types(run.tool_call_id), 5.0)
    t0 = time.monotonic()
    assert daemon.executor.cancel(run.tool_call_id, "stop", ALICE)
    assert run.join(5.0) and time.monotonic() - t0 < 2.0
    assert (run.result["status"], run.result["stdoutPreview"], run.result["signal"]) == (
        "cancelled", "partial\n", "SIGKILL")
    timed = daemon.run(lease_id, ["sleep", "30"], policy={"process": {"timeoutMs": 200}})
    assert (timed["timedOut"], timed["error"]["code"]) == (True, "TIMEOUT")
    assert daemon.run(lease_id, ["echo", "still here"])["stdoutPreview"] == "still here\n"
    assert daemon.backend.created == 1 and daemon.backend.destroyed == 0


def test_lease_quota_and_pool_maximum_refuse_without_making_sandboxes(daemon):
    first = daemon.acquire()
    daemon.acquire()  # the pool's maximum (2) is reached
    assert daemon.backend.created == 2
    with pytest.raises(ResourceExhausted, match="its quota"):
        daemon.acquire()  # alice's lease quota (2)
    with pytest.raises(ResourceExhausted, match="maximum of 2 sandboxes"):
        daemon.acquire(ROOT)
    assert daemon.backend.created == 2
    daemon.pools.release(first, ALICE)
    assert wait_for(lambda: daemon.backend.destroyed == 1, 5.0)  # removed off the caller's thread
    daemon.acquire(ROOT, wait_ms=5000)  # room again once the released sandbox is gone
    assert (daemon.backend.created, len(daemon.backend.live)) == (3, 2)
    assert [p["created"] for p in daemon.pools.list()] == [3]


def test_a_failed_create_gives_its_room_back(daemon):
    daemon.backend.fail("create")
    with pytest.raises(SandboxdError) as info:
        daemon.acquire()
    assert type(info.value) is BackendUnavailable
    assert daemon.backend.live == [] and daemon.backend.created == 0
    for _ in range(2):  # the failed one holds no place in the pool
        daemon.acquire(ROOT)
    assert daemon.backend.created == 2


def test_shutdown_removes_every_warm_sandbox(daemon):
    daemon.acquire()
    lease_id = daemon.acquire()
    run = daemon.executor.submit(daemon.leased(lease_id, ["sleep", "30"]), ALICE)
    assert wait_for(lambda: ev.STARTED in daemon.types(run.tool_call_id), 5.0)
    daemon.executor.shutdown(5.0)
    daemon.pools.shutdown(5.0)
    assert run.result is not None and run.result["status"] == "cancelled"
    assert daemon.backend.live == [] and daemon.backend.destroyed == 2


def _command_view(daemon: PoolDaemon, lease_id: str, argv: tuple[str, ...]) -> LeaseSandbox:
    """A call's Sandbox over the lease's warm sandbox, taken as prepare_leased takes it."""
    template, _ = daemon.executor.explain(prepared_call(daemon.workspace, ["true"]), ALICE)
    ws = daemon.pools.sandbox_for(lease_id, ALICE, template)  # busy until the view is destroyed
    return LeaseSandbox(daemon.pools, ws, CommandSpec(lease_id, ws.sandbox_id, argv, "/workspace", {}, 5_000,
                                                      1 << 20, 1 << 20))


def test_a_leased_sandbox_outlives_each_of_its_processes(daemon, tmp_path):
    """Through the Sandbox and Process protocols: each command is a Process of the call's
    view of the one warm sandbox; destroying the view hands the sandbox back to its lease
    (the engine's sandbox stays), and the next command runs in it."""
    lease_id = daemon.acquire()
    seen = []
    for n, word in enumerate(["one", "two"]):
        view = _command_view(daemon, lease_id, ("echo", word))
        sandbox: Sandbox = view
        spool = OutputSpool(tmp_path / f"spool-{n}", {STDOUT: 1 << 20, STDERR: 1 << 20}, preview_bytes=64)
        process: Process = sandbox.start(spool, b"")
        assert process.wait(5.0) and process.output_ended()
        assert process.collect()[0] == ExitStatus(0, "", False)
        sandbox.destroy()
        sandbox.destroy()  # idempotent: the lease is handed back once
        spool.close()
        assert spool.summary(STDOUT).path.read_bytes() == f"{word}\n".encode()
        seen.append((sandbox.sandbox_id, sandbox.engine_id))
        assert daemon.backend.live == [sandbox.sandbox_id]
        assert (daemon.backend.created, daemon.backend.destroyed) == (1, 0)
    assert seen[0] == seen[1]  # one sandbox, two processes
    assert (view.warm.busy, view.warm.dead) == ("", False)  # the lease's again
    daemon.pools.release(lease_id, ALICE)
    assert gone(daemon, 1)


def test_a_leased_sandbox_found_broken_is_retired_not_handed_back(daemon, tmp_path):
    lease_id = daemon.acquire()
    sandbox = _command_view(daemon, lease_id, ("true",))
    process = sandbox.start(OutputSpool(tmp_path / "spool", {STDOUT: 64, STDERR: 64}, preview_bytes=64), b"")
    assert process.wait(5.0) and process.collect()[0].exit_code == 0  # the command itself ended cleanly
    assert "gone" in sandbox.broken("the sandbox's supervisor is gone").message
    sandbox.destroy()
    assert gone(daemon, 1)  # retired, although nothing of the command was left in it
    with pytest.raises(SandboxdError, match="is gone"):
        daemon.run(lease_id, ["true"])
