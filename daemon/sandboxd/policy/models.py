"""What a call asks for and what it is allowed: the PreparedToolCall and SandboxPolicy
as pydantic models (camelCase on the wire, like the seed), and their resolution into
an EffectivePolicy with every default filled in and every limit checked against the
daemon's maxima. Pure: no filesystem, no engine."""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from sandboxd_contract.canonical import canonical_json

from sandboxd.policy.egress_rules import normalize_pattern
from sandboxd.policy.roots import is_within, normalized_roots
from sandboxd.core.errors import InvalidArgument, PermissionDenied
from sandboxd.core.settings import LimitSettings

WORKSPACE = "/workspace"
DEFAULT_TEMP_DIR = "/tmp"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
# Every string of a request is at most this long (a path, an id, a name)...
MAX_FIELD_CHARS = 4096
# ...but an argument (Linux's own limit for one, MAX_ARG_STRLEN) and an injected value.
MAX_ARG_CHARS = 128 * 1024
MAX_ENV_VALUE_CHARS = 32 * 1024
_LONG_FIELDS = {"argv": MAX_ARG_CHARS, "policy.environment.injectedEnv": MAX_ENV_VALUE_CHARS}
# All injected names and values together (what one exec's environment may hold, with room).
MAX_ENV_TOTAL_CHARS = 128 * 1024
# Sandbox paths where a tmpfs or a bind would hide the kernel's own views.
_FORBIDDEN_MOUNT_PARENTS = ("/proc", "/sys", "/dev")


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True
    )


class FilesystemPolicy(_Model):
    cwd: str = ""
    read_roots: list[str] = Field(default_factory=list, max_length=64)
    write_roots: list[str] = Field(default_factory=list, max_length=64)
    blocked_paths: list[str] = Field(default_factory=list, max_length=256)
    temp_dir: str = ""
    persist_outputs: bool = False


class NetworkPolicy(_Model):
    egress: Literal["none", "allowlist", "open"] = "none"
    allow_domains: list[str] = Field(default_factory=list, max_length=256)
    deny_private_networks: bool = True


class EnvironmentPolicy(_Model):
    inherited_env: list[str] = Field(default_factory=list, max_length=256)
    injected_env: dict[str, str] = Field(default_factory=dict, max_length=256)
    secret_env_allowed: bool = False


class ProcessPolicy(_Model):
    # Zero or unset means "the daemon's default"; proto3 cannot tell them apart.
    timeout_ms: int | None = Field(default=None, ge=0)
    max_memory_mb: int | None = Field(default=None, ge=0)
    max_stdout_bytes: int | None = Field(default=None, ge=0)
    max_stderr_bytes: int | None = Field(default=None, ge=0)
    max_pids: int | None = Field(default=None, ge=0)
    cpu_millicores: int | None = Field(default=None, ge=0)
    max_file_size_mb: int | None = Field(default=None, ge=0)
    max_tmp_size_mb: int | None = Field(default=None, ge=0)


class AuditPolicy(_Model):
    record_command: bool = True
    record_file_access: bool = True
    record_network_access: bool = True


class SandboxPolicy(_Model):
    filesystem: FilesystemPolicy | None = None
    network: NetworkPolicy = Field(default_factory=NetworkPolicy)
    environment: EnvironmentPolicy = Field(default_factory=EnvironmentPolicy)
    process: ProcessPolicy = Field(default_factory=ProcessPolicy)
    audit: AuditPolicy = Field(default_factory=AuditPolicy)


class CredentialRef(_Model):
    binding_id: str
    env_name: str = ""
    file_path: str = ""


class Authorization(_Model):
    status: str = ""
    grant_id: str = ""
    approval_digest: str = ""
    expires_at: str = ""
    signature: str = ""
    approved_by: str = ""
    approved_at: str = ""


class RuntimeSettings(_Model):
    adapter: Literal["", "docker", "nsjail"] = ""
    image: str = Field(default="", max_length=256)
    idempotency_key: str = Field(default="", max_length=256)
    lease_id: str = ""


