"""What every engine's spec is made of, and what the rest of the daemon shares with the
compilers: the sandbox's identity, its staged workspace roots, the attachments a call
brings (shim, egress, secrets), the paths under /dev/sandboxd, and the one mount list
both compilers start from (backends/docker/compile.py, backends/nsjail/compile.py).
Pure: no engine, no filesystem."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from sandboxd.policy.models import WORKSPACE, EffectivePolicy, is_within
from sandboxd.policy.preflight import HostPlan

LABEL_PREFIX = "sandboxd."
# RLIMIT_NOFILE inside the sandbox.
MAX_OPEN_FILES = 4096
# The empty, root-owned tmpfs that stands for /workspace when only parts are visible.
WORKSPACE_BASE_TMPFS_BYTES = 64 * 1024
MASK_DIR_TMPFS_BYTES = 4 * 1024


def plain(value: Any) -> Any:
    """dataclasses.asdict's JSON, without its deep copy of every leaf (a millisecond a
    spec, on every call's path): dataclasses become dicts, tuples lists."""
    if value is None or isinstance(value, (str, int, float)):  # most leaves: asked first
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    return value


@dataclass(frozen=True)
class MountSpec:
    type: str  # "bind" | "tmpfs"
    target: str
    source: str = ""
    read_only: bool = False
    tmpfs_size_bytes: int = 0
    tmpfs_mode: int = 0


@dataclass(frozen=True)
class StagedBind:
    """One workspace root: where preflight found it (its inode), and the staging path
    the engine mounts it from (backends/staging.py binds it there first)."""

    host_path: str
    dev: int
    ino: int
    staged_path: str


@dataclass(frozen=True)
class StagedMask:
    """A blocked path inside a staged root: masked there, on the inode preflight found,
    before the engine is called (a mount point cannot be renamed away after)."""

    bind_index: int
    relative_path: str
    kind: str  # "file" | "dir"
    dev: int
    ino: int


@dataclass(frozen=True)
class Staging:
    """What a sandbox's staging needs: the workspace as checked, each root, each mask."""

    directory: str
    uid: int  # the sandbox user: the staging directory is its, searchable by it alone, once made
    workspace: str
    workspace_dev: int
    workspace_ino: int
    binds: tuple[StagedBind, ...]
    masks: tuple[StagedMask, ...] = ()
    mask_file: str = ""


def staging_for(plan: HostPlan, mask_file: str) -> Staging | None:
    """The roots of `plan` bound under its staging directory, in the plan's order, and
    each mask in the deepest root that holds it (the one the sandbox sees there)."""
    if not plan.staging_dir or not plan.binds:
        return None
    masks = []
    for m in plan.masks:
        holders = [i for i, b in enumerate(plan.binds) if is_within(m.sandbox_path, b.sandbox_path)]
        if holders:
            i = max(holders, key=lambda k: len(plan.binds[k].sandbox_path))
            rel = posixpath.relpath(m.sandbox_path, plan.binds[i].sandbox_path)
            masks.append(StagedMask(i, rel, m.kind, m.dev, m.ino))
    return Staging(plan.staging_dir, plan.uid, plan.workspace, plan.workspace_dev, plan.workspace_ino,
                   tuple(StagedBind(b.host_path, b.dev, b.ino, f"{plan.staging_dir}/{i}")
                         for i, b in enumerate(plan.binds)), tuple(masks), mask_file)


def bind_source(plan: HostPlan, index: int) -> str:
    """Where the engine mounts the plan's `index`th root from."""
    return f"{plan.staging_dir}/{index}" if plan.staging_dir else plan.binds[index].host_path


@dataclass(frozen=True)
class SandboxIdentity:
    daemon_id: str
    sandbox_id: str
    tool_call_id: str  # a warm sandbox's: POOL_CALL_PREFIX + its pool's key


POOL_CALL_PREFIX = "pool:"


def is_warm_sandbox(labels: Mapping[str, str]) -> bool:
    """Whether a spec's labels are a pool's warm sandbox's (its commands come later)."""
    return labels.get(f"{LABEL_PREFIX}tool_call_id", "").startswith(POOL_CALL_PREFIX)


# What the daemon binds into a sandbox beyond the policy's mounts, all under /dev (a
# tmpfs on both backends, so the read-only image root needs no mount point of its own):
# the shim that runs before the command, the egress proxy's socket, env secrets.
SHIM_PATH = "/dev/sandboxd/shim"
EGRESS_SOCKET_PATH = "/dev/sandboxd/egress.sock"
SECRETS_DIR = "/dev/sandboxd/secrets"
# The shim waits here until the daemon's file-access watch is attached.
GATE_PATH = "/dev/sandboxd/gate"
# The directory of the FIFOs the command's stdout and stderr are written to (Docker).
STDIO_DIR = "/dev/sandboxd/stdio"
# A warm sandbox's supervisor connects to the daemon here (a socket the daemon listens
# on, bound read-only; the daemon takes exactly one connection, the supervisor's).
CONTROL_SOCKET = "/dev/sandboxd/control.sock"


@dataclass(frozen=True)
class EgressAttachment:
    """A proxied sandbox's way out: its proxy endpoint, reached on a loopback port."""

    socket_host_path: str
    port: int

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Every spelling tools look for. Loopback stays direct: it is the sandbox's own."""
        url = self.proxy_url
        out: dict[str, str] = {}
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            out[name] = out[name.lower()] = url
        out["NO_PROXY"] = out["no_proxy"] = "localhost,127.0.0.1,::1"
        return out


