"""Pure translation of (EffectivePolicy, HostPlan, call identity) into what the nsjail
backend is told: an NsjailSpec. It starts from the same mount list as compile_docker,
so a policy means the same view on both backends, and renders to an nsjail config
(protobuf text format) plus a command line. No filesystem, no processes: golden tests
pin the output.

Why a config file rather than flags: nsjail's -R/-B/-m flags split their argument on
':', so a path holding ':' cannot be said with them, and flags cannot ask for
nosuid/nodev/noexec or a read-only tmpfs. The config's `mount {}` messages can.

What differs from Docker, and why (the backend's module doc has the rest):
- Every tmpfs a jail mounts belongs to the sandbox user (nsjail mounts them inside the
  user namespace, where only that uid is mapped), where Docker's belong to root. So a
  tmpfs the sandbox must not write into is mounted read-only, and a blocked directory's
  tmpfs has mode 0 instead of Docker's root-owned 0500: closed either way.
- Files of the image appear owned by nobody (uid 0 is not mapped), not by root.
- /dev/init is the host's static tini, bound read-only: PID 1 of the jail, as
  docker-init is PID 1 of a container, so exit codes (128+N for signal N, 127 when the
  command is not found), signal handling and zombie reaping are Docker's.
- Seccomp: the jail's first process is the shim, which loads the Docker backend's
  profile (compiled to BPF by seccomp_bpf.py, bound at /dev/sandboxd/seccomp) and execs
  the init: one profile for both backends, and a call of another ABI (i386's int 0x80)
  gets the profile's errno as in Docker. nsjail's own kafel policies cannot do that:
  kafel kills any call whose architecture is not the host's before its rules run.
  A syscall newer than the profile gets EPERM where runc's stub gives ENOSYS.
- egress 'open' without denyPrivateNetworks is refused (Unimplemented): nsjail would
  share the host's network namespace, which is not what Docker's bridge gives.
- /proc is read-only as a whole (Docker: read-write with read-only parts); /sys is
  empty; /dev belongs to the sandbox user; no HOSTNAME variable (Docker adds one).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from sandboxd.sandbox.spec import (LABEL_PREFIX, MASK_DIR_TMPFS_BYTES, MAX_OPEN_FILES, SHIM_PATH, WORKSPACE_BASE_TMPFS_BYTES,
                                   Attachments, SandboxIdentity, Staging, plain, require_egress, sandbox_mounts,
                                   staging_for)
from sandboxd.backends.cgroup_home import TOP_LEVEL
from sandboxd.core.errors import FailedPrecondition, Unimplemented
from sandboxd.policy.models import WORKSPACE, EffectivePolicy
from sandboxd.policy.preflight import HostPlan

# Each controller's per-sandbox cgroup is <mount>/<top>/<daemon id>/<sandbox id> (on cgroup
# v2, where no cgroup can be renamed, a spawn slot's name instead: slots.py). The top is
# this one at the hierarchy's top, or a delegated cgroup's (backends/cgroup_home.py).
NSJAIL_CGROUP_ROOT = TOP_LEVEL
# Where the init binary is bound inside the jail (inside the /dev tmpfs, so that no
# mount point is needed in the image).
INIT_PATH = "/dev/init"
# Where the seccomp program is bound for the shim to load.
SECCOMP_PROGRAM_PATH = "/dev/sandboxd/seccomp"
DEFAULT_INIT_BINARY = "/usr/bin/tini-static"
HOSTNAME = "sandbox"
DEV_TMPFS_BYTES = 64 * 1024
DEV_SHM_BYTES = 64 * 2**20  # Docker's default --shm-size
DEVICES = ("full", "null", "random", "tty", "urandom", "zero")
DEV_SYMLINKS = (("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"), ("/proc/self/fd/1", "/dev/stdout"),
                ("/proc/self/fd/2", "/dev/stderr"), ("pts/ptmx", "/dev/ptmx"))
STACK_MB = 8
CPU_PERIOD_US = 100_000
# nsjail's own wall-clock limit, a backstop behind the daemon's timeout for when the
# daemon is gone: the daemon kills at timeoutMs, nsjail this much later.
TIME_LIMIT_SLACK_S = 30
LOG_LEVEL = "WARNING"
_CGROUP_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class NsjailMount:
    """One `mount {}` of the nsjail config, in the order nsjail mounts them."""

    dst: str
    src: str = ""
    fstype: str = ""
    options: str = ""
    is_bind: bool = False
    rw: bool = False
    is_dir: bool | None = None  # None: nsjail decides from the source
    is_symlink: bool = False
    nosuid: bool = False
    nodev: bool = False
    noexec: bool = False
    mandatory: bool = True


@dataclass(frozen=True)
class NsjailSpec:
    """Everything the nsjail backend is told. One jail per spec."""

    name: str
    labels: dict[str, str]
    nsjail_binary: str
    init_binary: str
    argv: tuple[str, ...]
    rootfs: str
    uid: int
    gid: int
    cwd: str
    env: dict[str, str]
    mounts: tuple[NsjailMount, ...]
    # Host paths of the shim and of the seccomp program it loads (both bound read-only).
    shim_binary: str
    seccomp_program_path: str
    network: str  # "none": a fresh network namespace with only lo
    # The per-sandbox cgroup (relative to each controller's mount), made by the backend.
    cgroup: str
    memory_bytes: int
    # The command's processes plus nsjail itself, which lives in the cgroup beside the
    # jail as docker-init lives in a container's (the jail's own tini is the other +1
    # Docker also counts).
    pids_max: int
    cpu_quota_us: int
    cpu_period_us: int
    rlimits: tuple[tuple[str, int], ...]
    time_limit_s: int
    stdin_open: bool
    timeout_ms: int
    max_stdout_bytes: int
    max_stderr_bytes: int
    # The workspace roots bound into a directory of the daemon's first (compile.Staging).
    staging: Staging | None = None
    hostname: str = HOSTNAME
    no_new_privileges: bool = True
    keep_caps: bool = False
    log_level: str = LOG_LEVEL
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def init_argv(self) -> tuple[str, ...]:
        # The shim puts the jail under the seccomp program, then becomes its init.
        return (SHIM_PATH, "--seccomp", SECCOMP_PROGRAM_PATH, "--", INIT_PATH, "--")

    def command(self, config_path: str, log_fd: int) -> list[str]:
        """The exact nsjail command line: the same for every jail (the command is in the
        config), so nsjail can be started before the call it serves is known. The config
        and the log descriptor are host resources the backend makes."""
        return nsjail_command(self.nsjail_binary, config_path, log_fd)

    def config_text(self) -> str:
        # Rendered once: a call needs it for the jail, its size and the spec digest.
        text = self.__dict__.get("_config_text")
        if text is None:
            text = render_config(self)
            object.__setattr__(self, "_config_text", text)
        return text

    def to_json_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = plain(self)
        d["init_argv"] = list(self.init_argv)
        d["config"] = self.config_text().splitlines()
        return d


def nsjail_command(binary: str, config_path: str, log_fd: int) -> list[str]:
    return [binary, "--config", config_path, "--log_fd", str(log_fd)]


def cgroup_for(daemon_id: str, sandbox_id: str, top: str = NSJAIL_CGROUP_ROOT) -> str:
    return f"{top}/{daemon_id}/{sandbox_id}"


def _check_name(value: str, what: str) -> None:
    if not _CGROUP_NAME_RE.fullmatch(value):
        raise FailedPrecondition(f"{what} {value!r} cannot name a cgroup directory")


def _workspace_mounts(policy: EffectivePolicy, plan: HostPlan, mask_file: str) -> list[NsjailMount]:
    """compile_docker's mounts, in its order (parents before children), said to nsjail.
    Masks placed in the staged roots (staging.py) come in with them (nsjail's binds are
    recursive) and are not mounted again: nsjail, as the sandbox user, cannot even open
    a mode-000 mask file to mount over it."""
    out: list[NsjailMount] = []
    staged_masks = {m.sandbox_path for m in plan.masks} if plan.staging_dir else set()
    for m in sandbox_mounts(policy, plan, mask_file, Attachments()):
        if m.target in staged_masks and (m.source == mask_file or (m.type == "tmpfs" and m.read_only)):
            continue
        if m.type == "bind":
            # A blocked file is the mask file bound read-only; other binds are the
            # workspace's, file or directory as the host has them.
            out.append(NsjailMount(dst=m.target, src=m.source, is_bind=True, rw=not m.read_only,
                                   is_dir=False if m.source == mask_file else None, nosuid=True, nodev=True,
                                   noexec=bool(plan.outputs_dir) and m.source == plan.outputs_dir))
        elif m.target == policy.temp_dir:
            # Docker mounts its tmpfs noexec; so does this.
            out.append(NsjailMount(dst=m.target, fstype="tmpfs", rw=True,
                                   options=f"size={m.tmpfs_size_bytes},mode={m.tmpfs_mode:o}",
                                   nosuid=True, nodev=True, noexec=True))
        elif m.read_only:
            # A blocked directory: the tmpfs is the sandbox user's here, so mode 0 (and
            # read-only, so it cannot chmod it back) closes it as root's 0500 does in Docker.
            out.append(NsjailMount(dst=m.target, fstype="tmpfs", rw=False, options=f"size={MASK_DIR_TMPFS_BYTES},mode=0",
                                   nosuid=True, nodev=True, noexec=True))
        else:
            # /workspace when only parts of it are visible: read-only, since the tmpfs
            # is the sandbox user's and it must not create files beside the roots.
            assert m.target == WORKSPACE, m
            out.append(NsjailMount(dst=m.target, fstype="tmpfs", rw=False,
                                   options=f"size={WORKSPACE_BASE_TMPFS_BYTES},mode={m.tmpfs_mode:o}",
                                   nosuid=True, nodev=True, noexec=True))
    return out


def system_mounts(rootfs: str, init_binary: str, shim_binary: str, seccomp_program: str) -> list[NsjailMount]:
    """What every jail mounts besides the workspace: the image, /proc, /dev and the daemon's files in it."""
    mounts = [
        # The image, read-only. Device nodes in it are inert (nodev) and set-uid bits too.
        NsjailMount(dst="/", src=rootfs, is_bind=True, rw=False, is_dir=True, nosuid=True, nodev=True),
        # A procfs of the jail's own PID namespace, read-only.
        NsjailMount(dst="/proc", fstype="proc", options="hidepid=invisible", rw=False,
                    nosuid=True, nodev=True, noexec=True),
        # /dev: a small tmpfs, read-only once the nodes below are bound into it.
        NsjailMount(dst="/dev", fstype="tmpfs", options=f"size={DEV_TMPFS_BYTES},mode=755", rw=False,
                    nosuid=True, noexec=True),
    ]
    mounts += [NsjailMount(dst=f"/dev/{d}", src=f"/dev/{d}", is_bind=True, rw=True, is_dir=False, nosuid=True, noexec=True)
               for d in DEVICES]
    mounts += [NsjailMount(dst=dst, src=src, is_symlink=True) for src, dst in DEV_SYMLINKS]
    mounts += [
        NsjailMount(dst="/dev/pts", fstype="devpts", options="newinstance,ptmxmode=0666,mode=0620", rw=True,
                    nosuid=True, noexec=True),
        NsjailMount(dst="/dev/shm", fstype="tmpfs", options=f"size={DEV_SHM_BYTES},mode=1777", rw=True,
                    nosuid=True, nodev=True, noexec=True),
        NsjailMount(dst="/dev/mqueue", fstype="mqueue", rw=True, nosuid=True, nodev=True, noexec=True),
        NsjailMount(dst=INIT_PATH, src=init_binary, is_bind=True, rw=False, is_dir=False, nosuid=True, nodev=True),
        NsjailMount(dst=SHIM_PATH, src=shim_binary, is_bind=True, rw=False, is_dir=False, nosuid=True, nodev=True),
        NsjailMount(dst=SECCOMP_PROGRAM_PATH, src=seccomp_program, is_bind=True, rw=False, is_dir=False,
                    nosuid=True, nodev=True, noexec=True),
    ]
    return mounts


