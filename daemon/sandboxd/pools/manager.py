"""Warm sandboxes and leases. A pool holds sandboxes for one (workspace, image, backend,
policy class); each runs the shim's supervisor instead of a command. A lease hands one
sandbox to one principal; Execute calls naming the lease run through the supervisor
(pools/lease.py: the sandbox outlives each command), so each command still gets its own
timeout, output caps, events and artifacts, and its leftover processes are killed when
it ends. A released or expired lease's sandbox is destroyed, never handed to anyone
else: the pool makes a fresh one.

The manager is given what it needs at construction (settings, the ledger, the egress
proxy, the workspace reservations, how to resolve an image and where to stage mounts):
it never calls back into the calls package."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sandboxd.core.errors import Aborted, FailedPrecondition, NotFound, ResourceExhausted, Unimplemented
from sandboxd.core.metrics import Histogram
from sandboxd.core.settings import DaemonSettings
from sandboxd.egress.proxy import EgressProxy
from sandboxd.ledger import events as ev
from sandboxd.ledger import lease_rows
from sandboxd.ledger.events import EventLog
from sandboxd.ledger.store import Database
from sandboxd.policy.principal import Principal
import sandboxd.pools.warm as warm
from sandboxd.pools.builder import WarmSandboxBuilder
from sandboxd.pools.metrics import render_pool_metrics
from sandboxd.pools.template import PoolTemplate, WorkspaceReservations, template_key
from sandboxd.pools.warm import Lease, Pool, WarmSandbox
from sandboxd.sandbox.protocol import Backend

log = logging.getLogger("sandboxd.pools.manager")


class PoolManager:
    def __init__(self, settings: DaemonSettings, *, daemon_id: str, shim: str | None, proxy: EgressProxy | None,
                 db: Database, events: EventLog, checkpoint_soon: Callable[[], None],
                 workspaces: WorkspaceReservations, resolve_image: Callable[[Backend, str], str],
                 staging_dir: Callable[[str], str]):
        self._settings = settings.pools
        self._quotas = settings.quotas
        self._proxy = proxy
        self._db = db
        self._events = events
        self._checkpoint_soon = checkpoint_soon
        self._builder = WarmSandboxBuilder(settings, daemon_id=daemon_id, shim=shim, proxy=proxy,
                                           workspaces=workspaces, resolve_image=resolve_image,
                                           staging_dir=staging_dir)
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
    def proxy(self) -> EgressProxy | None:
        return self._proxy

    # -- leases ------------------------------------------------------------------------
    def acquire(self, template: PoolTemplate, caller: Principal, lease_ms: int, wait_ms: int) -> Lease:
        t0 = time.monotonic()
        lease = self._acquire(template, caller, lease_ms, wait_ms)
        self.acquire_latency.observe(time.monotonic() - t0)
        return lease

    def _check_template(self, template: PoolTemplate, no_credentials: str) -> None:
        if template.secrets:
            raise Unimplemented(no_credentials, field="credentialRefs")
        if template.policy.proxied and self._proxy is None:
            raise FailedPrecondition("this policy needs the egress proxy, which is unavailable",
                                     field="policy.network.egress")

    def _acquire(self, template: PoolTemplate, caller: Principal, lease_ms: int, wait_ms: int) -> Lease:
        self._check_template(template, "pooled sandboxes do not take credentials yet")
        lease_s = warm.lease_seconds(lease_ms, self._settings)
        key = template_key(template)
        with self._cond:
            held = warm.leases_held(self._leases.values(), self._acquiring, caller.name)
            if held >= self._quotas.leases:
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

    def _pool_for(self, key: str, template: PoolTemplate, caller: Principal) -> Pool:
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
        if own >= self._quotas.pools:
            raise ResourceExhausted(f"{caller.name} has {own} pools, its quota; a pool unused for "
                                    f"{self._settings.idle_ttl_s:.0f} s retires (or an admin drains one)")
        old = self._pools.get(key)
        pool = self._pools[key] = Pool(key, template, owner=caller.name, predecessor=old)
        return pool

    def _take(self, pool: Pool, caller: Principal, lease_s: float, deadline: float) -> Lease:
        """An idle sandbox of `pool` leased, or a new one once there is room (waiting
        until `deadline` for it)."""
        s = self._settings
        with self._cond:
            while True:
                if self._closing:
                    raise FailedPrecondition("the daemon is shutting down")
                if pool.draining:  # while this caller waited: nothing more is made in it
                    raise warm.drained()
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
        return self._lease_new(pool, caller, lease_s)

    def _lease_new(self, pool: Pool, caller: Principal, lease_s: float) -> Lease:
        """A sandbox made for this caller (its place in the pool counted in `creating`)."""
        try:
            ws = self._builder.build(pool.template, pool.key)
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
                raise warm.drained()
            return self._lease(pool, ws, caller, lease_s)

    def ensure(self, template: PoolTemplate, caller: Principal) -> dict[str, Any]:
        """The pool for this template, made if missing; the upkeep thread warms it."""
        self._check_template(template, "pooled sandboxes do not take credentials at creation")
        key = template_key(template)
        with self._cond:
            self._pool_for(key, template, caller).last_used = time.monotonic()
            self._cond.notify_all()
        return next(p for p in self.list() if p["poolKey"] == key)

    def _lease(self, pool: Pool, ws: WarmSandbox, caller: Principal, lease_s: float) -> Lease:
        lease = Lease("lease_" + ev.new_id("x")[2:], caller.name, ws, time.time() + lease_s, pool.key, pool=pool)
        ws.lease = lease
        pool.last_used = time.monotonic()
        pool.leased[lease.lease_id] = lease
        self._leases[lease.lease_id] = lease
        # On the log, under the lease id: who held which sandbox, for how long.
        with self._db.transaction() as conn:
            lease_rows.insert_lease_owner(conn, lease.lease_id, caller.name)
            lease.last_event_id = self._events.append(conn, lease.lease_id, "", [lease.leased_event()])[-1].event_id
        self._checkpoint_soon()
        return lease

    def release(self, lease_id: str, caller: Principal) -> None:
        with self._cond:
            lease = self._owned(lease_id, caller)
            self._end_lease(lease, "released")

    def _owned(self, lease_id: str, caller: Principal, field: str = "runtime.leaseId") -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or (lease.principal != caller.name and not caller.admin):
            # Another tenant's lease reads exactly like one that does not exist.
            raise NotFound(f"no lease {lease_id}", field=field)
        return lease

    def _end_lease(self, lease: Lease, why: str) -> None:
        """Under the lock. Its sandbox is destroyed (never reused): after the running
        command, if there is one."""
        if self._leases.pop(lease.lease_id, None) is not None:
            try:
                self._events.record(lease.lease_id, lease.last_event_id, [lease.ended_event(why)])
            except Exception:
                log.exception("recording the end of lease %s failed", lease.lease_id)
            self._checkpoint_soon()
        pool = lease.pool
        if pool is not None:
            pool.leased.pop(lease.lease_id, None)
        ws = lease.sandbox
        ws.lease = None
        ws.dead = True
        if ws.busy:
            warm.retire(pool, ws)  # it counts against the pool until the command ends and it is gone
        else:
            self._destroy_later(pool, ws)
        self._cond.notify_all()

    def sandbox_for(self, lease_id: str, caller: Principal, call: PoolTemplate) -> WarmSandbox:
        """The leased sandbox a call runs in, marked busy; the call's sandbox-fixing
        policy must be the lease's."""
        return self._hold(lease_id, caller, "pending", "runtime.leaseId", template_key(call))

    def hold(self, lease_id: str, caller: Principal, holder: str) -> WarmSandbox:
        """The leased sandbox, marked busy by `holder` (a file transfer): no command runs
        in it until command_done."""
        return self._hold(lease_id, caller, holder, "target.leaseId", None)

    def _hold(self, lease_id: str, caller: Principal, holder: str, field: str, key: str | None) -> WarmSandbox:
        with self._cond:
            lease = self._owned(lease_id, caller, field)
            if lease.expires <= time.time():
                self._end_lease(lease, "expired")
                raise NotFound(f"lease {lease_id} expired", field=field)
            if key is not None and key != lease.key:
                raise FailedPrecondition("the call's workspace, image, backend or sandbox policy differ from the "
                                         "lease's: only timeout, output caps, cwd and env may change per command",
                                         field=field)
            ws = lease.sandbox
            if ws.busy:
                raise Aborted(f"lease {lease_id} is running {ws.busy}: one command or transfer at a time",
                              field=field)
            if ws.dead:
                raise FailedPrecondition(f"the sandbox of lease {lease_id} is gone; release it and acquire another",
                                         field=field)
            ws.busy = holder
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

    # -- removal ------------------------------------------------------------------------
    def _destroy_later(self, pool: Pool | None, ws: WarmSandbox) -> None:
        """Under the lock: removal happens off the caller's thread, once."""
        warm.retire(pool, ws)
        if ws.removing:
            return
        ws.removing = True
        t = threading.Thread(target=self._destroy_counted, args=(ws, ws.retired_from), daemon=True,
                             name=f"destroy-{ws.sandbox_id}")
        self._destroyers = [d for d in self._destroyers if d.is_alive()] + [t]
        t.start()

    def _destroy_counted(self, ws: WarmSandbox, pool: Pool | None) -> None:
        try:
            self._builder.destroy(ws)
        finally:
            if pool is not None:
                with self._cond:
                    warm.removed(pool)
                    self._cond.notify_all()  # a waiter at the maximum may make one now

    # -- upkeep -------------------------------------------------------------------------
    def _maintain(self) -> None:
        while True:
            with self._cond:
                self._cond.wait(0.5)
                if self._closing:
                    return
                refill = self._upkeep(time.time(), time.monotonic())
            for pool in refill:
                self._refill(pool)

    def _upkeep(self, now: float, mono: float) -> list[Pool]:
        """Under the lock: expired leases end, stale idle sandboxes and unused pools go.
        Returns the pools to make one more sandbox for (counted in their `creating`)."""
        s = self._settings
        for lease in list(self._leases.values()):
            if lease.expires <= now:
                log.info("lease %s expired: its sandbox goes", lease.lease_id)
                self._end_lease(lease, "expired")
        refill: list[Pool] = []
        for pool in list(self._pools.values()):
            for ws in warm.sweep_idle(pool, mono, s.idle_ttl_s):
                self._destroy_later(pool, ws)
            if warm.unused(pool, mono, s.idle_ttl_s):
                log.info("pool %s unused for %.0f s: retired", pool.key, mono - pool.last_used)
                pool.draining = True
                for ws in warm.sweep_idle(pool, mono, s.idle_ttl_s):  # a draining pool keeps none
                    self._destroy_later(pool, ws)
            if warm.wants_refill(pool, s):
                pool.creating += 1
                refill.append(pool)
            if pool.draining and not pool.size:  # its removals too: a pool made again counts them
                del self._pools[pool.key]
        return refill

    def _refill(self, pool: Pool) -> None:
        try:
            ws = self._builder.build(pool.template, pool.key)
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

    # -- views and the end -------------------------------------------------------------
    def leases(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Every lease held now, or `owner`'s, in HeldLease's JSON form (`sandboxctl ps`)."""
        with self._cond:
            return [{"lease": lease.to_json(), "principal": lease.principal,
                     "workspace": lease.sandbox.prepared.plan.workspace, "image": lease.sandbox.prepared.image,
                     # "pending": a call claimed it and is being admitted (no id yet)
                     "toolCallId": "" if lease.sandbox.busy == "pending" else lease.sandbox.busy}
                    for lease in self._leases.values() if owner is None or lease.principal == owner]

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
        return render_pool_metrics(self.list(), self.acquire_latency)

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
