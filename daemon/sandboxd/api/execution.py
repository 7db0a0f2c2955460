"""ExecutionService: Execute, Run, Cancel, ExplainPolicy, and a second client's view of
running calls (ListRunning, StreamOutput), translated to the executor."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf import json_format

from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

from sandboxd.api.auth import Authenticator
from sandboxd.api.errors import TOOL_CALL_ID_KEY
from sandboxd.api.messages import call_to_json, encode_output_event, message_to_json, result_to_pb, serialize_event
from sandboxd.calls.executor import CallExecutor, CallRun, ReplayRun, StreamItem
from sandboxd.core.errors import InvalidArgument, SandboxdError
from sandboxd.ledger import events as ev
from sandboxd.policy.principal import Principal
from sandboxd.sandbox.output import STDERR, STDOUT
from sandboxd.sandbox.spec import network_plan

log = logging.getLogger("sandboxd.api.execution")
# Run's output in its response: by default (under gRPC's usual 4 MiB receive limit), and
# at most (this daemon's channel takes 64 MiB).
RUN_INLINE_OUTPUT_BYTES = 3 * 1024 * 1024
RUN_INLINE_OUTPUT_MAX_BYTES = 32 * 1024 * 1024


class ExecutionServicer(pb_grpc.ExecutionServiceServicer):
    def __init__(self, executor: CallExecutor, authenticate: Authenticator):
        self._executor = executor
        self._authenticate = authenticate

    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> Iterator[pb.ExecuteEvent | bytes]:
        run = self._executor.submit(call_to_json(request.call), self._authenticate(context))
        if not context.add_callback(lambda: run.cancel("the client went away") if run.result is None else None):
            run.cancel("the client went away")  # gone already: no callback will come
        context.set_trailing_metadata(((TOOL_CALL_ID_KEY, run.tool_call_id),))
        for item in run.stream(is_active=context.is_active):
            if item.kind == "output":
                stream, offset, data = item.data
                yield encode_output_event(run.tool_call_id, stream, offset, data)
            else:
                yield self._event(run.tool_call_id, item)

    def Run(self, request: pb.RunRequest, context: grpc.ServicerContext) -> pb.RunResponse:
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
                raise AssertionError("unreachable")  # abort raises
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

    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        if not request.tool_call_id:
            raise InvalidArgument("required", field="toolCallId")
        caller = self._authenticate(context)
        return pb.CancelResponse(cancelled=self._executor.cancel(
            request.tool_call_id, request.reason or "cancelled by the caller", caller))

    def ListRunning(self, request: pb.ListRunningRequest, context: grpc.ServicerContext) -> pb.ListRunningResponse:
        caller = self._authenticate(context)
        pools = self._executor.pools
        leases = [] if pools is None else pools.leases(None if caller.admin else caller.name)
        return pb.ListRunningResponse(calls=[json_format.ParseDict(c, pb.RunningCall())
                                             for c in self._executor.running(caller)],
                                      leases=[json_format.ParseDict(h, pb.HeldLease()) for h in leases])

    def StreamOutput(self, request: pb.StreamOutputRequest,
                     context: grpc.ServicerContext) -> Iterator[pb.ExecuteEvent | bytes]:
        if not request.tool_call_id:
            raise InvalidArgument("required", field="toolCallId")
        source = self._executor.follow(request.tool_call_id, self._authenticate(context), context.is_active)
        # Not following: what a running call's spool holds now; a call that has a result
        # (already, or by the time its spool is read) is read to its end.
        live = context.is_active if request.follow else (lambda: source.result is not None and context.is_active())
        since = {STDOUT: request.stdout_offset, STDERR: request.stderr_offset}
        try:
            for item in source.stream(is_active=live):
                if item.kind != "output":
                    yield self._event(source.tool_call_id, item)
                    continue
                stream, offset, data = item.data
                skip = max(0, since[stream] - offset)
                if skip < len(data):
                    yield encode_output_event(source.tool_call_id, stream, offset + skip, data[skip:])
        finally:
            if isinstance(source, ReplayRun):
                source.close()

    @staticmethod
    def _event(tool_call_id: str, item: StreamItem) -> pb.ExecuteEvent:
        """An accepted, started or finished item as Execute sends it."""
        out = pb.ExecuteEvent(tool_call_id=tool_call_id, event_id=item.event_id)
        if item.kind == "accepted":
            out.accepted.CopyFrom(pb.CallAccepted(tool_call_id=tool_call_id, **item.data))
        elif item.kind == "started":
            out.started.sandbox_id = item.data["sandboxId"]
        else:
            out.finished.result.CopyFrom(result_to_pb(item.data))
        return out

    def refused(self, method: str, request: Any, caller: Principal, exc: SandboxdError) -> None:
        """An Execute or Run refused before it reached the executor (api/limits.py: over
        its caller's cap) is on the log all the same, under an id of its own."""
        tool_call_id = ev.new_id("tc")
        exc.tool_call_id = tool_call_id
        try:
            # A request whose message never came (within limits.REFUSED_READ_S) is on
            # record all the same: who, when and why, with nothing of what it would have asked.
            raw = call_to_json(request.call) if request is not None else {}
            asked = raw.get("toolCallId")
            requested = asked if isinstance(asked, str) else ""
            self._executor.record_refusal(tool_call_id, raw, caller.name, "admission", exc, requested)
        except Exception:  # refused all the same; the daemon's log says why it is not on record
            log.exception("recording the refusal of %s %s failed", method, tool_call_id)

    def ExplainPolicy(self, request: pb.ExplainPolicyRequest, context: grpc.ServicerContext) -> pb.ExplainPolicyResponse:
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


def add_execution_service(servicer: ExecutionServicer, server: grpc.Server) -> None:
    """Like the generated registration, except that Execute's serializer passes
    pre-encoded output events through."""
    handlers = {
        "Execute": grpc.unary_stream_rpc_method_handler(
            servicer.Execute, request_deserializer=pb.ExecuteRequest.FromString, response_serializer=serialize_event),
        "Run": grpc.unary_unary_rpc_method_handler(
            servicer.Run, request_deserializer=pb.RunRequest.FromString,
            response_serializer=pb.RunResponse.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            servicer.Cancel, request_deserializer=pb.CancelRequest.FromString,
            response_serializer=pb.CancelResponse.SerializeToString),
        "ExplainPolicy": grpc.unary_unary_rpc_method_handler(
            servicer.ExplainPolicy, request_deserializer=pb.ExplainPolicyRequest.FromString,
            response_serializer=pb.ExplainPolicyResponse.SerializeToString),
        "ListRunning": grpc.unary_unary_rpc_method_handler(
            servicer.ListRunning, request_deserializer=pb.ListRunningRequest.FromString,
            response_serializer=pb.ListRunningResponse.SerializeToString),
        "StreamOutput": grpc.unary_stream_rpc_method_handler(
            servicer.StreamOutput, request_deserializer=pb.StreamOutputRequest.FromString,
            response_serializer=serialize_event),
    }
    name = pb.DESCRIPTOR.services_by_name["ExecutionService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
