"""`sandboxd`: builds the daemon's parts explicitly and serves them on a Unix socket."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import resource
import secrets
import shutil
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

from sandboxd.ledger import audit
from sandboxd.recording import filewatch
from sandboxd.core import hostdirs
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.backends.hostlocks import daemon_running
from sandboxd.backends.hostlocks import hold_daemon_lock
from sandboxd.backends.hostlocks import remove_stale_cgroups
from sandboxd.backends.docker.backend import DockerBackend
from sandboxd.backends.nsjail.backend import NsjailBackend
from sandboxd.sandbox.spec import SANDBOX_CGROUP_ROOT
from sandboxd.backends.nsjail.compile import NSJAIL_CGROUP_ROOT
from sandboxd.core.errors import BackendUnavailable, SandboxdError
from sandboxd.secrets.broker import CredentialBroker
from sandboxd.ledger.events import CheckpointFile, EventLog
from sandboxd.calls.executor import STAGING_SUBDIR, CallExecutor, clean_spool
from sandboxd.core.metrics import MetricsServer, render
from sandboxd.pools.manager import PoolManager
from sandboxd.egress.proxy import EgressProxy
from sandboxd.ledger.retention import RetentionSweeper
from sandboxd.api.limits import LimitInterceptor, StreamWatchdog, worker_count
from sandboxd.api.service import (ArtifactServicer, AuditServicer, Authenticator, ErrorInterceptor, ExecutionServicer, PoolServicer,
                      TraceServicer, add_execution_service)
from sandboxd.core.settings import DaemonSettings, load_settings
from sandboxd.ledger.store import Database
from sandboxd.api.transport import ConnectionLimits, PeerCredentialRelay

log = logging.getLogger("sandboxd")
SERVICE_NAMES = tuple(pb.DESCRIPTOR.services_by_name[n].full_name
                      for n in ("ExecutionService", "ArtifactService", "TraceService", "AuditService", "PoolService"))


class JsonLogFormatter(logging.Formatter):
    converter = time.gmtime  # log times are UTC, whatever TZ the daemon runs with

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%SZ"), "level": record.levelname,
                 "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _daemon_id(settings: DaemonSettings) -> str:
    if settings.daemon_id:
        return settings.daemon_id
    path = settings.state_dir / "daemon_id"
    if path.exists():
        return path.read_text().strip()
    value = "sd-" + secrets.token_hex(8)
    path.write_text(value + "\n")
    return value


def _mask_file(settings: DaemonSettings) -> str:
    """An empty, root-owned, mode-000 file bound over blocked files."""
    path = settings.state_dir / "mask" / "empty"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    if not path.exists():
        path.touch()
    os.chmod(path, 0)
    return str(path)


@dataclass
class Daemon:
    settings: DaemonSettings
    server: grpc.Server
    executor: CallExecutor
    db: Database
    daemon_id: str
    relay: PeerCredentialRelay
    proxy: EgressProxy | None = None
    metrics: MetricsServer | None = None
    retention: RetentionSweeper | None = None
    audit_index: audit.AuditIndex | None = None
    watchdog: StreamWatchdog | None = None

    def stop(self, grace_s: float | None = None) -> None:
        grace = self.settings.grace_period_s if grace_s is None else grace_s
        log.info("shutting down: cancelling running calls")
        self.relay.close()
        if self.retention is not None:
            self.retention.stop()
        self.executor.shutdown(grace)
        if self.executor.pools is not None:
            self.executor.pools.shutdown()
        self.server.stop(grace=1).wait()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.proxy is not None:
            self.proxy.stop()
        if self.metrics is not None:
            self.metrics.stop()
        for backend in self.executor.backends.values():
            close = getattr(backend, "close", None)
            if close is not None:
                close()
        if self.audit_index is not None:
            self.audit_index.stop()
            self.audit_index.db.close()
        self.db.close()
        log.info("stopped")


def _start_backends(settings: DaemonSettings, daemon_id: str, shim: str = "") -> tuple[dict, dict[str, str]]:
    """Every configured backend that passes its checks, and why each other one does not.
    A backend that fails a check is never used: its calls are refused with the reason."""
    backends: dict = {}
    unavailable: dict[str, str] = {}
    try:
        docker_backend = DockerBackend(settings.docker_host, str(settings.seccomp_profile), _mask_file(settings),
                                       stdio_dir=str(settings.runtime_dir / "stdio"))
        docker_backend.check()
        reaped = docker_backend.reap_orphans(daemon_id)
        if reaped:
            log.warning("removed %d containers left by an earlier run of this daemon", reaped)
        # Its containers' deadlines hold without this process, and its staged roots go.
        docker_backend.start_backstop(daemon_id, str(settings.runtime_dir / STAGING_SUBDIR))
        backends["docker"] = docker_backend
    except SandboxdError as exc:
        unavailable["docker"] = exc.message
    if settings.nsjail.enabled:
        try:
            ns = settings.nsjail
            nsjail_backend = NsjailBackend(ns.rootfs_dir, seccomp_profile_path=settings.seccomp_profile, shim_binary=shim,
                                           nsjail_binary=ns.nsjail_binary, init_binary=ns.init_binary,
                                           docker_host=settings.docker_host, warm_slots=ns.warm_slots)
            nsjail_backend.check()
            reaped = nsjail_backend.reap_orphans(daemon_id)
            if reaped:
                log.warning("removed %d jails left by an earlier run of this daemon", reaped)
            nsjail_backend.warm(daemon_id)
            nsjail_backend.prune_exports()
            backends["nsjail"] = nsjail_backend
        except SandboxdError as exc:
            unavailable["nsjail"] = exc.message
    else:
        unavailable["nsjail"] = "disabled in the daemon's settings"
    # Other daemons' leftovers (killed outright, or state wiped): reaped by nobody else.
    docker_backend = backends.get("docker")
    threading.Thread(target=_remove_stale_cgroups, args=(daemon_id, docker_backend), name="stale-cgroups",
                     daemon=True).start()
    for name, reason in unavailable.items():
        log.error("backend %s unavailable: %s", name, reason)
    return backends, unavailable


def _remove_stale_cgroups(daemon_id: str, docker_backend) -> None:
    def keep(root: str, name: str) -> bool:
        if root == NSJAIL_CGROUP_ROOT:  # <daemon id>/<sandbox or slot>
            return name == daemon_id or daemon_running(name)
        # <sandbox id>: a Docker sandbox's parent, kept while any container of it exists
        # (or while dockerd cannot say).
        return docker_backend is None or docker_backend.has_sandbox(name)

    removed = remove_stale_cgroups((NSJAIL_CGROUP_ROOT, SANDBOX_CGROUP_ROOT), keep=keep)
    if removed:
        log.info("removed %d empty sandbox cgroups that daemons no longer running left", removed)


def _install_shim(settings: DaemonSettings) -> tuple[str, str]:
    """The sandbox shim copied into the runtime dir (root's, traversable: nsjail binds it
    as the sandbox user; checked by hostdirs.check_daemon_dirs), or why not: calls that
    need it are then refused."""
    source = settings.shim_binary
    if not os.access(source, os.X_OK):
        reason = f"the sandbox shim {source} is missing (build it with `make native`)"
        log.error("%s", reason)
        return "", reason
    runtime = settings.runtime_dir
    target, tmp = runtime / "sandbox-shim", runtime / ".sandbox-shim.tmp"
    shutil.copyfile(source, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return str(target), ""


def _start_egress(settings: DaemonSettings) -> tuple[EgressProxy | None, str]:
    """The egress proxy, or why there is none: allowlist calls are then refused."""
    if not settings.egress.enabled:
        return None, "disabled in the daemon's settings"
    proxy = EgressProxy.from_settings(settings.egress)
    try:
        proxy.start()
    except SandboxdError as exc:
        log.error("egress proxy unavailable: %s", exc.message)
        return None, exc.message
    return proxy, ""


def _raise_open_file_limit() -> None:
    """Sandboxes' proxy connections are the daemon's file descriptors: the soft limit
    (often 1024) goes up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


