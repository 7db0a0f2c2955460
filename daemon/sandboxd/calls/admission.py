"""Admission: a request becomes an accepted call or a recorded refusal. It is parsed,
a retry of an accepted idempotency key is answered by the first call, the caller's and
the daemon's quotas are checked, the approval verified and its grant claimed, the call
prepared and its workspace (or lease) taken; then its acceptance is committed. Every
refusal is on record (under an id of its own) before the caller hears it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

from sandboxd.calls.acceptance import accepted_drafts, refusal_drafts
from sandboxd.calls.janitor import Janitor
from sandboxd.calls.placement import Placement
from sandboxd.calls.prepare import Prepared, Preparer
from sandboxd.calls.replay import AttachedRun, Records, ReplayRun, answer_retry
from sandboxd.calls.run import CallRun
from sandboxd.core.errors import (AlreadyExists, FailedPrecondition, InternalError, PermissionDenied,
                                  ResourceExhausted, SandboxdError)
from sandboxd.core.settings import DaemonSettings
from sandboxd.ledger import artifact_usage, call_rows
from sandboxd.ledger import events as ev
from sandboxd.ledger.store import Database
from sandboxd.policy.approvals import verify_authorization
from sandboxd.policy.models import PreparedToolCall, parse_call, request_digest
from sandboxd.policy.principal import Principal
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool

log = logging.getLogger("sandboxd.calls.admission")

Submitted = CallRun | AttachedRun | ReplayRun
# (tool_call_id, placement, spool, accepted event id, principal) -> the call's run
RunFactory = Callable[[str, Placement, OutputSpool, str, str], CallRun]


class CallTable:
    """The calls the daemon holds, under one lock: running (a None placeholder while
    one is admitted), ending (result out, thread still tidying), and what admissions in
    progress have claimed (idempotency keys, grants)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, CallRun | None] = {}
        # tool_call_id -> principal, for the per-principal quota (same keys as runs).
        self.owners: dict[str, str] = {}
        self.pending_keys: dict[str, str] = {}
        # Grant ids claimed by calls being admitted (the used_grants table has the rest).
        self.pending_grants: dict[str, str] = {}
        # Calls whose result is out while their thread still tidies up (the spool, the
        # checkpoint): no longer running for quotas, still waited for at shutdown.
        self.ending: dict[str, CallRun] = {}
        self.closing = False

    def release(self, tool_call_id: str, key: str) -> None:
        """An admission that failed gives back its slot and its key."""
        with self.lock:
            if self.runs.get(tool_call_id) is None:
                self.runs.pop(tool_call_id, None)
                self.owners.pop(tool_call_id, None)
            self.pending_keys.pop(key, None)

    def drop_grant(self, grant_id: str) -> None:
        with self.lock:
            self.pending_grants.pop(grant_id, None)

    def forget(self, run: CallRun) -> None:
        with self.lock:
            if self.runs.get(run.tool_call_id) is run:
                del self.runs[run.tool_call_id]
                self.owners.pop(run.tool_call_id, None)
                self.ending[run.tool_call_id] = run

    def ended(self, run: CallRun) -> None:
        with self.lock:
            self.ending.pop(run.tool_call_id, None)

    def running(self, tool_call_id: str) -> CallRun | None:
        """(Holds no lock: for callers that hold it.)"""
        return self.runs.get(tool_call_id)


def refusal_id(call: PreparedToolCall, tool_call_id: str) -> str:
    """The id a refusal is recorded under: never an id the caller chose, so that a
    refused call reserves nothing (another tenant could otherwise take the id a
    caller will use, with a call that does not even run)."""
    return ev.new_id("tc") if call.tool_call_id else tool_call_id


