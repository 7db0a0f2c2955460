"""Making and removing a warm sandbox. A sandbox of a pool runs the shim's supervisor
instead of a command, under its template's policy with the engine-side time limit
stretched to its whole possible life (each command has its own), and carries the
daemon's labels, so a restart reaps it like any other. A half-made one is unwound by a
cleanup stack, released only once its supervisor said it is ready."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace

from sandboxd.core.settings import DaemonSettings
from sandboxd.egress.proxy import EgressProxy
from sandboxd.egress.records import EgressEndpoint
from sandboxd.ledger import events as ev
from sandboxd.pools.leftovers import oom_kill_files, oom_kills, pidfds, sandbox_processes, sandbox_task_count
from sandboxd.pools.supervisor import await_ready, await_supervisor, control_listener, control_socket_path
from sandboxd.pools.template import BuiltSandbox, PoolTemplate, WorkspaceReservations
from sandboxd.pools.warm import WarmSandbox
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.sandbox.protocol import Backend
from sandboxd.sandbox.spec import POOL_CALL_PREFIX, Attachments, EgressAttachment, SandboxIdentity

log = logging.getLogger("sandboxd.pools.builder")

# The supervisor's own output: kept small, read only to say why one never called in.
SUPERVISOR_SPOOL_CAPS = {STDOUT: 64 * 1024, STDERR: 64 * 1024}
SUPERVISOR_PREVIEW_BYTES = 4096


def workspace_holder(sandbox_id: str) -> str:
    """A warm sandbox's name among the workspace reservations."""
    return f"pool:{sandbox_id}"


class WarmSandboxBuilder:
    def __init__(self, settings: DaemonSettings, *, daemon_id: str, shim: str | None, proxy: EgressProxy | None,
                 workspaces: WorkspaceReservations, resolve_image: Callable[[Backend, str], str],
                 staging_dir: Callable[[str], str]):
        self._settings = settings
        self._daemon_id = daemon_id
        self._shim = shim
        self._proxy = proxy
        self._workspaces = workspaces
        self._resolve_image = resolve_image
        self._staging_dir = staging_dir

    def build(self, template: PoolTemplate, key: str) -> WarmSandbox:
        """A warm sandbox of pool `key`, its supervisor ready for a command."""
        t = template
        # Looked up for each sandbox: the image a tag names may have changed since the
        # pool was made, and a lease's record names what its sandbox runs.
        image_digest = self._resolve_image(t.backend, t.image)
        sandbox_id = "sbx-" + ev.new_id("x")[2:]
        control_path = control_socket_path(self._settings.runtime_dir, sandbox_id)
        with control_listener(control_path, t.plan.uid, t.plan.gid) as listener, ExitStack() as undo:
            spool = OutputSpool(self._settings.spool_dir / sandbox_id, SUPERVISOR_SPOOL_CAPS, SUPERVISOR_PREVIEW_BYTES)
            undo.callback(spool.discard)
            endpoint, egress = self._open_egress(t, sandbox_id, undo)
            attachments = Attachments(self._shim or "", egress, control_host_socket=str(control_path))
            # The engine-side limit is the sandbox's whole life; each command has its own.
            pools = self._settings.pools
            policy = replace(t.policy, timeout_ms=int((pools.max_lease_s + pools.idle_ttl_s) * 1000))
            plan = replace(t.plan, staging_dir=self._staging_dir(sandbox_id))
            spec = t.backend.compile(policy, plan, SandboxIdentity(self._daemon_id, sandbox_id, POOL_CALL_PREFIX + key),
                                     argv=("supervisor",), image=t.image, stdin_open=False, attachments=attachments)
            self._workspaces.reserve(workspace_holder(sandbox_id), t.plan)
            undo.callback(self._workspaces.release, workspace_holder(sandbox_id))
            handle = t.backend.create(spec)
            undo.callback(t.backend.destroy, handle)
            t.backend.start(handle, spool, b"")
            conn = await_supervisor(listener, t.backend, handle, spool)
            undo.callback(conn.close)
            await_ready(conn, sandbox_id)
            undo.pop_all()
        # handle.spec: the backend may have placed the sandbox (nsjail on cgroup v2: its cgroup).
        built = BuiltSandbox(sandbox_id, t.policy, t.plan, t.image, image_digest, t.backend, handle.spec, attachments)
        log.info("warm sandbox %s ready for %s", sandbox_id, key)
        baseline = sandbox_processes(handle.spec)
        single_threaded = baseline is not None and sandbox_task_count(handle.spec) == len(baseline)
        counters = oom_kill_files(handle.spec)
        return WarmSandbox(sandbox_id, key, built, handle, spool, conn, endpoint=endpoint, baseline_pids=baseline,
                           baseline_pidfds=pidfds(baseline) if single_threaded and baseline is not None else (),
                           oom_kill_files=counters, oom_kills_seen=oom_kills(counters))

    def _open_egress(self, t: PoolTemplate, sandbox_id: str,
                     undo: ExitStack) -> tuple[EgressEndpoint | None, EgressAttachment | None]:
        """The sandbox's endpoint on the egress proxy, for a proxied policy (closed by
        `undo`), and how the sandbox reaches it."""
        if not t.policy.proxied:
            return None, None
        proxy = self._proxy
        assert proxy is not None  # the pool manager refuses a proxied template without one
        rules = proxy.rules(t.policy.allow_domains, t.policy.deny_private_networks, any_host=t.policy.egress == "open")
        endpoint = proxy.open_endpoint(sandbox_id, rules, uid=t.plan.uid, gid=t.plan.gid,
                                       record_allowed=t.policy.record_network_access)
        undo.callback(proxy.close_endpoint, endpoint)
        return endpoint, EgressAttachment(str(proxy.socket_path(sandbox_id)), self._settings.egress.proxy_port)

    def destroy(self, ws: WarmSandbox) -> None:
        """Removes the sandbox and everything held for it; never raises."""
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
        if ws.endpoint is not None and self._proxy is not None:
            try:
                self._proxy.close_endpoint(ws.endpoint)
            except Exception:
                log.exception("closing the egress endpoint of %s failed", ws.sandbox_id)
        self._release_host_side(ws)

    def _release_host_side(self, ws: WarmSandbox) -> None:
        ws.spool.discard()
        ws.control.close()
        if ws.pidfd >= 0:
            os.close(ws.pidfd)
            ws.pidfd = -1
        for fd in ws.baseline_pidfds:
            os.close(fd)
        ws.baseline_pidfds = ()
        self._workspaces.release(workspace_holder(ws.sandbox_id))
