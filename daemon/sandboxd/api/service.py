"""gRPC servicers: they only translate proto <-> domain. Errors are turned into status
codes in exactly one place, ErrorInterceptor."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import json_format, message_factory

from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

from sandboxd.ledger import audit
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.sandbox.spec import network_plan
from sandboxd.core.errors import InvalidArgument, NotFound, PermissionDenied, SandboxdError, Unauthenticated
from sandboxd.ledger.events import EventLog
from sandboxd.calls.executor import CallExecutor, CallRun, ReplayRun
from sandboxd.sandbox.output import STDOUT
from sandboxd.core.settings import DaemonSettings
from sandboxd.api.transport import peer_uid, resolve_principal
from sandboxd.policy.principal import Principal

log = logging.getLogger("sandboxd.api.service")
TOOL_CALL_ID_KEY = "sandboxd-tool-call-id"
DOWNLOAD_CHUNK_BYTES = 256 * 1024
# Run's output in its response: by default (under gRPC's usual 4 MiB receive limit), and
# at most (this daemon's channel takes 64 MiB).
RUN_INLINE_OUTPUT_BYTES = 3 * 1024 * 1024
RUN_INLINE_OUTPUT_MAX_BYTES = 32 * 1024 * 1024


def message_to_json(message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=False)


def call_to_json(call: pb.PreparedToolCall) -> dict[str, Any]:
    raw = message_to_json(call)
    if call.stdin:
        raw["stdin"] = bytes(call.stdin)
    else:
        raw.pop("stdin", None)
    return raw


class Authenticator:
    """The caller of an RPC: on the Unix socket, from the uid the peer-credential relay
    recorded; on TCP (mutual TLS only), from the client certificate's subject CN. Either
    way a principal of the daemon's config, or UNAUTHENTICATED."""

    def __init__(self, settings: DaemonSettings):
        self._settings = settings
        self._uid_of = {name: uid for uid, name in settings.principals.items()}

    def __call__(self, context: grpc.ServicerContext) -> Principal:
        auth = context.auth_context() or {}
        if auth.get("transport_security_type") == [b"ssl"]:
            return self._from_certificate(auth)
        return resolve_principal(peer_uid(context, self._settings.internal_dir), self._settings)

    def _from_certificate(self, auth: dict) -> Principal:
        tcp = self._settings.tcp
        names = auth.get("x509_common_name") or []
        if tcp is None or not names:
            raise Unauthenticated("the client certificate names no subject (CN)")
        cn = names[0].decode("utf-8", "replace")
        name = tcp.subjects.get(cn) if tcp.subjects else cn
        if name is None or name not in self._uid_of:
            raise Unauthenticated(f"certificate subject CN={cn} is not a principal of this daemon")
        # A TCP principal is the same tenant as its uid on the socket: same workspaces.
        return Principal(name=name, uid=self._uid_of[name], admin=name in self._settings.admins)


def _abort(context: grpc.ServicerContext, exc: SandboxdError) -> None:
    if exc.tool_call_id:
        context.set_trailing_metadata(((TOOL_CALL_ID_KEY, exc.tool_call_id),))
    context.abort(exc.code, exc.message)


def _wrap_unary(behavior: Callable) -> Callable:
    def wrapper(request, context):
        try:
            return behavior(request, context)
        except SandboxdError as exc:
            _abort(context, exc)
        except Exception:
            if context.code() is not None:  # already aborted deliberately
                raise
            log.exception("unhandled error in %s", getattr(behavior, "__name__", "handler"))
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
    return wrapper


def _wrap_stream(behavior: Callable) -> Callable:
    def wrapper(request, context):
        try:
            yield from behavior(request, context)
        except SandboxdError as exc:
            _abort(context, exc)
        except Exception:
            if context.code() is not None:
                raise
            log.exception("unhandled error in %s", getattr(behavior, "__name__", "handler"))
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
    return wrapper