class Admission:
    def __init__(self, settings: DaemonSettings, db: Database, records: Records, daemon_id: str,
                 table: CallTable, preparer: Preparer, janitor: Janitor,
                 placement_for: Callable[[Prepared], Placement], make_run: RunFactory):
        self._settings = settings
        self._db = db
        self._records = records
        self._daemon_id = daemon_id
        self._table = table
        self._preparer = preparer
        self._janitor = janitor
        self._placement_for = placement_for
        self._make_run = make_run

    def submit(self, raw: Mapping[str, Any], caller: Principal, start: bool = True) -> Submitted:
        """Verifies and starts a call (see CallExecutor.submit)."""
        requested = raw.get("toolCallId")
        requested_id = requested if isinstance(requested, str) else ""
        principal = caller.name
        try:
            call = parse_call(raw)
            tool_call_id = call.tool_call_id or ev.new_id("tc")
        except SandboxdError as exc:
            exc.tool_call_id = refused = ev.new_id("tc")
            self.reject(refused, raw, principal, "validation", exc, requested_id)
            raise
        # Keys are the caller's own: another principal's identical key is another call.
        key = f"{principal}/{call.runtime.idempotency_key}" if call.runtime.idempotency_key else ""
        digest = request_digest(call) if key else ""
        earlier = self._take_slot(raw, call, tool_call_id, principal, key, digest, requested_id)
        if earlier is not None:
            return earlier
        with ExitStack() as undo:
            undo.callback(self._table.release, tool_call_id, key)
            run, grant_id = self._accept(undo, raw, call, tool_call_id, caller, key, digest, requested_id)
            undo.pop_all()
        table = self._table
        with table.lock:
            table.runs[tool_call_id] = run
            table.pending_keys.pop(key, None)
            if grant_id:
                table.pending_grants.pop(grant_id, None)
            closing = table.closing
        if closing:  # accepted just before shutdown began: it ends at once, recorded
            run.cancel("the daemon is shutting down")
        if start:
            run.start()
        return run

    def _take_slot(self, raw: Mapping[str, Any], call: PreparedToolCall, tool_call_id: str, principal: str,
                   key: str, digest: str, requested_id: str) -> AttachedRun | ReplayRun | None:
        """The call's place among the running ones (a placeholder until it is accepted),
        or the first call with its key."""
        table = self._table
        with table.lock:
            try:
                if table.closing:
                    raise FailedPrecondition("the daemon is shutting down")
                if key:
                    earlier = answer_retry(self._db, self._records, table.running, key in table.pending_keys,
                                           key, digest, principal)
                    if earlier is not None:
                        return earlier
                # (An id made here just now is new: no query for it.)
                if call.tool_call_id and (tool_call_id in table.runs or self._records.events.has_call(tool_call_id)):
                    raise AlreadyExists(f"a call with id {tool_call_id} was already submitted", field="toolCallId")
            except SandboxdError as exc:
                # Recorded under an id of its own: the requested id, or the key's, belongs
                # to the earlier call (which the error names when there is one).
                refused = ev.new_id("tc")
                self.reject(refused, raw, principal, "admission", exc, requested_id)
                exc.tool_call_id = refused
                raise
            over = self._over_quota(principal)
            if over is not None:
                over.tool_call_id = refused = refusal_id(call, tool_call_id)
                self.reject(refused, raw, principal, "admission", over, requested_id)
                raise over
            table.runs[tool_call_id] = None
            table.owners[tool_call_id] = principal
            if key:
                table.pending_keys[key] = tool_call_id
        return None

    def _over_quota(self, principal: str) -> ResourceExhausted | None:
        """Holds the table's lock."""
        table = self._table
        mine = sum(1 for p in table.owners.values() if p == principal)
        if mine >= self._settings.quotas.concurrent_calls_for(principal):
            return ResourceExhausted(f"{principal} has {mine} calls running, its quota")
        if len(table.runs) >= self._settings.max_concurrent_calls:
            return ResourceExhausted(f"{len(table.runs)} calls are running, the daemon's maximum")
        quota_mb = self._settings.quotas.artifact_mb_for(principal)
        stored = artifact_usage.stored_bytes(self._db, principal) if quota_mb else 0
        if quota_mb and stored >= quota_mb * 2**20:
            return ResourceExhausted(f"{principal}'s artifacts hold {stored} bytes, its quota of {quota_mb} MB "
                                     "(quotas.artifact_mb): retention must remove older calls first")
        return None

    def _accept(self, undo: ExitStack, raw: Mapping[str, Any], call: PreparedToolCall, tool_call_id: str,
                caller: Principal, key: str, digest: str, requested_id: str) -> tuple[CallRun, str]:
        """The call verified, prepared and placed, and its acceptance committed (not
        fsynced: its run flushes it before the command starts). Each step pushes its undo."""
        principal = caller.name
        try:
            approved = verify_authorization(raw, call, self._settings.approvals)
            grant_id = call.authorization.grant_id if approved else ""
            if grant_id:
                self._claim_grant(grant_id, tool_call_id)
                undo.callback(self._table.drop_grant, grant_id)
            placement = self._place(undo, call, tool_call_id, caller)
        except SandboxdError as exc:
            exc.tool_call_id = refused = refusal_id(call, tool_call_id)
            self.reject(refused, raw, principal, "verification", exc, requested_id)
            raise
        except Exception as exc:
            log.exception("preparing call %s failed", tool_call_id)
            refused = refusal_id(call, tool_call_id)
            internal = InternalError(f"preparing the sandbox failed: {type(exc).__name__}", tool_call_id=refused)
            self.reject(refused, raw, principal, "verification", internal, requested_id)
            raise internal from None
        prepared = placement.prepared
        # Before the call is recorded as accepted: once it is, it must get a result.
        spool = OutputSpool(self._settings.spool_dir / placement.spool_name(tool_call_id),
                            {STDOUT: prepared.policy.max_stdout_bytes, STDERR: prepared.policy.max_stderr_bytes},
                            self._settings.limits.preview_bytes, redactor=prepared.redactor())
        with self._db.transaction(durable=False) as conn:
            call_rows.insert_owner(conn, tool_call_id, principal)
            if grant_id:
                call_rows.insert_used_grant(conn, grant_id, tool_call_id)
            if key:
                call_rows.insert_idempotency_key(conn, key, digest, tool_call_id)
            recorded = self._records.events.append(conn, tool_call_id, call.parent_event_id, accepted_drafts(
                raw, prepared, principal, self._daemon_id, digest, approved))
        return self._make_run(tool_call_id, placement, spool, recorded[-1].event_id, principal), grant_id

    def _place(self, undo: ExitStack, call: PreparedToolCall, tool_call_id: str, caller: Principal) -> Placement:
        """The call prepared, and its workspace reserved (a fresh sandbox) or its lease's
        sandbox claimed; both given back by `undo`."""
        if call.runtime.lease_id:
            prepared = self._preparer.prepare_leased(call, tool_call_id, caller)
        else:
            prepared = self._preparer.prepare(call, tool_call_id, caller)
        placement = self._placement_for(prepared)
        undo.callback(placement.abandon, tool_call_id)
        if not caller.admin and prepared.plan.uid != caller.uid:
            raise PermissionDenied("the workspace belongs to another user; a principal may only use "
                                   "workspaces its own uid owns", field="workspace")
        placement.admit(tool_call_id)
        return placement

    def _claim_grant(self, grant_id: str, tool_call_id: str) -> None:
        """A grant runs one call: a second call presenting it is refused."""
        with self._table.lock:
            holder = call_rows.grant_holder(self._db, grant_id) or self._table.pending_grants.get(grant_id)
            if holder is not None:
                raise PermissionDenied(f"grant {grant_id} was already used by another call",
                                       field="authorization.grantId")
            self._table.pending_grants[grant_id] = tool_call_id

    def reject(self, tool_call_id: str, raw: Mapping[str, Any], principal: str, stage: str,
               exc: SandboxdError, requested_id: str = "") -> None:
        """The request and its refusal, in one transaction."""
        given = raw.get("parentEventId")
        parent = given if isinstance(given, str) else ""
        drafts = refusal_drafts(raw, principal, self._daemon_id, stage, exc, requested_id)
        with self._db.transaction() as conn:
            call_rows.insert_owner_if_new(conn, tool_call_id, principal)
            self._records.events.append(conn, tool_call_id, parent[:256], drafts)
        self._janitor.checkpoint_soon()
