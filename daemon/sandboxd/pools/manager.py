"""Warm sandboxes and leases. A pool holds sandboxes for one (workspace, image, backend,
policy class); each runs the shim's supervisor instead of a command. A lease hands one
sandbox to one principal; Execute calls naming the lease run through the supervisor
(LeaseBackend, the Backend protocol again), so each command still gets its own timeout,
output caps, events and artifacts, and its leftover processes are killed when it ends.
A released or expired lease's sandbox is destroyed, never handed to anyone else: the
pool makes a fresh one. Pool sandboxes carry the daemon's labels, so a restart reaps
them like any other."""

from __future__ import annotations

import array
import hashlib
import logging
import math
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from sandboxd.ledger import events as ev
from sandboxd.sandbox.protocol import ExitStatus
from sandboxd.sandbox.protocol import ResourceUsage
from sandboxd.sandbox.protocol import SandboxHandle
from sandboxd.sandbox.spec import Attachments, EgressAttachment, SandboxIdentity
from sandboxd.core.errors import Aborted, FailedPrecondition, InternalError, NotFound, ResourceExhausted, Unimplemented
from sandboxd.core.metrics import Histogram, render
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.policy.models import EffectivePolicy, canonical_json

if TYPE_CHECKING:
    from sandboxd.calls.executor import CallExecutor, Prepared
    from sandboxd.policy.principal import Principal

log = logging.getLogger("sandboxd.pools.manager")
READY_TIMEOUT_S = 30.0
# How long the supervisor may take to start a command ("P <pid>").
START_TIMEOUT_S = 10.0
# Fields of a policy that each command brings itself; the rest fixes the sandbox.
PER_COMMAND = ("cwd", "env", "timeoutMs", "maxStdoutBytes", "maxStderrBytes", "recordCommand", "recordFileAccess",
               "recordNetworkAccess")


def policy_class(policy: EffectivePolicy) -> dict[str, Any]:
    return {k: v for k, v in policy.to_json_dict().items() if k not in PER_COMMAND}


def pool_key(workspace: str, image: str, backend: str, uid: int, gid: int, policy: EffectivePolicy) -> str:
    body = {"workspace": workspace, "image": image, "backend": backend, "uid": uid, "gid": gid,
            "policy": policy_class(policy)}
    return "pool-" + hashlib.sha256(canonical_json(body)).hexdigest()[:16]


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class WarmSandbox:
    sandbox_id: str
    key: str
    prepared: "Prepared"
    handle: SandboxHandle
    spool: OutputSpool
    control: socket.socket  # the supervisor's connection: the only way to it
    created: float = field(default_factory=time.monotonic)
    idle_since: float = field(default_factory=time.monotonic)
    lease: "Lease | None" = None
    busy: str = ""  # the tool_call_id running in it
    dead: bool = False
    endpoint: Any = None  # its egress proxy endpoint, for a proxied policy
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
    watch: Any = None  # its FileWatch, from its first recorded command until it is destroyed
    # Every secret any command of it was given (label -> value): what each command's output
    # and events are redacted of, since a command's tempDir (and what it wrote there) stays.
    secrets_seen: dict[str, bytes] = field(default_factory=dict)
    # Counted in its pool's `destroying` from when its removal became due (a command may
    # still be running in it) until it is gone.
    retired: bool = False
    retired_from: "Pool | None" = None
    removing: bool = False  # its removal has begun (once)

    def remember_secrets(self, secrets: tuple) -> dict[str, bytes]:
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
    pool: "Pool | None" = None

    def to_json(self) -> dict[str, Any]:
        return {"leaseId": self.lease_id, "sandboxId": self.sandbox.sandbox_id, "expiresAt": _rfc3339(self.expires),
                "poolKey": self.key, "backend": self.sandbox.prepared.backend.name}


def _drained() -> Aborted:
    return Aborted("the pool was drained while this request waited for a sandbox; acquire again")


@dataclass
class Pool:
    key: str
    template: "Prepared"  # what a sandbox of this pool is made from
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
    predecessor: "Pool | None" = None

    @property
    def size(self) -> int:
        old = self.predecessor
        if old is not None and not old.size:
            self.predecessor = old = None
        return len(self.idle) + len(self.leased) + self.creating + self.destroying + (old.size if old else 0)


@dataclass(frozen=True)
class CommandSpec:
    """What a leased command is: the sandbox exists, so only the process is described."""

    lease_id: str
    sandbox_id: str
    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    timeout_ms: int
    max_stdout_bytes: int
    max_stderr_bytes: int
    temp_dir: str = "/tmp"  # where the command's credential files go

    def to_json_dict(self) -> dict[str, Any]:
        # Flat fields: a shallow copy (asdict's deep copy is paid once per command).
        return {f.name: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v)
                for f in fields(self) for v in (getattr(self, f.name),)}


