"""CallRun: one accepted call, run on its own thread (or the caller's), from the
sandbox's creation to its recorded result. Whatever it built is unwound by one cleanup
stack, so a consumer that goes away, a cancel or a failure never leaves a sandbox behind.
Where it runs (fresh or leased) is its placement's business, not the run's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandboxd.calls.acceptance import credential_drafts, sandbox_prepared_draft, started_draft
from sandboxd.calls.placement import Placement, RecordingTools
from sandboxd.calls.prepare import Prepared
from sandboxd.calls.replay import Answer, ReplayRun
from sandboxd.calls.result import CallEnd, FinishedCall, error_result, finished_call
from sandboxd.calls.stream import StreamItem
from sandboxd.core.errors import FailedPrecondition, SandboxdError
from sandboxd.core.settings import DaemonSettings
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import ArtifactRecord, FileArtifactStore
from sandboxd.ledger.events import EventDraft, EventLog
from sandboxd.ledger.store import Database
from sandboxd.outputs.collect import Collected, OutputCollector, movable_masks
from sandboxd.recording.baseline import Baseline
from sandboxd.recording.activity import printable
from sandboxd.recording.recorder import FileRecord, FileRecorder
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool, StreamSummary
from sandboxd.sandbox.protocol import ExitStatus, Process, ResourceUsage

log = logging.getLogger("sandboxd.calls.run")
# After a kill, how long the engine gets to end the process tree before we give up.
KILL_GRACE_S = 10.0
# A command still running this long after its start has ToolCallStarted committed on its own.
STARTED_COMMIT_AFTER_S = 0.05
# Of persistOutputs' walk's gaps, at most this many are listed in artifactsOmitted.
MAX_LISTED_GAPS = 20


def _always() -> bool:
    return True


class RunHost(Protocol):
    """What a run needs of its executor."""
    events: EventLog
    db: Database
    artifacts: FileArtifactStore
    settings: DaemonSettings
    baseline: Baseline | None

    def after_call(self, spool: OutputSpool | None, tool_call_id: str) -> None: ...

    def forget_run(self, run: "CallRun") -> None: ...

    def run_ended(self, run: "CallRun") -> None: ...


@dataclass
class _Ending:
    """How the command ended, filled in as the run goes."""
    t0: float = field(default_factory=time.monotonic)
    timed_out: bool = False
    status: ExitStatus | None = None
    usage: ResourceUsage = field(default_factory=lambda: ResourceUsage(0, 0))
    failure: SandboxdError | None = None


def output_artifacts(store: FileArtifactStore, tool_call_id: str, out: StreamSummary,
                     err: StreamSummary) -> list[ArtifactRecord]:
    """The call's stored stdout and stderr as artifacts (an empty, untruncated one is none)."""
    now = ev.utc_now()
    records: list[ArtifactRecord] = []
    for kind, summ in (("stdout", out), ("stderr", err)):
        if summ.stored_bytes == 0 and not summ.truncated:
            continue  # its empty file goes with the spool, after the result is out
        store.put_blob(summ.path, summ.content_hash)
        note = f"{kind} of {tool_call_id}: {summ.stored_bytes} bytes"
        if summ.truncated:
            note += f" (truncated; the command wrote {summ.produced_bytes})"
        records.append(ArtifactRecord(ev.new_id("art"), tool_call_id, ev.new_id("ev"), kind,
                                      summ.content_hash, summ.stored_bytes, note, now))
    return records


