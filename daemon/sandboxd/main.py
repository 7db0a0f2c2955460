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
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

from sandboxd.api.limits import LimitInterceptor, StreamWatchdog
from sandboxd.api.server import build_server, listen
from sandboxd.api.transport import ConnectionLimits, PeerCredentialRelay
from sandboxd.backends.hostlocks import hold_daemon_lock
from sandboxd.backends.cgroup_home import CgroupHome
from sandboxd.backends.start import place_jail_cgroups, start_backends
from sandboxd import __version__
from sandboxd.calls.executor import CallExecutor
from sandboxd.check import dir_findings, load_config, render_errors, run_check
from sandboxd.calls.janitor import Janitor
from sandboxd.calls.prepare import STAGING_SUBDIR, resolve_allowed_image, staging_dir
from sandboxd.calls.reservations import WorkspaceReservations
from sandboxd.calls.recovery import clean_incoming, clean_spool
from sandboxd.core import hostdirs, hostfacts
from sandboxd.core.errors import BackendUnavailable, SandboxdError
from sandboxd.core.hostfacts import HostFacts
from sandboxd.core.metrics import MetricsServer, render
from sandboxd.core.mounts import unmount
from sandboxd.core.safe_open import UnsafeFile, held_setting_file
from sandboxd.outputs import tempdir
from sandboxd.core.sdnotify import SystemdNotifier
from sandboxd.core.settings import DaemonSettings
from sandboxd.egress.proxy import EgressProxy
from sandboxd.ledger import artifact_usage, audit, transfer_usage
from sandboxd.ledger.artifacts import FileArtifactStore, open_blob_store
from sandboxd.ledger.events import CheckpointFile, EventLog
from sandboxd.ledger.retention import RetentionSweeper
from sandboxd.ledger.store import Database
from sandboxd.pools import PoolManager
from sandboxd.recording import filewatch
from sandboxd.secrets.broker import CredentialBroker, reap_left_tmpfs

log = logging.getLogger("sandboxd")


class JsonLogFormatter(logging.Formatter):
    converter = staticmethod(time.gmtime)  # log times are UTC, whatever TZ the daemon runs with

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


@dataclass
class Daemon:
    settings: DaemonSettings
    server: Any  # a grpc.Server (api/server.py)
    executor: CallExecutor
    db: Database
    daemon_id: str
    relay: PeerCredentialRelay
    proxy: EgressProxy | None = None
    metrics: MetricsServer | None = None
    retention: RetentionSweeper | None = None
    audit_index: audit.AuditIndex | None = None
    watchdog: StreamWatchdog | None = None
    mounted_secrets: bool = False  # the secrets tmpfs is this daemon's to unmount at stop

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
        if self.mounted_secrets:
            _unmount_secrets(self.settings)
        log.info("stopped")


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
    try:
        with held_setting_file(source, setting="shim_binary") as held:  # a FIFO there: refused, not waited on
            shutil.copyfile(held, tmp)
    except UnsafeFile as exc:
        log.error("%s", exc.message)
        return "", exc.message
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return str(target), ""


def _check_file_recording(settings: DaemonSettings) -> None:
    if not settings.file_watch:
        return
    filewatch.use_reader_library(settings.file_audit.reader_library)
    try:
        filewatch.reader_library()
    except filewatch.FileWatchError as exc:  # said now; each recorded call is refused
        log.error("file-access recording unavailable: %s", exc)


def _start_egress(settings: DaemonSettings, cleanup: ExitStack) -> tuple[EgressProxy | None, str]:
    """The egress proxy, or why there is none: allowlist calls are then refused."""
    if not settings.egress.enabled:
        return None, "disabled in the daemon's settings"
    proxy = EgressProxy.from_settings(settings.egress)
    try:
        proxy.start()
    except SandboxdError as exc:
        log.error("egress proxy unavailable: %s", exc.message)
        return None, exc.message
    cleanup.callback(proxy.stop)
    return proxy, ""


