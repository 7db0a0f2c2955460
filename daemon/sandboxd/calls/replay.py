"""Idempotent retries: a retry of an accepted key is answered by the first call, never
a second run: attached to it while it runs, replayed from the event log and the artifact
store once it is done."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import IO, Any, Protocol

from sandboxd.calls.acceptance import replayed_draft
from sandboxd.calls.stream import StreamItem
from sandboxd.core.errors import Aborted, AlreadyExists, FailedPrecondition, InternalError
from sandboxd.ledger import call_rows
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.event_types import ToolCallExpired, ToolCallStarted, ToolPolicyChecked, ToolResultValidated
from sandboxd.ledger.events import EventLog
from sandboxd.ledger.store import Database
from sandboxd.sandbox.output import MAX_CHUNK_BYTES, STDERR, STDOUT

Answer = tuple[dict[str, Any], str]  # (the result, its ToolCallFinished event id)


def _always() -> bool:
    return True


class Followed(Protocol):
    """A running call another consumer can follow (run.CallRun)."""
    tool_call_id: str

    @property
    def result(self) -> dict[str, Any] | None: ...

    def stream(self, is_active: Callable[[], bool] = ...) -> Iterator[StreamItem]: ...

    def finished(self, is_active: Callable[[], bool] = ...) -> Answer | None: ...


class Records(Protocol):
    """Where a finished call is read back from (the executor's log and store)."""
    events: EventLog
    artifacts: FileArtifactStore


class AttachedRun:
    """A second consumer of a running call (an idempotent retry). Going away does not
    cancel the call: its first caller still owns it."""

    def __init__(self, run: Followed):
        self._run = run
        self.tool_call_id = run.tool_call_id

    @property
    def result(self) -> dict[str, Any] | None:
        return self._run.result

    def cancel(self, reason: str) -> bool:
        return False

    def stream(self, is_active: Callable[[], bool] = _always) -> Iterator[StreamItem]:
        return self._run.stream(is_active)

    def finished(self, is_active: Callable[[], bool] = _always) -> Answer | None:
        return self._run.finished(is_active)


class ReplayRun:
    """A call that already finished, answered again from the event log and the artifact
    store: the same events, the same output, the same result. Nothing runs."""

    def __init__(self, records: Records, tool_call_id: str):
        self.tool_call_id = tool_call_id
        self._events = records.events.for_call(tool_call_id)
        recorded = [e for e in self._events if e.type == ev.RESULT_VALIDATED]
        if not recorded:
            raise InternalError(f"call {tool_call_id} has no recorded result")
        self.result: dict[str, Any] = dict(ToolResultValidated.from_payload(recorded[-1].payload).result)
        # Opened now: a retention sweep from here on removes nothing this replay reads.
        self._outputs: list[tuple[int, IO[bytes]]] = []
        store = records.artifacts
        stored = store.list_for_call(tool_call_id)
        named = {a.get("artifactId") for a in self.result.get("artifacts", []) if isinstance(a, dict)}
        try:
            for record in stored:
                stream = {"stdout": STDOUT, "stderr": STDERR}.get(record.kind)
                if stream is not None:
                    self._outputs.append((stream, store.open(record)))
        except FileNotFoundError:
            stored = []
        expired = [e for e in self._events if e.type == ev.EXPIRED]
        if expired or not named <= {r.artifact_id for r in stored}:
            self.close()
            when = (ToolCallExpired.from_payload(expired[-1].payload).expired_at or expired[-1].time) if expired \
                else "just now"
            raise FailedPrecondition(f"call {tool_call_id}, the first with this key, expired ({when}) under the "
                                     "retention period: its output is gone, so it cannot be answered again, and "
                                     "the key is not run twice; its trace remains", field="runtime.idempotencyKey",
                                     tool_call_id=tool_call_id)

    def close(self) -> None:
        for _, f in self._outputs:
            f.close()
        self._outputs = []

    def finished(self, is_active: Callable[[], bool] = _always) -> Answer | None:
        finished = [e for e in self._events if e.type == ev.FINISHED]
        return self.result, finished[-1].event_id if finished else ""

    def cancel(self, reason: str) -> bool:
        return False

    def stream(self, is_active: Callable[[], bool] = _always) -> Iterator[StreamItem]:
        by_type = {e.type: e for e in self._events}
        checked = by_type[ev.POLICY_CHECKED]
        policy = ToolPolicyChecked.from_payload(checked.payload)
        yield StreamItem("accepted", checked.event_id, {"backend": policy.backend, "image": policy.image})
        started = by_type.get(ev.STARTED)
        if started is not None:
            yield StreamItem("started", started.event_id,
                             {"sandboxId": ToolCallStarted.from_payload(started.payload).sandbox_id})
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


def answer_retry(db: Database, records: Records, running: Callable[[str], Followed | None], pending: bool,
                 key: str, digest: str, principal: str) -> AttachedRun | ReplayRun | None:
    """A call already accepted under `key` answers the retry: the running call's
    stream, or the finished call's record. Never a second run. None: the key is new.
    `pending`: the first call with the key is still being prepared."""
    if pending:
        raise Aborted("the first call with this key is still being prepared; retry shortly",
                      field="runtime.idempotencyKey")
    row = call_rows.idempotency_key_row(db, key)
    if row is None:
        return None
    first_digest, first_id = row
    if first_digest != digest:
        raise AlreadyExists(f"was already used by call {first_id} for a different request",
                            field="runtime.idempotencyKey", tool_call_id=first_id)
    run = running(first_id)
    answer: AttachedRun | ReplayRun = (AttachedRun(run) if run is not None and run.result is None
                                       else ReplayRun(records, first_id))
    with db.transaction() as conn:  # the parent is the call's last event at this commit
        last = call_rows.last_event_id(conn, first_id)
        records.events.append(conn, first_id, last, [replayed_draft(principal, key, isinstance(answer, AttachedRun))])
    return answer
