"""ArtifactService, TraceService and AuditService: what the daemon kept of its calls,
each answer limited to what the caller may see."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

from sandboxd.api.auth import Authenticator
from sandboxd.api.messages import artifact_to_pb, call_summary, event_to_pb
from sandboxd.calls.executor import CallExecutor
from sandboxd.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from sandboxd.ledger import audit
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.events import CheckpointFile, EventLog
from sandboxd.policy.principal import Principal

DOWNLOAD_CHUNK_BYTES = 256 * 1024


class ArtifactServicer(pb_grpc.ArtifactServiceServicer):
    def __init__(self, store: FileArtifactStore, executor: CallExecutor, authenticate: Authenticator):
        self._store = store
        self._executor = executor
        self._authenticate = authenticate

    def ListArtifacts(self, request: pb.ListArtifactsRequest, context: grpc.ServicerContext) -> pb.ListArtifactsResponse:
        if not request.tool_call_id:
            raise InvalidArgument("required", field="toolCallId")
        self._executor.check_access(request.tool_call_id, self._authenticate(context))
        return pb.ListArtifactsResponse(artifacts=[artifact_to_pb(r) for r in self._store.list_for_call(request.tool_call_id)])

    def _not_found(self, artifact_id: str, caller: Principal) -> NotFound:
        """NOT_FOUND for an artifact with no row: saying it expired if it did and the
        caller may see its call; another tenant's is as if it never existed."""
        expired = self._store.expired(artifact_id)
        if expired is not None:
            try:
                self._executor.check_access(expired[0], caller)
                return NotFound(f"artifact {artifact_id} expired at {expired[1]}: its call is past the "
                                f"retention period (its trace keeps the content hash)", field="artifactId")
            except NotFound:
                pass
        return NotFound(f"no artifact {artifact_id}", field="artifactId")

    def DownloadArtifact(self, request: pb.DownloadArtifactRequest,
                         context: grpc.ServicerContext) -> Iterator[pb.ArtifactChunk]:
        if not request.artifact_id:
            raise InvalidArgument("required", field="artifactId")
        caller = self._authenticate(context)
        try:
            record = self._store.get(request.artifact_id)
        except NotFound:
            raise self._not_found(request.artifact_id, caller) from None
        try:
            self._executor.check_access(record.tool_call_id, caller)
        except NotFound:
            raise NotFound(f"no artifact {request.artifact_id}", field="artifactId") from None
        if record.change == "deleted":
            raise FailedPrecondition(f"artifact {request.artifact_id} records that the call deleted {record.path}: "
                                     "it has no content to download", field="artifactId")
        try:
            blob = self._store.open(record)
        except FileNotFoundError:  # expired between the row and the blob
            raise self._not_found(request.artifact_id, caller) from None
        with blob as f:
            offset = 0
            first = True
            while True:
                data = f.read(DOWNLOAD_CHUNK_BYTES)
                if not data and not first:
                    return
                chunk = pb.ArtifactChunk(offset=offset, data=data)
                if first:
                    chunk.artifact.CopyFrom(artifact_to_pb(record))
                    first = False
                yield chunk
                offset += len(data)
                if not data:
                    return


class TraceServicer(pb_grpc.TraceServiceServicer):
    def __init__(self, events: EventLog, executor: CallExecutor, authenticate: Authenticator,
                 checkpoints: CheckpointFile | None = None):
        self._events = events
        self._checkpoints = checkpoints
        self._executor = executor
        self._authenticate = authenticate

    def _admin(self, context: grpc.ServicerContext) -> None:
        if not self._authenticate(context).admin:
            raise PermissionDenied("the whole log is for admin principals; ask for one call's trace instead")

    def GetTrace(self, request: pb.GetTraceRequest, context: grpc.ServicerContext) -> pb.GetTraceResponse:
        if not request.tool_call_id:
            raise InvalidArgument("required", field="toolCallId")
        self._executor.check_access(request.tool_call_id, self._authenticate(context))
        found = self._events.for_call(request.tool_call_id)
        if not found:
            raise NotFound(f"no trace for call {request.tool_call_id}", field="toolCallId")
        return pb.GetTraceResponse(events=[event_to_pb(e) for e in found])

    def VerifyLog(self, request: pb.VerifyLogRequest, context: grpc.ServicerContext) -> pb.VerifyLogResponse:
        self._admin(context)
        report = self._events.verify(self._checkpoints.read() if self._checkpoints else ())
        return pb.VerifyLogResponse(ok=report.ok, events_checked=report.events_checked,
                                    first_bad_seq=report.first_bad_seq or 0, reason=report.reason,
                                    head_hash=report.head_hash)

    def ExportEvents(self, request: pb.ExportEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.TraceEvent]:
        if request.tool_call_id:
            self._executor.check_access(request.tool_call_id, self._authenticate(context))
            found = self._events.for_call(request.tool_call_id)
            if not found:
                raise NotFound(f"no trace for call {request.tool_call_id}", field="toolCallId")
            yield from (event_to_pb(e) for e in found if e.seq > request.after_seq)
            return
        self._admin(context)
        after = request.after_seq
        while batch := self._events.range(after, 1000):
            yield from (event_to_pb(e) for e in batch)
            after = batch[-1].seq


class AuditServicer(pb_grpc.AuditServiceServicer):
    """Forensic queries (ledger/audit.py). A principal that is not an admin sees its own calls only."""

    def __init__(self, index: audit.AuditIndex, authenticate: Authenticator):
        self._index = index
        self._authenticate = authenticate

    def QueryCalls(self, request: pb.QueryCallsRequest, context: grpc.ServicerContext) -> pb.QueryCallsResponse:
        caller = self._authenticate(context)
        principal = request.principal
        if not caller.admin:
            if principal and principal != caller.name:
                return pb.QueryCallsResponse()  # other tenants' calls do not exist for this caller
            principal = caller.name
        q = audit.CallQuery(
            command_contains=request.command_contains, path=request.path, path_operation=request.path_operation,
            domain=request.domain, principal=principal, workspace=request.workspace, status=request.status,
            since=request.since, until=request.until, page_size=request.page_size, page_token=request.page_token,
            proposed_by=request.proposed_by, session_id=request.session_id)
        try:
            audit.check_query(q)  # a bad filter is refused before any indexing
            self._index.sync()  # every call recorded before this query is in the answer
            rows, token = audit.query_calls(self._index.db, q)
        except audit.BadFilter as exc:
            raise InvalidArgument(exc.reason, field=exc.field) from None
        return pb.QueryCallsResponse(calls=[call_summary(r) for r in rows], next_page_token=token)
