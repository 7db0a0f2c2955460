"""AsyncSandboxdClient: the asyncio twin of client.SandboxdClient, method for method
(its requests are built by the same functions), raising only sandboxd_client.errors."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import grpc

from .client import (CHANNEL_OPTIONS, CallOutcome, TlsFiles, checked_artifact, default_socket, explain_request,
                     output_refs, outcome_of, run_request, sandbox_request)
from .errors import SandboxdClientError, from_rpc_error
from .transfer import Receiver, TransferError, local_entries, upload_requests
from sandboxd_contract.calls import build_call
from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc


class AsyncExecuteStream:
    """One call's events (`async for`); `cancel()` abandons it (the daemon then cancels
    the call and removes its sandbox), as does leaving the loop early."""

    def __init__(self, rpc: Any):
        self._rpc = rpc

    async def __aiter__(self) -> AsyncIterator[pb.ExecuteEvent]:
        try:
            async for event in self._rpc:
                yield event
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            if not self._rpc.done():  # the caller stopped reading: the call is not wanted
                self._rpc.cancel()

    def cancel(self) -> None:
        self._rpc.cancel()


class AsyncSandboxdClient:
    def __init__(self, socket_path: str | None = None, *, target: str | None = None, tls: TlsFiles | None = None):
        """The Unix socket (default), or `target` "host:port" with `tls` (the daemon only
        speaks mutual TLS on TCP)."""
        if tls is not None:
            if not target:
                raise ValueError("tls needs a host:port target")
            self._channel = grpc.aio.secure_channel(target, tls.credentials(), options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(target or f"unix:{socket_path or default_socket()}",
                                                      options=CHANNEL_OPTIONS)
        self._exec = pb_grpc.ExecutionServiceStub(self._channel)
        self._artifacts = pb_grpc.ArtifactServiceStub(self._channel)
        self._traces = pb_grpc.TraceServiceStub(self._channel)
        self._audit = pb_grpc.AuditServiceStub(self._channel)
        self._pools = pb_grpc.PoolServiceStub(self._channel)
        self._files = pb_grpc.FileServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Connects now rather than at the first call."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise SandboxdClientError(f"the daemon did not answer within {timeout_s} s") from None

    async def __aenter__(self) -> "AsyncSandboxdClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method: Any, request: Any) -> Any:
        """One unary RPC, its failure as the client's error."""
        try:
            return await method(request)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def execute(self, call: dict[str, Any] | pb.PreparedToolCall, timeout_s: float | None = None) -> AsyncExecuteStream:
        """Starts a call; `async for` over the returned stream for its events."""
        return AsyncExecuteStream(self._exec.Execute(pb.ExecuteRequest(call=build_call(call)), timeout=timeout_s))

    async def run(self, call: dict[str, Any] | pb.PreparedToolCall, timeout_s: float | None = None) -> CallOutcome:
        """Runs a call to the end (Run) and collects its output and result; output larger
        than the response holds comes from the artifact store."""
        try:
            response = await self._exec.Run(run_request(call), timeout=timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        downloaded = {}
        for ref in output_refs(response):
            sink = io.BytesIO()
            await self.download_artifact(ref.artifact_id, sink)
            downloaded[ref.kind] = sink.getvalue()
        return outcome_of(response, downloaded)

    async def cancel(self, tool_call_id: str, reason: str = "") -> bool:
        return (await self._unary(self._exec.Cancel, pb.CancelRequest(tool_call_id=tool_call_id,
                                                                      reason=reason))).cancelled

    async def list_running(self) -> pb.ListRunningResponse:
        """The caller's running calls and the leases it holds (an admin: everyone's)."""
        return await self._unary(self._exec.ListRunning, pb.ListRunningRequest())

    def stream_output(self, tool_call_id: str, *, follow: bool = False, stdout_offset: int = 0,
                      stderr_offset: int = 0) -> AsyncExecuteStream:
        """A call's output for a client other than the one that started it (as
        SandboxdClient.stream_output); going away never cancels the call."""
        return AsyncExecuteStream(self._exec.StreamOutput(pb.StreamOutputRequest(
            tool_call_id=tool_call_id, follow=follow, stdout_offset=stdout_offset, stderr_offset=stderr_offset)))

    async def explain(self, policy: dict[str, Any] | None, workspace: str, *, image: str = "", adapter: str = "",
                      argv: list[str] | None = None, cwd: str = "") -> pb.ExplainPolicyResponse:
        """What the policy would materialize to, without running anything (a dry run)."""
        request = explain_request(policy, workspace, image=image, adapter=adapter, argv=argv, cwd=cwd)
        return await self._unary(self._exec.ExplainPolicy, request)

    async def list_artifacts(self, tool_call_id: str) -> list[pb.ArtifactRef]:
        return list((await self._unary(self._artifacts.ListArtifacts,
                                       pb.ListArtifactsRequest(tool_call_id=tool_call_id))).artifacts)

    async def download_artifact(self, artifact_id: str, sink: BinaryIO) -> pb.ArtifactRef:
        """Streams an artifact into `sink` and checks its sha256; raises on mismatch."""
        ref = None
        digest = hashlib.sha256()
        try:
            async for chunk in self._artifacts.DownloadArtifact(pb.DownloadArtifactRequest(artifact_id=artifact_id)):
                if chunk.HasField("artifact"):
                    ref = chunk.artifact
                digest.update(chunk.data)
                sink.write(chunk.data)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return checked_artifact(artifact_id, ref, digest)

    async def upload_requests(self, requests: Iterator[pb.UploadRequest]) -> pb.TransferResult:
        """FileService.Upload of prepared requests (transfer.upload_requests makes them)."""
        try:
            return await self._files.Upload(requests)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def upload(self, to: pb.TransferTarget, path: str, source: str | os.PathLike) -> pb.TransferResult:
        """As SandboxdClient.upload."""
        return await self.upload_requests(upload_requests(to, path, local_entries(Path(source))))

    async def download(self, frm: pb.TransferTarget, path: str, dest: str | os.PathLike) -> pb.TransferResult:
        """As SandboxdClient.download."""
        receiver = Receiver(Path(dest))
        try:
            async for chunk in self._files.Download(pb.DownloadRequest(target=frm, path=path)):
                result = receiver.feed(chunk)
                if result is not None:
                    return result
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            receiver.abandon()
        raise TransferError("the download ended before its result")

    async def get_trace(self, tool_call_id: str) -> list[pb.TraceEvent]:
        return list((await self._unary(self._traces.GetTrace, pb.GetTraceRequest(tool_call_id=tool_call_id))).events)

    async def verify_log(self) -> pb.VerifyLogResponse:
        return await self._unary(self._traces.VerifyLog, pb.VerifyLogRequest())

    async def export_events(self, tool_call_id: str = "", after_seq: int = 0) -> AsyncIterator[pb.TraceEvent]:
        try:
            async for event in self._traces.ExportEvents(pb.ExportEventsRequest(tool_call_id=tool_call_id,
                                                                                 after_seq=after_seq)):
                yield event
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def query_calls(self, **filters: Any) -> pb.QueryCallsResponse:
        """One page of recorded calls, newest first (filters: SandboxdClient.query_calls')."""
        return await self._unary(self._audit.QueryCalls, pb.QueryCallsRequest(**filters))

    async def iter_calls(self, **filters: Any) -> AsyncIterator[pb.CallSummary]:
        """Every matching call, newest first, page by page."""
        token = filters.pop("page_token", "")
        while True:
            page = await self.query_calls(page_token=token, **filters)
            for summary in page.calls:
                yield summary
            token = page.next_page_token
            if not token:
                return

    async def acquire_sandbox(self, workspace: str, policy: dict[str, Any] | None = None, *, image: str = "",
                              adapter: str = "", lease_ms: int = 0, wait_ms: int = 0) -> pb.Lease:
        """A lease on a warm sandbox; run calls in it with runtime.leaseId = lease.lease_id."""
        request = sandbox_request(workspace, policy, image=image, adapter=adapter, lease_ms=lease_ms, wait_ms=wait_ms)
        return await self._unary(self._pools.AcquireSandbox, request)

    async def create_pool(self, workspace: str, policy: dict[str, Any] | None = None, *, image: str = "",
                          adapter: str = "") -> pb.PoolStatus:
        """Makes (and starts warming) the pool a later acquire_sandbox with the same
        arguments leases from."""
        sandbox = sandbox_request(workspace, policy, image=image, adapter=adapter)
        return await self._unary(self._pools.CreatePool, pb.CreatePoolRequest(sandbox=sandbox))

    async def release_sandbox(self, lease_id: str) -> None:
        await self._unary(self._pools.ReleaseSandbox, pb.ReleaseSandboxRequest(lease_id=lease_id))

    async def list_pools(self) -> list[pb.PoolStatus]:
        return list((await self._unary(self._pools.ListPools, pb.ListPoolsRequest())).pools)

    async def drain_pools(self, pool_key: str = "") -> int:
        return (await self._unary(self._pools.DrainPool, pb.DrainPoolRequest(pool_key=pool_key))).destroyed