def _raise_open_file_limit() -> None:
    """Sandboxes' proxy connections are the daemon's file descriptors: the soft limit
    (often 1024) goes up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


@dataclass
class _Ledger:
    """The log, its forensic index, the checkpoints and the artifacts: what every call
    records into."""

    db: Database
    audit_index: audit.AuditIndex
    events: EventLog
    checkpoints: CheckpointFile
    artifacts: FileArtifactStore


def _open_ledger(settings: DaemonSettings, cleanup: ExitStack) -> _Ledger:
    db = Database(settings.db_path)
    cleanup.callback(db.close)
    audit.drop_from_log_db(db)
    audit_index = audit.AuditIndex(db, audit.open_index_db(settings.audit_db_path))
    cleanup.callback(audit_index.db.close)
    events = EventLog(db, on_append=audit_index.notify)
    checkpoints = CheckpointFile(settings.state_dir / "checkpoints.jsonl", events, settings.checkpoint_interval_s)
    caught_up = audit_index.sync()
    if caught_up:
        log.info("indexed %d events the forensic index had not seen", caught_up)
    audit_index.start()
    cleanup.callback(audit_index.stop)
    artifact_usage.count_existing(db)
    transfer_usage.count_existing(db)
    blobs = open_blob_store(settings.artifacts, settings.blob_dir)  # S3: its uploader starts here
    cleanup.callback(blobs.close)
    return _Ledger(db, audit_index, events, checkpoints, FileArtifactStore(settings.blob_dir, db, blobs))


@dataclass
class _Sandboxing:
    """What runs calls: the backends that passed their checks (and why the others did
    not), and the sandbox shim (or why it is missing)."""

    backends: dict[str, Any]
    unavailable: dict[str, str]
    shim: str
    no_shim_reason: str


def _start_sandboxing(settings: DaemonSettings, daemon_id: str, host: HostFacts, home: CgroupHome | str,
                      cleanup: ExitStack) -> _Sandboxing:
    shim, no_shim_reason = _install_shim(settings)  # before the backends: every jail starts with it
    tempdir.reap(settings.runtime_dir)  # persistOutputs' tmpfs a killed daemon left mounted
    _check_file_recording(settings)
    backends, unavailable = start_backends(settings, daemon_id, shim, host, home,
                                         str(settings.runtime_dir / STAGING_SUBDIR), cleanup)
    if settings.default_backend not in backends:
        raise BackendUnavailable(f"the default backend {settings.default_backend!r} is unavailable: "
                                 f"{unavailable.get(settings.default_backend, 'not configured')}")
    return _Sandboxing(backends, unavailable, shim, no_shim_reason)


def _build_executor(settings: DaemonSettings, sandboxing: _Sandboxing, ledger: _Ledger, dirs: dict[str, int],
                    daemon_id: str, cleanup: ExitStack) -> tuple[CallExecutor, EgressProxy | None]:
    proxy, no_proxy_reason = _start_egress(settings, cleanup)
    broker = CredentialBroker(settings.credentials, settings.secrets_path, dir_fd=dirs["secrets_dir"])
    broker.purge()
    # The pools are made first and given what they share with the calls (the workspace
    # reservations, the janitor's checkpoints), never the executor.
    reservations, janitor = WorkspaceReservations(), Janitor(ledger.checkpoints)
    pools = PoolManager(settings, daemon_id=daemon_id, shim=sandboxing.shim or None, proxy=proxy, db=ledger.db,
                        events=ledger.events, checkpoint_soon=janitor.checkpoint_soon, workspaces=reservations,
                        resolve_image=partial(resolve_allowed_image, settings.allowed_images),
                        staging_dir=partial(staging_dir, settings.runtime_dir))
    executor = CallExecutor(settings, ledger.db, ledger.events, ledger.artifacts, sandboxing.backends, daemon_id,
                            sandboxing.unavailable, proxy=proxy, no_proxy_reason=no_proxy_reason,
                            checkpoints=ledger.checkpoints, shim=sandboxing.shim or None,
                            no_shim_reason=sandboxing.no_shim_reason, broker=broker, pools=pools,
                            reservations=reservations, janitor=janitor)
    cleanup.callback(executor.shutdown, 0.0)
    cleanup.callback(pools.shutdown)
    interrupted = executor.recover_interrupted()
    if interrupted:
        log.warning("recorded %d calls that an earlier run of this daemon never finished", interrupted)
    clean_spool(settings)
    half_written = clean_incoming(executor.artifacts)
    if half_written:
        log.warning("removed %d artifact blobs an earlier run left half-written", half_written)
    return executor, proxy


def _serve(settings: DaemonSettings, daemon_id: str, executor: CallExecutor, ledger: _Ledger,
           cleanup: ExitStack) -> tuple[Any, LimitInterceptor, PeerCredentialRelay]:
    """The gRPC server started on its private socket, and the relay in front of it on
    the public one."""
    server, limits = build_server(settings, executor, ledger.artifacts, ledger.events, ledger.checkpoints,
                                  ledger.audit_index)
    cleanup.callback(limits.watchdog.stop)
    cleanup.callback(lambda: server.stop(grace=0).wait())  # started or not: its ports are closed
    # gRPC listens privately; the public socket is the peer-credential relay in front.
    internal = settings.internal_dir
    shutil.rmtree(internal, ignore_errors=True)
    internal.mkdir(mode=0o700, parents=True)
    internal_socket = internal / "grpc.sock"
    listen(server, settings, internal_socket)
    # What start-up built lives as long as the daemon: out of the collector's full
    # passes, each of which walked all of it (18 ms here) on whichever call tripped one.
    gc.collect()
    gc.freeze()
    cleanup.callback(gc.unfreeze)
    server.start()
    relay = PeerCredentialRelay(settings.socket_path, internal_socket, internal, settings.socket_mode,
                                settings.socket_ownership(), limits=ConnectionLimits.from_settings(settings),
                                library=settings.relay_library)
    cleanup.callback(relay.close)
    relay.start()
    log.info("serving on %s (daemon %s, state %s)", settings.socket_path, daemon_id, settings.state_dir)
    return server, limits, relay


def _unmount_secrets(settings: DaemonSettings) -> None:
    """The secrets tmpfs this daemon mounted goes with it (its sandboxes' secrets were
    released already)."""
    try:
        unmount(str(settings.secrets_path))
    except OSError as exc:
        log.error("could not unmount the secrets tmpfs %s: %s", settings.secrets_path, exc.strerror)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


def build_daemon(settings: DaemonSettings, host: HostFacts) -> Daemon:
    """The daemon, serving, on the host `host` describes (hostfacts.probe). What a
    start-up that fails halfway made is undone, in the reverse order: sockets, threads,
    the backends' sandboxes, the databases, the lock and the directories' descriptors."""
    _raise_open_file_limit()
    home = place_jail_cgroups(settings, host)
    with ExitStack() as cleanup:
        # First, before anything is made in them or started: each directory the daemon owns
        # is its own, closed to others and reached through no symlink, or start-up is refused
        # (another local user may have made one first under /tmp or /dev/shm).
        dirs = hostdirs.check_daemon_dirs(settings)
        cleanup.callback(_close_all, dirs.values())
        if settings.secrets_dir is None:  # the daemon's own tmpfs: one a killed run left is wiped and unmounted
            reap_left_tmpfs(settings.secrets_path)
        dirs["secrets_dir"], mounted_secrets = hostdirs.open_secrets_dir(
            settings.secrets_path, daemon_mounts=settings.secrets_dir is None)
        if mounted_secrets:
            cleanup.callback(unmount, str(settings.secrets_path))
        daemon_id = _daemon_id(settings)
        lock_fd = hold_daemon_lock(daemon_id)  # open, and locked, while the process lives
        cleanup.callback(os.close, lock_fd)
        sandboxing = _start_sandboxing(settings, daemon_id, host, home, cleanup)
        ledger = _open_ledger(settings, cleanup)
        executor, proxy = _build_executor(settings, sandboxing, ledger, dirs, daemon_id, cleanup)
        retention = RetentionSweeper(settings.retention, ledger.db, ledger.events, ledger.artifacts,
                                     ledger.audit_index, on_swept=lambda: ledger.checkpoints.checkpoint(force=True))
        server, limits, relay = _serve(settings, daemon_id, executor, ledger, cleanup)
        metrics = None
        if settings.metrics_address:
            metrics = MetricsServer(settings.metrics_address,
                                    lambda: _metrics_text(executor, ledger.audit_index, retention, ledger.artifacts))
            metrics.start()
            cleanup.callback(metrics.stop)
        retention.start()  # serving first: a backlog of expired calls never delays start-up
        cleanup.pop_all()  # built: from now on Daemon.stop takes it down
    return Daemon(settings, server, executor, ledger.db, daemon_id, relay, proxy, metrics, retention,
                  ledger.audit_index, watchdog=limits.watchdog, mounted_secrets=mounted_secrets)


def _metrics_text(executor: CallExecutor, audit_index: audit.AuditIndex, retention: RetentionSweeper,
                  artifacts: FileArtifactStore) -> str:
    running = len(executor.running_calls())
    pending = getattr(artifacts.blobs, "pending", None)  # the S3 store's uploader (s3_blobs.py)
    uploads = [] if pending is None else [
        ("sandboxd_artifact_uploads_pending", "gauge", "Blobs kept locally until the S3 store has them",
         [f"sandboxd_artifact_uploads_pending {pending()}"])]
    text = render(uploads + [
        ("sandboxd_calls_running", "gauge", "Calls running now", [f"sandboxd_calls_running {running}"]),
        ("sandboxd_audit_index_lag_events", "gauge", "Events the forensic index has not indexed yet",
         [f"sandboxd_audit_index_lag_events {audit_index.lag()}"]),
        ("sandboxd_calls_expired_total", "counter", "Calls expired by retention since the daemon started",
         [f"sandboxd_calls_expired_total {retention.expired_total}"]),
    ])
    return text + (executor.pools.metrics() if executor.pools is not None else "")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sandboxd", description="The execution boundary for agent tool calls.")
    parser.add_argument("--version", action="version", version=f"sandboxd {__version__}")
    parser.add_argument("--config", help="YAML settings file (embedded defaults otherwise)")
    parser.add_argument("--socket", dest="socket_path", help="Unix socket to serve on")
    parser.add_argument("--state-dir", help="directory for the database, artifacts and spool")
    parser.add_argument("--workspace-root", action="append", dest="workspace_roots",
                        help="directory whose subdirectories may be workspaces (repeatable)")
    parser.add_argument("--log-level", default=None)
    commands = parser.add_subparsers(dest="command", metavar="{check}", help="without one: start the daemon")
    check = commands.add_parser("check", help="say what will work on this host and why not (changes nothing)")
    check.add_argument("--config", default=argparse.SUPPRESS, help="YAML settings file, validated as the daemon "
                       "would load it (embedded defaults otherwise)")
    check.add_argument("--json", action="store_true", help="a JSON list of findings instead of lines")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # Taken out of the environment before anything is started: no child inherits systemd's socket.
    notifier = SystemdNotifier.take_from_environment()
    args = _parse_args(argv)
    config_path = args.config or os.environ.get("SANDBOXD_CONFIG")
    if args.command == "check":
        return run_check(config_path, as_json=args.json)
    settings, errors = load_config(config_path, socket_path=args.socket_path, state_dir=args.state_dir,
                                   workspace_roots=args.workspace_roots, log_level=args.log_level)
    if settings is None:  # refused before anything is made
        print(render_errors(config_path, errors), file=sys.stderr)
        return 2
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler])

    # Looked at before any is made: a directory start-up would refuse leaves no other made.
    refused = [f for f in dir_findings(settings) if f.status == "fail"]
    for finding in refused:
        log.error("cannot start: %s: %s", finding.field or finding.probe, finding.reason)
    if refused:
        return 1
    try:
        daemon = build_daemon(settings, hostfacts.probe())  # the host probed once, here
    except SandboxdError as exc:
        log.error("cannot start: %s", exc.message)
        notifier.status(f"cannot start: {exc.message}")
        return 1

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` dumps every thread's stack to the log
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Serving, every part up, and a stop now handled: systemd may count on the socket.
    notifier.ready(f"serving on {settings.socket_path} (backends: {', '.join(sorted(daemon.executor.backends))})")
    while not stop.wait(1.0):
        pass
    notifier.stopping("stopping: cancelling running calls, removing sandboxes")
    daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
