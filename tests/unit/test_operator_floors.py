"""The operator's floors under every caller's policy, through a real CallExecutor over the
in-process FakeBackend: denyPrivateNetworks lowered only by a principal the operator lists
(egress.private_networks_principals), on every path a policy takes, refused before
anything is made and on record; always_blocked refused at the start when malformed; and a
leased command never run where a blocked path is not masked."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxd.calls.executor import CallExecutor
from sandboxd.calls.prepare import refuse_unmasked
from sandboxd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from sandboxd.core.settings import DaemonSettings, EgressSettings
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.events import EventLog
from sandboxd.ledger.store import Database
from sandboxd.policy.preflight import HostPlan, Mask
from sandboxd.policy.principal import Principal
from sandboxd.sandbox.fake import FakeBackend
from sandboxd_testing import prepared_call

from .conftest import LIMITS, WORKSPACE_GID, WORKSPACE_UID

ALICE = Principal("alice", WORKSPACE_UID, admin=False)
ROOT = Principal("root", 0, admin=True)
LOWERED = {"network": {"egress": "open", "denyPrivateNetworks": False}}


def build(tmp_path: Path, **settings) -> tuple[CallExecutor, FakeBackend, EventLog, Database, Path]:
    roots = tmp_path / "roots"
    workspace = roots / "alice"
    workspace.mkdir(parents=True, exist_ok=True)
    os.chown(workspace, WORKSPACE_UID, WORKSPACE_GID)
    daemon_settings = DaemonSettings(
        workspace_roots=(roots,), state_dir=tmp_path / "state", socket_path=tmp_path / "run" / "sandboxd.sock",
        runtime_dir=tmp_path / "runtime", secrets_dir=tmp_path / "secrets", default_backend="fake",
        limits=LIMITS, file_watch=False, daemon_id="sd-floors", **settings)
    db = Database(daemon_settings.db_path)
    events = EventLog(db)
    backend = FakeBackend(deadline_slack_s=None)
    executor = CallExecutor(daemon_settings, db, events, FileArtifactStore(daemon_settings.blob_dir, db),
                            {"fake": backend}, "sd-floors", unavailable={"docker": "not in this test"})
    return executor, backend, events, db, workspace


@pytest.fixture
def floors(tmp_path: Path) -> Iterator[tuple[CallExecutor, FakeBackend, EventLog, Path]]:
    executor, backend, events, db, workspace = build(
        tmp_path, egress=EgressSettings(private_networks_principals=("alice",)))
    yield executor, backend, events, workspace
    executor.shutdown(5.0)
    db.close()


def test_an_unlisted_principal_lowering_deny_private_networks_is_refused_on_record(floors):
    executor, backend, events, workspace = floors
    with pytest.raises(PermissionDenied) as info:
        executor.submit(prepared_call(workspace, ["true"], LOWERED), ROOT)  # an admin is no exception
    exc = info.value
    assert exc.field == "policy.network.denyPrivateNetworks" and "egress.private_networks_principals" in exc.reason
    assert backend.created == 0  # nothing made
    recorded = events.for_call(exc.tool_call_id)
    assert [e.type for e in recorded] == [ev.REQUESTED, "ToolCallRejected"]
    rejected = recorded[-1].payload
    assert rejected["code"] == "PERMISSION_DENIED" and rejected["field"] == "policy.network.denyPrivateNetworks"
    assert "egress.private_networks_principals" in rejected["reason"]


def test_explain_is_refused_too(floors):
    executor, backend, _events, workspace = floors
    with pytest.raises(PermissionDenied) as info:
        executor.explain(prepared_call(workspace, ["true"], LOWERED), ROOT)
    assert info.value.field == "policy.network.denyPrivateNetworks"
    assert backend.created == 0


def test_a_listed_principal_may_lower_it(floors):
    executor, backend, _events, workspace = floors
    run = executor.submit(prepared_call(workspace, ["true"], LOWERED), ALICE)
    answer = run.finished()
    assert answer is not None and answer[0]["status"] == "success"
    prepared, _notes = executor.explain(prepared_call(workspace, ["true"], LOWERED), ALICE)
    assert prepared.policy.deny_private_networks is False


def test_a_star_lets_every_principal_lower_it(tmp_path):
    everyone = EgressSettings(private_networks_principals=("*",))
    executor, _backend, _events, db, workspace = build(tmp_path, egress=everyone)
    try:
        prepared, _notes = executor.explain(prepared_call(workspace, ["true"], LOWERED), ROOT)
        assert json.dumps(prepared.policy.to_json_dict())
    finally:
        executor.shutdown(5.0)
        db.close()


def test_a_malformed_always_blocked_stops_the_start(tmp_path):
    with pytest.raises(InvalidArgument) as info:
        build(tmp_path, always_blocked=(".env", "../secrets"))
    assert info.value.field == "always_blocked[1]"


def _plan(*masks: Mask) -> HostPlan:
    return HostPlan(workspace="/ws", uid=1000, gid=1000, binds=(), masks=masks)


def test_a_leased_command_is_refused_where_its_sandbox_does_not_mask_a_blocked_path():
    env = Mask("/workspace/.env", "file", 5, 10, "always_blocked: .env")
    refuse_unmasked("lease-1", _plan(env), _plan(env))  # masked as it was when the sandbox was made
    refuse_unmasked("lease-1", _plan(), _plan(env))  # gone since: nothing to show
    for now in (env, Mask("/workspace/.env", "file", 5, 11, "always_blocked: .env")):  # appeared; replaced
        with pytest.raises(FailedPrecondition) as info:
            refuse_unmasked("lease-1", _plan(now), _plan() if now is env else _plan(env))
        assert info.value.field == "runtime.leaseId"
        assert "lease lease-1" in info.value.reason and "always_blocked: .env" in info.value.reason
