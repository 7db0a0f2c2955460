"""Warm sandboxes, leases and pools, and their accounting. A pool's size counts every
sandbox that holds a place in it: idle, leased, being made, and retired but not yet
removed (and those of the drained pool it replaced under the same key). Every function
that changes a count runs under the pool manager's lock."""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sandboxd.core.errors import Aborted
from sandboxd.core.settings import PoolSettings
from sandboxd.egress.records import EgressEndpoint
from sandboxd.ledger.event_types import SandboxLeased, SandboxLeaseEnded, draft
from sandboxd.ledger.events import EventDraft
from sandboxd.pools.template import BuiltSandbox, PoolTemplate
from sandboxd.recording.filewatch import FileWatch
from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.protocol import SandboxHandle
from sandboxd.secrets.broker import ResolvedSecret


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class WarmSandbox:
    sandbox_id: str
    key: str
    prepared: BuiltSandbox  # what it was made as (calls/ reads its plan, attachments, image digest)
    handle: SandboxHandle
    spool: OutputSpool
    control: socket.socket  # the supervisor's connection: the only way to it
    created: float = field(default_factory=time.monotonic)
    idle_since: float = field(default_factory=time.monotonic)
    lease: Lease | None = None
    busy: str = ""  # the tool_call_id running in it
    dead: bool = False
    endpoint: EgressEndpoint | None = None  # its egress proxy endpoint, for a proxied policy
    baseline_pids: set[int] | None = None  # processes of the idle sandbox (init, supervisor, ...)
    # A pidfd on each of them, when each is single-threaded (the pids cgroup counted as
    # many tasks as it listed processes): while every one lives, the same task count after
    # a command says nothing of it is left, without listing the tree. A command can kill
    # one of them (the egress forwarder runs as the sandbox user) to hide a process of its
    # own in the count: then the tree is listed, and the sandbox retired.
    baseline_pidfds: tuple[int, ...] = ()
    # A host pid inside it (its init), for file watches, and a pidfd that keeps that
    # number from being reused: 0 / -1 until first asked.
    pid: int = 0
    pidfd: int = -1
    watch: FileWatch | None = None  # from its first recorded command until it is destroyed
    # Every secret any command of it was given (label -> value): what each command's output
    # and events are redacted of, since a command's tempDir (and what it wrote there) stays.
    secrets_seen: dict[str, bytes] = field(default_factory=dict)
    # Counted in its pool's `destroying` from when its removal became due (a command may
    # still be running in it) until it is gone.
    retired: bool = False
    # Its OOM-kill counters (leftovers.oom_kill_files) and their sum after its last
    # command: a leased command's OOM kills are what it added (one read per command).
    oom_kill_files: tuple[str, ...] = ()
    oom_kills_seen: int = 0
    retired_from: Pool | None = None
    removing: bool = False  # its removal has begun (once)

    def remember_secrets(self, secrets: Iterable[ResolvedSecret]) -> dict[str, bytes]:
        """Adds a command's secrets to what the sandbox was ever given; returns them all.
        (Another value under a binding id already seen gets a label of its own.)"""
        for s in secrets:
            if s.value in self.secrets_seen.values():
                continue
            label, n = s.binding_id, 1
            while label in self.secrets_seen:
                n += 1
                label = f"{s.binding_id}#{n}"
            self.secrets_seen[label] = s.value
        return dict(self.secrets_seen)

    def init_pid(self) -> int:
        """The sandbox's init while it lives; 0 once it is gone (or never came up)."""
        if self.pidfd < 0:
            pid = self.prepared.backend.sandbox_pid(self.handle)
            if not pid:
                return 0
            try:
                self.pidfd = os.pidfd_open(pid)
            except OSError:
                return 0
            self.pid = pid
        poller = select.poll()  # not select(): descriptors above 1023 are normal here
        poller.register(self.pidfd, select.POLLIN)
        return 0 if poller.poll(0) else self.pid  # a pidfd turns readable when its process exits