class PoolManager:
    def __init__(self, executor: "CallExecutor"):
        self._ex = executor
        self._settings = executor.settings.pools
        self._cond = threading.Condition()
        self._pools: dict[str, Pool] = {}
        self._leases: dict[str, Lease] = {}
        # principal -> acquires admitted and not yet answered: they count against its
        # lease quota, so concurrent acquires cannot take more than it.
        self._acquiring: dict[str, int] = {}
        self._closing = False
        self._destroyers: list[threading.Thread] = []
        self.acquire_latency = Histogram()
        self._thread = threading.Thread(target=self._maintain, name="pools", daemon=True)
        self._thread.start()

    @property
    def proxy(self):
        return self._ex.proxy

    # -- leases ------------------------------------------------------------------------
    def acquire(self, template: "Prepared", caller: "Principal", lease_ms: int, wait_ms: int) -> Lease:
        t0 = time.monotonic()
        lease = self._acquire(template, caller, lease_ms, wait_ms)
        self.acquire_latency.observe(time.monotonic() - t0)
        return lease

    def _acquire(self, template: "Prepared", caller: "Principal", lease_ms: int, wait_ms: int) -> Lease:
        if template.secrets:
            raise Unimplemented("pooled sandboxes do not take credentials yet", field="credentialRefs")
        if template.policy.proxied and self._ex.proxy is None:
            raise FailedPrecondition("this policy needs the egress proxy, which is unavailable",
                                     field="policy.network.egress")
        s = self._settings
        lease_s = min(lease_ms / 1000 if lease_ms else s.default_lease_s, s.max_lease_s)
        key = pool_key(template.plan.workspace, template.image, template.backend.name, template.plan.uid,
                       template.plan.gid, template.policy)
        with self._cond:
            held = sum(1 for lease in self._leases.values() if lease.principal == caller.name)
            held += self._acquiring.get(caller.name, 0)
            quota = self._ex.settings.quotas.leases
            if held >= quota:
                raise ResourceExhausted(f"{caller.name} holds {held} leases (or is acquiring them), its quota; "
                                        "release one first")
            pool = self._pool_for(key, template, caller)
            self._acquiring[caller.name] = self._acquiring.get(caller.name, 0) + 1
        try:
            return self._take(pool, caller, lease_s, time.monotonic() + wait_ms / 1000)
        finally:
            with self._cond:
                left = self._acquiring[caller.name] - 1
                if left:
                    self._acquiring[caller.name] = left
                else:
                    del self._acquiring[caller.name]

    def _pool_for(self, key: str, template: "Prepared", caller: "Principal") -> Pool:
        """The pool for `key`, made if missing within the daemon's and the caller's pool
        caps (a pool keeps sandboxes warm: one principal must not fill the machine)."""
        pool = self._pools.get(key)
        if pool is not None and not pool.draining:
            pool.last_used = time.monotonic()
            return pool
        live = [p for p in self._pools.values() if not p.draining]
        if len(live) >= self._settings.max_pools:
            raise ResourceExhausted(f"the daemon keeps its maximum of {self._settings.max_pools} pools; "
                                    "drain one or wait for an idle one to retire")
        own = sum(1 for p in live if p.owner == caller.name)
        if own >= self._ex.settings.quotas.pools:
            raise ResourceExhausted(f"{caller.name} has {own} pools, its quota; a pool unused for "
                                    f"{self._settings.idle_ttl_s:.0f} s retires (or an admin drains one)")
        old = self._pools.get(key)
        pool = self._pools[key] = Pool(key, template, owner=caller.name, predecessor=old)
        return pool

    def _take(self, pool: Pool, caller: "Principal", lease_s: float, deadline: float) -> Lease:
        s = self._settings
        with self._cond:
            while True:
                if self._closing:
                    raise FailedPrecondition("the daemon is shutting down")
                if pool.draining:  # while this caller waited: nothing more is made in it
                    raise _drained()
                while pool.idle:
                    ws = pool.idle.pop()
                    if not ws.dead:
                        return self._lease(pool, ws, caller, lease_s)
                    self._destroy_later(pool, ws)
                if pool.size < s.max_size:
                    pool.creating += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResourceExhausted(f"the pool for this workspace and policy has its maximum of "
                                            f"{s.max_size} sandboxes (leased, being made or being removed); "
                                            "retry, or ask to wait (waitMs)")
                self._cond.wait(left)
        try:
            ws = self._create(pool)
        except BaseException:
            with self._cond:
                pool.creating -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            pool.creating -= 1
            pool.created += 1
            if self._closing:
                self._destroy_later(pool, ws)
                raise FailedPrecondition("the daemon is shutting down")
            if pool.draining:  # drained while this one was being made: never handed out
                self._destroy_later(pool, ws)
                raise _drained()
            return self._lease(pool, ws, caller, lease_s)

    def ensure(self, template: "Prepared", caller: "Principal") -> dict[str, Any]:
        """The pool for this template, made if missing; the upkeep thread warms it."""
        if template.secrets:
            raise Unimplemented("pooled sandboxes do not take credentials at creation", field="credentialRefs")
        if template.policy.proxied and self._ex.proxy is None:
            raise FailedPrecondition("this policy needs the egress proxy, which is unavailable",
                                     field="policy.network.egress")
        key = pool_key(template.plan.workspace, template.image, template.backend.name, template.plan.uid,
                       template.plan.gid, template.policy)
        with self._cond:
            self._pool_for(key, template, caller).last_used = time.monotonic()
            self._cond.notify_all()
        return next(p for p in self.list() if p["poolKey"] == key)

    def _lease(self, pool: Pool, ws: WarmSandbox, caller: "Principal", lease_s: float) -> Lease:
        lease = Lease("lease_" + ev.new_id("x")[2:], caller.name, ws, time.time() + lease_s, pool.key, pool=pool)
        ws.lease = lease
        pool.last_used = time.monotonic()
        pool.leased[lease.lease_id] = lease
        self._leases[lease.lease_id] = lease
        # On the log, under the lease id: who held which sandbox, for how long.
        with self._ex.db.transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO call_owners (tool_call_id, principal) VALUES (?,?)",
                         (lease.lease_id, caller.name))
            lease.last_event_id = self._ex.events.append(conn, lease.lease_id, "", [ev.EventDraft(
                ev.SANDBOX_LEASED, {"principal": caller.name, "sandboxId": ws.sandbox_id, "poolKey": pool.key,
                                    "backend": ws.prepared.backend.name, "workspace": ws.prepared.plan.workspace,
                                    "image": ws.prepared.image, "imageDigest": ws.prepared.image_digest,
                                    "expiresAt": _rfc3339(lease.expires)})])[-1].event_id
        self._ex.checkpoint_soon()
        return lease

    def release(self, lease_id: str, caller: "Principal") -> None:
        with self._cond:
            lease = self._owned(lease_id, caller)
            self._end_lease(lease, "released")

    def _owned(self, lease_id: str, caller: "Principal") -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or (lease.principal != caller.name and not caller.admin):
            # Another tenant's lease reads exactly like one that does not exist.
            raise NotFound(f"no lease {lease_id}", field="runtime.leaseId")
        return lease

    def _end_lease(self, lease: Lease, why: str) -> None:
        """Under the lock. Its sandbox is destroyed (never reused): after the running
        command, if there is one."""
        if self._leases.pop(lease.lease_id, None) is not None:
            try:
                self._ex.events.record(lease.lease_id, lease.last_event_id, [ev.EventDraft(
                    ev.SANDBOX_LEASE_ENDED, {"reason": why, "sandboxId": lease.sandbox.sandbox_id})])
            except Exception:
                log.exception("recording the end of lease %s failed", lease.lease_id)
            self._ex.checkpoint_soon()
        pool = lease.pool
        if pool is not None:
            pool.leased.pop(lease.lease_id, None)
        ws = lease.sandbox
        ws.lease = None
        ws.dead = True
        if ws.busy:
            self._retire(pool, ws)  # it counts against the pool until the command ends and it is gone
        else:
            self._destroy_later(pool, ws)
        self._cond.notify_all()

    def sandbox_for(self, lease_id: str, caller: "Principal", call: "Prepared") -> WarmSandbox:
        """The leased sandbox a call runs in, marked busy; the call's sandbox-fixing
        policy must be the lease's."""
        key = pool_key(call.plan.workspace, call.image, call.backend.name, call.plan.uid, call.plan.gid, call.policy)
        with self._cond:
            lease = self._owned(lease_id, caller)
            if lease.expires <= time.time():
                self._end_lease(lease, "expired")
                raise NotFound(f"lease {lease_id} expired", field="runtime.leaseId")
            if key != lease.key:
                raise FailedPrecondition("the call's workspace, image, backend or sandbox policy differ from the "
                                         "lease's: only timeout, output caps, cwd and env may change per command",
                                         field="runtime.leaseId")
            ws = lease.sandbox
            if ws.busy:
                raise Aborted(f"lease {lease_id} is running call {ws.busy}: one command at a time",
                              field="runtime.leaseId")
            if ws.dead:
                raise FailedPrecondition(f"the sandbox of lease {lease_id} is gone; release it and acquire another",
                                         field="runtime.leaseId")
            ws.busy = "pending"
            return ws

    def claim(self, ws: WarmSandbox, tool_call_id: str) -> None:
        with self._cond:
            ws.busy = tool_call_id

    def command_done(self, ws: WarmSandbox, healthy: bool) -> None:
        with self._cond:
            ws.busy = ""
            if not healthy:
                ws.dead = True
                lease = ws.lease
                if lease is not None and lease.pool is not None:
                    # Removed now, not when its lease ends (a client may hold a lease for
                    # hours): the lease answers "its sandbox is gone" from here on.
                    lease.pool.leased.pop(lease.lease_id, None)
                    self._destroy_later(lease.pool, ws)
            if ws.dead and ws.lease is None:
                # Its lease ended while it ran (_end_lease retired it): counted in its own
                # pool since, not in whatever pool holds its key now.
                self._destroy_later(ws.retired_from, ws)
            self._cond.notify_all()

    # -- sandboxes ------------------------------------------------------------------------
    def _create(self, pool: Pool) -> WarmSandbox:
        ex, t = self._ex, pool.template
        # Looked up for each sandbox: the image a tag names may have changed since the
        # pool was made, and a lease's record names what its sandbox runs.
        image_digest = ex.resolve_allowed_image(t.backend, t.image)
        sandbox_id = "sbx-" + ev.new_id("x")[2:]
        # The supervisor calls in: a socket only the sandbox's user may reach, accepted
        # once (before any command exists) and then removed, so no command can ever
        # stand in for the supervisor or open a second channel.
        control_dir = ex.settings.runtime_dir / "control"
        control_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(control_dir, 0o711)
        control_path = control_dir / f"{sandbox_id}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(str(control_path))
            os.chown(control_path, t.plan.uid, t.plan.gid)
            os.chmod(control_path, 0o600)
            listener.listen(1)
        except BaseException:
            listener.close()
            control_path.unlink(missing_ok=True)
            raise
        endpoint = None
        egress = None
        handle = None
        spool = OutputSpool(ex.settings.spool_dir / sandbox_id, {STDOUT: 64 * 1024, STDERR: 64 * 1024}, 4096)
        reserved = False
        try:
            if t.policy.proxied:
                proxy = ex.proxy
                endpoint = proxy.open_endpoint(
                    sandbox_id, proxy.rules(t.policy.allow_domains, t.policy.deny_private_networks,
                                            any_host=t.policy.egress == "open"),
                    uid=t.plan.uid, gid=t.plan.gid, record_allowed=t.policy.record_network_access)
                egress = EgressAttachment(str(proxy.socket_path(sandbox_id)), ex.settings.egress.proxy_port)
            attachments = Attachments(ex.shim or "", egress, control_host_socket=str(control_path))
            # The engine-side limit is the sandbox's whole life; each command has its own.
            life_ms = int((self._settings.max_lease_s + self._settings.idle_ttl_s) * 1000)
            policy = replace(t.policy, timeout_ms=life_ms)
            plan = replace(t.plan, staging_dir=ex.staging_dir(sandbox_id))
            spec = t.backend.compile(policy, plan, SandboxIdentity(ex.daemon_id, sandbox_id, f"pool:{pool.key}"),
                                     argv=("supervisor",), image=t.image, stdin_open=False, attachments=attachments)
            ex.reserve_workspace(f"pool:{sandbox_id}", t.plan)
            reserved = True
            handle = t.backend.create(spec)
            t.backend.start(handle, spool, b"")
            conn = _await_supervisor(listener, t.backend, handle, spool)
            conn.settimeout(READY_TIMEOUT_S)
            if conn.recv(16) != b"R":
                conn.close()
                raise InternalError(f"the supervisor of {sandbox_id} did not say it was ready")
            conn.settimeout(None)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)  # argv and env in one message
        except BaseException:
            if handle is not None:
                t.backend.destroy(handle)
            if endpoint is not None:
                ex.proxy.close_endpoint(endpoint)
            spool.discard()
            if reserved:
                ex.release_workspace(f"pool:{sandbox_id}")
            raise
        finally:
            listener.close()
            control_path.unlink(missing_ok=True)
        # handle.spec: the backend may have placed the sandbox (nsjail on cgroup v2: its cgroup).
        prepared = replace(t, spec=handle.spec, sandbox_id=sandbox_id, attachments=attachments, image_digest=image_digest)
        log.info("warm sandbox %s ready for %s", sandbox_id, pool.key)
        baseline = sandbox_processes(handle.spec)
        single_threaded = baseline is not None and sandbox_task_count(handle.spec) == len(baseline)
        return WarmSandbox(sandbox_id, pool.key, prepared, handle, spool, conn, endpoint=endpoint,
                           baseline_pids=baseline,
                           baseline_pidfds=_pidfds(baseline) if single_threaded else ())

    def _retire(self, pool: Pool | None, ws: WarmSandbox) -> None:
        """Under the lock: `ws` counts against `pool` as being removed, once, from now
        until it is gone."""
        if not ws.retired:
            ws.retired, ws.retired_from = True, pool
            if pool is not None:
                pool.destroyed += 1
                pool.destroying += 1

    def _destroy_later(self, pool: Pool | None, ws: WarmSandbox) -> None:
        """Under the lock: removal happens off the caller's thread, once."""
        self._retire(pool, ws)
        if ws.removing:
            return
        ws.removing = True
        t = threading.Thread(target=self._destroy_counted, args=(ws, ws.retired_from), daemon=True,
                             name=f"destroy-{ws.sandbox_id}")
        self._destroyers = [d for d in self._destroyers if d.is_alive()] + [t]
        t.start()

    def _destroy_counted(self, ws: WarmSandbox, pool: Pool | None) -> None:
        try:
            self._destroy(ws)
        finally:
            if pool is not None:
                with self._cond:
                    pool.destroying -= 1
                    self._cond.notify_all()  # a waiter at the maximum may make one now

    def _destroy(self, ws: WarmSandbox) -> None:
        backend = ws.prepared.backend
        try:
            backend.kill(ws.handle)
        except Exception:  # noqa: BLE001 - destroy below is what matters
            pass
        if ws.watch is not None:  # before the removal: it holds a descriptor of the sandbox's mount
            try:
                ws.watch.stop()
            except Exception:
                log.exception("stopping the file watch of %s failed", ws.sandbox_id)
            ws.watch = None
        try:
            backend.destroy(ws.handle)
        except Exception:
            log.exception("destroying warm sandbox %s failed", ws.sandbox_id)
        if ws.endpoint is not None:
            try:
                self._ex.proxy.close_endpoint(ws.endpoint)
            except Exception:
                log.exception("closing the egress endpoint of %s failed", ws.sandbox_id)
        ws.spool.discard()
        ws.control.close()
        if ws.pidfd >= 0:
            os.close(ws.pidfd)
            ws.pidfd = -1
        for fd in ws.baseline_pidfds:
            os.close(fd)
        ws.baseline_pidfds = ()
        self._ex.release_workspace(f"pool:{ws.sandbox_id}")

    # -- upkeep -------------------------------------------------------------------------
    def _maintain(self) -> None:
        while True:
            with self._cond:
                self._cond.wait(0.5)
                if self._closing:
                    return
                now, mono = time.time(), time.monotonic()
                for lease in list(self._leases.values()):
                    if lease.expires <= now:
                        log.info("lease %s expired: its sandbox goes", lease.lease_id)
                        self._end_lease(lease, "expired")
                refill: list[Pool] = []
                for pool in list(self._pools.values()):
                    keep = []
                    for ws in pool.idle:
                        ended = ws.handle.output_closed.is_set()  # the supervisor is gone
                        if ended or ws.dead or mono - ws.idle_since > self._settings.idle_ttl_s or pool.draining:
                            self._destroy_later(pool, ws)
                        else:
                            keep.append(ws)
                    pool.idle = keep
                    if not pool.draining and not pool.leased and not pool.creating \
                            and mono - pool.last_used > self._settings.idle_ttl_s:
                        # Unused for its idle TTL: the pool retires instead of refilling.
                        log.info("pool %s unused for %.0f s: retired", pool.key, mono - pool.last_used)
                        pool.draining = True
                        for ws in pool.idle:
                            self._destroy_later(pool, ws)
                        pool.idle = []
                    if not pool.draining and len(pool.idle) + pool.creating < self._settings.min_idle \
                            and pool.size < self._settings.max_size:
                        pool.creating += 1
                        refill.append(pool)
                    if pool.draining and not pool.size:  # its removals too: a pool made again counts them
                        del self._pools[pool.key]
            for pool in refill:
                try:
                    ws = self._create(pool)
                    with self._cond:
                        pool.created += 1
                        if self._closing or pool.draining:
                            self._destroy_later(pool, ws)  # made while the pool was being emptied
                        else:
                            pool.idle.append(ws)
                        self._cond.notify_all()
                except Exception as exc:  # noqa: BLE001 - a pool that cannot refill waits
                    log.warning("could not refill %s: %s", pool.key, exc)
                finally:
                    with self._cond:
                        pool.creating -= 1

    def list(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Every pool, or those `owner` made."""
        with self._cond:
            return [{"poolKey": p.key, "workspace": p.template.plan.workspace, "image": p.template.image,
                     "backend": p.template.backend.name, "idle": len(p.idle), "leased": len(p.leased),
                     "minIdle": self._settings.min_idle, "maxSize": self._settings.max_size,
                     "created": p.created, "destroyed": p.destroyed} for p in self._pools.values()
                    if owner is None or p.owner == owner]

    def metrics(self) -> str:
        """Prometheus exposition of every pool (by key and backend: no workspace paths)."""
        pools = self.list()
        families = []
        for name, field_, kind, help_text in (
                ("sandboxd_pool_idle_sandboxes", "idle", "gauge", "Warm sandboxes waiting for a lease"),
                ("sandboxd_pool_leased_sandboxes", "leased", "gauge", "Warm sandboxes leased"),
                ("sandboxd_pool_created_total", "created", "counter", "Warm sandboxes created"),
                ("sandboxd_pool_destroyed_total", "destroyed", "counter", "Warm sandboxes destroyed")):
            families.append((name, kind, help_text, [
                f'{name}{{pool="{p["poolKey"]}",backend="{p["backend"]}"}} {p[field_]}' for p in pools]))
        families.append(("sandboxd_pool_acquire_seconds", "histogram", "AcquireSandbox latency",
                         self.acquire_latency.render("sandboxd_pool_acquire_seconds")))
        return render(families)

    def drain(self, key: str = "") -> int:
        with self._cond:
            n = 0
            for pool in list(self._pools.values()):
                if key and pool.key != key:
                    continue
                pool.draining = True
                for ws in pool.idle:
                    self._destroy_later(pool, ws)
                    n += 1
                pool.idle = []
                for lease in list(pool.leased.values()):
                    self._end_lease(lease, "drained")
                    n += 1
            return n

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Every warm sandbox is gone when this returns (up to the timeout)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s)  # a refill in progress finishes, and is destroyed
        self.drain()
        with self._cond:
            destroyers = list(self._destroyers)
        for t in destroyers:
            t.join(max(0.0, deadline - time.monotonic()))


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("credential", os.MFD_CLOEXEC)
    try:
        os.write(fd, content)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _await_supervisor(listener: socket.socket, backend, handle: SandboxHandle, spool: OutputSpool) -> socket.socket:
    """The supervisor's connection, once it calls in. A sandbox that ends first is
    reported then, not after the whole wait."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    poller = select.poll()  # not select: the daemon's descriptors go past 1023
    poller.register(listener, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise InternalError(f"the supervisor of {handle.sandbox_id} did not call in within {READY_TIMEOUT_S:.0f} s: "
                                f"{spool.summary(STDERR).preview[-300:]!r}")
        if poller.poll(min(left, 0.1) * 1000):
            return listener.accept()[0]
        if backend.wait(handle, 0):
            status, _ = backend.collect(handle)
            raise InternalError(f"the sandbox {handle.sandbox_id} ended before its supervisor called in (exit code "
                                f"{status.exit_code}{', ' + status.signal if status.signal else ''}): "
                                f"{spool.summary(STDERR).preview[-300:]!r}")


class _CommandIO:
    """A running command's pipes (its stdout, stderr and stdin) and the supervisor's
    socket, polled together."""

    def __init__(self, out_r: int, err_r: int, in_w: int, pending: memoryview, sink: OutputSpool, conn_fd: int):
        self.streams = {out_r: STDOUT, err_r: STDERR}
        self.in_w = in_w
        self.pending = pending
        self.sink = sink
        self.conn_fd = conn_fd
        self.poller = select.poll()
        for fd in self.streams:
            self.poller.register(fd, select.POLLIN)
        self.poller.register(conn_fd, select.POLLIN)
        if in_w >= 0:
            os.set_blocking(in_w, False)
            self.poller.register(in_w, select.POLLOUT)

    def close(self) -> None:
        for fd in list(self.streams) + ([self.in_w] if self.in_w >= 0 else []):
            os.close(fd)
        self.streams = {}
        self.in_w = -1


class LeaseBackend:
    """The Backend protocol for one command in a leased sandbox, through its supervisor."""

    def __init__(self, pools: PoolManager, ws: WarmSandbox, secret_env: dict[str, str] | None = None,
                 secret_files: dict[str, bytes] | None = None):
        self._pools = pools
        self._ws = ws
        # Credential values for the command's environment: sent to the supervisor only.
        self._secret_env = dict(secret_env or {})
        # sandbox path (under tempDir) -> content: the supervisor writes each for this
        # command only, from a memfd (never a file on the host's disk).
        self._secret_files = dict(secret_files or {})
        self.name = ws.prepared.backend.name
        self._conn: socket.socket | None = None
        self._io: _CommandIO | None = None  # the running command's descriptors
        self._status: int | None = None
        self._done = threading.Event()
        self._healthy = True
        # Set when the command's end found nothing of it left in the sandbox: nothing
        # can start another process there until the next command, so destroy() need not
        # look again.
        self._found_clean = False

    def create(self, spec: CommandSpec) -> SandboxHandle:
        return SandboxHandle(self._ws.sandbox_id, self._ws.handle.engine_id, spec)

    def broken(self, why: str) -> InternalError:
        """The sandbox cannot take this command: it is replaced, never leased on."""
        self._healthy = False
        return InternalError(why)

    def network_records(self):
        """What this command's connections through the sandbox's proxy were (the
        endpoint is emptied for the next command)."""
        if self._ws.endpoint is None:
            return [], 0, {}
        return self._pools.proxy.take_records(self._ws.endpoint)

    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        spec: CommandSpec = handle.spec
        if self._ws.endpoint is not None:
            self.network_records()  # anything from before this command is nobody's
        env = {**spec.env, **self._secret_env}
        fields = [spec.cwd, str(len(spec.argv)), *spec.argv, str(len(env)), *(f"{k}={v}" for k, v in env.items())]
        if self._secret_files:
            fields += [str(len(self._secret_files)), spec.temp_dir, *self._secret_files]
        payload = b"\0".join(f.encode("utf-8", "surrogateescape") for f in fields) + b"\0"
        made: list[int] = []
        try:
            contents = []
            for value in self._secret_files.values():
                contents.append(_memfd(value))
                made.append(contents[-1])
            for _ in range(3):
                made += os.pipe2(os.O_CLOEXEC)
        except BaseException:
            for fd in made:
                os.close(fd)
            raise
        in_r, in_w, out_r, out_w, err_r, err_w = made[len(contents):]
        conn = self._ws.control  # the supervisor's own connection: one command at a time
        try:
            conn.settimeout(START_TIMEOUT_S)  # a supervisor that does not answer is a dead sandbox
            try:
                conn.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                          array.array("i", [in_r, out_w, err_w, *contents]))])
                answer = conn.recv(256)
            finally:
                conn.settimeout(None)
        except OSError as exc:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            self._healthy = False
            raise InternalError(f"the sandbox's supervisor did not take the command: {exc}") from None
        finally:
            for fd in (in_r, out_w, err_w, *contents):
                try:
                    os.close(fd)
                except OSError:
                    pass
        if not answer.startswith(b"P "):
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            if not answer:
                self._healthy = False  # the supervisor is gone
                raise InternalError("the sandbox's supervisor is gone")
            # A refusal ("E why"): nothing ran, the supervisor waits for the next command.
            self._done.set()
            raise FailedPrecondition("the sandbox's supervisor refused the command: "
                                     + answer[2:200].decode("utf-8", "replace"))
        self._conn = conn
        if not stdin:
            os.close(in_w)
            in_w = -1
        # Both output pipes, stdin and the supervisor's answer are served by whoever
        # waits for the command (wait()), on its thread: a thread of their own, and the
        # hand-off back from it, cost a short command a quarter of a millisecond.
        self._io = _CommandIO(out_r, err_r, in_w, memoryview(stdin), sink, self._conn.fileno())

    def _serve(self, handle: SandboxHandle, timeout_s: float) -> bool:
        """Moves the command's bytes until it has ended and its output is drained (True)
        or `timeout_s` passes (False)."""
        io = self._io
        assert io is not None
        deadline = time.monotonic() + timeout_s
        last_look = False
        try:
            while io.streams or not self._done.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    if last_look:
                        return False
                    last_look = True  # one pass without waiting: what has ended by now counts
                for fd, _ in io.poller.poll(max(0, math.ceil(left * 1000))):
                    if fd == io.conn_fd:
                        self._answer(io.poller, io.conn_fd)
                    elif fd == io.in_w:
                        try:
                            io.pending = io.pending[os.write(io.in_w, io.pending):]
                        except BlockingIOError:
                            continue
                        except OSError:
                            io.pending = io.pending[:0]  # the command stopped reading
                        if not io.pending:
                            io.poller.unregister(io.in_w)
                            os.close(io.in_w)
                            io.in_w = -1
                    elif fd in io.streams:
                        data = os.read(fd, 1 << 20)
                        if data:
                            io.sink.write(io.streams[fd], data)
                        else:
                            io.poller.unregister(fd)
                            os.close(fd)
                            del io.streams[fd]
        except OSError as exc:
            log.warning("command channel of %s broke: %s", handle.sandbox_id, exc)
            self._healthy = False
        io.close()
        self._io = None
        handle.output_closed.set()
        self._done.set()
        return True

    def _answer(self, poller, conn_fd: int) -> None:
        """The supervisor's "X <status>" (or its end: the sandbox broke)."""
        assert self._conn is not None
        try:
            answer = self._conn.recv(256)
        except OSError:
            answer = b""
        poller.unregister(conn_fd)
        if answer.startswith(b"X "):
            self._status = int(answer[2:])
            self._kill_leftovers()
        else:
            self._healthy = False
        self._done.set()

    def _kill_leftovers(self) -> None:
        """What the supervisor could not see (nsjail's hidepid hides non-dumpable
        processes) is still in the sandbox's cgroup: killed from outside, by host pid."""
        baseline = self._ws.baseline_pids
        if baseline is None:
            return
        ws = self._ws
        intact = _all_alive(ws.baseline_pidfds)
        if intact and sandbox_task_count(ws.prepared.spec) == len(ws.baseline_pidfds):
            self._found_clean = True  # one read instead of listing the tree (~0.3 ms)
            return
        if ws.baseline_pidfds and not intact:
            log.warning("a process the sandbox %s started with is gone: it is retired after this command",
                        ws.sandbox_id)
            self._healthy = False
        present = sandbox_processes(self._ws.prepared.spec)
        left = (present or set()) - baseline
        self._found_clean = present is not None and not left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, handle: SandboxHandle, timeout_s: float) -> bool:
        if self._io is None:  # never started, or served to the end already
            return self._done.wait(timeout_s) and handle.output_closed.wait(5.0)
        return self._serve(handle, timeout_s)

    def kill(self, handle: SandboxHandle) -> None:
        if self._conn is not None and not self._done.is_set():
            try:
                self._conn.send(b"K")
            except OSError:
                self._healthy = False

    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        status = self._status if self._status is not None else -1
        if status < 0:
            return ExitStatus(-1, "", False), ResourceUsage(0, 0)
        code = os.waitstatus_to_exitcode(status)
        sig = signal.Signals(-code).name if code < 0 else ""
        return ExitStatus(128 - code if code < 0 else code, sig, False), ResourceUsage(0, 0)

    def destroy(self, handle: SandboxHandle) -> None:
        """The sandbox stays (it is the lease's) if nothing of the command is left in it.
        The supervisor kills what it can see; a process it cannot see (nsjail's /proc
        hides non-dumpable ones) still counts in the sandbox's cgroup, and then the
        sandbox is retired rather than handed the next command."""
        healthy = False  # unless shown below: a failure here retires the sandbox
        try:
            if self._io is not None:  # it never ended, not even after SIGKILL: retired
                self._io.close()
                self._io = None
                self._healthy = False
            if self._healthy and self._ws.baseline_pids is not None and not self._found_clean:
                deadline = time.monotonic() + 0.5
                while True:
                    left = (sandbox_processes(self._ws.prepared.spec) or set()) - self._ws.baseline_pids
                    if not left:
                        break
                    if time.monotonic() > deadline:
                        log.warning("command left %d process(es) in %s: the sandbox is retired", len(left),
                                    self._ws.sandbox_id)
                        self._healthy = False
                        break
                    time.sleep(0.01)
            healthy = self._healthy and self._done.is_set()
        finally:
            # Always: a sandbox left busy would never be removed, nor leave its pool's count.
            self._pools.command_done(self._ws, healthy)


