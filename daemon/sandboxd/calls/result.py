"""The result of a finished call and the events that record it, built by pure functions
from plain inputs (the exit status, usage, output summaries and artifacts, the file and
network records, the cancel reason): no clock, no store, no id made here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sandboxd.core.errors import SandboxdError
from sandboxd.egress.records import ConnectionRecord, summarize_external_calls
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import ArtifactRecord
from sandboxd.ledger.events import EventDraft
from sandboxd.ledger.event_types import (ArtifactPersisted, CountedAttempts, DestinationCount, FileAccessObserved,
                                          NetworkAccessObserved, OutputDigest, ToolCallFinished, ToolResultValidated, draft)
from sandboxd.policy.models import EffectivePolicy
from sandboxd.recording import activity
from sandboxd.recording.recorder import FileRecord
from sandboxd.sandbox.output import StreamSummary
from sandboxd.sandbox.protocol import ExitStatus, ResourceUsage

# Paths listed in ToolResult.effectsObserved per kind (the events hold all of them).
MAX_EFFECT_PATHS = 1000
# Per FileAccessObserved event: entries (writes, creations, ...), or plain reads.
FILE_ENTRIES_PER_EVENT = 500
FILE_READS_PER_EVENT = 2000
# Events whose every string may have come from the sandbox (names, hosts, methods, reasons).
SANDBOX_WORDED_EVENTS = (ev.FILE_ACCESS, ev.NETWORK_ACCESS)

Overflow = dict[tuple[str, int, str], list[int]]  # (host, port, decision) -> [attempts, up, down]


@dataclass
class NetworkRecord:
    """A call's connections through its egress proxy, and those only counted."""
    connections: list[ConnectionRecord] = field(default_factory=list)
    dropped: int = 0
    overflow: Overflow = field(default_factory=dict)


@dataclass
class CallEnd:
    """Everything a finished call's record is made of."""
    tool_call_id: str
    policy: EffectivePolicy
    status: ExitStatus | None
    usage: ResourceUsage
    latency_ms: int
    timed_out: bool
    cancel_reason: str
    failure: SandboxdError | None
    stdout: StreamSummary
    stderr: StreamSummary
    artifacts: list[ArtifactRecord]
    files: FileRecord = field(default_factory=FileRecord)
    network: NetworkRecord = field(default_factory=NetworkRecord)
    # Changed files not kept as artifacts, and why (outputs/collect.py).
    artifacts_omitted: list[str] = field(default_factory=list)


@dataclass
class FinishedCall:
    result: dict[str, Any]
    drafts: list[EventDraft]  # after the call's pending events, in the order they are appended
    finished_id: str


def _error(code: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"code": code, "message": message, "retryable": retryable, "safeToShowUser": True}


def outcome(policy: EffectivePolicy, exit_code: int, oom: bool, timed_out: bool, cancel_reason: str,
            failure: SandboxdError | None, truncated: bool) -> tuple[str, dict[str, Any] | None]:
    """The result's status and error, first cause first."""
    if cancel_reason:
        return "cancelled", _error("CANCELLED", cancel_reason)
    if failure is not None:
        return "error", _error(failure.kind, failure.message, failure.retryable)
    if timed_out:
        return "error", _error("TIMEOUT", f"killed after the {policy.timeout_ms} ms timeout")
    if oom:
        return "error", _error("OOM_KILLED", f"killed at the memory limit of {policy.memory_bytes // 2**20} MB")
    if exit_code != 0:
        return "error", _error("NONZERO_EXIT", f"the command exited with {exit_code}")
    if truncated:
        return "partial", _error("OUTPUT_TRUNCATED", "output exceeded its cap and was truncated")
    return "success", None


def error_result(tool_call_id: str, code: str, message: str) -> dict[str, Any]:
    return {"toolCallId": tool_call_id, "status": "error", "exitCode": -1, "error": _error(code, message)}


def artifact_json(r: ArtifactRecord) -> dict[str, Any]:
    out = {"artifactId": r.artifact_id, "kind": r.kind, "uri": r.uri, "contentHash": r.content_hash,
           "sizeBytes": r.size_bytes, "summary": r.summary, "toolCallId": r.tool_call_id,
           "eventId": r.event_id, "createdAt": r.created_at}
    if r.path:
        out |= {"path": r.path, "change": r.change, "fileMode": r.file_mode}
        if r.previous_path:
            out["previousPath"] = r.previous_path
    return out


def persisted(r: ArtifactRecord) -> EventDraft:
    return draft(ArtifactPersisted(r.artifact_id, r.kind, r.content_hash, r.size_bytes, r.path, r.change,
                                   r.previous_path, r.file_mode), r.event_id)