@dataclass(frozen=True)
class SecretMount:
    """A credential's value in a file on the daemon's tmpfs, bound read-only into the
    sandbox: at the call's file target, or (env_name set) where the shim reads it into
    that variable. The value itself is never in a spec."""

    binding_id: str
    host_path: str
    sandbox_path: str
    env_name: str = ""


@dataclass(frozen=True)
class Attachments:
    """Host facts a call brings into its sandbox besides the HostPlan."""

    shim_host_path: str = ""
    egress: EgressAttachment | None = None
    secrets: tuple[SecretMount, ...] = ()
    # Set for a warm (pool) sandbox: the daemon's control socket for its supervisor. The
    # sandbox then runs the supervisor, not a command.
    control_host_socket: str = ""
    # Set when the call's file accesses are recorded: the FIFO the shim waits on.
    gate_host_path: str = ""
    # Set when the command's output goes to the daemon through FIFOs in this host
    # directory (named stdout and stderr) instead of the engine's copy of its stdio.
    stdio_host_dir: str = ""

    @property
    def needs_shim(self) -> bool:
        return (self.egress is not None or any(s.env_name for s in self.secrets) or bool(self.control_host_socket)
                or bool(self.gate_host_path) or bool(self.stdio_host_dir))

    def wrap(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        if not self.needs_shim:
            return tuple(argv)
        if not self.shim_host_path:
            raise ValueError("the sandbox shim is needed but there is none")
        out: list[str] = [SHIM_PATH]
        if self.egress is not None:
            out += ["--egress", EGRESS_SOCKET_PATH, str(self.egress.port)]
        for s in self.secrets:
            if s.env_name:
                out += ["--env", f"{s.env_name}={s.sandbox_path}"]
        if self.control_host_socket:
            return (*out, "--supervise", CONTROL_SOCKET)
        if self.stdio_host_dir:
            out += ["--stdio", STDIO_DIR]
        if self.gate_host_path:
            out += ["--gate", GATE_PATH]
        return (*out, "--", *argv)

    def env(self) -> dict[str, str]:
        return self.egress.env() if self.egress is not None else {}

    def binds(self) -> list[tuple[str, str]]:
        """(sandbox path, host path) of every read-only file bind, shim first."""
        out = []
        if self.needs_shim:
            out.append((SHIM_PATH, self.shim_host_path))
        if self.egress is not None:
            out.append((EGRESS_SOCKET_PATH, self.egress.socket_host_path))
        out += [(s.sandbox_path, s.host_path) for s in self.secrets]
        if self.control_host_socket:
            out.append((CONTROL_SOCKET, self.control_host_socket))
        if self.gate_host_path:
            out.append((GATE_PATH, self.gate_host_path))
        if self.stdio_host_dir:
            out.append((STDIO_DIR, self.stdio_host_dir))
        return out


def network_plan(policy: EffectivePolicy, egress: EgressAttachment | None) -> dict[str, Any]:
    """What ExplainPolicy shows of the network: the proxy the sandbox is given and the
    names it may reach through it."""
    plan: dict[str, Any] = {"egress": policy.egress, "denyPrivateNetworks": policy.deny_private_networks}
    if policy.egress == "none":
        plan["network"] = "loopback only"
    elif policy.egress == "open":
        plan["network"] = "the engine's default network"
    if egress is not None:
        plan.update({"network": "loopback only; the proxy is the one way out", "proxy": egress.proxy_url,
                     "proxySocket": EGRESS_SOCKET_PATH,
                     "allowDomains": list(policy.allow_domains) if policy.egress == "allowlist" else ["(any)"]})
    return plan


def require_egress(policy: EffectivePolicy, attachments: Attachments) -> None:
    """A proxied policy without its proxy would be a sandbox cut off, or worse, an open one."""
    egress = attachments.egress
    if policy.proxied != (egress is not None):
        raise ValueError(f"egress {policy.egress!r} with{'out' if egress is None else ''} an egress attachment")


def sandbox_mounts(policy: EffectivePolicy, plan: HostPlan, mask_file: str,
                   attachments: Attachments) -> tuple[MountSpec, ...]:
    """The sandbox's view as Docker mounts it; nsjail's compiler starts from the same
    list, so that a policy means the same view on both engines."""
    mounts: list[MountSpec] = [MountSpec("bind", target, source=source, read_only=True)
                               for target, source in attachments.binds()]
    bound = {b.sandbox_path for b in plan.binds}
    if WORKSPACE not in bound:
        # Only parts of the workspace are visible: /workspace itself is an empty,
        # root-owned directory the sandbox user cannot write into.
        mounts.append(MountSpec("tmpfs", WORKSPACE, read_only=False,
                                tmpfs_size_bytes=WORKSPACE_BASE_TMPFS_BYTES, tmpfs_mode=0o755))
    for i, b in enumerate(plan.binds):
        mounts.append(MountSpec("bind", b.sandbox_path, source=bind_source(plan, i), read_only=b.read_only))
    if plan.outputs_dir:  # persistOutputs: the daemon's tmpfs, which outlives the sandbox
        mounts.append(MountSpec("bind", policy.temp_dir, source=plan.outputs_dir, read_only=False))
    else:
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