def compile_nsjail(
    policy: EffectivePolicy,
    plan: HostPlan,
    identity: SandboxIdentity,
    *,
    argv: tuple[str, ...],
    rootfs: str,
    stdin_open: bool,
    mask_file: str,
    shim_binary: str,
    seccomp_program_path: str,
    nsjail_binary: str,
    init_binary: str = DEFAULT_INIT_BINARY,
    attachments: Attachments = Attachments(),
    cgroup_top: str = NSJAIL_CGROUP_ROOT,
) -> NsjailSpec:
    if policy.egress == "open" and not policy.proxied:
        # Unfiltered 'open' on nsjail would mean the host's own network namespace, which
        # is not what Docker's bridge gives (no NAT, host loopback reachable): refused.
        raise Unimplemented("egress 'open' without denyPrivateNetworks is not available on the nsjail backend; "
                            "'none', 'allowlist' and 'open' through the egress proxy are", field="policy.network.egress")
    require_egress(policy, attachments)
    # Secrets and the proxy socket: read-only file binds, not executable (the shim is
    # one of every jail's system mounts).
    attached = [NsjailMount(dst=target, src=source, is_bind=True, rw=False, is_dir=False, nosuid=True, nodev=True,
                            noexec=True) for target, source in attachments.binds() if target != SHIM_PATH]
    if plan.uid == 0 or plan.gid == 0:
        raise FailedPrecondition("the nsjail backend never runs a sandbox as root, inside or outside", field="workspace")
    _check_name(identity.daemon_id, "daemon id")
    _check_name(identity.sandbox_id, "sandbox id")
    return NsjailSpec(
        name=f"sandboxd-{identity.sandbox_id}",
        labels={
            f"{LABEL_PREFIX}daemon_id": identity.daemon_id,
            f"{LABEL_PREFIX}sandbox_id": identity.sandbox_id,
            f"{LABEL_PREFIX}tool_call_id": identity.tool_call_id,
            f"{LABEL_PREFIX}workspace": plan.workspace,
        },
        nsjail_binary=nsjail_binary,
        init_binary=init_binary,
        argv=attachments.wrap(tuple(argv)),
        rootfs=rootfs,
        uid=plan.uid,
        gid=plan.gid,
        cwd=policy.cwd,
        env={**policy.env, **attachments.env()},
        mounts=tuple(system_mounts(rootfs, init_binary, shim_binary, seccomp_program_path)
                     + _workspace_mounts(policy, plan, mask_file) + attached),
        shim_binary=shim_binary,
        seccomp_program_path=seccomp_program_path,
        network="none",
        cgroup=cgroup_for(identity.daemon_id, identity.sandbox_id, cgroup_top),
        memory_bytes=policy.memory_bytes,
        pids_max=policy.max_pids + 1,
        cpu_quota_us=policy.cpu_millicores * CPU_PERIOD_US // 1000,
        cpu_period_us=CPU_PERIOD_US,
        rlimits=(
            ("fsize_mb", policy.max_file_size_bytes // 2**20),
            ("nofile", MAX_OPEN_FILES),
            ("core_mb", 0),
            ("stack_mb", STACK_MB),
        ),
        time_limit_s=math.ceil(policy.timeout_ms / 1000) + TIME_LIMIT_SLACK_S,
        stdin_open=stdin_open,
        timeout_ms=policy.timeout_ms,
        max_stdout_bytes=policy.max_stdout_bytes,
        max_stderr_bytes=policy.max_stderr_bytes,
        staging=staging_for(plan, mask_file),
    )


# ---------------------------------------------------------------- config rendering


def quote(value: str) -> str:
    """A protobuf text-format string literal: printable ASCII as is, every other byte
    of the UTF-8 encoding as an octal escape. Round-trips any string without NUL."""
    out = ['"']
    for b in value.encode("utf-8", "surrogatepass"):
        c = chr(b)
        if c in '"\\':
            out.append("\\" + c)
        elif 0x20 <= b < 0x7F:
            out.append(c)
        else:
            out.append(f"\\{b:03o}")
    out.append('"')
    return "".join(out)


def _bool(v: bool) -> str:
    return "true" if v else "false"


def _mount_line(m: NsjailMount) -> str:
    parts = []
    if m.src:
        parts.append(f"src: {quote(m.src)}")
    parts.append(f"dst: {quote(m.dst)}")
    if m.is_symlink:
        parts.append("is_symlink: true")
        return "mount { " + " ".join(parts) + " }"
    if m.fstype:
        parts.append(f"fstype: {quote(m.fstype)}")
    if m.options:
        parts.append(f"options: {quote(m.options)}")
    if m.is_bind:
        parts.append("is_bind: true")
    parts.append(f"rw: {_bool(m.rw)}")
    if m.is_dir is not None:
        parts.append(f"is_dir: {_bool(m.is_dir)}")
    for flag in ("nosuid", "nodev", "noexec"):
        if getattr(m, flag):
            parts.append(f"{flag}: true")
    if not m.mandatory:
        parts.append("mandatory: false")
    return "mount { " + " ".join(parts) + " }"


def render_config(spec: NsjailSpec) -> str:
    rl = dict(spec.rlimits)
    lines = [
        f"name: {quote(spec.name)}",
        "mode: ONCE",
        f"hostname: {quote(spec.hostname)}",
        f"cwd: {quote(spec.cwd)}",
        f"time_limit: {spec.time_limit_s}",
        f"log_level: {spec.log_level}",
        # Nothing of nsjail's own environment; the variables below are all there is.
        "keep_env: false",
        f"keep_caps: {_bool(spec.keep_caps)}",
        f"disable_no_new_privs: {_bool(not spec.no_new_privileges)}",
        "skip_setsid: false",
        "nice_level: 0",
        # Every namespace; the network one has lo only.
        "clone_newnet: true",
        "clone_newuser: true",
        "clone_newns: true",
        "clone_newpid: true",
        "clone_newipc: true",
        "clone_newuts: true",
        "clone_newcgroup: true",
        "iface_no_lo: false",
        # Memory is the cgroup's business (as in Docker): no address-space or CPU-time rlimit.
        "rlimit_as_type: INF",
        "rlimit_cpu_type: INF",
        f"rlimit_fsize: {rl['fsize_mb']}",
        f"rlimit_nofile: {rl['nofile']}",
        f"rlimit_core: {rl['core_mb']}",
        f"rlimit_stack: {rl['stack_mb']}",
        # Non-root inside and outside: one id, mapped to itself.
        f'uidmap {{ inside_id: "{spec.uid}" outside_id: "{spec.uid}" count: 1 }}',
        f'gidmap {{ inside_id: "{spec.gid}" outside_id: "{spec.gid}" count: 1 }}',
    ]
    lines += [f"envar: {quote(f'{k}={v}')}" for k, v in spec.env.items()]
    lines += [_mount_line(m) for m in spec.mounts]
    # Last: a config cut short anywhere (it may reach nsjail through a pipe) has no
    # command, or fails to parse, so nsjail runs nothing.
    init, *init_args = spec.init_argv
    lines.append(f"exec_bin {{ path: {quote(init)} arg0: {quote(init)} "
                 + "".join(f"arg: {quote(a)} " for a in (*init_args, *spec.argv)) + "}")
    return "\n".join(lines) + "\n"
