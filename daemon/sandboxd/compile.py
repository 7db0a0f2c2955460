"""Pure translation of (EffectivePolicy, HostPlan, call identity) into what a backend
is told: a DockerSpec. No engine, no filesystem; golden tests pin the output."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .policy import WORKSPACE, EffectivePolicy
from .preflight import HostPlan

LABEL_PREFIX = "sandboxd."
# RLIMIT_NOFILE inside the sandbox.
MAX_OPEN_FILES = 4096
# The empty, root-owned tmpfs that stands for /workspace when only parts are visible.
WORKSPACE_BASE_TMPFS_BYTES = 64 * 1024
MASK_DIR_TMPFS_BYTES = 4 * 1024


@dataclass(frozen=True)
class MountSpec:
    type: str  # "bind" | "tmpfs"
    target: str
    source: str = ""
    read_only: bool = False
    tmpfs_size_bytes: int = 0
    tmpfs_mode: int = 0


@dataclass(frozen=True)
class SandboxIdentity:
    daemon_id: str
    sandbox_id: str
    tool_call_id: str


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
    cgroup_parent: str
    stdin_open: bool
    timeout_ms: int
    max_stdout_bytes: int
    max_stderr_bytes: int
    seccomp_profile: str
    hostname: str = "sandbox"
    read_only_rootfs: bool = True
    cap_drop: tuple[str, ...] = ("ALL",)
    no_new_privileges: bool = True
    init: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def cgroup_parent_for(sandbox_id: str) -> str:
    return f"/sandboxd/{sandbox_id}"


def _mounts(policy: EffectivePolicy, plan: HostPlan, mask_file: str) -> tuple[MountSpec, ...]:
    mounts: list[MountSpec] = []
    bound = {b.sandbox_path for b in plan.binds}
    if WORKSPACE not in bound:
        # Only parts of the workspace are visible: /workspace itself is an empty,
        # root-owned directory the sandbox user cannot write into.
        mounts.append(MountSpec("tmpfs", WORKSPACE, read_only=False,
                                tmpfs_size_bytes=WORKSPACE_BASE_TMPFS_BYTES, tmpfs_mode=0o755))
    for b in plan.binds:
        mounts.append(MountSpec("bind", b.sandbox_path, source=b.host_path, read_only=b.read_only))
    mounts.append(MountSpec("tmpfs", policy.temp_dir, tmpfs_size_bytes=policy.tmp_size_bytes, tmpfs_mode=0o1777))
    for m in plan.masks:
        if m.kind == "dir":
            # Docker ignores a tmpfs mode of 0; 0500 root-owned is as closed to the sandbox user.
            mounts.append(MountSpec("tmpfs", m.sandbox_path, read_only=True,
                                    tmpfs_size_bytes=MASK_DIR_TMPFS_BYTES, tmpfs_mode=0o500))
        else:
            mounts.append(MountSpec("bind", m.sandbox_path, source=mask_file, read_only=True))
    # Parents before children, so that every mount lands on the view it refines.
    return tuple(sorted(mounts, key=lambda m: (m.target.count("/"), m.target)))


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
) -> DockerSpec:
    network_mode = {"none": "none", "open": "bridge"}[policy.egress]
    return DockerSpec(
        name=f"sandboxd-{identity.sandbox_id}",
        image=image,
        argv=tuple(argv),
        user=f"{plan.uid}:{plan.gid}",
        working_dir=policy.cwd,
        env=dict(policy.env),
        labels={
            f"{LABEL_PREFIX}daemon_id": identity.daemon_id,
            f"{LABEL_PREFIX}sandbox_id": identity.sandbox_id,
            f"{LABEL_PREFIX}tool_call_id": identity.tool_call_id,
            f"{LABEL_PREFIX}workspace": plan.workspace,
        },
        mounts=_mounts(policy, plan, mask_file),
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
        cgroup_parent=cgroup_parent_for(identity.sandbox_id),
        stdin_open=stdin_open,
        timeout_ms=policy.timeout_ms,
        max_stdout_bytes=policy.max_stdout_bytes,
        max_stderr_bytes=policy.max_stderr_bytes,
        seccomp_profile=seccomp_profile,
    )

