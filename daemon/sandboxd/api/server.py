"""The gRPC server: the servicers behind the caps of api/limits.py and the error
interceptor, health and reflection, listening on the private socket behind the relay
(and on mutual TLS when configured)."""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

from sandboxd.api.auth import Authenticator
from sandboxd.api.errors import ErrorInterceptor
from sandboxd.api.execution import ExecutionServicer, add_execution_service
from sandboxd.api.limits import LimitInterceptor, worker_count
from sandboxd.api.pools import PoolServicer
from sandboxd.api.records import ArtifactServicer, AuditServicer, TraceServicer
from sandboxd.api.transfer import FileServicer
from sandboxd.calls.executor import CallExecutor
from sandboxd.core.errors import BackendUnavailable
from sandboxd.core.safe_open import read_setting_file
from sandboxd.core.settings import DaemonSettings, TcpSettings
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.audit import AuditIndex
from sandboxd.ledger.events import CheckpointFile, EventLog
from sandboxd.transfer.service import FileTransfers

log = logging.getLogger("sandboxd.api.server")
# A PEM chain, key or CA bundle past this is no certificate file.
TLS_FILE_MAX_BYTES = 1 << 20
SERVICES = ("ExecutionService", "ArtifactService", "TraceService", "AuditService", "PoolService", "FileService")


def _options(settings: DaemonSettings) -> list[tuple[str, int]]:
    rpc = settings.rpc_limits
    # The largest request a call may make (its stdin and argv) and room for the rest:
    # what a stalled request may make grpc buffer before any check.
    return [("grpc.max_receive_message_length",
             settings.limits.max_stdin_bytes + settings.limits.max_argv_bytes + 4 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.http2.max_frame_size", 4 * 1024 * 1024),
            ("grpc.max_connection_idle_ms", int(rpc.connection_idle_timeout_s * 1000)),
            # gRPC core cancels what arrives past its queue of RPCs not yet handed to
            # Python (1,000 by default) before any handler sees it: none on the log.
            ("grpc.server.max_pending_requests", rpc.max_pending_rpcs),
            ("grpc.server.max_pending_requests_hard_limit", 2 * rpc.max_pending_rpcs)]


def build_server(settings: DaemonSettings, executor: CallExecutor, artifacts: FileArtifactStore, events: EventLog,
                 checkpoints: CheckpointFile, audit_index: AuditIndex) -> tuple[grpc.Server, LimitInterceptor]:
    """The servicers behind the caps of api/limits.py, on a worker for every slot there
    is: one caller's load never leaves another's RPCs waiting for a thread. Not started;
    the caller stops the interceptor's watchdog (limits.watchdog) when it is done."""
    authenticate = Authenticator(settings)
    execution = ExecutionServicer(executor, authenticate)
    limits = LimitInterceptor(settings, authenticate, refused=execution.refused)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=worker_count(settings), thread_name_prefix="rpc"),
        interceptors=[limits, ErrorInterceptor()],  # the caps first: nothing runs before them
        options=_options(settings))
    add_execution_service(execution, server)
    pb_grpc.add_ArtifactServiceServicer_to_server(ArtifactServicer(artifacts, executor, authenticate), server)
    pb_grpc.add_TraceServiceServicer_to_server(TraceServicer(events, executor, authenticate, checkpoints), server)
    pb_grpc.add_AuditServiceServicer_to_server(AuditServicer(audit_index, authenticate), server)
    pb_grpc.add_PoolServiceServicer_to_server(PoolServicer(executor, authenticate), server)
    pb_grpc.add_FileServiceServicer_to_server(FileServicer(FileTransfers(executor), authenticate), server)
    names = tuple(pb.DESCRIPTOR.services_by_name[n].full_name for n in SERVICES)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("",) + names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, limits


def listen(server: grpc.Server, settings: DaemonSettings, internal_socket: Path) -> None:
    """Mutual TLS when configured, and the private socket the relay connects to. The
    TCP port first: binding it is what may fail, and gRPC keeps the ports of a server
    that never started open until the process ends."""
    if settings.tcp is not None:
        _listen_tls(server, settings.tcp)
    server.add_insecure_port(f"unix:{internal_socket}")


def _listen_tls(server: grpc.Server, tcp: TcpSettings) -> None:
    # Each read once from a descriptor: no link followed, a FIFO never waited on, the key
    # the daemon's own and closed to others.
    key = read_setting_file(tcp.key_file, setting="tcp.key_file", private=True, max_bytes=TLS_FILE_MAX_BYTES)
    chain = read_setting_file(tcp.cert_file, setting="tcp.cert_file", max_bytes=TLS_FILE_MAX_BYTES)
    client_ca = read_setting_file(tcp.client_ca_file, setting="tcp.client_ca_file", max_bytes=TLS_FILE_MAX_BYTES)
    credentials = grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca, require_client_auth=True)
    try:
        port = server.add_secure_port(tcp.address, credentials)
    except RuntimeError as exc:  # grpc raises (older versions returned 0) when the bind fails
        raise BackendUnavailable(f"cannot listen on {tcp.address}: {exc}") from None
    if not port:
        raise BackendUnavailable(f"cannot listen on {tcp.address}")
    log.info("serving mutual TLS on %s", tcp.address)


def serving(socket_path: Path, timeout_s: float = 2.0) -> bool:
    """Whether a daemon answers its health check on `socket_path` with SERVING."""
    try:
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                 timeout=timeout_s)
            return bool(response.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False