def _pidfds(pids: set[int]) -> tuple[int, ...]:
    """A pidfd on each process, or none at all if one has exited already."""
    out: list[int] = []
    try:
        for pid in sorted(pids):
            out.append(os.pidfd_open(pid))
    except OSError:
        for fd in out:
            os.close(fd)
        return ()
    return tuple(out)


def _all_alive(pidfds: tuple[int, ...]) -> bool:
    """True while none of the processes exited (a pidfd turns readable when it does)."""
    if not pidfds:
        return False
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    return not poller.poll(0)


def _pids_cgroup(spec: Any, cgroup_root: str) -> str | None:
    rel = getattr(spec, "cgroup_parent", None) or getattr(spec, "cgroup", None)
    if not rel:
        return None
    hierarchy = f"{cgroup_root}/pids" if os.path.isdir(f"{cgroup_root}/pids") else cgroup_root
    return f"{hierarchy}/{str(rel).strip('/')}"


def sandbox_task_count(spec: Any, cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Tasks (threads) in the sandbox's pids cgroup subtree, None if unknown."""
    root = _pids_cgroup(spec, cgroup_root)
    if root is None:
        return None
    try:
        with open(f"{root}/pids.current") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def sandbox_processes(spec: Any, cgroup_root: str = "/sys/fs/cgroup") -> set[int] | None:
    """Host pids in the sandbox's cgroup subtree (the v1 pids hierarchy, or the unified
    one on a v2 host), None if unknown. Plain strings and scandir: this runs twice per
    leased command."""
    root = _pids_cgroup(spec, cgroup_root)
    if root is None or not os.path.isdir(root):
        return None
    pids: set[int] = set()
    todo = [root]
    while todo:  # cgroup trees are shallow, but never recurse on what a sandbox can shape
        d = todo.pop()
        try:
            with open(f"{d}/cgroup.procs") as f:
                pids.update(int(line) for line in f if line.strip())
        except OSError:
            pass
        try:
            with os.scandir(d) as it:
                todo += [e.path for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            pass  # removed meanwhile
    return pids