class CallRun:
    """One accepted call. Its thread owns the sandbox from create to destroy."""

    def __init__(self, host: RunHost, tool_call_id: str, placement: Placement, spool: OutputSpool,
                 last_event_id: str, principal: str, recording: RecordingTools):
        self.tool_call_id = tool_call_id
        self._principal = principal
        self._placement = placement
        self.prepared: Prepared = placement.prepared
        self.spool = spool
        self._host = host
        self._recording = recording
        self._last_event_id = last_event_id
        self._cond = threading.Condition()
        self._started_event_id = ""
        self._pending_started: list[EventDraft] = []  # recorded with the result (see _start)
        self._prepared_event: EventDraft | None = None  # until recorded
        self._result: dict[str, Any] | None = None
        self._result_event_id = ""
        self._cancel_reason = ""
        self._process: Process | None = None  # once started, for a cancel to kill
        self._thread = threading.Thread(target=self._run, name=f"call-{tool_call_id}", daemon=True)
        self._ran = threading.Event()  # set once the run has ended, on whichever thread
        self.accepted_event_id = last_event_id

    # -- control ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def run_here(self) -> None:
        """Runs the call on the caller's thread (a caller that only waits for the
        result: a thread of its own and the hand-offs to it cost more than the command)."""
        self._run()

    def cancel(self, reason: str) -> bool:
        with self._cond:
            if self._result is not None or self._cancel_reason:
                return False
            self._cancel_reason = reason or "cancelled"
            process = self._process
        if process is not None:
            try:
                process.kill()
            except SandboxdError as exc:
                log.error("cancel of %s could not kill its sandbox: %s", self.tool_call_id, exc)
        return True

    def join(self, timeout_s: float | None = None) -> bool:
        return self._ran.wait(timeout_s)

    def finished(self, is_active: Callable[[], bool] = _always) -> Answer | None:
        """(the result, its ToolCallFinished event id) once there is one; None if the
        caller went away first."""
        with self._cond:
            while self._result is None:
                if not is_active():
                    return None
                self._cond.wait(0.25)
            return self._result, self._result_event_id

    @property
    def result(self) -> dict[str, Any] | None:
        with self._cond:
            return self._result

    # -- the stream a caller sees ------------------------------------------------
    def stream(self, is_active: Callable[[], bool] = _always) -> Iterator[StreamItem]:
        yield StreamItem("accepted", self.accepted_event_id, {
            "backend": self.prepared.backend.name, "image": self.prepared.image})
        with self._cond:
            while not self._started_event_id and self._result is None:
                if not is_active():
                    return
                self._cond.wait(0.25)
            started = self._started_event_id
        if started:
            yield StreamItem("started", started, {"sandboxId": self.prepared.sandbox_id})
            try:
                for stream, offset, data in self.spool.follow(should_stop=lambda: not is_active()):
                    yield StreamItem("output", "", (stream, offset, data))
            except FileNotFoundError:
                # A late follower (an idempotent retry): the output already moved into
                # the artifact store, so it is replayed from there.
                with self._cond:
                    while self._result is None:
                        self._cond.wait(0.25)
                replay = ReplayRun(self._host, self.tool_call_id)
                yield from (item for item in replay.stream(is_active) if item.kind == "output")
        with self._cond:
            while self._result is None:
                if not is_active():
                    return
                self._cond.wait(0.25)
            finished = StreamItem("finished", self._result_event_id, self._result)
        # Never yield holding the lock: the consumer's gRPC thread may need it.
        yield finished

    # -- the run ------------------------------------------------------------------
    def _record(self, drafts: list[EventDraft], durable: bool = True) -> list[ev.Event]:
        out = self._host.events.record(self.tool_call_id, self._last_event_id, drafts, durable)
        self._last_event_id = out[-1].event_id
        return out

    def _cancelled(self) -> bool:
        with self._cond:
            return bool(self._cancel_reason)

    def _run(self) -> None:
        ending = _Ending()
        placement = self._placement
        recorder = placement.recorder(self._recording, self.prepared.sandbox_id)
        try:
            with ExitStack() as cleanup:  # unwound in reverse: a step that fails never skips the next
                cleanup.callback(self._withhold_written())  # last: the sandbox gone, the after-walk done
                cleanup.callback(self.spool.close)
                cleanup.callback(self._refresh_if_ran, recorder)
                cleanup.enter_context(placement)  # the sandbox destroyed, its endpoint and secrets released
                cleanup.enter_context(recorder)  # the watch read out and the after-walk, before the removal
                cleanup.callback(self._record_unstarted)  # failed or cancelled before it started
                try:
                    self._run_command(recorder, ending)
                except SandboxdError as exc:
                    ending.failure = exc
                    log.error("call %s failed in the backend: %s", self.tool_call_id, exc.message)
                except Exception as exc:  # never let a bug leave the sandbox running
                    ending.failure = SandboxdError("internal error while running the sandbox")
                    log.exception("call %s: unexpected error: %s", self.tool_call_id, exc)
        except Exception as exc:
            # A cleanup step failed (every other one still ran): the call still ends on
            # the record, and gives back its slot and its workspace.
            ending.failure = ending.failure or SandboxdError("internal error while releasing the sandbox")
            log.exception("call %s: releasing its sandbox failed: %s", self.tool_call_id, exc)
        self._conclude(ending, recorder.record)

    def _withhold_written(self) -> Callable[[], None]:
        """A call with secrets (or in a sandbox that remembers some): the baseline keeps
        nothing raw of what it writes (recording/baseline.py), from before its sandbox is
        made until the function returned is called."""
        p, baseline = self.prepared, self._host.baseline
        if baseline is None or not (p.secrets or p.redaction):
            return lambda: None
        return baseline.withhold(host for _, host in self._placement.write_roots())

    def _run_command(self, recorder: FileRecorder, ending: _Ending) -> None:
        p, placement = self.prepared, self._placement
        if self._cancelled():
            return
        placement.open()
        if p.secrets:
            self._record(credential_drafts(p.secrets, self._principal))
        recorder.before_create()
        sandbox = placement.create()
        if self._cancelled():
            return
        recorder.sandbox_created()
        placement.before_start()
        ending.t0 = time.monotonic()
        process = placement.start(self.spool)
        with self._cond:
            self._process = process  # a cancel from here on kills it (before: _announce_start does)
        # Digested while a jail or container comes up (the spec's digest took a
        # millisecond between create and start, on every call's path).
        self._prepared_event = sandbox_prepared_draft(p, sandbox)
        recorder.sandbox_started(process)
        self._announce_start(process)
        self._wait(process, ending)
        ending.status, ending.usage = process.collect()

    def _announce_start(self, process: Process) -> None:
        """ToolSandboxPrepared and ToolCallStarted: a command that ends within
        STARTED_COMMIT_AFTER_S has them in its result's commit (a commit of their own took
        a third of a millisecond beside a short command); a longer one gets that commit
        then, not fsynced on its own (the accept before it was, and a crash ends the call
        as INTERRUPTED either way). Their ids are fixed now: the stream says "started" at once."""
        assert self._prepared_event is not None
        self._pending_started = [self._prepared_event, started_draft(self.prepared.sandbox_id)]
        self._prepared_event = None
        with self._cond:
            self._started_event_id = self._pending_started[-1].event_id
            self._cond.notify_all()
            if self._cancel_reason:
                process.kill()

    def _wait(self, process: Process, ending: _Ending) -> None:
        timeout_s = self.prepared.policy.timeout_ms / 1000
        deadline = time.monotonic() + timeout_s
        ended = process.wait(min(STARTED_COMMIT_AFTER_S, timeout_s))
        if not ended:
            self._record(self._pending_started, durable=False)
            self._pending_started = []
            ended = process.wait(max(0.0, deadline - time.monotonic()))
        if not ended:
            with self._cond:
                ending.timed_out = not self._cancel_reason
            process.kill()
            if not process.wait(KILL_GRACE_S):
                raise FailedPrecondition("the sandbox did not end after SIGKILL")

    def _record_unstarted(self) -> None:
        """A sandbox that was made but whose command never started is still on record."""
        sandbox = self._placement.sandbox
        if sandbox is None or self._started_event_id:
            return
        try:
            self._record([self._prepared_event or sandbox_prepared_draft(self.prepared, sandbox)], durable=False)
        except Exception:
            log.exception("recording the sandbox of %s failed", self.tool_call_id)

    def _refresh_if_ran(self, recorder: FileRecorder) -> None:
        if self._placement.sandbox is not None:
            recorder.refresh_unseen()

    def _conclude(self, ending: _Ending, files: FileRecord) -> None:
        latency_ms = int((time.monotonic() - ending.t0) * 1000)
        with self._cond:
            cancel_reason = self._cancel_reason
        recorded = False
        try:
            self._finish(ending, latency_ms, cancel_reason, files)
            recorded = True
        except Exception:
            log.exception("recording the result of %s failed", self.tool_call_id)
            self._host.forget_run(self)
            with self._cond:
                self._result = error_result(self.tool_call_id, "INTERNAL", "the result could not be recorded")
                self._cond.notify_all()
        finally:
            try:
                self._placement.release_outputs()
                # Unrecorded, the spool stays for the next start, which recovers the
                # call from it.
                self._host.after_call(self.spool if recorded else None, self.tool_call_id)
                self._host.run_ended(self)
            finally:
                self._ran.set()

    def _left_behind(self, files: FileRecord) -> Collected:
        """The changed files, persistOutputs' files and the diff as artifacts
        (outputs/collect.py). A failure here costs the call its file artifacts, never
        its recorded result."""
        placement, p = self._placement, self.prepared
        redactor = p.redactor if p.secrets or p.redaction else None
        redact = redactor().redact_text if redactor is not None else (lambda text: text)
        try:
            kept, gaps = placement.kept_outputs()
            # Gaps name paths the sandbox chose: printable and redacted, as every name is.
            gaps = [redact(printable(gap)) for gap in gaps[:MAX_LISTED_GAPS]]
            if not files.changed and not kept:
                return Collected(omitted=gaps)
            roots = placement.write_roots() + ([(p.policy.temp_dir, placement.kept_tempdir)] if kept else [])
            collector = OutputCollector(self._host.settings.artifacts, self._host.artifacts, self._host.baseline,
                                        self.tool_call_id, roots, redactor, reader=(p.plan.uid, p.plan.gid),
                                        blocked=movable_masks([m.sandbox_path for m in p.plan.masks],
                                                              [b.sandbox_path for b in p.plan.binds],
                                                              [b.sandbox_path for b in p.plan.binds
                                                               if not b.read_only]))
            collected = collector.collect(files.changed, kept)
            collected.omitted[:0] = gaps
            return collected
        except Exception as exc:
            log.exception("collecting the files of %s failed", self.tool_call_id)
            return Collected(omitted=[redact(printable(f"the changed files could not be collected: {exc}"))])

    def _finish(self, ending: _Ending, latency_ms: int, cancel_reason: str, files: FileRecord) -> None:
        host, p = self._host, self.prepared
        out, err = self.spool.summary(STDOUT), self.spool.summary(STDERR)
        records = output_artifacts(host.artifacts, self.tool_call_id, out, err)
        left = self._left_behind(files)
        records += left.records
        end = CallEnd(self.tool_call_id, p.policy, ending.status, ending.usage, latency_ms, ending.timed_out,
                      cancel_reason, ending.failure, out, err, records, files, self._placement.network, left.omitted)
        redact = p.redactor().redact_text if p.secrets or p.redaction else None
        done: FinishedCall = finished_call(end, ev.new_id("ev"), ev.new_id("ev"), redact)
        drafts = self._pending_started + done.drafts
        self._pending_started = []
        with host.db.transaction() as conn:
            for r in records:
                host.artifacts.insert(conn, r)
            written = host.events.append(conn, self.tool_call_id, self._last_event_id, drafts)
        self._last_event_id = written[-1].event_id
        # The call's quota slot and workspace are free before its caller hears the
        # result: an agent's next call, sent at once, must not find them taken.
        host.forget_run(self)
        with self._cond:
            self._result = done.result
            self._result_event_id = done.finished_id
            self._cond.notify_all()