class PreparedToolCall(_Model):
    tool_call_id: str = ""
    session_id: str = Field(default="", max_length=256)
    run_id: str = Field(default="", max_length=256)
    parent_event_id: str = Field(default="", max_length=256)
    intent_id: str = Field(default="", max_length=256)
    tool_id: str = Field(min_length=1, max_length=256)
    tool_version: str = Field(default="", max_length=128)
    proposed_by: str = Field(default="", max_length=256)
    argv: list[str] = Field(min_length=1, max_length=4096)
    cwd: str = ""
    stdin: bytes = b""
    workspace: str = Field(min_length=1, max_length=4096)
    policy: SandboxPolicy = Field(default_factory=SandboxPolicy)
    credential_refs: list[CredentialRef] = Field(default_factory=list, max_length=16)
    authorization: Authorization = Field(default_factory=Authorization)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)

    @field_validator("tool_call_id")
    @classmethod
    def _id_shape(cls, v: str) -> str:
        if v and not _ID_RE.fullmatch(v):
            raise ValueError("must be 1-128 characters of [A-Za-z0-9._:-], starting alphanumeric")
        return v

    @field_validator("argv")
    @classmethod
    def _argv_clean(cls, v: list[str]) -> list[str]:
        for i, arg in enumerate(v):
            if "\x00" in arg:
                raise ValueError(f"argument {i} contains a NUL byte")
        if not v[0]:
            raise ValueError("argv[0] must not be empty")
        return v


@dataclass(frozen=True)
class EffectivePolicy:
    """A SandboxPolicy with every default applied, every path normalized to an
    absolute sandbox path, the roots reduced to the fewest giving the same view (a root
    both read and written is a write root: roots.normalized_roots), and every limit within
    the daemon's maxima."""

    cwd: str
    read_roots: tuple[str, ...]
    write_roots: tuple[str, ...]
    blocked_paths: tuple[str, ...]
    temp_dir: str
    egress: str
    allow_domains: tuple[str, ...]
    deny_private_networks: bool
    env: dict[str, str] = field(hash=False)
    timeout_ms: int = 0
    memory_bytes: int = 0
    max_stdout_bytes: int = 0
    max_stderr_bytes: int = 0
    max_pids: int = 0
    cpu_millicores: int = 0
    max_file_size_bytes: int = 0
    tmp_size_bytes: int = 0
    persist_outputs: bool = False  # tempDir's files kept as artifacts (a daemon tmpfs bound there)
    record_command: bool = True
    record_file_access: bool = True
    record_network_access: bool = True
    # Each root -> the field the caller named it in first ("policy.filesystem.readRoots[2]"):
    # normalizing drops and merges roots, so a refusal names the caller's own index.
    root_fields: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def root_field(self, path: str, kind: str, index: int) -> str:
        return self.root_fields.get(path, f"policy.filesystem.{kind}[{index}]")

    @property
    def proxied(self) -> bool:
        """Whether the sandbox's one way out is the daemon's egress proxy: always for an
        allowlist, and for 'open' that must keep private addresses out, because only a
        proxy can check the address a name resolves to (and record every connection)."""
        return self.egress == "allowlist" or (self.egress == "open" and self.deny_private_networks)

    def to_json_dict(self) -> dict[str, Any]:
        """camelCase keys, lists for tuples, a copy of env. Made once (a call used it
        three times) and shared: never change it. (The fields are flat: no asdict() deep
        copy, which cost a leased command ~1 ms.)"""
        known = self.__dict__.get("_json")
        if known is None:
            known = {}
            for name, camel in _EFFECTIVE_POLICY_KEYS:
                v = getattr(self, name)
                known[camel] = list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v
            object.__setattr__(self, "_json", known)
        return known

    def digest(self) -> str:
        # Computed once: the policy is immutable.
        known = self.__dict__.get("_digest")
        if known is None:
            known = "sha256:" + hashlib.sha256(canonical_json(self.to_json_dict())).hexdigest()
            object.__setattr__(self, "_digest", known)
        return known


# root_fields only words refusals: it stays out of the record and the digest (two
# policies that reduce to the same roots are the same policy).
_EFFECTIVE_POLICY_KEYS = tuple(
    (f.name, to_camel(f.name)) for f in fields(EffectivePolicy) if f.name != "root_fields"
)


