"""Pure translation of (EffectivePolicy, HostPlan, call identity) into what the Docker
backend is told: a DockerSpec. No engine, no filesystem; golden tests pin the output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from sandboxd.policy.models import EffectivePolicy
from sandboxd.policy.preflight import HostPlan
from sandboxd.sandbox.spec import (LABEL_PREFIX, MAX_OPEN_FILES, Attachments, MountSpec, SandboxIdentity, Staging,
                                   plain, require_egress, sandbox_mounts, staging_for)

# A container's deadline without the daemon: its timeout and this much more. (The
# watcher acts only once the daemon is gone; while it lives, its own timeout kills.)
BACKSTOP_SLACK_S = 2
# dockerd's cgroup drivers (its info's CgroupDriver) the backend knows how to place a
# sandbox's cgroup under.
CgroupDriver = Literal["cgroupfs", "systemd"]
CGROUP_DRIVERS: tuple[CgroupDriver, ...] = ("cgroupfs", "systemd")


@dataclass(frozen=True)
class DockerSpec:
    """Everything the Docker backend is told. One container per spec."""

    name: str
    image: str
    argv: tuple[str, ...]
    user: str
    working_dir: str
    env: dict[str, str]
    labels: dict[str, str]
    mounts: tuple[MountSpec, ...]
    network_mode: str
    memory_bytes: int
    pids_limit: int
    nano_cpus: int
    ulimits: tuple[tuple[str, int, int], ...]
    cgroup_parent: str  # as dockerd is told it (a path, or a systemd slice)
    cgroup_dir: str  # the same cgroup, relative to a hierarchy's root (/sys/fs/cgroup[/<controller>])
    stdin_open: bool
    timeout_ms: int
    max_stdout_bytes: int
    max_stderr_bytes: int
    seccomp_profile: str
    # The host directory of the FIFOs the command's output reaches the daemon through
    # ("" when it comes over the attach socket).
    stdio_host_dir: str = ""
    # The workspace roots bound into a directory of the daemon's before the engine is
    # called (None: no roots, or a pure test's plan).
    staging: Staging | None = None
    hostname: str = "sandbox"
    read_only_rootfs: bool = True
    cap_drop: tuple[str, ...] = ("ALL",)
    no_new_privileges: bool = True
    init: bool = True
    cgroup_driver: CgroupDriver = "cgroupfs"
    extra: dict[str, Any] = field(default_factory=dict)

    def container_cgroup_dir(self, engine_id: str) -> str:
        """The container's own cgroup, relative to a hierarchy's root."""
        leaf = f"docker-{engine_id}.scope" if self.cgroup_driver == "systemd" else engine_id
        return f"{self.cgroup_dir}/{leaf}"

    def to_json_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = plain(self)
        return d




SANDBOX_CGROUP_ROOT = "sandboxd"  # each Docker sandbox's parent cgroup is below it
SANDBOX_SLICE = f"{SANDBOX_CGROUP_ROOT}.slice"  # the same, under dockerd's systemd cgroup driver


def sandbox_slice(sandbox_id: str) -> str:
    """The systemd slice a sandbox's containers go in: a '-' in a slice's name is a
    level of nesting, so the id's own are spelled '_' (ids are [a-z0-9-])."""
    return f"{SANDBOX_CGROUP_ROOT}-{sandbox_id.replace('-', '_')}.slice"


def cgroup_parent_for(sandbox_id: str, driver: CgroupDriver = "cgroupfs") -> str:
    """The parent cgroup dockerd is told: a path under cgroupfs, a slice under systemd
    (which refuses a path)."""
    return sandbox_slice(sandbox_id) if driver == "systemd" else f"/{SANDBOX_CGROUP_ROOT}/{sandbox_id}"


def cgroup_dir_for(sandbox_id: str, driver: CgroupDriver = "cgroupfs") -> str:
    """Where that parent is, relative to a hierarchy's root: systemd nests
    sandboxd-<id>.slice in sandboxd.slice."""
    if driver == "systemd":
        return f"{SANDBOX_SLICE}/{sandbox_slice(sandbox_id)}"
    return f"{SANDBOX_CGROUP_ROOT}/{sandbox_id}"




def compile_docker(
    policy: EffectivePolicy,
    plan: HostPlan,
    identity: SandboxIdentity,
    *,
    argv: tuple[str, ...],
    image: str,
    stdin_open: bool,
    mask_file: str,
    seccomp_profile: str,
    attachments: Attachments = Attachments(),
    cgroup_driver: CgroupDriver = "cgroupfs",
) -> DockerSpec:
    require_egress(policy, attachments)
    # Proxied: no network at all; the proxy is reached through a bound Unix socket.
    network_mode = "none" if policy.proxied else {"none": "none", "open": "bridge"}[policy.egress]
    return DockerSpec(
        name=f"sandboxd-{identity.sandbox_id}",
        image=image,
        argv=attachments.wrap(tuple(argv)),
        user=f"{plan.uid}:{plan.gid}",
        working_dir=policy.cwd,
        env={**policy.env, **attachments.env()},
        labels={
            f"{LABEL_PREFIX}daemon_id": identity.daemon_id,
            f"{LABEL_PREFIX}sandbox_id": identity.sandbox_id,
            f"{LABEL_PREFIX}tool_call_id": identity.tool_call_id,
            f"{LABEL_PREFIX}workspace": plan.workspace,
            # Enforced by the backstop watcher if the daemon dies (backends/backstop.py).
            f"{LABEL_PREFIX}deadline_s": str(-(-policy.timeout_ms // 1000) + BACKSTOP_SLACK_S),
        },
        mounts=sandbox_mounts(policy, plan, mask_file, attachments),
        network_mode=network_mode,
        memory_bytes=policy.memory_bytes,
        pids_limit=policy.max_pids,
        nano_cpus=policy.cpu_millicores * 1_000_000,
        ulimits=(
            ("fsize", policy.max_file_size_bytes, policy.max_file_size_bytes),
            ("nofile", MAX_OPEN_FILES, MAX_OPEN_FILES),
            ("core", 0, 0),
        ),
        # A per-sandbox parent cgroup outlives the container, so CPU time and peak
        # memory can still be read after the container has exited.
        cgroup_parent=cgroup_parent_for(identity.sandbox_id, cgroup_driver),
        cgroup_dir=cgroup_dir_for(identity.sandbox_id, cgroup_driver),
        cgroup_driver=cgroup_driver,
        stdin_open=stdin_open,
        timeout_ms=policy.timeout_ms,
        max_stdout_bytes=policy.max_stdout_bytes,
        max_stderr_bytes=policy.max_stderr_bytes,
        seccomp_profile=seccomp_profile,
        stdio_host_dir=attachments.stdio_host_dir,
        staging=staging_for(plan, mask_file),
    )

