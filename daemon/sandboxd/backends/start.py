"""The backends started at the daemon's start: each one checked, its leftovers from an
earlier run reaped, and why each one that cannot run does not (its calls are then
refused with that reason). Also where the jails' cgroups go (cgroup_home.py), settled
before the daemon starts any process."""

from __future__ import annotations

import logging
import os
import threading
from contextlib import ExitStack
from typing import Any

from sandboxd.backends.cgroup_home import CgroupHome, PlacementRefused, find_home, settle
from sandboxd.backends.cgroups import layout_for
from sandboxd.backends.docker.backend import DockerBackend
from sandboxd.backends.docker.compile import SANDBOX_CGROUP_ROOT
from sandboxd.backends.hostlocks import daemon_running, remove_stale_cgroups
from sandboxd.backends.nsjail.backend import NsjailBackend
from sandboxd.core.errors import BackendUnavailable, SandboxdError
from sandboxd.core.hostfacts import HostFacts
from sandboxd.core.settings import DaemonSettings

log = logging.getLogger("sandboxd")


def _mask_file(settings: DaemonSettings) -> str:
    """An empty, root-owned, mode-000 file bound over blocked files."""
    path = settings.state_dir / "mask" / "empty"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    if not path.exists():
        path.touch()
    os.chmod(path, 0)
    return str(path)


def _start_docker(settings: DaemonSettings, daemon_id: str, staging_root: str, cleanup: ExitStack) -> DockerBackend:
    backend = DockerBackend(settings.docker_host, str(settings.seccomp_profile), _mask_file(settings),
                            stdio_dir=str(settings.runtime_dir / "stdio"))
    backend.check()
    reaped = backend.reap_orphans(daemon_id)
    if reaped:
        log.warning("removed %d containers left by an earlier run of this daemon", reaped)
    # Its containers' deadlines hold without this process, and its staged roots go.
    backend.start_backstop(daemon_id, staging_root)
    _close_on_failure(backend, cleanup)
    return backend


def place_jail_cgroups(settings: DaemonSettings, host: HostFacts) -> CgroupHome | str:
    """Where the jails' cgroups go (backends/cgroup_home.py), or why they cannot: below
    the daemon's own cgroup when systemd delegated it, the daemon having moved itself
    into its leaf there. Done first, before the daemon starts any process: one left in
    the delegated cgroup would keep the controllers from being enabled below it."""
    if not settings.nsjail.enabled:
        return "disabled in the daemon's settings"
    try:
        home = find_home(host.cgroup_version, settings.nsjail.cgroup_placement, host.cgroup_root)
        settle(home, host.cgroup_root)
    except PlacementRefused as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read the daemon's own cgroup: {exc}"
    log.info("the jails' cgroups go %s", home.how)
    return home


def _start_nsjail(settings: DaemonSettings, daemon_id: str, shim: str, host: HostFacts, home: CgroupHome | str,
                  cleanup: ExitStack) -> NsjailBackend:
    if isinstance(home, str):
        raise BackendUnavailable(home)
    ns = settings.nsjail
    layout = layout_for(host.cgroup_version, host.cgroup_root, join_exec=settings.cgroup_exec_binary, base=home.base)
    backend = NsjailBackend(ns.rootfs_dir, seccomp_profile_path=settings.seccomp_profile, shim_binary=shim,
                            nsjail_binary=ns.nsjail_binary, nsjail_binary_sha256=ns.nsjail_binary_sha256,
                            init_binary=ns.init_binary,
                            docker_host=settings.docker_host, warm_slots=ns.warm_slots,
                            cgroup_layout=layout, cgroup_exec_binary=settings.cgroup_exec_binary,
                            cgroup_top=home.top)
    backend.check()
    reaped = backend.reap_orphans(daemon_id)
    if reaped:
        log.warning("removed %d jails left by an earlier run of this daemon", reaped)
    _close_on_failure(backend, cleanup)  # before warming: its warm slots are its to end
    backend.warm(daemon_id)
    backend.prune_exports()
    return backend


def _close_on_failure(backend: object, cleanup: ExitStack) -> None:
    close = getattr(backend, "close", None)
    if close is not None:
        cleanup.callback(close)


def start_backends(settings: DaemonSettings, daemon_id: str, shim: str, host: HostFacts, home: CgroupHome | str,
                   staging_root: str, cleanup: ExitStack) -> tuple[dict[str, Any], dict[str, str]]:
    """Every configured backend that passes its checks, and why each other one does not.
    A backend that fails a check is never used: its calls are refused with the reason.
    `host` is what start-up found of the host: nsjail's cgroup layout is made from it,
    below `home` (or `home` says why there is none). `staging_root`: where the calls
    stage their roots (the Docker backstop unmounts this daemon's, once it is gone)."""
    backends: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    try:
        backends["docker"] = _start_docker(settings, daemon_id, staging_root, cleanup)
    except SandboxdError as exc:
        unavailable["docker"] = exc.message
    if settings.nsjail.enabled:
        try:
            backends["nsjail"] = _start_nsjail(settings, daemon_id, shim, host, home, cleanup)
        except SandboxdError as exc:
            unavailable["nsjail"] = exc.message
    else:
        unavailable["nsjail"] = "disabled in the daemon's settings"
    # Other daemons' leftovers (killed outright, or state wiped): reaped by nobody else.
    docker_backend = backends.get("docker")
    jail_top = home.top if isinstance(home, CgroupHome) else CgroupHome().top
    threading.Thread(target=_remove_stale_cgroups, args=(daemon_id, docker_backend, jail_top), name="stale-cgroups",
                     daemon=True).start()
    for name, reason in unavailable.items():
        log.error("backend %s unavailable: %s", name, reason)
    return backends, unavailable


def _remove_stale_cgroups(daemon_id: str, docker_backend: DockerBackend | None, jail_top: str) -> None:
    def keep(root: str, name: str) -> bool:
        if root == jail_top:  # <daemon id>/<sandbox or slot>
            return name == daemon_id or daemon_running(name)
        # <sandbox id>: a Docker sandbox's parent, kept while any container of it exists
        # (or while dockerd cannot say).
        return docker_backend is None or docker_backend.has_sandbox(name)

    removed = remove_stale_cgroups((jail_top, SANDBOX_CGROUP_ROOT), keep=keep)
    if removed:
        log.info("removed %d empty sandbox cgroups that daemons no longer running left", removed)
