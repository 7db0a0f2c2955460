"""The blocking Python client for sandboxd, SandboxdClient, and what its asyncio twin
(aio.AsyncSandboxdClient) shares with it: the channel's options, the TLS files, the
requests both build the same way and the outcome of a Run. Both speak the proto contract
and raise only sandboxd_client.errors."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import grpc
from google.protobuf import json_format

from .errors import SandboxdClientError, from_rpc_error
from .transfer import local_entries, receive, upload_requests
from sandboxd_contract.calls import build_call, to_json
from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

DEFAULT_SOCKET = "/run/sandboxd/sandboxd.sock"
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024),
                   # A client's identity is its connection (the daemon reads the peer's
                   # uid when it connects): never share one with another client object.
                   ("grpc.use_local_subchannel_pool", 1),
                   ("grpc.http2.max_frame_size", 4 * 1024 * 1024),
                   ("grpc.http2.lookahead_bytes", 64 * 1024 * 1024)]


# Output this client takes inline in a Run response (its channel receives 64 MiB).
RUN_INLINE_BYTES = 32 * 1024 * 1024


def default_socket() -> str:
    return os.environ.get("SANDBOXD_SOCKET", DEFAULT_SOCKET)


def run_request(call: dict[str, Any] | pb.PreparedToolCall) -> pb.RunRequest:
    # RUN_INLINE_BYTES read at each call: a test lowers it to reach the artifact path.
    return pb.RunRequest(call=build_call(call), max_inline_output_bytes=RUN_INLINE_BYTES)


def output_refs(response: pb.RunResponse) -> list[pb.ArtifactRef]:
    """The output artifacts a Run's answer did not carry inline (to download)."""
    if response.output_inline:
        return []
    return [ref for ref in response.result.artifacts if ref.kind in ("stdout", "stderr")]


def outcome_of(response: pb.RunResponse, downloaded: dict[str, bytes]) -> "CallOutcome":
    """A Run's answer: its output inline, or as downloaded from the artifacts."""
    if response.output_inline:
        return CallOutcome(response.tool_call_id, response.result, response.stdout, response.stderr)
    return CallOutcome(response.tool_call_id, response.result, downloaded.get("stdout", b""),
                       downloaded.get("stderr", b""))


def checked_artifact(artifact_id: str, ref: pb.ArtifactRef | None, digest: "hashlib._Hash") -> pb.ArtifactRef:
    """A downloaded artifact's metadata, once its content's sha256 matched it."""
    if ref is None:
        raise SandboxdClientError(f"artifact {artifact_id}: the stream carried no metadata")
    if ref.content_hash != "sha256:" + digest.hexdigest():
        raise SandboxdClientError(f"artifact {artifact_id}: content does not match {ref.content_hash}")
    return ref


def explain_request(policy: dict[str, Any] | None, workspace: str, *, image: str = "", adapter: str = "",
                    argv: list[str] | None = None, cwd: str = "") -> pb.ExplainPolicyRequest:
    request = pb.ExplainPolicyRequest(workspace=workspace, argv=argv or [], cwd=cwd)
    if policy is not None:
        request.policy.CopyFrom(json_format.ParseDict(policy, pb.SandboxPolicy()))
    if image or adapter:
        request.runtime.CopyFrom(pb.RuntimeSettings(image=image, adapter=adapter))
    return request


def sandbox_request(workspace: str, policy: dict[str, Any] | None, *, image: str = "", adapter: str = "",
                    lease_ms: int = 0, wait_ms: int = 0) -> pb.AcquireSandboxRequest:
    """What fixes a warm sandbox (AcquireSandbox's request, and CreatePool's sandbox)."""
    request = pb.AcquireSandboxRequest(workspace=workspace, lease_ms=lease_ms, wait_ms=wait_ms,
                                       runtime=pb.RuntimeSettings(image=image, adapter=adapter))
    if policy is not None:
        json_format.ParseDict(policy, request.policy)
    return request


@dataclass
class CallOutcome:
    """A finished call: its result and its whole stored output (events: those of the
    Execute stream it came from, if it came from one)."""

    tool_call_id: str
    result: pb.ToolResult
    stdout: bytes = b""
    stderr: bytes = b""
    events: list[pb.ExecuteEvent] = field(default_factory=list)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a daemon's mutual-TLS TCP listener: the CA that signed the daemon's
    certificate, and this client's certificate and key."""

    ca_file: str
    cert_file: str
    key_file: str

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file), private_key=read(self.key_file),
                                            certificate_chain=read(self.cert_file))