def check_strings(value: Any, path: str = "") -> None:
    """Every string of a request (and every key) before anything reads it: no NUL byte
    (a path, an image or a name with one means something else to the kernel or the
    engine than to the check), and a bounded length. The refusal names the field."""
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidArgument("contains a NUL byte", field=path or None)
        limit = _LONG_FIELDS.get(path.split("[", 1)[0] if path.startswith("argv") else path.rsplit(".", 1)[0],
                                 MAX_FIELD_CHARS)
        if len(value) > limit:
            raise InvalidArgument(f"{len(value)} characters exceed the maximum of {limit}", field=path or None)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and ("\x00" in key or len(key) > MAX_FIELD_CHARS):
                raise InvalidArgument("a key with a NUL byte or over the maximum length", field=path or None)
            check_strings(item, where)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_strings(item, f"{path}[{i}]")


def _check_env_total(data: Mapping[str, Any]) -> None:
    policy = data.get("policy")
    env = policy.get("environment") if isinstance(policy, Mapping) else None
    injected = env.get("injectedEnv") if isinstance(env, Mapping) else None
    if isinstance(injected, Mapping):
        total = sum(len(str(k)) + len(v) + 2 for k, v in injected.items() if isinstance(v, str))
        if total > MAX_ENV_TOTAL_CHARS:
            raise InvalidArgument(f"{total} characters together exceed the maximum of {MAX_ENV_TOTAL_CHARS}",
                                  field="policy.environment.injectedEnv")


def parse_call(data: Mapping[str, Any]) -> PreparedToolCall:
    check_strings(data)
    _check_env_total(data)
    try:
        return PreparedToolCall.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc) from None


def parse_policy(data: Mapping[str, Any] | None, prefix: str = "policy") -> SandboxPolicy:
    try:
        return SandboxPolicy.model_validate(data or {})
    except ValidationError as exc:
        raise _first_error(exc, prefix) from None


