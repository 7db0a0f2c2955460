from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_STREAM_UNSPECIFIED: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDOUT: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDERR: _ClassVar[OutputStream]
OUTPUT_STREAM_UNSPECIFIED: OutputStream
OUTPUT_STREAM_STDOUT: OutputStream
OUTPUT_STREAM_STDERR: OutputStream

class FilesystemPolicy(_message.Message):
    __slots__ = ("cwd", "read_roots", "write_roots", "blocked_paths", "temp_dir", "persist_outputs")
    CWD_FIELD_NUMBER: _ClassVar[int]
    READ_ROOTS_FIELD_NUMBER: _ClassVar[int]
    WRITE_ROOTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_PATHS_FIELD_NUMBER: _ClassVar[int]
    TEMP_DIR_FIELD_NUMBER: _ClassVar[int]
    PERSIST_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    cwd: str
    read_roots: _containers.RepeatedScalarFieldContainer[str]
    write_roots: _containers.RepeatedScalarFieldContainer[str]
    blocked_paths: _containers.RepeatedScalarFieldContainer[str]
    temp_dir: str
    persist_outputs: bool
    def __init__(self, cwd: _Optional[str] = ..., read_roots: _Optional[_Iterable[str]] = ..., write_roots: _Optional[_Iterable[str]] = ..., blocked_paths: _Optional[_Iterable[str]] = ..., temp_dir: _Optional[str] = ..., persist_outputs: _Optional[bool] = ...) -> None: ...

class NetworkPolicy(_message.Message):
    __slots__ = ("egress", "allow_domains", "deny_private_networks")
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DOMAINS_FIELD_NUMBER: _ClassVar[int]
    DENY_PRIVATE_NETWORKS_FIELD_NUMBER: _ClassVar[int]
    egress: str
    allow_domains: _containers.RepeatedScalarFieldContainer[str]
    deny_private_networks: bool
    def __init__(self, egress: _Optional[str] = ..., allow_domains: _Optional[_Iterable[str]] = ..., deny_private_networks: _Optional[bool] = ...) -> None: ...

class EnvironmentPolicy(_message.Message):
    __slots__ = ("inherited_env", "injected_env", "secret_env_allowed")
    class InjectedEnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INHERITED_ENV_FIELD_NUMBER: _ClassVar[int]
    INJECTED_ENV_FIELD_NUMBER: _ClassVar[int]
    SECRET_ENV_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    inherited_env: _containers.RepeatedScalarFieldContainer[str]
    injected_env: _containers.ScalarMap[str, str]
    secret_env_allowed: bool
    def __init__(self, inherited_env: _Optional[_Iterable[str]] = ..., injected_env: _Optional[_Mapping[str, str]] = ..., secret_env_allowed: _Optional[bool] = ...) -> None: ...

class ProcessPolicy(_message.Message):
    __slots__ = ("timeout_ms", "max_memory_mb", "max_stdout_bytes", "max_stderr_bytes", "max_pids", "cpu_millicores", "max_file_size_mb", "max_tmp_size_mb")
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    MAX_STDOUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STDERR_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLICORES_FIELD_NUMBER: _ClassVar[int]
    MAX_FILE_SIZE_MB_FIELD_NUMBER: _ClassVar[int]
    MAX_TMP_SIZE_MB_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    max_memory_mb: int
    max_stdout_bytes: int
    max_stderr_bytes: int
    max_pids: int
    cpu_millicores: int
    max_file_size_mb: int
    max_tmp_size_mb: int
    def __init__(self, timeout_ms: _Optional[int] = ..., max_memory_mb: _Optional[int] = ..., max_stdout_bytes: _Optional[int] = ..., max_stderr_bytes: _Optional[int] = ..., max_pids: _Optional[int] = ..., cpu_millicores: _Optional[int] = ..., max_file_size_mb: _Optional[int] = ..., max_tmp_size_mb: _Optional[int] = ...) -> None: ...

class AuditPolicy(_message.Message):
    __slots__ = ("record_command", "record_file_access", "record_network_access")
    RECORD_COMMAND_FIELD_NUMBER: _ClassVar[int]
    RECORD_FILE_ACCESS_FIELD_NUMBER: _ClassVar[int]
    RECORD_NETWORK_ACCESS_FIELD_NUMBER: _ClassVar[int]
    record_command: bool
    record_file_access: bool
    record_network_access: bool
    def __init__(self, record_command: _Optional[bool] = ..., record_file_access: _Optional[bool] = ..., record_network_access: _Optional[bool] = ...) -> None: ...

