"""A real CallExecutor over the in-process FakeBackend: admission, idempotent retries,
cancellation, timeouts and a backend's failures, each checked on the event log and on
the fake's own counts of what it created and destroyed. No dockerd, no process: the
whole file takes a second or two."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandboxd.calls.executor import CallExecutor
from sandboxd.core.errors import (AlreadyExists, BackendUnavailable, InvalidArgument, PermissionDenied,
                                  ResourceExhausted, SandboxdError)
from sandboxd.core.settings import DaemonSettings, QuotaSettings
from sandboxd.ledger import artifact_usage
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.events import EventLog
from sandboxd.ledger.store import Database
from sandboxd.policy.principal import Principal
from sandboxd.sandbox.fake import FakeBackend
from sandboxd_testing import prepared_call, wait_for

from .conftest import LIMITS, WORKSPACE_GID, WORKSPACE_UID

ALICE = Principal("alice", WORKSPACE_UID, admin=False)
BOB = Principal("bob", WORKSPACE_UID + 1, admin=False)
DAEMON_ID = "sd-fake-test"


@dataclass
class Daemonless:
    """What main.build_daemon wires together, minus gRPC, engines, proxy and pools."""

    executor: CallExecutor
    backend: FakeBackend
    events: EventLog
    db: Database
    workspace: Path

    def call(self, argv: list[str], **extra: Any) -> dict[str, Any]:
        return prepared_call(self.workspace, argv, **extra)

    def run(self, argv: list[str], caller: Principal = ALICE, **extra: Any) -> dict[str, Any]:
        """Submits a call and waits for its recorded result."""
        run = self.executor.submit(self.call(argv, **extra), caller)
        answer = run.finished()
        assert answer is not None
        return answer[0]

    def types(self, tool_call_id: str) -> list[str]:
        return [e.type for e in self.events.for_call(tool_call_id)]

    def payload(self, tool_call_id: str, event_type: str) -> dict[str, Any]:
        found = [e.payload for e in self.events.for_call(tool_call_id) if e.type == event_type]
        assert len(found) == 1, f"{event_type} of {tool_call_id}: {found}"
        return found[0]


def refused(cls: type[SandboxdError], fn: Any, *args: Any) -> SandboxdError:
    with pytest.raises(SandboxdError) as info:
        fn(*args)
    assert type(info.value) is cls, f"expected {cls.__name__}, got {type(info.value).__name__}: {info.value}"
    return info.value


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemonless]:
    """The one place the executor is built (as main.build_daemon does): adapt it here."""
    roots = tmp_path / "roots"
    workspace = roots / "alice"
    workspace.mkdir(parents=True)
    os.chown(workspace, WORKSPACE_UID, WORKSPACE_GID)
    settings = DaemonSettings(
        workspace_roots=(roots,), state_dir=tmp_path / "state", socket_path=tmp_path / "run" / "sandboxd.sock",
        runtime_dir=tmp_path / "runtime", secrets_dir=tmp_path / "secrets", default_backend="fake",
        limits=LIMITS, file_watch=False, quotas=QuotaSettings(per_principal={"alice": 1}, artifact_mb=10240),
        daemon_id=DAEMON_ID)
    db = Database(settings.db_path)
    events = EventLog(db)
    # No deadline of the fake's own: whatever ends a command here, the executor did.
    backend = FakeBackend(deadline_slack_s=None)
    executor = CallExecutor(settings, db, events, FileArtifactStore(settings.blob_dir, db), {"fake": backend},
                            DAEMON_ID, unavailable={"docker": "not in this test"})
    yield Daemonless(executor, backend, events, db, workspace)
    executor.shutdown(5.0)
    db.close()


def sandbox_of(daemon: Daemonless, tool_call_id: str) -> str:
    sandbox_id = daemon.payload(tool_call_id, ev.POLICY_CHECKED)["sandboxId"]
    assert isinstance(sandbox_id, str) and sandbox_id
    return sandbox_id


def wait_started(daemon: Daemonless, tool_call_id: str) -> str:
    sandbox_id = sandbox_of(daemon, tool_call_id)
    assert wait_for(lambda: "start" in daemon.backend.verbs(sandbox_id), 5.0), daemon.backend.history
    return sandbox_id


def leaves_nothing(daemon: Daemonless) -> None:
    backend = daemon.backend
    assert wait_for(lambda: not daemon.executor.running_calls(), 5.0)
    assert backend.live == [] and backend.created == backend.destroyed, backend.history


# ------------------------------------------------------------------ a call's life


def test_a_call_runs_in_a_fake_sandbox_and_is_recorded(daemon):
    result = daemon.run(["echo", "hello"])
    assert (result["status"], result["exitCode"], result["stdoutPreview"]) == ("success", 0, "hello\n")
    tool_call_id = result["toolCallId"]
    assert daemon.types(tool_call_id)[:7] == [ev.REQUESTED, ev.ARGS_VALIDATED, ev.POLICY_CHECKED,
                                              ev.SANDBOX_PREPARED, ev.STARTED, ev.FINISHED, ev.RESULT_VALIDATED]
    sandbox_id = sandbox_of(daemon, tool_call_id)
    assert daemon.payload(tool_call_id, ev.POLICY_CHECKED)["backend"] == "fake"
    assert daemon.backend.verbs(sandbox_id) == ["create", "start", "collect", "destroy"]
    leaves_nothing(daemon)
    assert daemon.backend.created == 1


def test_a_nonzero_exit_is_the_commands_own(daemon):
    result = daemon.run(["echo-err", "boom", ";", "exit", "3"])
    assert (result["status"], result["exitCode"], result["error"]["code"]) == ("error", 3, "NONZERO_EXIT")
    assert result["stderrPreview"] == "boom\n"
    leaves_nothing(daemon)


# ------------------------------------------------------------------ admission


def test_a_principal_over_its_quota_is_refused_and_nothing_is_created(daemon):
    first = daemon.executor.submit(daemon.call(["sleep", "30"]), ALICE)
    wait_started(daemon, first.tool_call_id)
    exc = refused(ResourceExhausted, daemon.executor.submit, daemon.call(["echo", "second"]), ALICE)
    assert exc.kind == "RESOURCE_EXHAUSTED" and "quota" in exc.reason
    assert exc.tool_call_id and exc.tool_call_id != first.tool_call_id
    assert daemon.types(exc.tool_call_id) == [ev.REQUESTED, ev.REJECTED]
    rejected = daemon.payload(exc.tool_call_id, ev.REJECTED)
    assert (rejected["stage"], rejected["code"]) == ("admission", "RESOURCE_EXHAUSTED")
    assert daemon.backend.created == 1  # the first call's only
    assert daemon.executor.cancel(first.tool_call_id, "done", ALICE)
    assert first.join(5.0)
    leaves_nothing(daemon)


def test_a_bad_field_is_refused_with_its_path(daemon):
    bad = daemon.call(["echo", "x"], policy={"process": {"timeoutMs": -5}})
    exc = refused(InvalidArgument, daemon.executor.submit, bad, ALICE)
    assert exc.kind == "INVALID_ARGUMENT" and exc.field == "policy.process.timeoutMs"
    rejected = daemon.payload(exc.tool_call_id, ev.REJECTED)
    assert (rejected["stage"], rejected["code"], rejected["field"]) == (
        "validation", "INVALID_ARGUMENT", "policy.process.timeoutMs")
    assert daemon.backend.history == []  # the backend was never asked anything


def test_an_unknown_backend_and_another_users_workspace_are_refused(daemon):
    exc = refused(BackendUnavailable, daemon.executor.submit,
                  daemon.call(["true"], runtime={"image": "sandboxd/default:latest", "adapter": "docker"}), ALICE)
    assert exc.field == "runtime.adapter" and "not in this test" in exc.reason
    exc = refused(PermissionDenied, daemon.executor.submit, daemon.call(["true"]), BOB)
    assert exc.field == "workspace"
    assert daemon.payload(exc.tool_call_id, ev.REJECTED)["stage"] == "verification"
    assert daemon.backend.created == 0


def test_an_idempotent_retry_is_answered_by_the_first_call(daemon):
    runtime = {"image": "sandboxd/default:latest", "idempotencyKey": "key-1"}
    first = daemon.run(["echo", "once"], runtime=runtime)
    retry = daemon.executor.submit(daemon.call(["echo", "once"], runtime=runtime), ALICE)
    answer = retry.finished()
    assert answer is not None and answer[0] == first
    assert daemon.backend.created == 1  # never a second run
    replayed = daemon.payload(first["toolCallId"], ev.REPLAYED)
    assert (replayed["idempotencyKey"], replayed["attached"]) == ("alice/key-1", False)
    # The same key for another request is the caller's mistake, named.
    exc = refused(AlreadyExists, daemon.executor.submit, daemon.call(["echo", "twice"], runtime=runtime), ALICE)
    assert exc.field == "runtime.idempotencyKey" and first["toolCallId"] in exc.reason
    # ... and recorded under an id of its own: the first call's log is not the refusal's.
    assert exc.tool_call_id != first["toolCallId"]
    assert daemon.payload(exc.tool_call_id, ev.REJECTED)["code"] == "ALREADY_EXISTS"
    leaves_nothing(daemon)


def test_a_retry_of_a_running_call_attaches_to_it(daemon):
    runtime = {"image": "sandboxd/default:latest", "idempotencyKey": "key-2"}
    first = daemon.executor.submit(daemon.call(["sleep", "30"], runtime=runtime), ALICE)
    wait_started(daemon, first.tool_call_id)
    retry = daemon.executor.submit(daemon.call(["sleep", "30"], runtime=runtime), ALICE)
    assert daemon.payload(first.tool_call_id, ev.REPLAYED)["attached"] is True
    daemon.executor.cancel(first.tool_call_id, "enough", ALICE)
    answer = retry.finished()
    assert answer is not None and answer[0]["toolCallId"] == first.tool_call_id
    assert answer[0]["status"] == "cancelled"
    assert daemon.backend.created == 1
    leaves_nothing(daemon)


# ------------------------------------------------------------------ cancellation and timeouts


def test_a_running_call_cancelled_is_killed_destroyed_and_recorded(daemon):
    run = daemon.executor.submit(daemon.call(["echo", "partial", ";", "sleep", "30"]), ALICE)
    sandbox_id = wait_started(daemon, run.tool_call_id)
    t0 = time.monotonic()
    assert daemon.executor.cancel(run.tool_call_id, "the user pressed stop", ALICE)
    assert run.join(5.0) and time.monotonic() - t0 < 2.0
    result = run.result
    assert result is not None
    assert (result["status"], result["error"]["code"], result["error"]["message"]) == (
        "cancelled", "CANCELLED", "the user pressed stop")
    assert result["stdoutPreview"] == "partial\n"  # what it printed before is kept
    verbs = daemon.backend.verbs(sandbox_id)
    assert "kill" in verbs and verbs[-1] == "destroy"
    assert daemon.payload(run.tool_call_id, ev.FINISHED)["exitCode"] == 137
    assert not daemon.executor.cancel(run.tool_call_id, "again", ALICE)  # ended: nothing to cancel
    leaves_nothing(daemon)


def test_a_call_past_its_timeout_is_killed_and_says_so(daemon):
    t0 = time.monotonic()
    result = daemon.run(["sleep", "30"], policy={"process": {"timeoutMs": 200}})
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert (result["status"], result["timedOut"], result["error"]["code"]) == ("error", True, "TIMEOUT")
    assert result["signal"] == "SIGKILL"
    sandbox_id = sandbox_of(daemon, result["toolCallId"])
    assert daemon.backend.verbs(sandbox_id) == ["create", "start", "kill", "collect", "destroy"]
    leaves_nothing(daemon)


def test_shutdown_cancels_running_calls_and_removes_their_sandboxes(daemon):
    run = daemon.executor.submit(daemon.call(["sleep", "30"]), ALICE)
    wait_started(daemon, run.tool_call_id)
    daemon.executor.shutdown(5.0)
    result = run.result
    assert result is not None and result["status"] == "cancelled"
    assert daemon.backend.live == [] and daemon.backend.destroyed == 1


# ------------------------------------------------------------------ the backend failing


def test_a_failed_create_leaves_nothing_and_is_on_the_log(daemon):
    result = daemon.run(["fail-create", "echo", "x"])
    assert (result["status"], result["error"]["code"]) == ("error", "BACKEND_UNAVAILABLE")
    assert result["error"]["retryable"] is True
    tool_call_id = result["toolCallId"]
    assert ev.SANDBOX_PREPARED not in daemon.types(tool_call_id)  # no sandbox was made
    assert daemon.payload(tool_call_id, ev.RESULT_VALIDATED)["result"]["error"]["code"] == "BACKEND_UNAVAILABLE"
    assert daemon.backend.created == 0 and daemon.backend.live == []
    leaves_nothing(daemon)
    assert daemon.run(["echo", "after"])["status"] == "success"  # the call's slot was released


@pytest.mark.parametrize("step", ["start", "collect"])
def test_a_failure_after_create_still_destroys_the_sandbox(daemon, step):
    result = daemon.run([f"fail-{step}", "echo", "x"])
    assert (result["status"], result["error"]["code"]) == ("error", "INTERNAL")
    tool_call_id = result["toolCallId"]
    assert ev.SANDBOX_PREPARED in daemon.types(tool_call_id)  # the sandbox that was made is on record
    sandbox_id = sandbox_of(daemon, tool_call_id)
    assert daemon.backend.verbs(sandbox_id)[-1] == "destroy"
    assert daemon.backend.created == 1
    leaves_nothing(daemon)


def test_an_engine_that_cannot_resolve_the_image_refuses_before_anything_is_made(daemon):
    daemon.backend.fail("resolve_image")
    exc = refused(BackendUnavailable, daemon.executor.submit, daemon.call(["true"]), ALICE)
    assert daemon.payload(exc.tool_call_id, ev.REJECTED)["code"] == "BACKEND_UNAVAILABLE"
    assert daemon.backend.created == 0
    assert daemon.run(["true"])["status"] == "success"  # the quota's slot was given back


def test_a_cleanup_step_that_fails_still_ends_the_call_on_the_record(daemon, monkeypatch):
    """A bug while the run unwinds (here: the file recorder's exit raises after doing
    its work) must not leave the call unrecorded, its slot held or its caller waiting."""
    from sandboxd.recording import recorder

    done_exit = recorder.FileRecorder.__exit__

    def failing_exit(self, *exc_info):
        done_exit(self, *exc_info)
        raise ValueError("a bug in a cleanup step")

    monkeypatch.setattr(recorder.FileRecorder, "__exit__", failing_exit)
    result = daemon.run(["echo", "hi"])
    assert (result["status"], result["error"]["code"]) == ("error", "INTERNAL")
    assert ev.RESULT_VALIDATED in daemon.types(result["toolCallId"])
    leaves_nothing(daemon)
    monkeypatch.undo()
    assert daemon.run(["echo", "after"])["status"] == "success"  # alice's one slot was given back


def test_a_principal_whose_artifacts_fill_its_quota_is_refused_and_others_are_not(daemon):
    first = daemon.run(["echo", "counted"])
    assert artifact_usage.stored_bytes(daemon.db, "alice") == len("counted\n")
    with daemon.db.transaction() as conn:  # as if alice's calls had kept 10 GiB
        conn.execute("UPDATE artifact_usage SET bytes = ? WHERE principal = 'alice'", (10240 * 2**20,))
    exc = refused(ResourceExhausted, daemon.executor.submit, daemon.call(["echo", "more"]), ALICE)
    assert "quotas.artifact_mb" in exc.reason and exc.tool_call_id != first["toolCallId"]
    assert daemon.payload(exc.tool_call_id, ev.REJECTED)["code"] == "RESOURCE_EXHAUSTED"
    bobs = daemon.workspace.parent / "bob"
    bobs.mkdir()
    os.chown(bobs, BOB.uid, WORKSPACE_GID)
    run = daemon.executor.submit(prepared_call(bobs, ["echo", "mine"]), BOB)
    answer = run.finished()
    assert answer is not None and answer[0]["status"] == "success"
    leaves_nothing(daemon)