def _first_error(exc: ValidationError, prefix: str = "") -> InvalidArgument:
    err = exc.errors()[0]
    path = prefix
    for part in err["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    reason = err["msg"]
    if err["type"] == "extra_forbidden":
        reason = "unknown field"
    more = len(exc.errors()) - 1
    if more:
        reason += f" (and {more} more problem{'s' if more > 1 else ''})"
    return InvalidArgument(reason, field=path or None)


def normalize_sandbox_path(raw: str, field: str, base: str = WORKSPACE) -> str:
    """Absolute, normalized sandbox path; relative paths are taken from `base`.
    Collapses `//`, `./` and `..` so that aliases compare equal."""
    if not isinstance(raw, str) or not raw:
        raise InvalidArgument("must be a non-empty path", field=field)
    if "\x00" in raw or len(raw) > 4096:
        raise InvalidArgument("contains a NUL byte or is longer than 4096 bytes", field=field)
    path = raw if raw.startswith("/") else f"{base}/{raw}"
    path = posixpath.normpath(re.sub(r"/+", "/", path))
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return path


def _limit(value: int | None, default: int, maximum: int, field: str, unit: str) -> int:
    if not value:
        return default
    if value > maximum:
        raise InvalidArgument(f"{value} {unit} exceeds the daemon's maximum of {maximum} {unit}", field=field)
    return value


def _tmp_size_mb(asked: int | None, limits: LimitSettings, memory_mb: int, pp: str) -> int:
    """tempDir's size. It is a tmpfs, so what is written there is memory, charged to the
    sandbox's limit: a tempDir that could grow past what the limit leaves the processes
    would end in an OOM kill instead of ENOSPC. A quarter of the memory always stays
    for the processes: the default shrinks to fit, and a policy asking for more is
    refused with the reason."""
    room = memory_mb - memory_mb // 4
    if not asked:
        return max(1, min(limits.default_tmp_size_mb, room))  # never 0: a tmpfs of size 0 has no limit
    size = _limit(asked, limits.default_tmp_size_mb, limits.max_tmp_size_mb, f"{pp}.maxTmpSizeMb", "MB")
    if size > room:
        raise InvalidArgument(f"a {size} MB tempDir is memory (a tmpfs) within maxMemoryMb {memory_mb}: full, it would "
                              f"leave the processes less than a quarter of it and end in an OOM kill, not ENOSPC; "
                              f"at most {room} MB, or raise maxMemoryMb", field=f"{pp}.maxTmpSizeMb")
    return size


@dataclass(frozen=True)
class _Filesystem:
    """A policy's filesystem section, resolved: normalized paths checked against each other."""

    cwd: str
    read_roots: tuple[str, ...]
    write_roots: tuple[str, ...]
    blocked: tuple[str, ...]
    temp_dir: str
    root_fields: dict[str, str]


def resolve_policy(
    call: PreparedToolCall, limits: LimitSettings, inheritable_env: Mapping[str, str | None]
) -> EffectivePolicy:
    """Applies defaults and maxima. `inheritable_env`: the daemon-env values a policy may
    inherit (None: allowed, but unset there); nothing else of it is ever used."""
    policy = call.policy
    fs = _resolve_filesystem(call)
    net = policy.network
    allow_domains = _resolve_domains(net)
    env = _resolve_env(call, fs.temp_dir, inheritable_env)
    proc = policy.process
    pp = "policy.process"
    memory_mb = _limit(proc.max_memory_mb, limits.default_memory_mb, limits.max_memory_mb, f"{pp}.maxMemoryMb", "MB")
    return EffectivePolicy(
        cwd=fs.cwd,
        read_roots=fs.read_roots,
        write_roots=fs.write_roots,
        blocked_paths=fs.blocked,
        temp_dir=fs.temp_dir,
        root_fields=fs.root_fields,
        egress=net.egress,
        allow_domains=allow_domains,
        deny_private_networks=net.deny_private_networks,
        env=env,
        timeout_ms=_limit(proc.timeout_ms, limits.default_timeout_ms, limits.max_timeout_ms, f"{pp}.timeoutMs", "ms"),
        memory_bytes=memory_mb * 2**20,
        max_stdout_bytes=_limit(proc.max_stdout_bytes, limits.default_stdout_bytes, limits.max_output_bytes, f"{pp}.maxStdoutBytes", "bytes"),
        max_stderr_bytes=_limit(proc.max_stderr_bytes, limits.default_stderr_bytes, limits.max_output_bytes, f"{pp}.maxStderrBytes", "bytes"),
        max_pids=_limit(proc.max_pids, limits.default_pids, limits.max_pids, f"{pp}.maxPids", "processes"),
        cpu_millicores=_limit(proc.cpu_millicores, limits.default_cpu_millicores, limits.max_cpu_millicores, f"{pp}.cpuMillicores", "millicores"),
        max_file_size_bytes=_limit(proc.max_file_size_mb, limits.default_file_size_mb, limits.max_file_size_mb, f"{pp}.maxFileSizeMb", "MB") * 2**20,
        tmp_size_bytes=_tmp_size_mb(proc.max_tmp_size_mb, limits, memory_mb, pp) * 2**20,
        persist_outputs=bool(policy.filesystem and policy.filesystem.persist_outputs),
        record_command=policy.audit.record_command,
        record_file_access=policy.audit.record_file_access,
        record_network_access=policy.audit.record_network_access,
    )


def _resolve_filesystem(call: PreparedToolCall) -> _Filesystem:
    fs = call.policy.filesystem
    fs_prefix = "policy.filesystem"
    if fs is None:
        fs = FilesystemPolicy(read_roots=[WORKSPACE])
    temp_dir = normalize_sandbox_path(fs.temp_dir or DEFAULT_TEMP_DIR, f"{fs_prefix}.tempDir", base="/")
    if temp_dir == "/" or is_within(temp_dir, WORKSPACE) or any(is_within(temp_dir, p) for p in _FORBIDDEN_MOUNT_PARENTS):
        raise InvalidArgument("must be a directory outside /workspace, /proc, /sys and /dev", field=f"{fs_prefix}.tempDir")

    first_named: dict[str, str] = {}

    def paths(values: list[str], name: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
        out: list[str] = []
        for i, raw in enumerate(values):
            where = f"{fs_prefix}.{name}[{i}]"
            p = normalize_sandbox_path(raw, where)
            if not any(is_within(p, root) for root in allowed):
                raise InvalidArgument(f"{p} must lie inside {' or '.join(allowed)}", field=where)
            if p not in out:
                out.append(p)
                first_named.setdefault(f"{name}:{p}", where)
        return tuple(out)

    read_roots = paths(fs.read_roots, "readRoots", (WORKSPACE,))
    write_roots = paths(fs.write_roots, "writeRoots", (WORKSPACE, temp_dir))
    blocked = paths(fs.blocked_paths, "blockedPaths", (WORKSPACE,))
    for i, p in enumerate(blocked):
        if p == WORKSPACE:
            raise InvalidArgument("blocking all of /workspace: use empty roots instead", field=f"{fs_prefix}.blockedPaths[{i}]")
    for name, roots in (("readRoots", read_roots), ("writeRoots", write_roots)):
        for i, root in enumerate(roots):
            if any(is_within(root, b) for b in blocked):
                raise InvalidArgument(f"{root} lies inside a blocked path", field=f"{fs_prefix}.{name}[{i}]")
    read_roots, write_roots = normalized_roots(read_roots, write_roots)

    cwd_raw = call.cwd or fs.cwd or WORKSPACE
    cwd_field = "cwd" if call.cwd else f"{fs_prefix}.cwd"
    cwd = normalize_sandbox_path(cwd_raw, cwd_field)
    if not (is_within(cwd, WORKSPACE) or is_within(cwd, temp_dir)):
        raise InvalidArgument(f"{cwd} must lie inside /workspace or tempDir", field=cwd_field)
    if any(is_within(cwd, b) for b in blocked):
        raise InvalidArgument(f"{cwd} is a blocked path", field=cwd_field)
    # A root kept as a write root that was also a read root is named by its writeRoots entry.
    root_fields = {p: first_named[f"readRoots:{p}"] for p in read_roots}
    root_fields.update({p: first_named[f"writeRoots:{p}"] for p in write_roots})
    return _Filesystem(cwd, read_roots, write_roots, blocked, temp_dir, root_fields)


def _resolve_domains(net: NetworkPolicy) -> tuple[str, ...]:
    if net.allow_domains and net.egress != "allowlist":
        raise InvalidArgument(f"allowDomains needs egress 'allowlist', not '{net.egress}'", field="policy.network.allowDomains")
    allow_domains: list[str] = []
    for i, pattern in enumerate(net.allow_domains):
        try:
            normalized = normalize_pattern(pattern)
        except ValueError as exc:
            raise InvalidArgument(f"{pattern!r}: {exc}", field=f"policy.network.allowDomains[{i}]") from None
        if normalized not in allow_domains:
            allow_domains.append(normalized)
    return tuple(allow_domains)


BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What every sandbox's environment sets (so an image's own values of them never show).
BASE_ENV_NAMES = ("HOME", "LANG", "PATH", "TMPDIR")


def _resolve_env(call: PreparedToolCall, temp_dir: str, inheritable_env: Mapping[str, str | None]) -> dict[str, str]:
    """The sandbox's whole environment: a fixed base, allowlisted inherited names, then
    the policy's injected values. Nothing else of the daemon's environment."""
    envp = call.policy.environment
    env = {"PATH": BASE_PATH, "HOME": temp_dir, "TMPDIR": temp_dir, "LANG": "C.UTF-8"}
    for i, name in enumerate(envp.inherited_env):
        where = f"policy.environment.inheritedEnv[{i}]"
        if not _ENV_NAME_RE.fullmatch(name):
            raise InvalidArgument(f"{name!r} is not a valid variable name", field=where)
        if name not in inheritable_env:
            raise PermissionDenied(f"{name} is not in the daemon's inheritable allowlist", field=where)
        value = inheritable_env[name]
        if value is not None:
            env[name] = value
    for name, value in envp.injected_env.items():
        where = f"policy.environment.injectedEnv.{name}"
        if not _ENV_NAME_RE.fullmatch(name):
            raise InvalidArgument(f"{name!r} is not a valid variable name", field=where)
        if "\x00" in value:
            raise InvalidArgument("value contains a NUL byte", field=where)
        env[name] = value
    return env


def request_digest(call: PreparedToolCall) -> str:
    """Digest of what a call would run; an idempotency key is bound to it. Excludes the
    ids that a retry may change (toolCallId, parent and session ids)."""
    body = {
        "toolId": call.tool_id, "toolVersion": call.tool_version, "argv": call.argv, "cwd": call.cwd,
        "stdinSha256": hashlib.sha256(call.stdin).hexdigest(), "workspace": call.workspace,
        "policy": call.policy.model_dump(mode="json", by_alias=True),
        "credentialRefs": [r.model_dump(mode="json", by_alias=True) for r in call.credential_refs],
        "adapter": call.runtime.adapter, "image": call.runtime.image,
    }
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()