def _grpc_server(settings: DaemonSettings, executor: CallExecutor, artifacts: FileArtifactStore, events: EventLog,
                 checkpoints: CheckpointFile, audit_index: audit.AuditIndex) -> tuple[grpc.Server, LimitInterceptor]:
    """The servicers behind the caps of rpc_limits.py, on a worker for every slot there
    is: one caller's load never leaves another's RPCs waiting for a thread."""
    rpc = settings.rpc_limits
    authenticate = Authenticator(settings)
    execution = ExecutionServicer(executor, authenticate)
    limits = LimitInterceptor(settings, authenticate, refused=execution.refused)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=worker_count(settings), thread_name_prefix="rpc"),
        interceptors=[limits, ErrorInterceptor()],  # the caps first: nothing runs before them
        # The largest request a call may make (its stdin and argv) and room for the rest:
        # what a stalled request may make grpc buffer before any check.
        options=[("grpc.max_receive_message_length",
                  settings.limits.max_stdin_bytes + settings.limits.max_argv_bytes + 4 * 1024 * 1024),
                 ("grpc.max_send_message_length", 64 * 1024 * 1024),
                 ("grpc.http2.max_frame_size", 4 * 1024 * 1024),
                 ("grpc.max_connection_idle_ms", int(rpc.connection_idle_timeout_s * 1000)),
                 # gRPC core cancels what arrives past its queue of RPCs not yet handed to
                 # Python (1,000 by default) before any handler sees it: none on the log.
                 ("grpc.server.max_pending_requests", rpc.max_pending_rpcs),
                 ("grpc.server.max_pending_requests_hard_limit", 2 * rpc.max_pending_rpcs)],
    )
    add_execution_service(execution, server)
    pb_grpc.add_ArtifactServiceServicer_to_server(ArtifactServicer(artifacts, executor, authenticate), server)
    pb_grpc.add_TraceServiceServicer_to_server(TraceServicer(events, executor, authenticate, checkpoints), server)
    pb_grpc.add_AuditServiceServicer_to_server(AuditServicer(audit_index, authenticate), server)
    pb_grpc.add_PoolServiceServicer_to_server(PoolServicer(executor, authenticate), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("",) + SERVICE_NAMES:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(SERVICE_NAMES + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, limits


def build_daemon(settings: DaemonSettings) -> Daemon:
    _raise_open_file_limit()
    # First, before anything is made in them or started: each directory the daemon owns
    # is its own, closed to others and reached through no symlink, or start-up is refused
    # (another local user may have made one first under /tmp or /dev/shm).
    dirs = hostdirs.check_daemon_dirs(settings)
    daemon_id = _daemon_id(settings)
    hold_daemon_lock(daemon_id)  # its descriptor stays open, and locked, while the process lives
    shim, no_shim_reason = _install_shim(settings)  # before the backends: every jail starts with it
    if settings.file_watch:
        filewatch.use_reader_library(settings.file_audit.reader_library)
        try:
            filewatch.reader_library()
        except filewatch.FileWatchError as exc:  # said now; each recorded call is refused
            log.error("file-access recording unavailable: %s", exc)
    backends, unavailable = _start_backends(settings, daemon_id, shim)
    if settings.default_backend not in backends:
        raise BackendUnavailable(f"the default backend {settings.default_backend!r} is unavailable: "
                                 f"{unavailable.get(settings.default_backend, 'not configured')}")
    db = Database(settings.db_path)
    audit.drop_from_log_db(db)
    audit_index = audit.AuditIndex(db, audit.open_index_db(settings.audit_db_path))
    events = EventLog(db, on_append=audit_index.notify)
    checkpoints = CheckpointFile(settings.state_dir / "checkpoints.jsonl", events, settings.checkpoint_interval_s)
    caught_up = audit_index.sync()
    if caught_up:
        log.info("indexed %d events the forensic index had not seen", caught_up)
    audit_index.start()
    artifacts = FileArtifactStore(settings.blob_dir, db)
    proxy, no_proxy_reason = _start_egress(settings)
    broker = CredentialBroker(settings.credentials, settings.secrets_dir, dir_fd=dirs["secrets_dir"])
    broker.purge()
    executor = CallExecutor(settings, db, events, artifacts, backends, daemon_id, unavailable,
                            proxy=proxy, no_proxy_reason=no_proxy_reason, checkpoints=checkpoints,
                            shim=shim or None, no_shim_reason=no_shim_reason, broker=broker)
    executor.pools = PoolManager(executor)
    interrupted = executor.recover_interrupted()
    if interrupted:
        log.warning("recorded %d calls that an earlier run of this daemon never finished", interrupted)
    clean_spool(settings)
    retention = RetentionSweeper(settings.retention, db, events, artifacts, audit_index,
                                 on_swept=lambda: checkpoints.checkpoint(force=True))

    server, limits = _grpc_server(settings, executor, artifacts, events, checkpoints, audit_index)

    # gRPC listens privately; the public socket is the peer-credential relay in front.
    internal = settings.internal_dir
    shutil.rmtree(internal, ignore_errors=True)
    internal.mkdir(mode=0o700, parents=True)
    internal_socket = internal / "grpc.sock"
    server.add_insecure_port(f"unix:{internal_socket}")
    if settings.tcp is not None:
        tcp = settings.tcp
        credentials = grpc.ssl_server_credentials(
            [(tcp.key_file.read_bytes(), tcp.cert_file.read_bytes())],
            root_certificates=tcp.client_ca_file.read_bytes(), require_client_auth=True)
        if not server.add_secure_port(tcp.address, credentials):
            raise BackendUnavailable(f"cannot listen on {tcp.address}")
        log.info("serving mutual TLS on %s", tcp.address)
    # What start-up built lives as long as the daemon: out of the collector's full
    # passes, each of which walked all of it (18 ms here) on whichever call tripped one.
    gc.collect()
    gc.freeze()
    server.start()
    relay = PeerCredentialRelay(settings.socket_path, internal_socket, internal, settings.socket_mode,
                                settings.socket_ownership(), limits=ConnectionLimits.from_settings(settings))
    relay.start()
    log.info("serving on %s (daemon %s, state %s)", settings.socket_path, daemon_id, settings.state_dir)
    metrics = None
    if settings.metrics_address:
        metrics = MetricsServer(settings.metrics_address, lambda: _metrics_text(executor, audit_index, retention))
        metrics.start()
    retention.start()  # serving first: a backlog of expired calls never delays start-up
    return Daemon(settings, server, executor, db, daemon_id, relay, proxy, metrics, retention, audit_index,
                  watchdog=limits.watchdog)


def _metrics_text(executor: CallExecutor, audit_index: audit.AuditIndex, retention: RetentionSweeper) -> str:
    running = len(executor.running_calls())
    text = render([
        ("sandboxd_calls_running", "gauge", "Calls running now", [f"sandboxd_calls_running {running}"]),
        ("sandboxd_audit_index_lag_events", "gauge", "Events the forensic index has not indexed yet",
         [f"sandboxd_audit_index_lag_events {audit_index.lag()}"]),
        ("sandboxd_calls_expired_total", "counter", "Calls expired by retention since the daemon started",
         [f"sandboxd_calls_expired_total {retention.expired_total}"]),
    ])
    return text + (executor.pools.metrics() if executor.pools is not None else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandboxd", description="The execution boundary for agent tool calls.")
    parser.add_argument("--config", help="YAML settings file (embedded defaults otherwise)")
    parser.add_argument("--socket", dest="socket_path", help="Unix socket to serve on")
    parser.add_argument("--state-dir", help="directory for the database, artifacts and spool")
    parser.add_argument("--workspace-root", action="append", dest="workspace_roots",
                        help="directory whose subdirectories may be workspaces (repeatable)")
    parser.add_argument("--log-level", default=None)
    args = parser.parse_args(argv)

    try:
        settings = load_settings(args.config or os.environ.get("SANDBOXD_CONFIG"),
                                 socket_path=args.socket_path, state_dir=args.state_dir,
                                 workspace_roots=args.workspace_roots, log_level=args.log_level)
    except (OSError, ValueError) as exc:
        print(f"sandboxd: bad configuration: {exc}", file=sys.stderr)
        return 2
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler])

    try:
        daemon = build_daemon(settings)
    except SandboxdError as exc:
        log.error("cannot start: %s", exc.message)
        return 1

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` dumps every thread's stack to the log
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
