"""CallExecutor: the life of one prepared tool call, from the request to the recorded
result. Verification, host preflight and compilation happen synchronously and refuse
before anything is created; the run itself happens on its own thread, so a consumer
that goes away never leaves a sandbox behind. Every step is an event in the log, and
an event is durable before the caller hears of it."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sandboxd.ledger import events as ev
from sandboxd.policy import images
from sandboxd.recording import snapshot
from sandboxd.ledger.artifacts import ArtifactRecord, FileArtifactStore
from sandboxd.sandbox.protocol import Backend
from sandboxd.sandbox.protocol import ExitStatus
from sandboxd.sandbox.protocol import ResourceUsage
from sandboxd.sandbox.protocol import SandboxHandle
from sandboxd.backends import staging
from sandboxd.sandbox.spec import Attachments, EgressAttachment, SandboxIdentity
from sandboxd.core.errors import (Aborted, AlreadyExists, BackendUnavailable, FailedPrecondition, InternalError, InvalidArgument, NotFound,
                     PermissionDenied, ResourceExhausted, SandboxdError)
from sandboxd.ledger.events import CheckpointFile, EventDraft, EventLog
from sandboxd.recording.filewatch import (MAX_PATHS as MAX_WATCHED_PATHS, FileWatch, FileWatchError, GateArrival, fid_supported,
                        reader_library)
from sandboxd.recording.live_snapshot import LiveSnapshots
from sandboxd.sandbox.output import MAX_CHUNK_BYTES, STDERR, STDOUT, OutputSpool
from sandboxd.secrets.redact import Redactor
from sandboxd.policy.models import (EffectivePolicy, PreparedToolCall, canonical_json, check_admission, is_within, parse_call,
                     request_digest, resolve_policy)
from sandboxd.policy.approvals import verify_authorization
from sandboxd.secrets.broker import CredentialBroker, ResolvedSecret
from sandboxd.pools.manager import CommandSpec, LeaseBackend, PoolManager
from sandboxd.policy.preflight import HostPlan, preflight
from sandboxd.egress.proxy import ConnectionRecord, EgressEndpoint, EgressProxy, summarize_external_calls
from sandboxd.core.settings import DaemonSettings
from sandboxd.policy.principal import Principal

log = logging.getLogger("sandboxd.calls.executor")
# After a kill, how long the engine gets to end the process tree before we give up.
KILL_GRACE_S = 10.0
# A command still running this long after its start has ToolCallStarted committed on its own.
STARTED_COMMIT_AFTER_S = 0.05
# How long a started sandbox may take to show a process the file watch can attach to.
GATE_TIMEOUT_S = 10.0
# Paths listed in ToolResult.effectsObserved per kind (the events hold all of them).
MAX_EFFECT_PATHS = 1000
# Per FileAccessObserved event: entries (writes, creations, ...), or plain reads.
FILE_ENTRIES_PER_EVENT = 500
FILE_READS_PER_EVENT = 2000
# A cancellation's reason is kept in the call's recorded result.
MAX_CANCEL_REASON_CHARS = 1024
# Below the runtime directory: each sandbox's staged workspace roots (backends/staging.py).
STAGING_SUBDIR = "mounts"
# A write root's snapshot is brought up to date this long after a change reaches it.
REFRESH_WRITE_ROOTS_AFTER_S = 0.02


@dataclass
class StreamItem:
    kind: str  # "accepted" | "started" | "output" | "finished"
    event_id: str = ""
    data: Any = None


@dataclass
class Prepared:
    call: PreparedToolCall
    policy: EffectivePolicy
    plan: HostPlan
    image: str
    image_digest: str
    backend: Backend
    spec: Any
    sandbox_id: str
    attachments: Attachments = Attachments()
    # Resolved credential values: in memory only, never in a spec, event or log.
    secrets: tuple[ResolvedSecret, ...] = ()
    # The warm sandbox a leased call runs in.
    lease: Any = None
    # Every secret this call's output and events are redacted of: its own, and for a
    # leased call every one its sandbox was ever given (its tempDir outlives a command).
    redaction: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def egress(self) -> EgressAttachment | None:
        return self.attachments.egress

    def redactor(self) -> Redactor:
        return Redactor(dict(self.redaction) or {s.binding_id: s.value for s in self.secrets})


class CallRun:
    """One accepted call. Its thread owns the sandbox from create to destroy."""

    def __init__(self, executor: "CallExecutor", tool_call_id: str, prepared: Prepared, spool: OutputSpool,
                 last_event_id: str, principal: str = ""):
        self.tool_call_id = tool_call_id
        self._principal = principal
        self.prepared = prepared
        self.spool = spool
        self._executor = executor
        self._last_event_id = last_event_id
        self._cond = threading.Condition()
        self._started_event_id = ""
        self._pending_started: list[EventDraft] = []  # recorded with the result (see _run)
        self._result: dict[str, Any] | None = None
        self._result_event_id = ""
        self._cancel_reason = ""
        self._handle: SandboxHandle | None = None
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
            handle = self._handle
        if handle is not None:
            try:
                self.prepared.backend.kill(handle)
            except SandboxdError as exc:
                log.error("cancel of %s could not kill its sandbox: %s", self.tool_call_id, exc)
        return True

    def join(self, timeout_s: float | None = None) -> bool:
        return self._ran.wait(timeout_s)

    def finished(self, is_active=lambda: True) -> "tuple[dict[str, Any], str] | None":
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
    def stream(self, is_active=lambda: True) -> Iterator[StreamItem]:
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
                replay = ReplayRun(self._executor, self.tool_call_id)
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
        out = self._executor.events.record(self.tool_call_id, self._last_event_id, drafts, durable)
        self._last_event_id = out[-1].event_id
        return out

    def _run(self) -> None:
        p = self.prepared
        backend = p.backend
        t0 = time.monotonic()
        timed_out = False
        status: ExitStatus | None = None
        usage = ResourceUsage(0, 0)
        failure: SandboxdError | None = None
        handle: SandboxHandle | None = None
        endpoint: EgressEndpoint | None = None
        connections: list[ConnectionRecord] = []
        watch: FileWatch | None = None
        gate_fd = -1
        arrival: GateArrival | None = None
        accesses: list[tuple[str, int, int]] = []
        # What mount marks cannot see (creations, deletions, renames, chmods, the content
        # a write found) comes from a before/after walk of the writable mounts.
        writable = [(b.sandbox_path, b.host_path) for b in p.plan.binds if not b.read_only]
        record_files = bool(p.attachments.gate_host_path) or (
            p.lease is not None and p.policy.record_file_access and self._executor.settings.file_watch
            and bool(p.plan.binds))
        before: snapshot.Snapshot | None = None
        after: snapshot.Snapshot | None = None
        prepared_event: EventDraft | None = None  # until recorded
        if p.lease is not None and not record_files and p.lease.watch is not None:
            p.lease.watch.unrecorded()  # the sandbox's kept watch sees this command too
        try:
            with self._cond:
                cancelled_early = bool(self._cancel_reason)
            if not cancelled_early and p.egress is not None:
                proxy = self._executor.proxy
                assert proxy is not None
                endpoint = proxy.open_endpoint(
                    p.sandbox_id, proxy.rules(p.policy.allow_domains, p.policy.deny_private_networks,
                                              any_host=p.policy.egress == "open"),
                    uid=p.plan.uid, gid=p.plan.gid, record_allowed=p.policy.record_network_access)
            if not cancelled_early and p.secrets:
                if p.lease is None:  # a leased command gets its env secrets over the control socket
                    self._executor.broker.materialize(p.sandbox_id, p.secrets, p.plan.uid, p.plan.gid)
                self._record([EventDraft(ev.CREDENTIAL_INJECTED, {
                    "bindingId": s.binding_id, "principal": self._principal, "target": s.target}) for s in p.secrets])
            if not cancelled_early and p.attachments.gate_host_path:
                _make_gate(Path(p.attachments.gate_host_path), p.plan.uid, p.plan.gid)
                try:
                    arrival = GateArrival(p.attachments.gate_host_path)  # before the sandbox can reach it
                except FileWatchError as exc:  # out of inotify instances: the sandbox's pid is polled
                    log.warning("call %s: the gate's arrival is polled for: %s", self.tool_call_id, exc)
            if not cancelled_early and record_files and writable and p.lease is not None:
                before = self._walk_before(writable)  # the sandbox is idle
            if not cancelled_early:
                handle = backend.create(p.spec)
                with self._cond:
                    self._handle = handle
                    cancelled_early = bool(self._cancel_reason)
            if not cancelled_early and handle is not None:
                if record_files and p.lease is not None:
                    watch = self._watch_lease()  # the sandbox is idle: what follows is this command's
                if p.lease is None:
                    # The acceptance was committed, not fsynced (a killed daemon keeps it):
                    # durable before the command can run.
                    self._executor.db.flush()
                t0 = time.monotonic()
                backend.start(handle, self.spool, p.call.stdin)
                if p.lease is not None:
                    # A leased command's, while it starts (a fsync before it cost each
                    # command a third of a millisecond): only a power loss in its first
                    # fraction of a millisecond could lose the record that it was accepted.
                    self._executor.db.flush()
                # Digested while a jail or container comes up (the spec's digest took a
                # millisecond between create and start, on every call's path).
                prepared_event = self._prepared_event(handle)
                if record_files and writable and p.lease is None:
                    # Walked while the sandbox comes up, on this thread (a kept snapshot
                    # takes well under a millisecond; a thread for it cost more).
                    before = self._walk_before(writable)
                if p.attachments.gate_host_path:
                    # The command waits at the gate until its mounts are watched.
                    watch, gate_fd = self._watch_and_open_gate(handle, arrival)
                # ToolSandboxPrepared and ToolCallStarted: a command that ends within
                # STARTED_COMMIT_AFTER_S has them in its result's commit (a commit of their
                # own took a third of a millisecond beside a short command); a longer one
                # gets that commit then, not fsynced on its own (the accept before it was,
                # and a crash ends the call as INTERRUPTED either way). Their ids are
                # fixed now: the stream says "started" at once.
                self._pending_started = [prepared_event, EventDraft(
                    ev.STARTED, {"sandboxId": p.sandbox_id, "startedAt": ev.utc_now()}, ev.new_id("ev"))]
                prepared_event = None
                with self._cond:
                    self._started_event_id = self._pending_started[-1].event_id
                    self._cond.notify_all()
                    if self._cancel_reason:
                        backend.kill(handle)
                deadline = time.monotonic() + p.policy.timeout_ms / 1000
                ended = backend.wait(handle, min(STARTED_COMMIT_AFTER_S, p.policy.timeout_ms / 1000))
                if not ended:
                    self._record(self._pending_started, durable=False)
                    self._pending_started = []
                    ended = backend.wait(handle, max(0.0, deadline - time.monotonic()))
                if not ended:
                    with self._cond:
                        timed_out = not self._cancel_reason
                    backend.kill(handle)
                    if not backend.wait(handle, KILL_GRACE_S):
                        raise FailedPrecondition("the sandbox did not end after SIGKILL")
                status, usage = backend.collect(handle)
        except SandboxdError as exc:
            failure = exc
            log.error("call %s failed in the backend: %s", self.tool_call_id, exc.message)
        except Exception as exc:  # never let a bug leave the sandbox running
            failure = SandboxdError("internal error while running the sandbox")
            log.exception("call %s: unexpected error: %s", self.tool_call_id, exc)
        finally:
            self._record_unstarted(handle, prepared_event)  # failed or cancelled before it started
            if watch is not None:
                try:
                    accesses = watch.collect() if p.lease is not None else watch.stop()
                except Exception:
                    log.exception("stopping the file watch of %s failed", p.sandbox_id)
            if before is not None and watch is not None:
                # The command's processes are gone (a leased sandbox's next command waits
                # for this). On this thread: a kept snapshot takes well under a
                # millisecond, and a thread for it beside the removal cost more.
                try:
                    after = self._executor.walk_write_roots(writable)
                except Exception:
                    log.exception("walking the write roots of %s failed", p.sandbox_id)
            try:  # nothing here may keep the sandbox from being destroyed below
                if arrival is not None:
                    arrival.close()
                if gate_fd >= 0:
                    os.close(gate_fd)
                if p.attachments.gate_host_path:
                    Path(p.attachments.gate_host_path).unlink(missing_ok=True)
            except OSError:
                log.exception("removing the file-watch gate of %s failed", p.sandbox_id)
            dropped: int = 0
            overflow: dict = {}
            if p.lease is not None and handle is not None:
                # Before the sandbox can take the lease's next command.
                try:
                    connections, dropped, overflow = backend.network_records()
                except Exception:
                    log.exception("reading the network records of %s failed", p.sandbox_id)
            if handle is not None:
                try:
                    backend.destroy(handle)
                except Exception:
                    log.exception("destroying sandbox %s failed", p.sandbox_id)
                if handle.reader is not None:
                    handle.reader.join(KILL_GRACE_S)  # the last bytes land before the spool closes
            elif p.lease is not None:
                # Ended (cancelled, or its walk failed) before the command reached the
                # sandbox: nothing ran in it, so it stays the lease's.
                self._executor.pools.command_done(p.lease, True)
            if endpoint is not None:
                try:
                    connections = self._executor.proxy.close_endpoint(endpoint)
                    dropped, overflow = endpoint.dropped_records, dict(endpoint.overflow)
                except Exception:
                    log.exception("closing the egress endpoint of %s failed", p.sandbox_id)
            if writable and after is None and handle is not None:
                # It may have changed its write roots unseen: their kept snapshots catch
                # up now, not in the next recording call's first snapshot.
                try:
                    self._executor.live_snapshots.refresh_soon(writable)
                except Exception:
                    log.exception("asking for the write roots of %s to be refreshed failed", p.sandbox_id)
            if p.secrets and p.lease is None:
                try:
                    self._executor.broker.release(p.sandbox_id)
                except Exception:
                    log.exception("removing the secrets of %s failed", p.sandbox_id)
            self.spool.close()
        latency_ms = int((time.monotonic() - t0) * 1000)
        with self._cond:
            cancel_reason = self._cancel_reason
        recorded = False
        try:
            files = _file_record(accesses, watch, before, after) if watch is not None else FileRecord()
            self._finish(status, usage, latency_ms, timed_out, cancel_reason, failure, connections, dropped, overflow,
                         files)
            recorded = True
        except Exception:
            log.exception("recording the result of %s failed", self.tool_call_id)
            self._executor._forget(self)
            with self._cond:
                self._result = _error_result(self.tool_call_id, "INTERNAL", "the result could not be recorded")
                self._cond.notify_all()
        finally:
            try:
                # Unrecorded, the spool stays for the next start, which recovers the
                # call from it.
                self._executor.after_call(self.spool if recorded else None, self.tool_call_id)
                self._executor._ended(self)
            finally:
                self._ran.set()

    def _prepared_event(self, handle: SandboxHandle) -> EventDraft:
        p = self.prepared
        return EventDraft(ev.SANDBOX_PREPARED, {
            "sandboxId": p.sandbox_id, "engineId": handle.engine_id, "backend": p.backend.name,
            # handle.spec: as it ran (nsjail on cgroup v2 may keep a spawn slot's cgroup).
            "specDigest": "sha256:" + hashlib.sha256(canonical_json(handle.spec.to_json_dict())).hexdigest(),
            **({"leaseId": p.call.runtime.lease_id} if p.lease is not None else {}),
        })

    def _record_unstarted(self, handle: SandboxHandle | None, prepared_event: EventDraft | None) -> None:
        """A sandbox that was made but whose command never started is still on record."""
        if handle is None or self._started_event_id:
            return
        try:
            self._record([prepared_event or self._prepared_event(handle)], durable=False)
        except Exception:
            log.exception("recording the sandbox of %s failed", self.tool_call_id)

    def _walk_before(self, writable: list[tuple[str, str]]) -> snapshot.Snapshot:
        """The write roots before the command; a walk that fails fails the call (it never
        runs unrecorded)."""
        try:
            return self._executor.walk_write_roots(writable)
        except Exception as exc:
            log.exception("walking the write roots of %s failed", self.prepared.sandbox_id)
            raise FailedPrecondition(f"file-access recording could not walk the write roots: {exc}") from None

    def _watch_and_open_gate(self, handle: SandboxHandle, arrival: GateArrival | None) -> tuple[FileWatch, int]:
        """Attaches a fanotify watch to the call's own mounts, then lets the command go. A
        watch that cannot be attached fails the call: it never runs unrecorded."""
        p = self.prepared
        watch = FileWatch(0, tuple(b.sandbox_path for b in p.plan.binds), fid=self._executor.fid_watch(p.plan))
        try:
            watch.prepare()  # while the sandbox comes up: only its marks wait for it
        except FileWatchError as exc:
            raise FailedPrecondition(f"file-access recording could not start: {exc}") from None
        try:
            deadline = time.monotonic() + GATE_TIMEOUT_S
            pid = 0
            while not pid and time.monotonic() < deadline and not handle.output_closed.is_set():
                # The shim opens the gate once the sandbox is up: its mounts are final.
                # (Without the inotify instance, the sandbox's pid says when it is up.)
                if arrival is None or arrival.wait(0.05):
                    pid = p.backend.sandbox_pid(handle)
                    if not pid:
                        time.sleep(0.0005)
            if not pid:
                raise FailedPrecondition("the sandbox never came up to be watched")
            try:
                watch.attach(pid)
            except FileWatchError as exc:
                raise FailedPrecondition(f"file-access recording could not start: {exc}") from None
            fd = os.open(p.attachments.gate_host_path, os.O_RDWR | os.O_CLOEXEC)  # never blocks on a FIFO
            try:
                os.write(fd, b"1")
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            watch.stop()
            raise
        return watch, fd

    def _watch_lease(self) -> FileWatch:
        """The watch on a leased sandbox's mounts, begun for one command before the
        supervisor is told to spawn it. Attached at the sandbox's first recorded command
        and kept until it is destroyed: the sandbox is idle between commands, so what a
        watch reads between begin() and collect() is that command's."""
        ws = self.prepared.lease
        pid = ws.init_pid()
        if not pid:
            raise self.prepared.backend.broken("the sandbox's supervisor is gone (its init exited)")
        if ws.watch is not None and not ws.watch.alive:  # its reader failed: a new watch, not a blind one
            ws.watch.stop()
            ws.watch = None
        if ws.watch is None:
            watch = FileWatch(pid, tuple(b.sandbox_path for b in ws.prepared.plan.binds),
                              fid=self._executor.fid_watch(ws.prepared.plan))
            try:
                watch.start()
            except FileWatchError as exc:
                raise FailedPrecondition(f"file-access recording could not start: {exc}") from None
            ws.watch = watch
        ws.watch.begin()
        return ws.watch

    def _finish(self, status: ExitStatus | None, usage: ResourceUsage, latency_ms: int, timed_out: bool,
                cancel_reason: str, failure: SandboxdError | None, connections: list[ConnectionRecord],
                dropped_connections: int, overflow: dict, files: "FileRecord | None" = None) -> None:
        files = files or FileRecord()
        ex = self._executor
        out, err = self.spool.summary(STDOUT), self.spool.summary(STDERR)
        records = _output_artifacts(ex.artifacts, self.tool_call_id, out, err)
        exit_code = status.exit_code if status else -1
        oom = bool(status and status.oom_killed)
        state, error = _outcome(self.prepared.policy, exit_code, oom, timed_out, cancel_reason, failure,
                                out.truncated or err.truncated)

        finished_id, validated_id = ev.new_id("ev"), ev.new_id("ev")
        result: dict[str, Any] = {
            "toolCallId": self.tool_call_id,
            "status": state,
            "exitCode": exit_code,
            "signal": status.signal if status else "",
            "timedOut": timed_out,
            "oomKilled": oom,
            "stdoutTruncated": out.truncated,
            "stderrTruncated": err.truncated,
            "stdoutPreview": out.preview,
            "stderrPreview": err.preview,
            "artifacts": [_artifact_json(r) for r in records],
            "effectsObserved": {**{k: paths[:MAX_EFFECT_PATHS] for k, paths in snapshot.effects(files.events).items()},
                                "externalCalls": summarize_external_calls(connections, overflow),
                                **({"incomplete": files.incomplete} if files.incomplete else {})},
            "usage": {"latencyMs": latency_ms, "cpuMs": usage.cpu_ms, "peakMemoryBytes": usage.peak_memory_bytes,
                      "outputBytes": out.produced_bytes + err.produced_bytes},
            "provenance": {"eventId": validated_id, "artifactRefs": [r.artifact_id for r in records]},
        }
        if error:
            result["error"] = error
        # Accesses go in batches: a test run touches thousands of files, and one event
        # per path would cost the log more than the run.
        drafts = [EventDraft(ev.FILE_ACCESS, payload) for payload in
                  snapshot.file_access_payloads(files.events, FILE_ENTRIES_PER_EVENT, FILE_READS_PER_EVENT)]
        if files.incomplete:
            drafts.append(EventDraft(ev.FILE_ACCESS, {"accesses": [], "incomplete": files.incomplete}))
        drafts += [EventDraft(ev.NETWORK_ACCESS, c.to_event()) for c in connections]
        if dropped_connections:
            drafts.append(EventDraft(ev.NETWORK_ACCESS, {
                "dropped": dropped_connections,
                "reason": "more attempts than the call's record holds: the rest are counted by destination",
                "byDestination": [{"host": h, "port": port, "decision": d, "attempts": n, "bytesUp": up,
                                   "bytesDown": down} for (h, port, d), (n, up, down) in sorted(overflow.items())],
            }))
        drafts = self._pending_started + drafts
        self._pending_started = []
        drafts += [
            EventDraft(ev.FINISHED, {
                "exitCode": exit_code, "signal": result["signal"], "timedOut": timed_out, "oomKilled": oom,
                "cancelled": bool(cancel_reason), "failure": failure.message if failure else "",
                "usage": result["usage"],
                "stdout": {"producedBytes": out.produced_bytes, "storedBytes": out.stored_bytes, "sha256": out.content_hash},
                "stderr": {"producedBytes": err.produced_bytes, "storedBytes": err.stored_bytes, "sha256": err.content_hash},
            }, finished_id),
            # The whole result is recorded, so the log alone can answer for the call.
            EventDraft(ev.RESULT_VALIDATED, {"result": result}, validated_id),
        ] + [_persisted(r) for r in records]
        if self.prepared.secrets or self.prepared.redaction:
            # Before anything is hashed into the log: a sandbox can name a file, a host
            # or a method after its secret as easily as it prints it.
            drafts, result = redact_sandbox_strings(
                drafts, result, self.prepared.redactor())
        with ex.db.transaction() as conn:
            for r in records:
                ex.artifacts.insert(conn, r)
            written = ex.events.append(conn, self.tool_call_id, self._last_event_id, drafts)
        self._last_event_id = written[-1].event_id
        # The call's quota slot and workspace are free before its caller hears the
        # result: an agent's next call, sent at once, must not find them taken.
        ex._forget(self)
        with self._cond:
            self._result = result
            self._result_event_id = finished_id
            self._cond.notify_all()