class SandboxPolicy(_message.Message):
    __slots__ = ("filesystem", "network", "environment", "process", "audit")
    FILESYSTEM_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    filesystem: FilesystemPolicy
    network: NetworkPolicy
    environment: EnvironmentPolicy
    process: ProcessPolicy
    audit: AuditPolicy
    def __init__(self, filesystem: _Optional[_Union[FilesystemPolicy, _Mapping]] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ..., environment: _Optional[_Union[EnvironmentPolicy, _Mapping]] = ..., process: _Optional[_Union[ProcessPolicy, _Mapping]] = ..., audit: _Optional[_Union[AuditPolicy, _Mapping]] = ...) -> None: ...

class CredentialRef(_message.Message):
    __slots__ = ("binding_id", "env_name", "file_path")
    BINDING_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_PATH_FIELD_NUMBER: _ClassVar[int]
    binding_id: str
    env_name: str
    file_path: str
    def __init__(self, binding_id: _Optional[str] = ..., env_name: _Optional[str] = ..., file_path: _Optional[str] = ...) -> None: ...

class Authorization(_message.Message):
    __slots__ = ("status", "grant_id", "approval_digest", "expires_at", "signature", "approved_by", "approved_at")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    APPROVED_BY_FIELD_NUMBER: _ClassVar[int]
    APPROVED_AT_FIELD_NUMBER: _ClassVar[int]
    status: str
    grant_id: str
    approval_digest: str
    expires_at: str
    signature: str
    approved_by: str
    approved_at: str
    def __init__(self, status: _Optional[str] = ..., grant_id: _Optional[str] = ..., approval_digest: _Optional[str] = ..., expires_at: _Optional[str] = ..., signature: _Optional[str] = ..., approved_by: _Optional[str] = ..., approved_at: _Optional[str] = ...) -> None: ...

class RuntimeSettings(_message.Message):
    __slots__ = ("adapter", "image", "idempotency_key", "lease_id")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    image: str
    idempotency_key: str
    lease_id: str
    def __init__(self, adapter: _Optional[str] = ..., image: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PreparedToolCall(_message.Message):
    __slots__ = ("tool_call_id", "session_id", "run_id", "parent_event_id", "intent_id", "tool_id", "tool_version", "proposed_by", "argv", "cwd", "stdin", "workspace", "policy", "credential_refs", "authorization", "runtime")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    INTENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_BY_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_REFS_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    session_id: str
    run_id: str
    parent_event_id: str
    intent_id: str
    tool_id: str
    tool_version: str
    proposed_by: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    stdin: bytes
    workspace: str
    policy: SandboxPolicy
    credential_refs: _containers.RepeatedCompositeFieldContainer[CredentialRef]
    authorization: Authorization
    runtime: RuntimeSettings
    def __init__(self, tool_call_id: _Optional[str] = ..., session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., parent_event_id: _Optional[str] = ..., intent_id: _Optional[str] = ..., tool_id: _Optional[str] = ..., tool_version: _Optional[str] = ..., proposed_by: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., stdin: _Optional[bytes] = ..., workspace: _Optional[str] = ..., policy: _Optional[_Union[SandboxPolicy, _Mapping]] = ..., credential_refs: _Optional[_Iterable[_Union[CredentialRef, _Mapping]]] = ..., authorization: _Optional[_Union[Authorization, _Mapping]] = ..., runtime: _Optional[_Union[RuntimeSettings, _Mapping]] = ...) -> None: ...

class ArtifactRef(_message.Message):
    __slots__ = ("artifact_id", "kind", "uri", "content_hash", "size_bytes", "summary", "tool_call_id", "event_id", "created_at", "path", "change", "previous_path", "file_mode")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_PATH_FIELD_NUMBER: _ClassVar[int]
    FILE_MODE_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    kind: str
    uri: str
    content_hash: str
    size_bytes: int
    summary: str
    tool_call_id: str
    event_id: str
    created_at: str
    path: str
    change: str
    previous_path: str
    file_mode: str
    def __init__(self, artifact_id: _Optional[str] = ..., kind: _Optional[str] = ..., uri: _Optional[str] = ..., content_hash: _Optional[str] = ..., size_bytes: _Optional[int] = ..., summary: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., event_id: _Optional[str] = ..., created_at: _Optional[str] = ..., path: _Optional[str] = ..., change: _Optional[str] = ..., previous_path: _Optional[str] = ..., file_mode: _Optional[str] = ...) -> None: ...

class EffectsObserved(_message.Message):
    __slots__ = ("reads", "writes", "deletes", "external_calls", "incomplete")
    READS_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    DELETES_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_CALLS_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    reads: _containers.RepeatedScalarFieldContainer[str]
    writes: _containers.RepeatedScalarFieldContainer[str]
    deletes: _containers.RepeatedScalarFieldContainer[str]
    external_calls: _containers.RepeatedScalarFieldContainer[str]
    incomplete: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reads: _Optional[_Iterable[str]] = ..., writes: _Optional[_Iterable[str]] = ..., deletes: _Optional[_Iterable[str]] = ..., external_calls: _Optional[_Iterable[str]] = ..., incomplete: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("latency_ms", "cpu_ms", "peak_memory_bytes", "output_bytes")
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    CPU_MS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    latency_ms: int
    cpu_ms: int
    peak_memory_bytes: int
    output_bytes: int
    def __init__(self, latency_ms: _Optional[int] = ..., cpu_ms: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., output_bytes: _Optional[int] = ...) -> None: ...

class ToolError(_message.Message):
    __slots__ = ("code", "message", "retryable", "safe_to_show_user")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    SAFE_TO_SHOW_USER_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    retryable: bool
    safe_to_show_user: bool
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ..., safe_to_show_user: _Optional[bool] = ...) -> None: ...

