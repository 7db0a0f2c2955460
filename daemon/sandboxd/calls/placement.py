"""Where a call's command runs: a fresh sandbox made for it and destroyed after, or a
leased warm sandbox that outlives the command. The one place that tells the two apart:
the run, admission and the recorder ask the placement, never the lease."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from sandboxd.calls.prepare import Prepared
from sandboxd.calls.reservations import WorkspaceReservations
from sandboxd.calls.result import NetworkRecord
from sandboxd.egress.proxy import EgressProxy
from sandboxd.ledger.store import Database
from sandboxd.outputs import tempdir
from sandboxd.policy.preflight import HostPlan
from sandboxd.pools import PoolManager
from sandboxd.recording import snapshot
from sandboxd.recording.changes import ChangedFile
from sandboxd.recording.recorder import FileRecorder, GatedWatch, KeptWatch, WriteRoots
from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.engine import create_sandbox
from sandboxd.sandbox.protocol import Process, Sandbox
from sandboxd.secrets.broker import CredentialBroker

log = logging.getLogger("sandboxd.calls.placement")


@dataclass(frozen=True)
class RecordingTools:
    """What a call's file recorder is made with (the executor's, shared by every call)."""
    file_watch: bool
    walk: Callable[[WriteRoots], snapshot.Snapshot]
    refresh: Callable[[WriteRoots], None]
    fid: Callable[[HostPlan], bool]


def spool_name(sandbox_id: str, tool_call_id: str, leased: bool) -> str:
    """A call's output spool, under the daemon's spool dir: a leased command's is named
    after the warm sandbox and the call (the sandbox's own, under its name alone, holds
    its supervisor's output)."""
    return f"{sandbox_id}.{tool_call_id}" if leased else sandbox_id


def _logged(what: str, sandbox_id: str, fn: Callable[..., Any], *args: Any) -> Callable[[], None]:
    """`fn(*args)` for a cleanup stack: a failure is logged, and the rest still runs."""
    def run() -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("%s %s failed", what, sandbox_id)
    return run


class _Placement(ABC):
    """A context manager: its exit releases what it made, in reverse order."""

    def __init__(self, prepared: Prepared, db: Database):
        self.prepared = prepared
        self._db = db
        self._resources = ExitStack()
        self.sandbox: Sandbox | None = None  # once created (for a lease: taken)
        self.kept_tempdir = ""  # persistOutputs: the host tmpfs at tempDir, until released
        self.network = NetworkRecord()

    def __enter__(self) -> "_Placement":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._resources.close()

    def kept_outputs(self) -> tuple[list[ChangedFile], list[str]]:
        """persistOutputs: what the call left in its tempDir, and why that may not be all."""
        if not self.kept_tempdir:
            return [], []
        return tempdir.kept_files(self.prepared.policy.temp_dir, self.kept_tempdir)

    def release_outputs(self) -> None:
        if self.kept_tempdir:
            tempdir.release(self.kept_tempdir)
            self.kept_tempdir = ""

    def write_roots(self) -> WriteRoots:
        # What mount marks cannot see (creations, deletions, renames, chmods, the content
        # a write found) comes from a before/after walk of the writable mounts.
        return [(b.sandbox_path, b.host_path) for b in self.prepared.plan.binds if not b.read_only]

    @abstractmethod
    def _make(self) -> Sandbox:
        """The sandbox the command runs in: made now, or taken."""

    def create(self) -> Sandbox:
        """The call's sandbox, destroyed (or handed back) when the placement exits."""
        sandbox = self._make()
        self.sandbox = sandbox
        self._resources.callback(self._remove, sandbox)
        return sandbox

    def _remove(self, sandbox: Sandbox) -> None:
        try:
            sandbox.destroy()  # (a fresh one's output lands in the spool before this returns)
        except Exception:
            log.exception("destroying sandbox %s failed", self.prepared.sandbox_id)

    def start(self, spool: OutputSpool) -> Process:
        """The call's command, in the sandbox create() made."""
        assert self.sandbox is not None
        return self.sandbox.start(spool, self.prepared.call.stdin)


class FreshPlacement(_Placement):
    """A sandbox made for one call: its egress endpoint, its secrets' files and the
    sandbox itself, each undone after the command."""


    def __init__(self, prepared: Prepared, db: Database, reservations: WorkspaceReservations,
                 proxy: EgressProxy | None, broker: CredentialBroker):
        super().__init__(prepared, db)
        self._reservations = reservations
        self._proxy = proxy
        self._broker = broker

    def spool_name(self, tool_call_id: str) -> str:
        return spool_name(self.prepared.sandbox_id, tool_call_id, leased=False)

    def admit(self, tool_call_id: str) -> None:
        self._reservations.reserve(tool_call_id, self.prepared.plan)

    def abandon(self, tool_call_id: str) -> None:
        self._reservations.release(tool_call_id)

    def recorder(self, tools: RecordingTools, label: str) -> FileRecorder:
        p = self.prepared
        gate = p.attachments.gate_host_path
        watcher = GatedWatch(gate, p.plan.uid, p.plan.gid, tuple(b.sandbox_path for b in p.plan.binds),
                             lambda: tools.fid(p.plan), label) if gate else None
        return FileRecorder(watcher, self.write_roots(), tools.walk, tools.refresh, label)

    def open(self) -> None:
        """The egress endpoint and the secrets' files, before the sandbox exists."""
        p = self.prepared
        if p.egress is not None:
            proxy = self._proxy
            assert proxy is not None
            endpoint = proxy.open_endpoint(
                p.sandbox_id, proxy.rules(p.policy.allow_domains, p.policy.deny_private_networks,
                                          any_host=p.policy.egress == "open"),
                uid=p.plan.uid, gid=p.plan.gid, record_allowed=p.policy.record_network_access)
            self._resources.callback(self._close_endpoint, proxy, endpoint)
        if p.secrets:
            self._broker.materialize(p.sandbox_id, p.secrets, p.plan.uid, p.plan.gid)
            self._resources.callback(_logged("removing the secrets of", p.sandbox_id, self._broker.release,
                                             p.sandbox_id))

    def _close_endpoint(self, proxy: EgressProxy, endpoint: Any) -> None:
        try:
            connections = proxy.close_endpoint(endpoint)
            self.network = NetworkRecord(connections, endpoint.dropped_records, dict(endpoint.overflow))
        except Exception:
            log.exception("closing the egress endpoint of %s failed", self.prepared.sandbox_id)

    def before_start(self) -> None:
        # The acceptance was committed, not fsynced (a killed daemon keeps it): durable
        # before the command can run.
        self._db.flush()

    def _make(self) -> Sandbox:
        p = self.prepared
        if p.plan.outputs_dir:  # persistOutputs: released by the run once it is collected
            tempdir.make(p.plan.outputs_dir, p.policy.tmp_size_bytes, p.plan.uid, p.plan.gid)
            self.kept_tempdir = p.plan.outputs_dir
        return create_sandbox(p.backend, p.spec)


class LeasedPlacement(_Placement):
    """A command in a leased warm sandbox, through its supervisor: the sandbox stays
    the lease's after the command (its LeaseSandbox view's destroy() hands it back)."""


    def __init__(self, prepared: Prepared, db: Database, pools: PoolManager):
        super().__init__(prepared, db)
        self._pools = pools
        lease = prepared.lease
        assert lease is not None  # prepare.Preparer.prepare_leased made it
        self._lease = lease
        self._ws = lease.warm
        # Ended (cancelled, or its walk failed) before the command reached the sandbox:
        # nothing ran in it, so it stays the lease's.
        self._resources.callback(self._hand_back_unused)

    def spool_name(self, tool_call_id: str) -> str:
        return spool_name(self.prepared.sandbox_id, tool_call_id, leased=True)

    def admit(self, tool_call_id: str) -> None:
        self._pools.claim(self._ws, tool_call_id)

    def abandon(self, tool_call_id: str) -> None:
        self._pools.command_done(self._ws, True)  # the lease's sandbox is free again

    def recorder(self, tools: RecordingTools, label: str) -> FileRecorder:
        p, ws = self.prepared, self._ws
        if tools.file_watch and p.policy.record_file_access and p.plan.binds:
            watcher = KeptWatch(ws, tuple(b.sandbox_path for b in ws.prepared.plan.binds),
                                lambda: tools.fid(ws.prepared.plan), self._lease.broken)
            return FileRecorder(watcher, self.write_roots(), tools.walk, tools.refresh, label)
        if ws.watch is not None:
            ws.watch.unrecorded()  # the sandbox's kept watch sees this command too
        return FileRecorder(None, self.write_roots(), tools.walk, tools.refresh, label)

    def open(self) -> None:
        """Nothing: the sandbox has its endpoint, and a command's env secrets travel over
        the supervisor's socket."""

    def _hand_back_unused(self) -> None:
        if self.sandbox is None:
            self._pools.command_done(self._ws, True)

    def _make(self) -> Sandbox:
        return self._lease  # the warm sandbox exists: the call takes it

    def _remove(self, sandbox: Sandbox) -> None:
        # Before the sandbox can take the lease's next command.
        try:
            connections, dropped, overflow = self._lease.network_records()
            self.network = NetworkRecord(connections, dropped, overflow)
        except Exception:
            log.exception("reading the network records of %s failed", self.prepared.sandbox_id)
        super()._remove(sandbox)

    def before_start(self) -> None:
        return None

    def start(self, spool: OutputSpool) -> Process:
        process = super().start(spool)
        # A leased command's, while it starts (a fsync before it cost each command a
        # third of a millisecond): only a power loss in its first fraction of a
        # millisecond could lose the record that it was accepted.
        self._db.flush()
        return process


Placement = FreshPlacement | LeasedPlacement


def placement_for(prepared: Prepared, db: Database, reservations: WorkspaceReservations,
                  proxy: EgressProxy | None, broker: CredentialBroker, pools: PoolManager | None) -> Placement:
    """Fresh or leased: decided here, once per call."""
    if prepared.lease is None:
        return FreshPlacement(prepared, db, reservations, proxy, broker)
    assert pools is not None
    return LeasedPlacement(prepared, db, pools)
