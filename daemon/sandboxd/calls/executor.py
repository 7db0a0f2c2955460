"""CallExecutor: the owner of the calls' life, from the request to the recorded result.
It wires the parts of calls/ together and keeps the daemon-wide state they share:
admission (admission.py), preparation (prepare.py), the run (run.py) in its placement
(placement.py), replay (replay.py), workspace reservations (reservations.py), the janitor
(janitor.py) and recovery at start (recovery.py). Verification, host preflight and
compilation happen synchronously and refuse before anything is created; the run itself
happens on its own thread, so a consumer that goes away never leaves a sandbox behind.
Every step is an event in the log, and an event is durable before the caller hears of it."""

from __future__ import annotations

import logging
import os
import shlex
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sandboxd.calls.admission import Admission, CallTable, Submitted
from sandboxd.calls.janitor import Janitor
from sandboxd.calls.placement import Placement, RecordingTools, placement_for
from sandboxd.calls.prepare import Prepared, Preparer, refuse_kept_tempdir
from sandboxd.calls.recovery import recover_interrupted
from sandboxd.calls.replay import AttachedRun, ReplayRun
from sandboxd.calls.reservations import WorkspaceReservations
from sandboxd.calls.run import CallRun
from sandboxd.calls.stream import StreamItem
from sandboxd.core.errors import FailedPrecondition, InvalidArgument, NotFound, SandboxdError
from sandboxd.core.settings import DaemonSettings
from sandboxd.egress.proxy import EgressProxy
from sandboxd.ledger import call_rows
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.events import CheckpointFile, EventLog
from sandboxd.ledger.store import Database
from sandboxd.policy.models import parse_call
from sandboxd.policy.preflight import HostPlan
from sandboxd.policy.principal import Principal
from sandboxd.pools import Lease, PoolManager
from sandboxd.recording import snapshot
from sandboxd.recording.filewatch import fid_supported
from sandboxd.recording.live_snapshot import LiveSnapshots
from sandboxd.recording.baseline import Baseline
from sandboxd.recording.recorder import WriteRoots
from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.protocol import Backend
from sandboxd.secrets.broker import CredentialBroker

__all__ = ["AttachedRun", "CallExecutor", "CallRun", "Prepared", "ReplayRun", "StreamItem"]

log = logging.getLogger("sandboxd.calls.executor")
# A cancellation's reason is kept in the call's recorded result.
MAX_CANCEL_REASON_CHARS = 1024
# A write root's snapshot is brought up to date this long after a change reaches it.
REFRESH_WRITE_ROOTS_AFTER_S = 0.02


def baseline_for(settings: DaemonSettings) -> Baseline | None:
    caps = settings.artifacts
    if not caps.diff or caps.baseline_max_mb == 0:
        return None
    baseline = Baseline(settings.state_dir / "baseline", caps.baseline_max_mb * 2**20, caps.diff_max_file_kb * 1024)
    baseline.open()
    return baseline