# Events whose every string may have come from the sandbox (names, hosts, methods, reasons).
SANDBOX_WORDED_EVENTS = (ev.FILE_ACCESS, ev.NETWORK_ACCESS)


def _redact_tree(value: Any, redact: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [_redact_tree(v, redact) for v in value]
    if isinstance(value, tuple):
        return tuple(_redact_tree(v, redact) for v in value)
    if isinstance(value, dict):
        return {k: _redact_tree(v, redact) for k, v in value.items()}
    return value


def redact_sandbox_strings(drafts: list[EventDraft], result: dict[str, Any],
                           redactor: Redactor) -> tuple[list[EventDraft], dict[str, Any]]:
    """The call's drafts and result with the secrets struck from every string a sandbox
    could have chosen: file and network records, the effects, failure and error texts.
    (Digests, ids and the daemon's own fields are left as they are.)"""
    text = redactor.redact_text
    result = {**result, "effectsObserved": _redact_tree(result["effectsObserved"], text)}
    if "error" in result:
        result["error"] = {**result["error"], "message": text(result["error"]["message"])}
    out: list[EventDraft] = []
    for d in drafts:
        if d.type in SANDBOX_WORDED_EVENTS:
            d = replace(d, payload=_redact_tree(d.payload, text))
        elif d.type == ev.FINISHED:
            d = replace(d, payload={**d.payload, "failure": text(d.payload["failure"])})
        elif d.type == ev.RESULT_VALIDATED:
            d = replace(d, payload={**d.payload, "result": result})
        out.append(d)
    return out, result


def _output_artifacts(store: FileArtifactStore, tool_call_id: str, out, err) -> list[ArtifactRecord]:
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


def _outcome(policy: EffectivePolicy, exit_code: int, oom: bool, timed_out: bool, cancel_reason: str,
             failure: SandboxdError | None, truncated: bool) -> tuple[str, dict[str, Any] | None]:
    """The result's status and error, first cause first."""
    def error(code: str, message: str, retryable: bool = False) -> dict[str, Any]:
        return {"code": code, "message": message, "retryable": retryable, "safeToShowUser": True}

    if cancel_reason:
        return "cancelled", error("CANCELLED", cancel_reason)
    if failure is not None:
        return "error", error(failure.kind, failure.message, failure.retryable)
    if timed_out:
        return "error", error("TIMEOUT", f"killed after the {policy.timeout_ms} ms timeout")
    if oom:
        return "error", error("OOM_KILLED", f"killed at the memory limit of {policy.memory_bytes // 2**20} MB")
    if exit_code != 0:
        return "error", error("NONZERO_EXIT", f"the command exited with {exit_code}")
    if truncated:
        return "partial", error("OUTPUT_TRUNCATED", "output exceeded its cap and was truncated")
    return "success", None


def _spool_name(sandbox_id: str, tool_call_id: str, leased: bool) -> str:
    """A call's output spool, under the daemon's spool dir: a leased command's is named
    after the warm sandbox and the call (the sandbox's own, under its name alone, holds
    its supervisor's output)."""
    return f"{sandbox_id}.{tool_call_id}" if leased else sandbox_id


def _make_gate(path: Path, uid: int, gid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
    os.chmod(path.parent, 0o711)
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)
    os.chown(path, uid, gid)


@dataclass
class FileRecord:
    """What a call did to files: FileAccessObserved entries, and why they may not be all."""
    events: snapshot.FileEvents = field(default_factory=lambda: snapshot.FileEvents([], []))
    incomplete: list[str] = field(default_factory=list)


def _file_record(accesses: list[tuple[str, int, int]], watch: FileWatch, before: snapshot.Snapshot | None,
                 after: snapshot.Snapshot | None) -> FileRecord:
    incomplete: list[str] = []
    if watch.overflowed:
        incomplete.append("the kernel's event queue overflowed: some opens were not recorded")
    if watch.dropped:
        incomplete.append(f"more than {MAX_WATCHED_PATHS} paths were opened: {watch.dropped} opens of "
                          "further paths are not listed")
    if watch.unresolved:
        incomplete.append(f"{watch.unresolved} events were in directories removed before they were read: "
                          "their paths are unknown")
    if watch.unnamed:
        incomplete.append(f"{watch.unnamed} events could not be named (a path longer than the system's limit, "
                          "or an error resolving it)")
    changes: list[dict[str, Any]] = []
    if before is not None:
        if after is None:
            incomplete.append("the write roots could not be walked after the call: no hashes after, "
                              "creations, deletions and renames not compared")
        else:
            for gap in dict.fromkeys(before.gaps + after.gaps):
                incomplete.append(gap)
            if before.complete and after.complete:
                changes = snapshot.diff(before.entries, after.entries,
                                        LiveSnapshots.changed_between(before, after))
            else:
                incomplete.append("creations, deletions and renames were not compared")
            unhashed = {p for s in (before, after) if s.unhashed for p, e in s.entries.items() if e.note}
            if unhashed:
                incomplete.append(f"{len(unhashed)} files have no content hash (over the hashing caps or "
                                  "unreadable): see sha256BeforeMissing / sha256AfterMissing")
    events = snapshot.file_events(accesses, changes, before.entries if before else {},
                                  after.entries if after else {})
    return FileRecord(events, [snapshot.printable(gap) for gap in incomplete])  # gaps name paths


def _artifact_json(r: ArtifactRecord) -> dict[str, Any]:
    return {"artifactId": r.artifact_id, "kind": r.kind, "uri": r.uri, "contentHash": r.content_hash,
            "sizeBytes": r.size_bytes, "summary": r.summary, "toolCallId": r.tool_call_id,
            "eventId": r.event_id, "createdAt": r.created_at}


def _error_result(tool_call_id: str, code: str, message: str) -> dict[str, Any]:
    return {"toolCallId": tool_call_id, "status": "error", "exitCode": -1,
            "error": {"code": code, "message": message, "retryable": False, "safeToShowUser": True}}


def _persisted(r: ArtifactRecord) -> EventDraft:
    return EventDraft(ev.ARTIFACT_PERSISTED, {
        "artifactId": r.artifact_id, "kind": r.kind, "contentHash": r.content_hash, "sizeBytes": r.size_bytes,
    }, r.event_id)


# What a refusal keeps of a request's strings and lists (a refused request may be as
# large as a gRPC message: kept whole, each refusal grew the log by megabytes, forever).
REFUSAL_STRING_CHARS = 256
REFUSAL_LIST_ITEMS = 64


def bounded(value: Any) -> Any:
    """`value` with each long string cut to a prefix that names its length and digest,
    and each long list cut (the refusal's record of what was sent, not a copy)."""
    if isinstance(value, str):
        if len(value) <= REFUSAL_STRING_CHARS:
            return value
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{value[:REFUSAL_STRING_CHARS]}...[{len(value)} characters, sha256:{digest}]"
    if isinstance(value, Mapping):
        items = list(value.items())
        kept = {bounded(str(k)): bounded(v) for k, v in items[:REFUSAL_LIST_ITEMS]}
        if len(items) > REFUSAL_LIST_ITEMS:
            kept["..."] = f"{len(items) - REFUSAL_LIST_ITEMS} more entries"
        return kept
    if isinstance(value, (list, tuple)):
        kept_list = [bounded(v) for v in value[:REFUSAL_LIST_ITEMS]]
        if len(value) > REFUSAL_LIST_ITEMS:
            kept_list.append(f"...[{len(value) - REFUSAL_LIST_ITEMS} more items]")
        return kept_list
    if isinstance(value, (bytes, bytearray)):
        return f"[{len(value)} bytes, sha256:{hashlib.sha256(value).hexdigest()}]"
    return value


def _request_summary(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What the trace keeps of a request: everything but stdin's bytes."""
    summary = {k: v for k, v in raw.items() if k != "stdin"}
    stdin = raw.get("stdin") or b""
    if isinstance(stdin, (bytes, bytearray)):
        summary["stdinBytes"] = len(stdin)
        summary["stdinSha256"] = "sha256:" + hashlib.sha256(stdin).hexdigest()
    return summary


class AttachedRun:
    """A second consumer of a running call (an idempotent retry). Going away does not
    cancel the call: its first caller still owns it."""

    def __init__(self, run: CallRun):
        self._run = run
        self.tool_call_id = run.tool_call_id

    @property
    def result(self) -> dict[str, Any] | None:
        return self._run.result

    def cancel(self, reason: str) -> bool:
        return False

    def stream(self, is_active=lambda: True) -> Iterator[StreamItem]:
        return self._run.stream(is_active)

    def finished(self, is_active=lambda: True) -> "tuple[dict[str, Any], str] | None":
        return self._run.finished(is_active)


class ReplayRun:
    """A call that already finished, answered again from the event log and the artifact
    store: the same events, the same output, the same result. Nothing runs."""

    def __init__(self, executor: "CallExecutor", tool_call_id: str):
        self.tool_call_id = tool_call_id
        self._executor = executor
        self._events = executor.events.for_call(tool_call_id)
        recorded = [e for e in self._events if e.type == ev.RESULT_VALIDATED]
        if not recorded:
            raise InternalError(f"call {tool_call_id} has no recorded result")
        self.result = recorded[-1].payload["result"]
        # Opened now: a retention sweep from here on removes nothing this replay reads.
        self._outputs: list[tuple[int, Any]] = []
        records = executor.artifacts.list_for_call(tool_call_id)
        named = {a.get("artifactId") for a in self.result.get("artifacts", []) if isinstance(a, dict)}
        try:
            for record in records:
                stream = {"stdout": STDOUT, "stderr": STDERR}.get(record.kind)
                if stream is not None:
                    self._outputs.append((stream, executor.artifacts.open(record)))
        except FileNotFoundError:
            records = []
        expired = [e for e in self._events if e.type == ev.EXPIRED]
        if expired or not named <= {r.artifact_id for r in records}:
            self.close()
            when = expired[-1].payload.get("expiredAt", expired[-1].time) if expired else "just now"
            raise FailedPrecondition(f"call {tool_call_id}, the first with this key, expired ({when}) under the "
                                     "retention period: its output is gone, so it cannot be answered again, and "
                                     "the key is not run twice; its trace remains", field="runtime.idempotencyKey",
                                     tool_call_id=tool_call_id)

    def close(self) -> None:
        for _, f in self._outputs:
            f.close()
        self._outputs = []

    def finished(self, is_active=lambda: True) -> "tuple[dict[str, Any], str] | None":
        finished = [e for e in self._events if e.type == ev.FINISHED]
        return self.result, finished[-1].event_id if finished else ""

    def cancel(self, reason: str) -> bool:
        return False

    def stream(self, is_active=lambda: True) -> Iterator[StreamItem]:
        by_type = {e.type: e for e in self._events}
        checked = by_type[ev.POLICY_CHECKED]
        yield StreamItem("accepted", checked.event_id, {
            "backend": checked.payload.get("backend", ""), "image": checked.payload.get("image", "")})
        started = by_type.get(ev.STARTED)
        if started is not None:
            yield StreamItem("started", started.event_id, {"sandboxId": started.payload.get("sandboxId", "")})
        try:
            for stream, f in self._outputs:
                offset = 0
                while data := f.read(MAX_CHUNK_BYTES):
                    if not is_active():
                        return
                    yield StreamItem("output", "", (stream, offset, data))
                    offset += len(data)
        finally:
            self.close()
        yield StreamItem("finished", by_type[ev.FINISHED].event_id, self.result)


class CallExecutor:
    def __init__(self, settings: DaemonSettings, db, events: EventLog, artifacts: FileArtifactStore,
                 backends: Mapping[str, Backend], daemon_id: str, unavailable: Mapping[str, str] | None = None,
                 proxy: EgressProxy | None = None, no_proxy_reason: str = "disabled",
                 checkpoints: CheckpointFile | None = None, shim: str | None = None,
                 no_shim_reason: str = "not installed", broker: CredentialBroker | None = None):
        self.settings = settings
        self.shim = shim
        self._no_shim_reason = no_shim_reason
        self.broker = broker or CredentialBroker(settings.credentials, settings.secrets_dir)
        self.pools: PoolManager | None = None  # set by main once the executor exists
        self.checkpoints = checkpoints
        self.proxy = proxy
        self._no_proxy_reason = no_proxy_reason
        self.db = db
        self.events = events
        self.artifacts = artifacts
        self.backends = dict(backends)
        self._unavailable = dict(unavailable or {})
        self.daemon_id = daemon_id
        # Content hashes of workspace files, reused while a file is unchanged.
        self.hashes = snapshot.HashCache()
        # Write roots' snapshots kept current between calls (a walk costs the whole tree).
        # Brought up to date 20 ms after a change, between calls: a call's snapshot then
        # finds nothing to rescan but what its own command did.
        self.live_snapshots = LiveSnapshots(self.hashes, refresh_after_s=REFRESH_WRITE_ROOTS_AFTER_S)
        self._lock = threading.Lock()
        self._runs: dict[str, CallRun] = {}
        # Calls whose result is out while their thread still tidies up (the spool, the
        # checkpoint): no longer running for quotas, still waited for at shutdown.
        self._ending: dict[str, CallRun] = {}
        # Grant ids claimed by calls being admitted (the used_grants table has the rest).
        self._pending_grants: dict[str, str] = {}
        # tool_call_id -> principal, for the per-principal quota (same keys as _runs).
        self._run_owners: dict[str, str] = {}
        self._pending_keys: dict[str, str] = {}
        # tool_call_id -> (host workspace, can write it), from admission to sandbox removal.
        self._workspace_users: dict[str, tuple[str, bool]] = {}
        self._closing = False
        self._inheritable = {n: os.environ[n] for n in settings.inheritable_env if n in os.environ}
        # Each finished call's housekeeping, on a thread of its own (a leftover spool goes
        # with the spool directory at the next start).
        self._after_calls: queue.SimpleQueue[tuple[OutputSpool | None, str] | None] = queue.SimpleQueue()
        self._janitor = threading.Thread(target=self._tidy_after_calls, name="call-janitor", daemon=True)
        self._janitor.start()

    def after_call(self, spool: OutputSpool | None, tool_call_id: str) -> None:
        """Off the caller's path: the recorded call's spool removed (six file operations,
        a third of a millisecond) and the log's head checkpointed (at most once a second,
        a fsync of 1-4 ms that fell to whichever call ended then)."""
        self._after_calls.put((spool, tool_call_id))

    def checkpoint_soon(self) -> None:
        """The log's head checkpointed off the caller's path (a refusal, a lease's events)."""
        self._after_calls.put((None, ""))

    def _tidy_after_calls(self) -> None:
        behind = False
        while True:
            try:
                # A checkpoint skipped (another was written under an interval ago) is
                # written once the interval has passed, not only after a later call.
                item = self._after_calls.get(timeout=self.checkpoints.min_interval_s if behind else None)
            except queue.Empty:
                item = (None, "")
            if item is None:
                return
            spool, tool_call_id = item
            if spool is not None:
                try:
                    spool.discard()
                except Exception:  # never lose the janitor: the next start removes it
                    log.exception("removing the spool of %s failed", tool_call_id)
            try:
                self.checkpoint()
                behind = self.checkpoints is not None and self.checkpoints.skipped
            except Exception:  # never lose the janitor: it tries again
                log.exception("checkpointing after %s failed", tool_call_id or "a skipped checkpoint")
                behind = self.checkpoints is not None

    def fid_watch(self, plan: HostPlan) -> bool:
        """Whether a call's file watch reads its events in FID mode (FileWatch.fid)."""
        mounts = {b.sandbox_path for b in plan.binds}
        # (A bound file, not a directory: its events would name the host's parent.)
        return (self.settings.file_watch_fid and len(mounts) == 1 and os.path.isdir(plan.binds[0].host_path)
                and fid_supported(plan.binds[0].host_path))

    def walk_write_roots(self, writable: list[tuple[str, str]]) -> snapshot.Snapshot:
        caps = self.settings.file_audit
        return self.live_snapshots.take(
            writable, snapshot.HashBudget(caps.hash_budget_mb * 2**20, caps.hash_max_file_mb * 2**20), caps.max_entries)

    # -- admission ------------------------------------------------------------------
    def _prepare(self, call: PreparedToolCall, tool_call_id: str, caller: Principal | None, *,
                 resolve_credentials: bool = True, sandbox: bool = True) -> Prepared:
        """Everything up to the compiled spec. The workspace must be `caller`'s own (an
        admin's: any), checked before anything else of the host is looked at; None only
        for the daemon's own templates. `resolve_credentials` False (ExplainPolicy, a
        pool's template) resolves none. `sandbox` False (a command for a leased sandbox,
        which exists) stops after the host checks: no image lookup, no spec."""
        check_admission(call)
        policy = resolve_policy(call, self.settings.limits, self._inheritable)
        argv_bytes = sum(len(a.encode()) + 1 for a in call.argv)
        if argv_bytes > self.settings.limits.max_argv_bytes:
            raise InvalidArgument(f"{argv_bytes} bytes exceed the maximum of {self.settings.limits.max_argv_bytes}", field="argv")
        if len(call.stdin) > self.settings.limits.max_stdin_bytes:
            raise InvalidArgument(f"{len(call.stdin)} bytes exceed the maximum of {self.settings.limits.max_stdin_bytes}", field="stdin")
        backend_name = call.runtime.adapter or self.settings.default_backend
        backend = self.backends.get(backend_name)
        if backend is None:
            reason = self._unavailable.get(backend_name, "not enabled in this daemon")
            raise BackendUnavailable(f"backend {backend_name!r} is unavailable: {reason}", field="runtime.adapter")
        image = call.runtime.image or self.settings.default_image
        if not images.allowed(images.parse_reference(image).name, self.settings.allowed_images):
            raise PermissionDenied(f"image {image!r} is not in the daemon's allowed images", field="runtime.image")
        plan = preflight(policy, call.workspace, self.settings,
                         owner_uid=None if caller is None or caller.admin else caller.uid)
        if policy.record_file_access and self.settings.file_watch and plan.binds:
            try:
                reader_library()  # refused here, before any sandbox is made
            except FileWatchError as exc:
                raise FailedPrecondition(f"file-access recording is unavailable on this daemon: {exc}",
                                         field="policy.audit.recordFileAccess") from None
        if not sandbox:
            return Prepared(call, policy, plan, image, "", backend, None, "")
        digest = self.resolve_allowed_image(backend, image)
        sandbox_id = "sbx-" + ev.new_id("x")[2:]
        plan = replace(plan, staging_dir=self.staging_dir(sandbox_id))
        egress = None
        if policy.proxied:
            if self.proxy is None:
                raise BackendUnavailable(f"egress {policy.egress!r} needs the egress proxy, which is unavailable: "
                                         f"{self._no_proxy_reason}", field="policy.network.egress")
            egress = EgressAttachment(str(self.proxy.socket_path(sandbox_id)), self.settings.egress.proxy_port)
        secrets = self.broker.resolve(call, policy, caller.name) if resolve_credentials and caller is not None else ()
        gate = ""
        if policy.record_file_access and self.settings.file_watch and plan.binds:
            gate = str(self.settings.runtime_dir / "gates" / sandbox_id)
        attachments = Attachments(self.shim or "", egress, self.broker.mounts(sandbox_id, secrets),
                                  gate_host_path=gate)
        if attachments.needs_shim and not self.shim:
            raise BackendUnavailable(f"this call needs the sandbox shim, which is unavailable: {self._no_shim_reason}",
                                     field="policy.network.egress" if egress else "credentialRefs")
        spec = backend.compile(policy, plan, SandboxIdentity(self.daemon_id, sandbox_id, tool_call_id),
                               argv=tuple(call.argv), image=image, stdin_open=bool(call.stdin),
                               attachments=attachments)
        return Prepared(call, policy, plan, image, digest, backend, spec, sandbox_id, attachments, secrets)

    def _prepare_leased(self, call: PreparedToolCall, tool_call_id: str, caller: Principal) -> Prepared:
        """A call in a leased sandbox: the same checks as any call, then the lease's
        sandbox (its policy class must match) and a command spec for its supervisor."""
        prepared = self._prepare(call, tool_call_id, caller, resolve_credentials=False, sandbox=False)
        secrets = self.broker.resolve(call, prepared.policy, caller.name) if call.credential_refs else ()
        if self.pools is None:
            raise FailedPrecondition("this daemon keeps no pools", field="runtime.leaseId")
        ws = self.pools.sandbox_for(call.runtime.lease_id, caller, prepared)
        try:
            # The sandbox's own attachments (the proxy variables) apply to every command;
            # env secrets travel to the supervisor on its private socket, never in a spec.
            env = {**prepared.policy.env, **ws.prepared.attachments.env()}
            secret_env = {s.env_name: s.value.decode("utf-8", "surrogateescape") for s in secrets if s.env_name}
            secret_files = {s.file_path: s.value for s in secrets if s.file_path}
            spec = CommandSpec(call.runtime.lease_id, ws.sandbox_id, tuple(call.argv), prepared.policy.cwd,
                               env, prepared.policy.timeout_ms,
                               prepared.policy.max_stdout_bytes, prepared.policy.max_stderr_bytes,
                               ws.prepared.policy.temp_dir)
            return replace(prepared, backend=LeaseBackend(self.pools, ws, secret_env, secret_files), spec=spec,
                           sandbox_id=ws.sandbox_id, image_digest=ws.prepared.image_digest, attachments=Attachments(),
                           lease=ws, secrets=secrets, redaction=ws.remember_secrets(secrets))
        except BaseException:
            self.pools.command_done(ws, True)
            raise

    def _pool_template(self, raw: Mapping[str, Any], caller: Principal, *, sandbox: bool = True) -> Prepared:
        """What a pool's sandboxes are made from. `sandbox` False skips the image lookup
        and the compile (an acquire from an existing pool needs neither; a sandbox made
        later looks its image up and compiles then)."""
        if self.pools is None:
            raise FailedPrecondition("this daemon keeps no pools")
        return self._prepare(parse_call(raw), "pool", caller, resolve_credentials=False, sandbox=sandbox)

    def acquire(self, raw: Mapping[str, Any], caller: Principal, lease_ms: int, wait_ms: int):
        """A lease on a warm sandbox for this workspace, image and policy."""
        return self.pools.acquire(self._pool_template(raw, caller, sandbox=False), caller, lease_ms, wait_ms)

    def create_pool(self, raw: Mapping[str, Any], caller: Principal) -> dict[str, Any]:
        return self.pools.ensure(self._pool_template(raw, caller), caller)

    def submit(self, raw: Mapping[str, Any], caller: Principal, start: bool = True) -> "CallRun | AttachedRun | ReplayRun":
        """Verifies and starts a call. Refusals raise (after being recorded); an
        accepted call's events up to ToolPolicyChecked are committed on return (a killed
        daemon keeps them) and fsynced before its command starts (a leased command's:
        as it starts). A retry of an accepted idempotency key gets the first call
        instead (running or done).
        With `start` False, a new call is the caller's to run at once (`run_here`)."""
        requested_id = raw.get("toolCallId") if isinstance(raw.get("toolCallId"), str) else ""
        principal = caller.name
        tool_call_id = ""
        try:
            call = parse_call(raw)
            tool_call_id = call.tool_call_id or ev.new_id("tc")
        except SandboxdError as exc:
            tool_call_id = ev.new_id("tc")
            exc.tool_call_id = tool_call_id
            self._reject(tool_call_id, raw, principal, "validation", exc, requested_id)
            raise
        # Keys are the caller's own: another principal's identical key is another call.
        key = f"{principal}/{call.runtime.idempotency_key}" if call.runtime.idempotency_key else ""
        digest = request_digest(call) if key else ""
        with self._lock:
            try:
                if self._closing:
                    raise FailedPrecondition("the daemon is shutting down")
                if key:
                    earlier = self._answer_retry(key, digest, principal)
                    if earlier is not None:
                        return earlier
                # (An id made here just now is new: no query for it.)
                if call.tool_call_id and (tool_call_id in self._runs or self.events.has_call(tool_call_id)):
                    raise AlreadyExists(f"a call with id {tool_call_id} was already submitted", field="toolCallId")
            except SandboxdError as exc:
                # Recorded under an id of its own: the requested id, or the key's, belongs
                # to the earlier call (which the error names when there is one).
                refused_id = ev.new_id("tc")
                self._reject(refused_id, raw, principal, "admission", exc, requested_id)
                exc.tool_call_id = refused_id
                raise
            mine = sum(1 for p in self._run_owners.values() if p == principal)
            quota = self.settings.quotas.concurrent_calls_for(principal)
            exc = None
            if mine >= quota:
                exc = ResourceExhausted(f"{principal} has {mine} calls running, its quota")
            elif len(self._runs) >= self.settings.max_concurrent_calls:
                exc = ResourceExhausted(f"{len(self._runs)} calls are running, the daemon's maximum")
            if exc is not None:
                exc.tool_call_id = self._refusal_id(call, tool_call_id)
                self._reject(exc.tool_call_id, raw, principal, "admission", exc, requested_id)
                raise exc
            placeholder = self._runs[tool_call_id] = None  # type: ignore[assignment]
            self._run_owners[tool_call_id] = principal
            if key:
                self._pending_keys[key] = tool_call_id
        grant_id = ""
        prepared = None
        try:
            try:
                approved = verify_authorization(raw, call, self.settings.approvals)
                grant_id = call.authorization.grant_id if approved else ""
                if grant_id:
                    self._claim_grant(grant_id, tool_call_id)
                if call.runtime.lease_id:
                    prepared = self._prepare_leased(call, tool_call_id, caller)
                else:
                    prepared = self._prepare(call, tool_call_id, caller)
                if not caller.admin and prepared.plan.uid != caller.uid:
                    # (A leased sandbox is handed back below, with every other refusal.)
                    raise PermissionDenied("the workspace belongs to another user; a principal may only use "
                                           "workspaces its own uid owns", field="workspace")
                if prepared.lease is None:
                    self._reserve_workspace(tool_call_id, prepared)
                else:
                    self.pools.claim(prepared.lease, tool_call_id)
            except SandboxdError as exc:
                exc.tool_call_id = self._refusal_id(call, tool_call_id)
                self._reject(exc.tool_call_id, raw, principal, "verification", exc, requested_id)
                raise
            except Exception as exc:
                log.exception("preparing call %s failed", tool_call_id)
                internal = InternalError(f"preparing the sandbox failed: {type(exc).__name__}",
                                         tool_call_id=self._refusal_id(call, tool_call_id))
                self._reject(internal.tool_call_id, raw, principal, "verification", internal, requested_id)
                raise internal from None
            # Before the call is recorded as accepted: once it is, it must get a result.
            spool = OutputSpool(self.settings.spool_dir / _spool_name(prepared.sandbox_id, tool_call_id,
                                                                      prepared.lease is not None),
                                {STDOUT: prepared.policy.max_stdout_bytes, STDERR: prepared.policy.max_stderr_bytes},
                                self.settings.limits.preview_bytes,
                                redactor=prepared.redactor())
            policy_digest = prepared.policy.digest()
            # Not fsynced here: CallRun._run flushes it before the command starts (on the
            # call's own thread, after the sandbox's creation), a leased one's as it starts.
            with self.db.transaction(durable=False) as conn:
                conn.execute("INSERT INTO call_owners (tool_call_id, principal) VALUES (?,?)", (tool_call_id, principal))
                if grant_id:
                    conn.execute("INSERT INTO used_grants (grant_id, tool_call_id) VALUES (?,?)", (grant_id, tool_call_id))
                if key:
                    conn.execute("INSERT INTO idempotency_keys (idempotency_key, request_digest, tool_call_id)"
                                 " VALUES (?,?,?)", (key, digest, tool_call_id))
                recorded = self.events.append(conn, tool_call_id, call.parent_event_id, [
                EventDraft(ev.REQUESTED, self._requested_payload(raw, call, principal, digest)),
                EventDraft(ev.ARGS_VALIDATED, {
                    "effectivePolicy": prepared.policy.to_json_dict(), "policyDigest": policy_digest}),
                EventDraft(ev.POLICY_CHECKED, {
                    "decision": "allowed", "backend": prepared.backend.name, "image": prepared.image,
                    # Named now (ToolSandboxPrepared may commit with the result): a crash
                    # recovery finds the call's spooled output by it.
                    "sandboxId": prepared.sandbox_id,
                    **({"leaseId": call.runtime.lease_id} if prepared.lease is not None else {}),
                    "authorization": ({"grantId": call.authorization.grant_id, "approvalDigest": approved,
                                       "verified": True} if approved else {"status": call.authorization.status}),
                    "imageDigest": prepared.image_digest, "uid": prepared.plan.uid, "gid": prepared.plan.gid,
                    "workspace": prepared.plan.workspace,
                    "binds": [[b.sandbox_path, "ro" if b.read_only else "rw"] for b in prepared.plan.binds],
                    "masks": [m.sandbox_path for m in prepared.plan.masks], "notes": list(prepared.plan.notes),
                    **({"command": self._command_record(prepared, principal, policy_digest)}
                       if prepared.policy.record_command else {}),
                }),
                ])
            run = CallRun(self, tool_call_id, prepared, spool, recorded[-1].event_id, principal)
        except BaseException:
            if prepared is not None and prepared.lease is not None and self.pools is not None:
                self.pools.command_done(prepared.lease, True)  # the lease's sandbox is free again
            with self._lock:
                self._pending_grants.pop(grant_id, None)
                if self._runs.get(tool_call_id) is placeholder:
                    del self._runs[tool_call_id]
                    self._run_owners.pop(tool_call_id, None)
                self._pending_keys.pop(key, None)
                self._workspace_users.pop(tool_call_id, None)
            raise
        with self._lock:
            self._runs[tool_call_id] = run
            self._pending_keys.pop(key, None)
            if grant_id:
                self._pending_grants.pop(grant_id, None)
            closing = self._closing
        if closing:  # accepted just before shutdown began: it ends at once, recorded
            run.cancel("the daemon is shutting down")
        if start:
            run.start()
        return run

    def stored_output(self, result: Mapping[str, Any], limit: int) -> tuple[bytes, bytes] | None:
        """A finished call's stored stdout and stderr, read back from the artifact
        store; None when together they pass `limit` bytes (or are gone)."""
        named = [a for a in result.get("artifacts", []) if a.get("kind") in ("stdout", "stderr")]
        if sum(int(a.get("sizeBytes", 0)) for a in named) > limit:
            return None
        out = {"stdout": b"", "stderr": b""}
        try:
            for a in named:
                with open(self.artifacts.blob_path(a["contentHash"]), "rb") as f:
                    out[a["kind"]] = f.read()
        except FileNotFoundError:
            return None
        return out["stdout"], out["stderr"]

    def _answer_retry(self, key: str, digest: str, principal: str) -> "AttachedRun | ReplayRun | None":
        """A call already accepted under `key` answers the retry: the running call's
        stream, or the finished call's record. Never a second run. Holds self._lock."""
        if key in self._pending_keys:
            raise Aborted("the first call with this key is still being prepared; retry shortly",
                          field="runtime.idempotencyKey")
        rows = self.db.query("SELECT request_digest, tool_call_id FROM idempotency_keys WHERE idempotency_key = ?", (key,))
        if not rows:
            return None
        first_id = rows[0]["tool_call_id"]
        if rows[0]["request_digest"] != digest:
            raise AlreadyExists(f"was already used by call {first_id} for a different request",
                                field="runtime.idempotencyKey", tool_call_id=first_id)
        running = self._runs.get(first_id)
        answer: AttachedRun | ReplayRun = (AttachedRun(running) if running is not None and running.result is None
                                           else ReplayRun(self, first_id))
        with self.db.transaction() as conn:  # the parent is the call's last event at this commit
            last = conn.execute("SELECT event_id FROM events WHERE tool_call_id = ? ORDER BY seq DESC LIMIT 1",
                                (first_id,)).fetchone()
            self.events.append(conn, first_id, last[0], [EventDraft(ev.REPLAYED, {
                "principal": principal, "idempotencyKey": key, "attached": isinstance(answer, AttachedRun)})])
        return answer

    def recover_interrupted(self) -> int:
        """Calls a crashed daemon accepted but never finished get a recorded end, so that
        the log answers for them and their idempotency keys never run them again.
        Their sandboxes' staged roots are unmounted first (the sandboxes are gone)."""
        left = staging.reap(str(self.settings.runtime_dir / STAGING_SUBDIR))
        if left:
            log.warning("removed %d staged workspace mounts an earlier run left", left)
        rows = self.db.query(
            "SELECT DISTINCT tool_call_id FROM events e WHERE type = ? AND NOT EXISTS ("
            " SELECT 1 FROM events f WHERE f.tool_call_id = e.tool_call_id AND f.type = ?)",
            (ev.POLICY_CHECKED, ev.RESULT_VALIDATED))
        for row in rows:
            tool_call_id = row["tool_call_id"]
            trace = self.events.for_call(tool_call_id)
            named = [e.payload for e in trace if e.type in (ev.POLICY_CHECKED, ev.SANDBOX_PREPARED)
                     and isinstance(e.payload.get("sandboxId"), str) and e.payload["sandboxId"]]
            leased = any(p.get("leaseId") for p in named)
            records = self._salvage_output(tool_call_id, named[-1]["sandboxId"], leased) if named else []
            result = _error_result(tool_call_id, "INTERRUPTED",
                                   "the daemon stopped before the call finished; its sandbox was removed")
            finished_id, validated_id = ev.new_id("ev"), ev.new_id("ev")
            result["artifacts"] = [_artifact_json(r) for r in records]
            result["provenance"] = {"eventId": validated_id, "artifactRefs": [r.artifact_id for r in records]}
            with self.db.transaction() as conn:
                for r in records:
                    self.artifacts.insert(conn, r)
                self.events.append(conn, tool_call_id, trace[-1].event_id, [
                    EventDraft(ev.FINISHED, {"interrupted": True, "exitCode": -1}, finished_id),
                    EventDraft(ev.RESULT_VALIDATED, {"result": result}, validated_id),
                ] + [_persisted(r) for r in records])
        self._close_open_leases()
        self.checkpoint(force=True)
        return len(rows)

    def _close_open_leases(self) -> None:
        """Leases a killed daemon held end on the record: their sandboxes were reaped
        with everything else it left."""
        rows = self.db.query(
            "SELECT DISTINCT tool_call_id FROM events e WHERE type = ? AND NOT EXISTS ("
            " SELECT 1 FROM events f WHERE f.tool_call_id = e.tool_call_id AND f.type IN (?, ?))",
            (ev.SANDBOX_LEASED, ev.SANDBOX_LEASE_ENDED, ev.EXPIRED))
        for row in rows:
            trace = self.events.for_call(row["tool_call_id"])
            self.events.record(row["tool_call_id"], trace[-1].event_id, [EventDraft(ev.SANDBOX_LEASE_ENDED, {
                "reason": "daemon-restarted", "sandboxId": trace[0].payload.get("sandboxId", "")})])
        if rows:
            log.warning("ended %d leases an earlier run of this daemon held", len(rows))

    def _salvage_output(self, tool_call_id: str, sandbox_id: str, leased: bool = False) -> list[ArtifactRecord]:
        """What an interrupted call printed before the crash, from its spool files."""
        records = []
        name = _spool_name(sandbox_id, tool_call_id, leased)
        if "/" in name or name in (".", ".."):
            return []
        for kind in ("stdout", "stderr"):
            path = self.settings.spool_dir / name / f"{kind}.out"
            if not path.exists() or path.stat().st_size == 0:
                continue
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            content_hash = "sha256:" + digest.hexdigest()
            size = path.stat().st_size
            self.artifacts.put_blob(path, content_hash)
            records.append(ArtifactRecord(ev.new_id("art"), tool_call_id, ev.new_id("ev"), kind, content_hash, size,
                                          f"{kind} of {tool_call_id} up to the interruption: {size} bytes",
                                          ev.utc_now()))
        return records

    def _requested_payload(self, raw: Mapping[str, Any], call: PreparedToolCall, principal: str,
                           digest: str) -> dict[str, Any]:
        payload = _request_summary(raw)
        if digest:
            payload["requestDigest"] = digest
        if not call.policy.audit.record_command:
            payload.pop("argv", None)
            payload["argvSha256"] = "sha256:" + hashlib.sha256(canonical_json(call.argv)).hexdigest()
        payload["principal"] = principal
        payload["daemonId"] = self.daemon_id
        return payload

    @staticmethod
    def _command_record(prepared: Prepared, principal: str, policy_digest: str) -> dict[str, Any]:
        """audit.recordCommand: what ran, where, as whom. Environment names only: values
        may be secrets, and the policy digest already pins them."""
        return {
            "argv": list(prepared.call.argv), "cwd": prepared.policy.cwd, "envNames": sorted(prepared.policy.env),
            "image": prepared.image, "imageDigest": prepared.image_digest, "backend": prepared.backend.name,
            "policyDigest": policy_digest, "principal": principal, "workspace": prepared.plan.workspace,
            "sandboxUser": f"{prepared.plan.uid}:{prepared.plan.gid}",
        }

    def _claim_grant(self, grant_id: str, tool_call_id: str) -> None:
        """A grant runs one call: a second call presenting it is refused."""
        with self._lock:
            rows = self.db.query("SELECT tool_call_id FROM used_grants WHERE grant_id = ?", (grant_id,))
            holder = rows[0]["tool_call_id"] if rows else self._pending_grants.get(grant_id)
            if holder is not None:
                raise PermissionDenied(f"grant {grant_id} was already used by another call", field="authorization.grantId")
            self._pending_grants[grant_id] = tool_call_id

    def checkpoint(self, force: bool = False) -> None:
        if self.checkpoints is not None:
            try:
                self.checkpoints.checkpoint(force)
            except OSError:
                log.exception("writing the log checkpoint failed")

    @staticmethod
    def _refusal_id(call: PreparedToolCall, tool_call_id: str) -> str:
        """The id a refusal is recorded under: never an id the caller chose, so that a
        refused call reserves nothing (another tenant could otherwise take the id a
        caller will use, with a call that does not even run)."""
        return ev.new_id("tc") if call.tool_call_id else tool_call_id

    def _reject(self, tool_call_id: str, raw: Mapping[str, Any], principal: str, stage: str,
                exc: SandboxdError, requested_id: str = "") -> None:
        payload = bounded(_request_summary(raw))
        payload["principal"] = principal
        payload["daemonId"] = self.daemon_id
        parent = raw.get("parentEventId") if isinstance(raw.get("parentEventId"), str) else ""
        with self.db.transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO call_owners (tool_call_id, principal) VALUES (?,?)",
                         (tool_call_id, principal))
            self.events.append(conn, tool_call_id, parent[:256], [
                EventDraft(ev.REQUESTED, payload),
                EventDraft(ev.REJECTED, {"stage": stage, "code": exc.kind, "field": bounded(exc.field or ""),
                                         "reason": bounded(exc.reason), "requestedToolCallId": requested_id[:256]}),
            ])
        self.checkpoint_soon()

    def check_access(self, tool_call_id: str, caller: Principal) -> None:
        """Another tenant's call is NOT_FOUND, exactly like a call that does not exist."""
        if caller.admin:
            return
        rows = self.db.query("SELECT principal FROM call_owners WHERE tool_call_id = ?", (tool_call_id,))
        if not rows or rows[0]["principal"] != caller.name:
            raise NotFound(f"no call {tool_call_id}", field="toolCallId")

    # -- explain --------------------------------------------------------------------
    def explain(self, raw_call: Mapping[str, Any], caller: Principal) -> tuple[Prepared, list[str]]:
        """A dry run, with Execute's checks: another tenant's workspace is refused before
        anything of it is looked at."""
        call = parse_call(raw_call)
        prepared = self._prepare(call, call.tool_call_id or "explain", caller, resolve_credentials=False)
        return prepared, list(prepared.plan.notes)

    # -- running calls ----------------------------------------------------------------
    def running_calls(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    def get_run(self, tool_call_id: str) -> CallRun | None:
        with self._lock:
            return self._runs.get(tool_call_id)

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

    def resolve_allowed_image(self, backend: Backend, image: str) -> str:
        """The digest of the local image `image` names, which must itself carry an
        allowed name: an allowed name that the engine resolves to another image (a short
        id, a name it cleans up) is refused, on every backend."""
        digest, names = backend.resolve_image(image)
        if not images.allowed_resolution(names, self.settings.allowed_images):
            shown = ", ".join(names[:5]) or "no name"
            raise PermissionDenied(f"image {image!r} resolves to {digest[:19]} ({shown}), which is not in the "
                                   "daemon's allowed images", field="runtime.image")
        return digest

    def staging_dir(self, sandbox_id: str) -> str:
        """Where a new sandbox's workspace roots are bound before the engine mounts them."""
        return str(self.settings.runtime_dir / STAGING_SUBDIR / sandbox_id)

    def _reserve_workspace(self, tool_call_id: str, prepared: Prepared) -> None:
        self.reserve_workspace(tool_call_id, prepared.plan)

    def release_workspace(self, holder: str) -> None:
        with self._lock:
            self._workspace_users.pop(holder, None)

    def reserve_workspace(self, tool_call_id: str, plan: HostPlan) -> None:
        """A call that can write a workspace runs alone on it. Its writes could swap a
        directory for a symlink between another call's host checks and that call's
        mounts, redirecting a bind (or a mask) to anywhere its owner can reach; so while
        a writer runs nobody else mounts the workspace, and the other way round. Nested
        workspaces count as one: a writer of /a can swap what a call on /a/b mounts, and
        a writer of /a/b what a call on /a finds inside it."""
        workspace = plan.workspace
        writes = any(not b.read_only for b in plan.binds)
        with self._lock:
            if self._closing:
                raise FailedPrecondition("the daemon is shutting down")
            others = [(tid, w) for tid, (ws, w) in self._workspace_users.items()
                      if is_within(ws, workspace) or is_within(workspace, ws)]
            if any(w for _, w in others) or (writes and others):
                holder = others[0][0]
                raise Aborted(f"call {holder} is using this workspace and one of the two can write it; "
                              "calls that write a workspace run alone on it (retry when it is done)",
                              field="workspace")
            self._workspace_users[tool_call_id] = (workspace, writes)

    def _forget(self, run: CallRun) -> None:
        with self._lock:
            self._workspace_users.pop(run.tool_call_id, None)
            if self._runs.get(run.tool_call_id) is run:
                del self._runs[run.tool_call_id]
                self._run_owners.pop(run.tool_call_id, None)
                self._ending[run.tool_call_id] = run

    def _ended(self, run: CallRun) -> None:
        with self._lock:
            self._ending.pop(run.tool_call_id, None)

    def shutdown(self, grace_s: float) -> None:
        """Cancels every running call and waits for their sandboxes to be removed."""
        deadline = time.monotonic() + grace_s
        with self._lock:
            self._closing = True
        while True:  # calls still in preparation register (cancelled) within moments
            with self._lock:
                preparing = any(r is None for r in self._runs.values())
                runs = [r for r in self._runs.values() if r is not None]
            if not preparing or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        for r in runs:
            r.cancel("the daemon is shutting down")
        with self._lock:
            runs += self._ending.values()
        for r in runs:
            r.join(max(0.0, deadline - time.monotonic()))
        self.live_snapshots.close()
        self._after_calls.put(None)
        self._janitor.join(max(0.0, deadline - time.monotonic()))
        self.checkpoint(force=True)


def clean_spool(settings: DaemonSettings) -> None:
    """Spool files of calls that a crashed daemon never finished."""
    shutil.rmtree(settings.spool_dir, ignore_errors=True)
    settings.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