@dataclass
class Lease:
    lease_id: str
    principal: str
    sandbox: WarmSandbox
    expires: float  # wall clock
    key: str
    last_event_id: str = ""
    # The pool it was taken from (a drained one's key may name a newer pool by its end).
    pool: Pool | None = None

    def to_json(self) -> dict[str, Any]:
        return {"leaseId": self.lease_id, "sandboxId": self.sandbox.sandbox_id, "expiresAt": rfc3339(self.expires),
                "poolKey": self.key, "backend": self.sandbox.prepared.backend.name}

    def leased_event(self) -> EventDraft:
        """On the log, under the lease id: who held which sandbox, until when."""
        built = self.sandbox.prepared
        return draft(SandboxLeased(self.principal, self.sandbox.sandbox_id, self.key, built.backend.name,
                                   built.plan.workspace, built.image, built.image_digest, rfc3339(self.expires)))

    def ended_event(self, why: str) -> EventDraft:
        return draft(SandboxLeaseEnded(why, self.sandbox.sandbox_id))


def drained() -> Aborted:
    return Aborted("the pool was drained while this request waited for a sandbox; acquire again")


@dataclass
class Pool:
    key: str
    template: PoolTemplate  # what a sandbox of this pool is made from
    idle: list[WarmSandbox] = field(default_factory=list)
    leased: dict[str, Lease] = field(default_factory=dict)
    owner: str = ""  # the principal that made it (CreatePool or its first AcquireSandbox)
    creating: int = 0
    destroying: int = 0  # retired, still being removed: they count until they are gone
    created: int = 0
    destroyed: int = 0
    draining: bool = False
    last_used: float = field(default_factory=time.monotonic)  # made, or last leased
    # The drained pool this one replaced under the same key, while any of its sandboxes
    # are still there (being made or removed): they count against this one's maximum.
    predecessor: Pool | None = None

    @property
    def size(self) -> int:
        old = self.predecessor
        if old is not None and not old.size:
            self.predecessor = old = None
        return len(self.idle) + len(self.leased) + self.creating + self.destroying + (old.size if old else 0)


def retire(pool: Pool | None, ws: WarmSandbox) -> None:
    """`ws` counts against `pool` as being removed, once, from now until it is gone
    (`removed`)."""
    if not ws.retired:
        ws.retired, ws.retired_from = True, pool
        if pool is not None:
            pool.destroyed += 1
            pool.destroying += 1


def removed(pool: Pool | None) -> None:
    """A retired sandbox of `pool` is gone: its place is free."""
    if pool is not None:
        pool.destroying -= 1


def lease_seconds(lease_ms: int, settings: PoolSettings) -> float:
    """A lease's length: as asked (0: the default), at most the daemon's maximum."""
    return min(lease_ms / 1000 if lease_ms else settings.default_lease_s, settings.max_lease_s)


def leases_held(leases: Iterable[Lease], acquiring: Mapping[str, int], principal: str) -> int:
    """What counts against a principal's lease quota: its leases, and its acquires
    admitted and not yet answered."""
    return sum(1 for lease in leases if lease.principal == principal) + acquiring.get(principal, 0)


def sweep_idle(pool: Pool, now: float, idle_ttl_s: float) -> list[WarmSandbox]:
    """Takes out of `pool.idle` (and returns) the sandboxes that must go: whose supervisor
    ended, that broke, idle past their TTL, or all of them in a draining pool."""
    keep, gone = [], []
    for ws in pool.idle:
        ended = ws.handle.output_closed.is_set()  # the supervisor is gone
        if ended or ws.dead or now - ws.idle_since > idle_ttl_s or pool.draining:
            gone.append(ws)
        else:
            keep.append(ws)
    pool.idle = keep
    return gone


def unused(pool: Pool, now: float, idle_ttl_s: float) -> bool:
    """Nothing leased or being made in it for its idle TTL: it retires instead of refilling."""
    return not pool.draining and not pool.leased and not pool.creating and now - pool.last_used > idle_ttl_s


def wants_refill(pool: Pool, settings: PoolSettings) -> bool:
    """Fewer idle sandboxes (counting those being made) than its minimum, and room for one.
    Never for a pool whose sandboxes may write the workspace: an idle one would hold it
    alone (writers run alone on a workspace) and so refuse every other call on it, and
    while one is leased its refill could only fail. Its leases are made at acquire."""
    if pool.template.plan.writes_workspace:
        return False
    return not pool.draining and len(pool.idle) + pool.creating < settings.min_idle and pool.size < settings.max_size