class SandboxdClient:
    def __init__(self, socket_path: str | None = None, *, target: str | None = None, tls: TlsFiles | None = None):
        """The Unix socket (default), or `target` "host:port" with `tls` (the daemon only
        speaks mutual TLS on TCP)."""
        if tls is not None:
            if not target:
                raise ValueError("tls needs a host:port target")
            self._channel = grpc.secure_channel(target, tls.credentials(), options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target or f"unix:{socket_path or default_socket()}",
                                                  options=CHANNEL_OPTIONS)
        self._exec = pb_grpc.ExecutionServiceStub(self._channel)
        self._artifacts = pb_grpc.ArtifactServiceStub(self._channel)
        self._traces = pb_grpc.TraceServiceStub(self._channel)
        self._audit = pb_grpc.AuditServiceStub(self._channel)
        self._pools = pb_grpc.PoolServiceStub(self._channel)
        self._files = pb_grpc.FileServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Connects now rather than at the first call."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise SandboxdClientError(f"the daemon did not answer within {timeout_s} s") from None

    def __enter__(self) -> "SandboxdClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def execute(self, call: dict[str, Any] | pb.PreparedToolCall, timeout_s: float | None = None) -> "ExecuteStream":
        """Starts a call; iterate the returned stream for its events."""
        return ExecuteStream(self._exec.Execute(pb.ExecuteRequest(call=build_call(call)), timeout=timeout_s))

    def run(self, call: dict[str, Any] | pb.PreparedToolCall, timeout_s: float | None = None) -> CallOutcome:
        """Runs a call to the end and collects its output and result, in one RPC (Run);
        output larger than the response holds comes from the artifact store."""
        try:
            response = self._exec.Run(run_request(call), timeout=timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        downloaded = {}
        for ref in output_refs(response):
            sink = io.BytesIO()
            self.download_artifact(ref.artifact_id, sink)
            downloaded[ref.kind] = sink.getvalue()
        return outcome_of(response, downloaded)

    def cancel(self, tool_call_id: str, reason: str = "") -> bool:
        try:
            return self._exec.Cancel(pb.CancelRequest(tool_call_id=tool_call_id, reason=reason)).cancelled
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def list_running(self) -> pb.ListRunningResponse:
        """The caller's running calls and the leases it holds (an admin: everyone's)."""
        try:
            return self._exec.ListRunning(pb.ListRunningRequest())
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def stream_output(self, tool_call_id: str, *, follow: bool = False, stdout_offset: int = 0,
                      stderr_offset: int = 0) -> ExecuteStream:
        """A call's output for a client other than the one that started it: a running
        call's (live to its end with `follow`), a finished call's from its stored output.
        Events as Execute's; going away never cancels the call."""
        return ExecuteStream(self._exec.StreamOutput(pb.StreamOutputRequest(
            tool_call_id=tool_call_id, follow=follow, stdout_offset=stdout_offset, stderr_offset=stderr_offset)))

    def explain(self, policy: dict[str, Any] | None, workspace: str, *, image: str = "", adapter: str = "",
                argv: list[str] | None = None, cwd: str = "") -> pb.ExplainPolicyResponse:
        """What the policy would materialize to, without running anything (a dry run)."""
        request = explain_request(policy, workspace, image=image, adapter=adapter, argv=argv, cwd=cwd)
        try:
            return self._exec.ExplainPolicy(request)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def list_artifacts(self, tool_call_id: str) -> list[pb.ArtifactRef]:
        try:
            return list(self._artifacts.ListArtifacts(pb.ListArtifactsRequest(tool_call_id=tool_call_id)).artifacts)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def download_artifact(self, artifact_id: str, sink: BinaryIO) -> pb.ArtifactRef:
        """Streams an artifact into `sink` and checks its sha256; raises on mismatch."""
        ref = None
        digest = hashlib.sha256()
        try:
            for chunk in self._artifacts.DownloadArtifact(pb.DownloadArtifactRequest(artifact_id=artifact_id)):
                if chunk.HasField("artifact"):
                    ref = chunk.artifact
                digest.update(chunk.data)
                sink.write(chunk.data)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return checked_artifact(artifact_id, ref, digest)

    def upload_requests(self, requests: Iterator[pb.UploadRequest]) -> pb.TransferResult:
        """FileService.Upload of prepared requests (transfer.upload_requests makes them)."""
        try:
            return self._files.Upload(requests)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def upload(self, to: pb.TransferTarget, path: str, source: str | os.PathLike) -> pb.TransferResult:
        """A local file (to `path` itself) or directory tree (below `path`) into a workspace
        or a leased sandbox (`transfer.target(...)`); lands whole or not at all."""
        return self.upload_requests(upload_requests(to, path, local_entries(Path(source))))

    def download(self, frm: pb.TransferTarget, path: str, dest: str | os.PathLike) -> pb.TransferResult:
        """A file (to `dest` itself) or directory tree (below `dest`) out of a workspace or
        a leased sandbox, each file's sha256 checked."""
        try:
            return receive(self._files.Download(pb.DownloadRequest(target=frm, path=path)), Path(dest))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def get_trace(self, tool_call_id: str) -> list[pb.TraceEvent]:
        try:
            return list(self._traces.GetTrace(pb.GetTraceRequest(tool_call_id=tool_call_id)).events)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def verify_log(self) -> pb.VerifyLogResponse:
        try:
            return self._traces.VerifyLog(pb.VerifyLogRequest())
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def export_events(self, tool_call_id: str = "", after_seq: int = 0) -> Iterator[pb.TraceEvent]:
        try:
            yield from self._traces.ExportEvents(pb.ExportEventsRequest(tool_call_id=tool_call_id, after_seq=after_seq))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def query_calls(self, **filters: Any) -> pb.QueryCallsResponse:
        """One page of recorded calls, newest first. Filters are QueryCallsRequest's
        fields: command_contains, path, path_operation, domain, principal, workspace,
        status, since, until, page_size, page_token, proposed_by, session_id."""
        try:
            return self._audit.QueryCalls(pb.QueryCallsRequest(**filters))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def acquire_sandbox(self, workspace: str, policy: dict[str, Any] | None = None, *, image: str = "",
                        adapter: str = "", lease_ms: int = 0, wait_ms: int = 0) -> pb.Lease:
        """A lease on a warm sandbox; run calls in it with runtime.leaseId = lease.lease_id."""
        request = sandbox_request(workspace, policy, image=image, adapter=adapter, lease_ms=lease_ms, wait_ms=wait_ms)
        try:
            return self._pools.AcquireSandbox(request)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def create_pool(self, workspace: str, policy: dict[str, Any] | None = None, *, image: str = "",
                    adapter: str = "") -> pb.PoolStatus:
        """Makes (and starts warming) the pool a later acquire_sandbox with the same
        arguments leases from."""
        sandbox = sandbox_request(workspace, policy, image=image, adapter=adapter)
        try:
            return self._pools.CreatePool(pb.CreatePoolRequest(sandbox=sandbox))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def release_sandbox(self, lease_id: str) -> None:
        try:
            self._pools.ReleaseSandbox(pb.ReleaseSandboxRequest(lease_id=lease_id))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def list_pools(self) -> list[pb.PoolStatus]:
        try:
            return list(self._pools.ListPools(pb.ListPoolsRequest()).pools)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def drain_pools(self, pool_key: str = "") -> int:
        try:
            return self._pools.DrainPool(pb.DrainPoolRequest(pool_key=pool_key)).destroyed
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def iter_calls(self, **filters: Any) -> Iterator[pb.CallSummary]:
        """Every matching call, newest first, page by page."""
        token = filters.pop("page_token", "")
        while True:
            page = self.query_calls(page_token=token, **filters)
            yield from page.calls
            token = page.next_page_token
            if not token:
                return


class ExecuteStream:
    """Iterator over one call's events; `cancel()` abandons it (the daemon then
    cancels the call and removes its sandbox)."""

    def __init__(self, rpc):
        self._rpc = rpc

    def __iter__(self) -> Iterator[pb.ExecuteEvent]:
        try:
            yield from self._rpc
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def cancel(self) -> None:
        self._rpc.cancel()