class Provenance(_message.Message):
    __slots__ = ("event_id", "artifact_refs")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_REFS_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    artifact_refs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, event_id: _Optional[str] = ..., artifact_refs: _Optional[_Iterable[str]] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("tool_call_id", "status", "exit_code", "signal", "timed_out", "oom_killed", "stdout_truncated", "stderr_truncated", "stdout_preview", "stderr_preview", "artifacts", "effects_observed", "usage", "error", "provenance", "artifacts_omitted")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_PREVIEW_FIELD_NUMBER: _ClassVar[int]
    STDERR_PREVIEW_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    EFFECTS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    status: str
    exit_code: int
    signal: str
    timed_out: bool
    oom_killed: bool
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_preview: str
    stderr_preview: str
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactRef]
    effects_observed: EffectsObserved
    usage: Usage
    error: ToolError
    provenance: Provenance
    artifacts_omitted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tool_call_id: _Optional[str] = ..., status: _Optional[str] = ..., exit_code: _Optional[int] = ..., signal: _Optional[str] = ..., timed_out: _Optional[bool] = ..., oom_killed: _Optional[bool] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., stdout_preview: _Optional[str] = ..., stderr_preview: _Optional[str] = ..., artifacts: _Optional[_Iterable[_Union[ArtifactRef, _Mapping]]] = ..., effects_observed: _Optional[_Union[EffectsObserved, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[_Union[ToolError, _Mapping]] = ..., provenance: _Optional[_Union[Provenance, _Mapping]] = ..., artifacts_omitted: _Optional[_Iterable[str]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("call",)
    CALL_FIELD_NUMBER: _ClassVar[int]
    call: PreparedToolCall
    def __init__(self, call: _Optional[_Union[PreparedToolCall, _Mapping]] = ...) -> None: ...

class CallAccepted(_message.Message):
    __slots__ = ("tool_call_id", "backend", "image")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    backend: str
    image: str
    def __init__(self, tool_call_id: _Optional[str] = ..., backend: _Optional[str] = ..., image: _Optional[str] = ...) -> None: ...

class CallStarted(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("stream", "offset", "data")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    stream: OutputStream
    offset: int
    data: bytes
    def __init__(self, stream: _Optional[_Union[OutputStream, str]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class CallFinished(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: ToolResult
    def __init__(self, result: _Optional[_Union[ToolResult, _Mapping]] = ...) -> None: ...

class ExecuteEvent(_message.Message):
    __slots__ = ("tool_call_id", "event_id", "accepted", "started", "output", "finished")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    event_id: str
    accepted: CallAccepted
    started: CallStarted
    output: OutputChunk
    finished: CallFinished
    def __init__(self, tool_call_id: _Optional[str] = ..., event_id: _Optional[str] = ..., accepted: _Optional[_Union[CallAccepted, _Mapping]] = ..., started: _Optional[_Union[CallStarted, _Mapping]] = ..., output: _Optional[_Union[OutputChunk, _Mapping]] = ..., finished: _Optional[_Union[CallFinished, _Mapping]] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("call", "max_inline_output_bytes")
    CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_INLINE_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    call: PreparedToolCall
    max_inline_output_bytes: int
    def __init__(self, call: _Optional[_Union[PreparedToolCall, _Mapping]] = ..., max_inline_output_bytes: _Optional[int] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("tool_call_id", "event_id", "result", "stdout", "stderr", "output_inline")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INLINE_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    event_id: str
    result: ToolResult
    stdout: bytes
    stderr: bytes
    output_inline: bool
    def __init__(self, tool_call_id: _Optional[str] = ..., event_id: _Optional[str] = ..., result: _Optional[_Union[ToolResult, _Mapping]] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., output_inline: _Optional[bool] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("tool_call_id", "reason")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    reason: str
    def __init__(self, tool_call_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ExplainPolicyRequest(_message.Message):
    __slots__ = ("policy", "workspace", "runtime", "argv", "cwd")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    policy: SandboxPolicy
    workspace: str
    runtime: RuntimeSettings
    argv: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    def __init__(self, policy: _Optional[_Union[SandboxPolicy, _Mapping]] = ..., workspace: _Optional[str] = ..., runtime: _Optional[_Union[RuntimeSettings, _Mapping]] = ..., argv: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ...) -> None: ...

class ExplainPolicyResponse(_message.Message):
    __slots__ = ("backend", "image", "effective_policy_json", "spec_json", "notes", "network_plan_json")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    NETWORK_PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    backend: str
    image: str
    effective_policy_json: str
    spec_json: str
    notes: _containers.RepeatedScalarFieldContainer[str]
    network_plan_json: str
    def __init__(self, backend: _Optional[str] = ..., image: _Optional[str] = ..., effective_policy_json: _Optional[str] = ..., spec_json: _Optional[str] = ..., notes: _Optional[_Iterable[str]] = ..., network_plan_json: _Optional[str] = ...) -> None: ...

class ListRunningRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunningCall(_message.Message):
    __slots__ = ("tool_call_id", "principal", "workspace", "command", "backend", "image", "sandbox_id", "lease_id", "requested_at")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    principal: str
    workspace: str
    command: str
    backend: str
    image: str
    sandbox_id: str
    lease_id: str
    requested_at: str
    def __init__(self, tool_call_id: _Optional[str] = ..., principal: _Optional[str] = ..., workspace: _Optional[str] = ..., command: _Optional[str] = ..., backend: _Optional[str] = ..., image: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., requested_at: _Optional[str] = ...) -> None: ...

class HeldLease(_message.Message):
    __slots__ = ("lease", "principal", "workspace", "image", "tool_call_id")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    principal: str
    workspace: str
    image: str
    tool_call_id: str
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., principal: _Optional[str] = ..., workspace: _Optional[str] = ..., image: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ListRunningResponse(_message.Message):
    __slots__ = ("calls", "leases")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[RunningCall]
    leases: _containers.RepeatedCompositeFieldContainer[HeldLease]
    def __init__(self, calls: _Optional[_Iterable[_Union[RunningCall, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[HeldLease, _Mapping]]] = ...) -> None: ...

class StreamOutputRequest(_message.Message):
    __slots__ = ("tool_call_id", "stdout_offset", "stderr_offset", "follow")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STDOUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STDERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    stdout_offset: int
    stderr_offset: int
    follow: bool
    def __init__(self, tool_call_id: _Optional[str] = ..., stdout_offset: _Optional[int] = ..., stderr_offset: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ("tool_call_id",)
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    def __init__(self, tool_call_id: _Optional[str] = ...) -> None: ...

class ListArtifactsResponse(_message.Message):
    __slots__ = ("artifacts",)
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactRef]
    def __init__(self, artifacts: _Optional[_Iterable[_Union[ArtifactRef, _Mapping]]] = ...) -> None: ...

class DownloadArtifactRequest(_message.Message):
    __slots__ = ("artifact_id",)
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    def __init__(self, artifact_id: _Optional[str] = ...) -> None: ...

class ArtifactChunk(_message.Message):
    __slots__ = ("artifact", "offset", "data")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactRef
    offset: int
    data: bytes
    def __init__(self, artifact: _Optional[_Union[ArtifactRef, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TraceEvent(_message.Message):
    __slots__ = ("seq", "event_id", "tool_call_id", "type", "time", "parent_event_id", "payload_json", "prev_hash", "hash")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PARENT_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    PREV_HASH_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    event_id: str
    tool_call_id: str
    type: str
    time: str
    parent_event_id: str
    payload_json: str
    prev_hash: str
    hash: str
    def __init__(self, seq: _Optional[int] = ..., event_id: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., type: _Optional[str] = ..., time: _Optional[str] = ..., parent_event_id: _Optional[str] = ..., payload_json: _Optional[str] = ..., prev_hash: _Optional[str] = ..., hash: _Optional[str] = ...) -> None: ...

class GetTraceRequest(_message.Message):
    __slots__ = ("tool_call_id",)
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    def __init__(self, tool_call_id: _Optional[str] = ...) -> None: ...

class GetTraceResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TraceEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[TraceEvent, _Mapping]]] = ...) -> None: ...

class VerifyLogRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyLogResponse(_message.Message):
    __slots__ = ("ok", "events_checked", "first_bad_seq", "reason", "head_hash")
    OK_FIELD_NUMBER: _ClassVar[int]
    EVENTS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    FIRST_BAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEAD_HASH_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    events_checked: int
    first_bad_seq: int
    reason: str
    head_hash: str
    def __init__(self, ok: _Optional[bool] = ..., events_checked: _Optional[int] = ..., first_bad_seq: _Optional[int] = ..., reason: _Optional[str] = ..., head_hash: _Optional[str] = ...) -> None: ...

class ExportEventsRequest(_message.Message):
    __slots__ = ("after_seq", "tool_call_id")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    tool_call_id: str
    def __init__(self, after_seq: _Optional[int] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class QueryCallsRequest(_message.Message):
    __slots__ = ("command_contains", "path", "path_operation", "domain", "principal", "workspace", "status", "since", "until", "page_size", "page_token", "proposed_by", "session_id")
    COMMAND_CONTAINS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PATH_OPERATION_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_BY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    command_contains: str
    path: str
    path_operation: str
    domain: str
    principal: str
    workspace: str
    status: str
    since: str
    until: str
    page_size: int
    page_token: str
    proposed_by: str
    session_id: str
    def __init__(self, command_contains: _Optional[str] = ..., path: _Optional[str] = ..., path_operation: _Optional[str] = ..., domain: _Optional[str] = ..., principal: _Optional[str] = ..., workspace: _Optional[str] = ..., status: _Optional[str] = ..., since: _Optional[str] = ..., until: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., proposed_by: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class CallSummary(_message.Message):
    __slots__ = ("tool_call_id", "principal", "workspace", "command", "tool_id", "backend", "image", "status", "exit_code", "error_code", "requested_at", "finished_at", "domains", "proposed_by", "session_id")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    TOOL_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_BY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    principal: str
    workspace: str
    command: str
    tool_id: str
    backend: str
    image: str
    status: str
    exit_code: int
    error_code: str
    requested_at: str
    finished_at: str
    domains: _containers.RepeatedScalarFieldContainer[str]
    proposed_by: str
    session_id: str
    def __init__(self, tool_call_id: _Optional[str] = ..., principal: _Optional[str] = ..., workspace: _Optional[str] = ..., command: _Optional[str] = ..., tool_id: _Optional[str] = ..., backend: _Optional[str] = ..., image: _Optional[str] = ..., status: _Optional[str] = ..., exit_code: _Optional[int] = ..., error_code: _Optional[str] = ..., requested_at: _Optional[str] = ..., finished_at: _Optional[str] = ..., domains: _Optional[_Iterable[str]] = ..., proposed_by: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class QueryCallsResponse(_message.Message):
    __slots__ = ("calls", "next_page_token")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[CallSummary]
    next_page_token: str
    def __init__(self, calls: _Optional[_Iterable[_Union[CallSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class AcquireSandboxRequest(_message.Message):
    __slots__ = ("workspace", "policy", "runtime", "lease_ms", "wait_ms")
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    workspace: str
    policy: SandboxPolicy
    runtime: RuntimeSettings
    lease_ms: int
    wait_ms: int
    def __init__(self, workspace: _Optional[str] = ..., policy: _Optional[_Union[SandboxPolicy, _Mapping]] = ..., runtime: _Optional[_Union[RuntimeSettings, _Mapping]] = ..., lease_ms: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "sandbox_id", "expires_at", "pool_key", "backend")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    POOL_KEY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    sandbox_id: str
    expires_at: str
    pool_key: str
    backend: str
    def __init__(self, lease_id: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., expires_at: _Optional[str] = ..., pool_key: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class ReleaseSandboxRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool_key", "workspace", "image", "backend", "idle", "leased", "min_idle", "max_size", "created", "destroyed")
    POOL_KEY_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    MIN_IDLE_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    DESTROYED_FIELD_NUMBER: _ClassVar[int]
    pool_key: str
    workspace: str
    image: str
    backend: str
    idle: int
    leased: int
    min_idle: int
    max_size: int
    created: int
    destroyed: int
    def __init__(self, pool_key: _Optional[str] = ..., workspace: _Optional[str] = ..., image: _Optional[str] = ..., backend: _Optional[str] = ..., idle: _Optional[int] = ..., leased: _Optional[int] = ..., min_idle: _Optional[int] = ..., max_size: _Optional[int] = ..., created: _Optional[int] = ..., destroyed: _Optional[int] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class DrainPoolRequest(_message.Message):
    __slots__ = ("pool_key",)
    POOL_KEY_FIELD_NUMBER: _ClassVar[int]
    pool_key: str
    def __init__(self, pool_key: _Optional[str] = ...) -> None: ...

class DrainPoolResponse(_message.Message):
    __slots__ = ("destroyed",)
    DESTROYED_FIELD_NUMBER: _ClassVar[int]
    destroyed: int
    def __init__(self, destroyed: _Optional[int] = ...) -> None: ...

class CreatePoolRequest(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: AcquireSandboxRequest
    def __init__(self, sandbox: _Optional[_Union[AcquireSandboxRequest, _Mapping]] = ...) -> None: ...

class TransferTarget(_message.Message):
    __slots__ = ("workspace", "policy", "lease_id")
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    workspace: str
    policy: SandboxPolicy
    lease_id: str
    def __init__(self, workspace: _Optional[str] = ..., policy: _Optional[_Union[SandboxPolicy, _Mapping]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class TransferEntry(_message.Message):
    __slots__ = ("path", "kind", "mode", "size_bytes", "sha256", "redacted")
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    REDACTED_FIELD_NUMBER: _ClassVar[int]
    path: str
    kind: str
    mode: int
    size_bytes: int
    sha256: str
    redacted: bool
    def __init__(self, path: _Optional[str] = ..., kind: _Optional[str] = ..., mode: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., redacted: _Optional[bool] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("target", "path", "entry", "data", "commit")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    target: TransferTarget
    path: str
    entry: TransferEntry
    data: bytes
    commit: bool
    def __init__(self, target: _Optional[_Union[TransferTarget, _Mapping]] = ..., path: _Optional[str] = ..., entry: _Optional[_Union[TransferEntry, _Mapping]] = ..., data: _Optional[bytes] = ..., commit: _Optional[bool] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("transfer_id", "entries", "total_bytes", "skipped")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    entries: _containers.RepeatedCompositeFieldContainer[TransferEntry]
    total_bytes: int
    skipped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfer_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[TransferEntry, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., skipped: _Optional[_Iterable[str]] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("target", "path")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    target: TransferTarget
    path: str
    def __init__(self, target: _Optional[_Union[TransferTarget, _Mapping]] = ..., path: _Optional[str] = ...) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("entry", "data", "result")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    entry: TransferEntry
    data: bytes
    result: TransferResult
    def __init__(self, entry: _Optional[_Union[TransferEntry, _Mapping]] = ..., data: _Optional[bytes] = ..., result: _Optional[_Union[TransferResult, _Mapping]] = ...) -> None: ...