class ErrorInterceptor(grpc.ServerInterceptor):
    """SandboxdError -> its status code; anything else -> INTERNAL without details."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        return handler


class ExecutionServicer(pb_grpc.ExecutionServiceServicer):
    def __init__(self, executor: CallExecutor, authenticate: Authenticator):
        self._executor = executor
        self._authenticate = authenticate

    def Execute(self, request: pb.ExecuteRequest, context) -> Iterator[pb.ExecuteEvent]:
        run = self._executor.submit(call_to_json(request.call), self._authenticate(context))
        if not context.add_callback(lambda: run.cancel("the client went away") if run.result is None else None):
            run.cancel("the client went away")  # gone already: no callback will come
        context.set_trailing_metadata(((TOOL_CALL_ID_KEY, run.tool_call_id),))
        for item in run.stream(is_active=context.is_active):
            out = pb.ExecuteEvent(tool_call_id=run.tool_call_id, event_id=item.event_id)
            if item.kind == "accepted":
                out.accepted.CopyFrom(pb.CallAccepted(tool_call_id=run.tool_call_id, **item.data))
            elif item.kind == "started":
                out.started.sandbox_id = item.data["sandboxId"]
            elif item.kind == "output":
                stream, offset, data = item.data
                yield encode_output_event(run.tool_call_id, stream, offset, data)
                continue
            else:
                out.finished.result.CopyFrom(result_to_pb(item.data))
            yield out

    def Run(self, request: pb.RunRequest, context) -> pb.RunResponse:
        run = self._executor.submit(call_to_json(request.call), self._authenticate(context), start=False)
        try:
            context.set_trailing_metadata(((TOOL_CALL_ID_KEY, run.tool_call_id),))
            if not context.add_callback(lambda: run.cancel("the client went away") if run.result is None else None):
                run.cancel("the client went away")  # gone already: no callback will come
        finally:
            if isinstance(run, CallRun):
                run.run_here()  # accepted: it runs whatever happened to the caller
        try:
            finished = run.finished(is_active=context.is_active)
            if finished is None:
                context.abort(grpc.StatusCode.CANCELLED, "the client went away")
            result, event_id = finished
            limit = min(request.max_inline_output_bytes or RUN_INLINE_OUTPUT_BYTES, RUN_INLINE_OUTPUT_MAX_BYTES)
            output = self._executor.stored_output(result, limit)
        finally:
            if isinstance(run, ReplayRun):
                run.close()
        response = pb.RunResponse(tool_call_id=run.tool_call_id, event_id=event_id, output_inline=output is not None)
        response.result.CopyFrom(result_to_pb(result))
        if output is not None:
            response.stdout, response.stderr = output
        return response

    def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        if not request.tool_call_id:
            raise InvalidArgument("required", field="toolCallId")
        caller = self._authenticate(context)
        return pb.CancelResponse(cancelled=self._executor.cancel(
            request.tool_call_id, request.reason or "cancelled by the caller", caller))

    def refused(self, method: str, request, caller: Principal, exc: SandboxdError) -> None:
        """An Execute or Run refused before it reached the executor (rpc_limits: over
        its caller's cap) is on the log all the same, under an id of its own."""
        tool_call_id = ev.new_id("tc")
        exc.tool_call_id = tool_call_id
        try:
            # A request whose message never came (within rpc_limits.REFUSED_READ_S) is on
            # record all the same: who, when and why, with nothing of what it would have asked.
            raw = call_to_json(request.call) if request is not None else {}
            requested = raw.get("toolCallId") if isinstance(raw.get("toolCallId"), str) else ""
            self._executor._reject(tool_call_id, raw, caller.name, "admission", exc, requested)
        except Exception:  # refused all the same; the daemon's log says why it is not on record
            log.exception("recording the refusal of %s %s failed", method, tool_call_id)

    def ExplainPolicy(self, request: pb.ExplainPolicyRequest, context) -> pb.ExplainPolicyResponse:
        caller = self._authenticate(context)
        raw: dict[str, Any] = {
            "toolId": "sandboxd.explain",
            "argv": list(request.argv) or ["true"],
            "workspace": request.workspace,
            "authorization": {"status": "not_required"},
        }
        if request.HasField("policy"):
            raw["policy"] = message_to_json(request.policy)
        if request.HasField("runtime"):
            raw["runtime"] = message_to_json(request.runtime)
        if request.cwd:
            raw["cwd"] = request.cwd
        prepared, notes = self._executor.explain(raw, caller)
        return pb.ExplainPolicyResponse(
            backend=prepared.backend.name,
            image=prepared.image,
            effective_policy_json=json.dumps(prepared.policy.to_json_dict(), indent=2, sort_keys=True),
            spec_json=json.dumps(prepared.spec.to_json_dict(), indent=2, sort_keys=True),
            notes=notes,
            network_plan_json=json.dumps(network_plan(prepared.policy, prepared.egress), indent=2, sort_keys=True),
        )


def result_to_pb(result: dict[str, Any]) -> pb.ToolResult:
    """A result in its JSON form (camelCase, as recorded) as a message: what
    json_format.ParseDict makes of it, in a third of the time (a tenth of a millisecond
    on every call's path), and a thousand effect paths at once instead of one by one."""
    return _from_json(pb.ToolResult, result)


def _from_json(cls, data: dict[str, Any]):
    fields = cls.DESCRIPTOR.fields_by_camelcase_name
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            raise json_format.ParseError(f"{cls.DESCRIPTOR.full_name} has no field {key!r}")
        if field.message_type is not None:
            sub = message_factory.GetMessageClass(field.message_type)
            value = [_from_json(sub, v) for v in value] if field.is_repeated else _from_json(sub, value)
        kwargs[field.name] = value
    return cls(**kwargs)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _length_delimited(tag: int, payload_len: int) -> bytes:
    return bytes([tag]) + _varint(payload_len)


def encode_output_event(tool_call_id: str, stream: int, offset: int, data: bytes) -> bytes:
    """ExecuteEvent{tool_call_id, output: OutputChunk{stream, offset, data}} in protobuf
    wire format, built around `data` with one copy: output chunks are most of the bytes
    a call streams, and building messages would copy each chunk twice more."""
    stream_value = pb.OUTPUT_STREAM_STDOUT if stream == STDOUT else pb.OUTPUT_STREAM_STDERR
    chunk_head = b"\x08" + _varint(stream_value) + (b"\x10" + _varint(offset) if offset else b"")
    data_head = _length_delimited(0x1A, len(data)) if data else b""  # proto3 omits empty fields
    chunk_len = len(chunk_head) + len(data_head) + len(data)
    call_id = tool_call_id.encode()
    head = (_length_delimited(0x0A, len(call_id)) + call_id if call_id else b"")
    return b"".join((head, _length_delimited(0x2A, chunk_len), chunk_head, data_head, data))


def _serialize_event(event: pb.ExecuteEvent | bytes) -> bytes:
    return event if isinstance(event, bytes) else event.SerializeToString()


def add_execution_service(servicer: "ExecutionServicer", server: grpc.Server) -> None:
    """Like the generated registration, except that Execute's serializer passes
    pre-encoded output events through."""
    handlers = {
        "Execute": grpc.unary_stream_rpc_method_handler(
            servicer.Execute, request_deserializer=pb.ExecuteRequest.FromString, response_serializer=_serialize_event),
        "Run": grpc.unary_unary_rpc_method_handler(
            servicer.Run, request_deserializer=pb.RunRequest.FromString,
            response_serializer=pb.RunResponse.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            servicer.Cancel, request_deserializer=pb.CancelRequest.FromString,
            response_serializer=pb.CancelResponse.SerializeToString),
        "ExplainPolicy": grpc.unary_unary_rpc_method_handler(
            servicer.ExplainPolicy, request_deserializer=pb.ExplainPolicyRequest.FromString,
            response_serializer=pb.ExplainPolicyResponse.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["ExecutionService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


def artifact_to_pb(r) -> pb.ArtifactRef:
    return pb.ArtifactRef(artifact_id=r.artifact_id, kind=r.kind, uri=r.uri, content_hash=r.content_hash,
                          size_bytes=r.size_bytes, summary=r.summary, tool_call_id=r.tool_call_id,
                          event_id=r.event_id, created_at=r.created_at)


class ArtifactServicer(pb_grpc.ArtifactServiceServicer):
    def __init__(self, store: FileArtifactStore, executor: CallExecutor, authenticate: Authenticator):
        self._store = store
        self._executor = executor
        self._authenticate = authenticate

    def ListArtifacts(self, request: pb.ListArtifactsRequest, context) -> pb.ListArtifactsResponse:
        if not request.tool_call_id:
            raise InvalidArgument("required", field="toolCallId")
        self._executor.check_access(request.tool_call_id, self._authenticate(context))
        return pb.ListArtifactsResponse(artifacts=[artifact_to_pb(r) for r in self._store.list_for_call(request.tool_call_id)])

    def _not_found(self, artifact_id: str, caller) -> NotFound:
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

    def DownloadArtifact(self, request: pb.DownloadArtifactRequest, context) -> Iterator[pb.ArtifactChunk]:
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
    def __init__(self, events: EventLog, executor: CallExecutor, authenticate: Authenticator, checkpoints=None):
        self._events = events
        self._checkpoints = checkpoints
        self._executor = executor
        self._authenticate = authenticate

    def _admin(self, context) -> None:
        if not self._authenticate(context).admin:
            raise PermissionDenied("the whole log is for admin principals; ask for one call's trace instead")

    def GetTrace(self, request: pb.GetTraceRequest, context) -> pb.GetTraceResponse:
        if not request.tool_call_id:
            raise InvalidArgument("required", field="toolCallId")
        self._executor.check_access(request.tool_call_id, self._authenticate(context))
        found = self._events.for_call(request.tool_call_id)
        if not found:
            raise NotFound(f"no trace for call {request.tool_call_id}", field="toolCallId")
        return pb.GetTraceResponse(events=[event_to_pb(e) for e in found])

    def VerifyLog(self, request: pb.VerifyLogRequest, context) -> pb.VerifyLogResponse:
        self._admin(context)
        report = self._events.verify(self._checkpoints.read() if self._checkpoints else ())
        return pb.VerifyLogResponse(ok=report.ok, events_checked=report.events_checked,
                                    first_bad_seq=report.first_bad_seq or 0, reason=report.reason,
                                    head_hash=report.head_hash)

    def ExportEvents(self, request: pb.ExportEventsRequest, context) -> Iterator[pb.TraceEvent]:
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


def event_to_pb(e) -> pb.TraceEvent:
    return pb.TraceEvent(seq=e.seq, event_id=e.event_id, tool_call_id=e.tool_call_id, type=e.type, time=e.time,
                         parent_event_id=e.parent_event_id, payload_json=e.payload_json,
                         prev_hash=e.prev_hash, hash=e.hash)


class AuditServicer(pb_grpc.AuditServiceServicer):
    """Forensic queries (audit.py). A principal that is not an admin sees its own calls only."""

    def __init__(self, index: "audit.AuditIndex", authenticate: Authenticator):
        self._index = index
        self._authenticate = authenticate

    def QueryCalls(self, request: pb.QueryCallsRequest, context) -> pb.QueryCallsResponse:
        caller = self._authenticate(context)
        principal = request.principal
        if not caller.admin:
            if principal and principal != caller.name:
                return pb.QueryCallsResponse()  # other tenants' calls do not exist for this caller
            principal = caller.name
        q = audit.CallQuery(
            command_contains=request.command_contains, path=request.path, path_operation=request.path_operation,
            domain=request.domain, principal=principal, workspace=request.workspace, status=request.status,
            since=request.since, until=request.until, page_size=request.page_size, page_token=request.page_token)
        try:
            audit.check_query(q)  # a bad filter is refused before any indexing
            self._index.sync()  # every call recorded before this query is in the answer
            rows, token = audit.query_calls(self._index.db, q)
        except audit.BadFilter as exc:
            raise InvalidArgument(exc.reason, field=exc.field) from None
        return pb.QueryCallsResponse(calls=[_call_summary(r) for r in rows], next_page_token=token)


def _call_summary(r: dict[str, Any]) -> pb.CallSummary:
    summary = pb.CallSummary(
        tool_call_id=r["tool_call_id"], principal=r["principal"], workspace=r["workspace"], command=r["command"],
        tool_id=r["tool_id"], backend=r["backend"], image=r["image"], status=r["status"],
        error_code=r["error_code"], requested_at=r["requested_at"], finished_at=r["finished_at"],
        domains=r["domains"])
    if r["exit_code"] is not None:
        summary.exit_code = r["exit_code"]
    return summary


class PoolServicer(pb_grpc.PoolServiceServicer):
    """Leases on warm sandboxes (pools.py); a lease is its principal's alone."""

    def __init__(self, executor: CallExecutor, authenticate: Authenticator):
        self._executor = executor
        self._authenticate = authenticate

    @staticmethod
    def _template(request: pb.AcquireSandboxRequest) -> dict[str, Any]:
        raw: dict[str, Any] = {"toolId": "sandboxd.pool", "argv": ["supervisor"], "workspace": request.workspace,
                               "authorization": {"status": "not_required"}}
        if request.HasField("policy"):
            raw["policy"] = message_to_json(request.policy)
        if request.HasField("runtime"):
            runtime = message_to_json(request.runtime)
            runtime.pop("leaseId", None)
            runtime.pop("idempotencyKey", None)
            raw["runtime"] = runtime
        return raw

    def CreatePool(self, request: pb.CreatePoolRequest, context) -> pb.PoolStatus:
        caller = self._authenticate(context)
        status = self._executor.create_pool(self._template(request.sandbox), caller)
        return json_format.ParseDict(status, pb.PoolStatus())

    def AcquireSandbox(self, request: pb.AcquireSandboxRequest, context) -> pb.Lease:
        caller = self._authenticate(context)
        lease = self._executor.acquire(self._template(request), caller, request.lease_ms, request.wait_ms)
        return json_format.ParseDict(lease.to_json(), pb.Lease())

    def ReleaseSandbox(self, request: pb.ReleaseSandboxRequest, context) -> pb.ReleaseSandboxResponse:
        caller = self._authenticate(context)
        if self._executor.pools is None:
            raise NotFound(f"no lease {request.lease_id}", field="leaseId")
        self._executor.pools.release(request.lease_id, caller)
        return pb.ReleaseSandboxResponse()

    def ListPools(self, request: pb.ListPoolsRequest, context) -> pb.ListPoolsResponse:
        caller = self._authenticate(context)
        # Pool keys name workspaces: a principal sees the pools it made, an admin all.
        pools = [] if self._executor.pools is None else self._executor.pools.list(None if caller.admin else caller.name)
        return pb.ListPoolsResponse(pools=[json_format.ParseDict(p, pb.PoolStatus()) for p in pools])

    def DrainPool(self, request: pb.DrainPoolRequest, context) -> pb.DrainPoolResponse:
        if not self._authenticate(context).admin:
            raise PermissionDenied("draining pools is for admin principals")
        n = self._executor.pools.drain(request.pool_key) if self._executor.pools is not None else 0
        return pb.DrainPoolResponse(destroyed=n)