def result_of(end: CallEnd, validated_id: str) -> dict[str, Any]:
    """The ToolResult of a finished call (provenance points at ToolResultValidated)."""
    out, err, status = end.stdout, end.stderr, end.status
    exit_code = status.exit_code if status else -1
    oom = bool(status and status.oom_killed)
    state, error = outcome(end.policy, exit_code, oom, end.timed_out, end.cancel_reason, end.failure,
                           out.truncated or err.truncated)
    files = end.files
    result: dict[str, Any] = {
        "toolCallId": end.tool_call_id, "status": state, "exitCode": exit_code,
        "signal": status.signal if status else "", "timedOut": end.timed_out, "oomKilled": oom,
        "stdoutTruncated": out.truncated, "stderrTruncated": err.truncated,
        "stdoutPreview": out.preview, "stderrPreview": err.preview,
        "artifacts": [artifact_json(r) for r in end.artifacts],
        "effectsObserved": {**{k: paths[:MAX_EFFECT_PATHS] for k, paths in activity.effects(files.events).items()},
                            "externalCalls": summarize_external_calls(end.network.connections, end.network.overflow),
                            **({"incomplete": files.incomplete} if files.incomplete else {})},
        "usage": {"latencyMs": end.latency_ms, "cpuMs": end.usage.cpu_ms,
                  "peakMemoryBytes": end.usage.peak_memory_bytes,
                  "outputBytes": out.produced_bytes + err.produced_bytes},
        "provenance": {"eventId": validated_id, "artifactRefs": [r.artifact_id for r in end.artifacts]},
    }
    if end.artifacts_omitted:
        result["artifactsOmitted"] = end.artifacts_omitted
    if error:
        result["error"] = error
    return result


def observation_drafts(files: FileRecord, network: NetworkRecord) -> list[EventDraft]:
    """FileAccessObserved and NetworkAccessObserved. Accesses go in batches: a test run
    touches thousands of files, and one event per path would cost the log more than the run."""
    drafts = [draft(e) for e in
              activity.file_access_events(files.events, FILE_ENTRIES_PER_EVENT, FILE_READS_PER_EVENT)]
    if files.incomplete:
        drafts.append(draft(FileAccessObserved(accesses=[], incomplete=files.incomplete)))
    drafts += [draft(c.observed()) for c in network.connections]
    if network.dropped:
        counted = CountedAttempts(network.dropped, by_destination=[
            DestinationCount(h, port, d, n, up, down) for (h, port, d), (n, up, down) in sorted(network.overflow.items())])
        drafts.append(draft(NetworkAccessObserved(counted=counted)))
    return drafts


def _stream_digest(summary: StreamSummary) -> OutputDigest:
    return OutputDigest(summary.produced_bytes, summary.stored_bytes, summary.content_hash)


def finished_call(end: CallEnd, finished_id: str, validated_id: str,
                  redact: Callable[[str], str] | None = None) -> FinishedCall:
    """The result and every event that records the end of the call: observations,
    ToolCallFinished, ToolResultValidated (the whole result, so that the log alone can
    answer for the call), an OutputDigest per artifact. With `redact`, the secrets are
    struck from every string the sandbox could have chosen."""
    result = result_of(end, validated_id)
    drafts = observation_drafts(end.files, end.network)
    drafts += [
        draft(ToolCallFinished(result["exitCode"], result["signal"], end.timed_out, result["oomKilled"],
                               bool(end.cancel_reason), end.failure.message if end.failure else "", result["usage"],
                               _stream_digest(end.stdout), _stream_digest(end.stderr)), finished_id),
        draft(ToolResultValidated(result), validated_id),
    ] + [persisted(r) for r in end.artifacts]
    if redact is not None:
        # Before anything is hashed into the log: a sandbox can name a file, a host or a
        # method after its secret as easily as it prints it.
        drafts, result = redact_sandbox_strings(drafts, result, redact)
    return FinishedCall(result, drafts, finished_id)


def interrupted_call(tool_call_id: str, artifacts: list[ArtifactRecord], finished_id: str,
                     validated_id: str) -> FinishedCall:
    """The recorded end of a call a stopped daemon never finished."""
    result = error_result(tool_call_id, "INTERRUPTED",
                          "the daemon stopped before the call finished; its sandbox was removed")
    result["artifacts"] = [artifact_json(r) for r in artifacts]
    result["provenance"] = {"eventId": validated_id, "artifactRefs": [r.artifact_id for r in artifacts]}
    drafts = [
        draft(ToolCallFinished.interrupted_call(), finished_id),
        draft(ToolResultValidated(result), validated_id),
    ] + [persisted(r) for r in artifacts]
    return FinishedCall(result, drafts, finished_id)


def _redact_tree(value: Any, redact: Callable[[str], str]) -> Any:
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
                           redact: Callable[[str], str]) -> tuple[list[EventDraft], dict[str, Any]]:
    """The call's drafts and result with the secrets struck from every string a sandbox
    could have chosen: file and network records, the effects, failure and error texts.
    (Digests, ids and the daemon's own fields are left as they are.)"""
    result = {**result, "effectsObserved": _redact_tree(result["effectsObserved"], redact)}
    if "error" in result:
        result["error"] = {**result["error"], "message": redact(result["error"]["message"])}
    out: list[EventDraft] = []
    for d in drafts:
        if d.type in SANDBOX_WORDED_EVENTS:
            d = replace(d, payload=_redact_tree(d.payload, redact))
        elif d.type == ev.FINISHED:
            finished = ToolCallFinished.from_payload(d.payload)
            d = draft(replace(finished, failure=redact(finished.failure or "")), d.event_id)
        elif d.type == ev.RESULT_VALIDATED:
            d = draft(ToolResultValidated(result), d.event_id)
        out.append(d)
    return out, result