class CallExecutor:
    def __init__(self, settings: DaemonSettings, db: Database, events: EventLog, artifacts: FileArtifactStore,
                 backends: Mapping[str, Backend], daemon_id: str, unavailable: Mapping[str, str] | None = None,
                 proxy: EgressProxy | None = None, no_proxy_reason: str = "disabled",
                 checkpoints: CheckpointFile | None = None, shim: str | None = None,
                 no_shim_reason: str = "not installed", broker: CredentialBroker | None = None,
                 pools: PoolManager | None = None, reservations: WorkspaceReservations | None = None,
                 janitor: Janitor | None = None):
        """`pools`, `reservations` and `janitor` are shared with the pool manager, which
        is made first and given them (never the executor)."""
        self.settings = settings
        self.shim = shim
        self.broker = broker or CredentialBroker(settings.credentials, settings.secrets_path)
        self.pools = pools
        self.checkpoints = checkpoints
        self.proxy = proxy
        self.db = db
        self.events = events
        self.artifacts = artifacts
        self.backends = dict(backends)
        self.daemon_id = daemon_id
        # Text files' content as hashed, for a call's diff (what a file held before it).
        self.baseline = baseline_for(settings)
        # Content hashes of workspace files, reused while a file is unchanged.
        self.hashes = snapshot.HashCache(baseline=self.baseline)
        # Write roots' snapshots kept current between calls (a walk costs the whole tree).
        # Brought up to date 20 ms after a change, between calls: a call's snapshot then
        # finds nothing to rescan but what its own command did.
        self.live_snapshots = LiveSnapshots(self.hashes, refresh_after_s=REFRESH_WRITE_ROOTS_AFTER_S)
        self._table = CallTable()
        self._reservations = reservations or WorkspaceReservations()
        self._preparer = Preparer(settings, self.backends, dict(unavailable or {}), daemon_id, self.broker, proxy,
                                  no_proxy_reason, shim, no_shim_reason, pools)
        self._recording = RecordingTools(settings.file_watch, self.walk_write_roots,
                                         self.live_snapshots.refresh_soon, self.fid_watch)
        # Each finished call's housekeeping, on a thread of its own.
        self._janitor = janitor or Janitor(checkpoints)
        self._admission = Admission(settings, db, self, daemon_id, self._table, self._preparer, self._janitor,
                                    self._placement_for, self._new_run)
        self._janitor.start()

    # -- the parts' wiring -------------------------------------------------------------
    def _placement_for(self, prepared: Prepared) -> Placement:
        return placement_for(prepared, self.db, self._reservations, self.proxy, self.broker, self.pools)

    def _new_run(self, tool_call_id: str, placement: Placement, spool: OutputSpool, accepted_event_id: str,
                 principal: str) -> CallRun:
        return CallRun(self, tool_call_id, placement, spool, accepted_event_id, principal, self._recording)

    def forget_run(self, run: CallRun) -> None:
        """The call's quota slot and workspace are free (its result is out)."""
        self._reservations.release(run.tool_call_id)
        self._table.forget(run)

    def run_ended(self, run: CallRun) -> None:
        self._table.ended(run)

    # -- housekeeping ----------------------------------------------------------------
    def after_call(self, spool: OutputSpool | None, tool_call_id: str) -> None:
        """Off the caller's path: the recorded call's spool removed and the log's head
        checkpointed (janitor.py)."""
        self._janitor.after_call(spool, tool_call_id)

    def checkpoint(self, force: bool = False) -> None:
        self._janitor.checkpoint(force)

    def fid_watch(self, plan: HostPlan) -> bool:
        """Whether a call's file watch reads its events in FID mode (FileWatch.fid)."""
        mounts = {b.sandbox_path for b in plan.binds}
        # (A bound file, not a directory: its events would name the host's parent.)
        return (self.settings.file_watch_fid and len(mounts) == 1 and os.path.isdir(plan.binds[0].host_path)
                and fid_supported(plan.binds[0].host_path))

    def walk_write_roots(self, writable: WriteRoots) -> snapshot.Snapshot:
        caps = self.settings.file_audit
        return self.live_snapshots.take(
            writable, snapshot.HashBudget(caps.hash_budget_mb * 2**20, caps.hash_max_file_mb * 2**20), caps.max_entries)

    def recover_interrupted(self) -> int:
        """Calls a crashed daemon accepted but never finished get a recorded end, so that
        the log answers for them and their idempotency keys never run them again."""
        interrupted = recover_interrupted(self.settings, self.db, self.events, self.artifacts)
        self.checkpoint(force=True)
        return interrupted

    # -- admission -------------------------------------------------------------------
    def submit(self, raw: Mapping[str, Any], caller: Principal, start: bool = True) -> Submitted:
        """Verifies and starts a call. Refusals raise (after being recorded); an
        accepted call's events up to ToolPolicyChecked are committed on return (a killed
        daemon keeps them) and fsynced before its command starts (a leased command's:
        as it starts). A retry of an accepted idempotency key gets the first call
        instead (running or done).
        With `start` False, a new call is the caller's to run at once (`run_here`)."""
        return self._admission.submit(raw, caller, start)

    def record_refusal(self, tool_call_id: str, raw: Mapping[str, Any], principal: str, stage: str,
                       exc: SandboxdError, requested_id: str = "") -> None:
        """A refusal on record (api/: a request refused before it reached the executor)."""
        self._admission.reject(tool_call_id, raw, principal, stage, exc, requested_id)

    def _pool_template(self, raw: Mapping[str, Any], caller: Principal, *, sandbox: bool = True) -> Prepared:
        """What a pool's sandboxes are made from. `sandbox` False skips the image lookup
        and the compile (an acquire from an existing pool needs neither; a sandbox made
        later looks its image up and compiles then)."""
        if self.pools is None:
            raise FailedPrecondition("this daemon keeps no pools")
        template = self._preparer.prepare(parse_call(raw), "pool", caller, resolve_credentials=False, sandbox=sandbox)
        refuse_kept_tempdir(template.policy, "a warm sandbox serves many calls")
        return template

    def acquire(self, raw: Mapping[str, Any], caller: Principal, lease_ms: int, wait_ms: int) -> Lease:
        """A lease on a warm sandbox for this workspace, image and policy."""
        with self._refusal_recorded(raw, caller, "lease"):
            template = self._pool_template(raw, caller, sandbox=False)
            assert self.pools is not None
            return self.pools.acquire(template, caller, lease_ms, wait_ms)

    def create_pool(self, raw: Mapping[str, Any], caller: Principal) -> dict[str, Any]:
        with self._refusal_recorded(raw, caller, "pool"):
            template = self._pool_template(raw, caller)
            assert self.pools is not None
            return self.pools.ensure(template, caller)

    @contextmanager
    def _refusal_recorded(self, raw: Mapping[str, Any], caller: Principal, stage: str) -> Iterator[None]:
        """A pool's, a lease's or an explain's refusal on the log as a call's is (a probe
        of what the daemon allows is evidence too), under an id of its own."""
        try:
            yield
        except SandboxdError as exc:
            if exc.tool_call_id is None:
                exc.tool_call_id = refused = ev.new_id("tc")
                try:
                    self._admission.reject(refused, raw, caller.name, stage, exc)
                except Exception:  # refused all the same; the daemon's log says why it is not on record
                    log.exception("recording the refusal %s failed", refused)
            raise

    def prepare_transfer(self, workspace: str, policy: Mapping[str, Any] | None, caller: Principal) -> Prepared:
        """A file transfer's view of a workspace: the host checks a call with `policy`
        would pass (the caller's own workspace, its roots, its masks); no sandbox."""
        raw: dict[str, Any] = {"toolId": "sandboxd.transfer", "argv": ["transfer"], "workspace": workspace,
                               "authorization": {"status": "not_required"},
                               # Any backend the daemon has: the roots do not depend on it.
                               "runtime": {"adapter": next(iter(self.backends), "")}}
        if policy is not None:
            # Nothing runs, so nothing is recorded but the transfer itself.
            raw["policy"] = {**policy, "audit": {"recordFileAccess": False}}
        return self._preparer.prepare(parse_call(raw), "transfer", caller, resolve_credentials=False, sandbox=False)

    @property
    def reservations(self) -> WorkspaceReservations:
        return self._reservations

    def explain(self, raw_call: Mapping[str, Any], caller: Principal) -> tuple[Prepared, list[str]]:
        """A dry run, with Execute's checks: another tenant's workspace is refused before
        anything of it is looked at."""
        with self._refusal_recorded(raw_call, caller, "explain"):
            call = parse_call(raw_call)
            prepared = self._preparer.prepare(call, call.tool_call_id or "explain", caller, resolve_credentials=False)
            return prepared, list(prepared.plan.notes)

    # -- records -----------------------------------------------------------------------
    def check_access(self, tool_call_id: str, caller: Principal) -> None:
        """Another tenant's call is NOT_FOUND, exactly like a call that does not exist."""
        if caller.admin:
            return
        if call_rows.owner_of(self.db, tool_call_id) != caller.name:
            raise NotFound(f"no call {tool_call_id}", field="toolCallId")

    def stored_output(self, result: Mapping[str, Any], limit: int) -> tuple[bytes, bytes] | None:
        """A finished call's stored stdout and stderr, read back from the artifact
        store; None when together they pass `limit` bytes (or are gone)."""
        named = [a for a in result.get("artifacts", []) if a.get("kind") in ("stdout", "stderr")]
        if sum(int(a.get("sizeBytes", 0)) for a in named) > limit:
            return None
        out = {"stdout": b"", "stderr": b""}
        try:
            for a in named:
                with self.artifacts.open_blob(a["contentHash"]) as f:
                    out[a["kind"]] = f.read()
        except FileNotFoundError:
            return None
        return out["stdout"], out["stderr"]

    # -- running calls ----------------------------------------------------------------
    def running_calls(self) -> list[str]:
        with self._table.lock:
            return list(self._table.runs)

    def get_run(self, tool_call_id: str) -> CallRun | None:
        with self._table.lock:
            return self._table.runs.get(tool_call_id)

    def running(self, caller: Principal) -> list[dict[str, Any]]:
        """The accepted calls without a recorded result that `caller` may see (its own;
        an admin: all), in RunningCall's JSON form (`sandboxctl ps`)."""
        with self._table.lock:
            runs = [(run, self._table.owners.get(tool_call_id, "")) for tool_call_id, run in self._table.runs.items()
                    if run is not None]
        listed = []
        for run, owner in runs:
            if not caller.admin and owner != caller.name:
                continue
            p = run.prepared
            first = self.events.for_call(run.tool_call_id)[:1]
            listed.append({"toolCallId": run.tool_call_id, "principal": owner, "workspace": p.call.workspace,
                           "command": shlex.join(p.call.argv) if p.policy.record_command else "",
                           "backend": p.backend.name, "image": p.image, "sandboxId": p.sandbox_id,
                           "leaseId": p.call.runtime.lease_id, "requestedAt": first[0].time if first else ""})
        return listed

    def follow(self, tool_call_id: str, caller: Principal,
               is_active: Callable[[], bool] = lambda: True) -> AttachedRun | ReplayRun:
        """A call's stream for a consumer other than its caller (`sandboxctl logs`):
        attached while it runs (going away cancels nothing), replayed from the log and
        the artifact store once it has a result. Another tenant's call is NOT_FOUND."""
        self.check_access(tool_call_id, caller)
        while True:
            with self._table.lock:
                admitting = tool_call_id in self._table.runs and self._table.runs[tool_call_id] is None
                run = self._table.runs.get(tool_call_id)
            if run is not None and run.result is None:
                return AttachedRun(run)
            if not admitting or not is_active():
                break
            time.sleep(0.01)  # accepted a moment ago: its run is being registered
        kinds = {e.type for e in self.events.for_call(tool_call_id)}
        if ev.EXPIRED in kinds:
            raise FailedPrecondition(f"call {tool_call_id} is past the retention period: its output is gone "
                                     "(its trace remains)", field="toolCallId")
        if ev.RESULT_VALIDATED not in kinds:
            if ev.REJECTED in kinds:
                raise FailedPrecondition(f"call {tool_call_id} was refused: it never ran, so it has no output",
                                         field="toolCallId")
            raise NotFound(f"no call {tool_call_id}", field="toolCallId")
        return ReplayRun(self, tool_call_id)

    def cancel(self, tool_call_id: str, reason: str, caller: Principal) -> bool:
        if len(reason) > MAX_CANCEL_REASON_CHARS or "\x00" in reason:  # it goes into the recorded result
            raise InvalidArgument(f"at most {MAX_CANCEL_REASON_CHARS} characters, no NUL", field="reason")
        self.check_access(tool_call_id, caller)
        run = self.get_run(tool_call_id)
        if run is None:
            if self.events.has_call(tool_call_id):
                return False
            raise NotFound(f"no call {tool_call_id}", field="toolCallId")
        return run.cancel(reason)

    def shutdown(self, grace_s: float) -> None:
        """Cancels every running call and waits for their sandboxes to be removed."""
        deadline = time.monotonic() + grace_s
        table = self._table
        with table.lock:
            table.closing = True
        self._reservations.close()
        while True:  # calls still in preparation register (cancelled) within moments
            with table.lock:
                preparing = any(r is None for r in table.runs.values())
                runs = [r for r in table.runs.values() if r is not None]
            if not preparing or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        for r in runs:
            r.cancel("the daemon is shutting down")
        with table.lock:
            runs += table.ending.values()
        for r in runs:
            r.join(max(0.0, deadline - time.monotonic()))
        self.live_snapshots.close()
        self._janitor.stop(max(0.0, deadline - time.monotonic()))
        self.checkpoint(force=True)
