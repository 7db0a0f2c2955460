"""The typed events of one call's causal chain, from its request to its result (and its
refusal, replay and expiry). Each is defined once here: its payload's fields, a builder
(`to_payload`, the exact dict the log has always hashed: same keys, same omissions) and
a reader (`from_payload`, tolerant of keys an older daemon did not write).

Readers keep values as the log holds them, never coerced: a payload read and written
again has the same canonical bytes (tests/unit/test_event_types.py holds every event of
the golden log to that). Nested objects another layer owns (the effective policy, the
result, the request as sent) stay JSON mappings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from sandboxd.ledger import events as ev

# The daemon's own keys in a ToolCallRequested payload; the rest is the request as sent.
_REQUEST_OWN_KEYS = ("principal", "daemonId", "stdinBytes", "stdinSha256", "requestDigest", "argvSha256")


def _mapping(value: Any) -> Mapping[str, Any]:
    """A nested object as read: an edited or early log may hold anything there."""
    return value if isinstance(value, Mapping) else {}


def _put(payload: dict[str, Any], key: str, value: Any) -> None:
    """An optional key: written when set (None means the daemon did not write it)."""
    if value is not None:
        payload[key] = value


@dataclass(frozen=True)
class ToolCallRequested:
    """The request as the trace keeps it (stdin as its size and digest; argv as its digest
    when the policy does not record commands), and who sent it to which daemon."""

    TYPE: ClassVar[str] = ev.REQUESTED
    principal: str
    daemon_id: str
    request: Mapping[str, Any]  # the request's proto JSON, without stdin and the keys below
    stdin_bytes: int | None = None
    stdin_sha256: str | None = None
    request_digest: str | None = None  # only with an idempotency key
    argv_sha256: str | None = None  # in place of argv, when commands are not recorded

    @classmethod
    def of_request(cls, summary: Mapping[str, Any], *, principal: str, daemon_id: str,
                   request_digest: str | None = None, argv_sha256: str | None = None) -> Self:
        """From the request's summary (CallExecutor's: stdin already replaced by its size
        and digest). An argv digest takes the argv's place."""
        rest = {k: v for k, v in summary.items() if k not in _REQUEST_OWN_KEYS}
        if argv_sha256 is not None:
            rest.pop("argv", None)
        return cls(principal, daemon_id, rest, summary.get("stdinBytes"), summary.get("stdinSha256"),
                   request_digest if request_digest is not None else summary.get("requestDigest"),
                   argv_sha256 if argv_sha256 is not None else summary.get("argvSha256"))

    def to_payload(self) -> dict[str, Any]:
        payload = dict(self.request)
        _put(payload, "stdinBytes", self.stdin_bytes)
        _put(payload, "stdinSha256", self.stdin_sha256)
        _put(payload, "requestDigest", self.request_digest)
        _put(payload, "argvSha256", self.argv_sha256)
        payload["principal"] = self.principal
        payload["daemonId"] = self.daemon_id
        return payload

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("principal", ""), p.get("daemonId", ""),
                   {k: v for k, v in p.items() if k not in _REQUEST_OWN_KEYS},
                   p.get("stdinBytes"), p.get("stdinSha256"), p.get("requestDigest"), p.get("argvSha256"))

    # What the index reads of the request (a refused one may hold anything).
    @property
    def argv(self) -> list[str] | None:
        """The argv when recorded as a list of strings, else None."""
        argv = self.request.get("argv")
        return argv if isinstance(argv, list) and all(isinstance(a, str) for a in argv) else None

    @property
    def tool_id(self) -> str:
        return str(self.request.get("toolId", ""))

    @property
    def workspace(self) -> str:
        return str(self.request.get("workspace", ""))


@dataclass(frozen=True)
class ToolArgsValidated:
    TYPE: ClassVar[str] = ev.ARGS_VALIDATED
    effective_policy: Mapping[str, Any]  # the policy layer's JSON of the resolved policy
    policy_digest: str

    def to_payload(self) -> dict[str, Any]:
        return {"effectivePolicy": self.effective_policy, "policyDigest": self.policy_digest}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("effectivePolicy", {}), p.get("policyDigest", ""))


@dataclass(frozen=True)
class CheckedAuthorization:
    """A verified grant (grant id, approval digest, verified) or the request's status."""

    status: str | None = None
    grant_id: str | None = None
    approval_digest: str | None = None
    verified: bool | None = None

    @classmethod
    def granted(cls, grant_id: str, approval_digest: str) -> Self:
        return cls(grant_id=grant_id, approval_digest=approval_digest, verified=True)

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {}
        _put(payload, "grantId", self.grant_id)
        _put(payload, "approvalDigest", self.approval_digest)
        _put(payload, "verified", self.verified)
        _put(payload, "status", self.status)
        return payload

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("status"), p.get("grantId"), p.get("approvalDigest"), p.get("verified"))


@dataclass(frozen=True)
class CommandRecord:
    """audit.recordCommand: what ran, where, as whom (environment names, never values)."""

    argv: Sequence[str]
    cwd: str
    env_names: Sequence[str]
    image: str
    image_digest: str
    backend: str
    policy_digest: str
    principal: str
    workspace: str
    sandbox_user: str  # "uid:gid"

    def to_payload(self) -> dict[str, Any]:
        return {"argv": list(self.argv), "cwd": self.cwd, "envNames": list(self.env_names), "image": self.image,
                "imageDigest": self.image_digest, "backend": self.backend, "policyDigest": self.policy_digest,
                "principal": self.principal, "workspace": self.workspace, "sandboxUser": self.sandbox_user}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("argv", []), p.get("cwd", ""), p.get("envNames", []), p.get("image", ""),
                   p.get("imageDigest", ""), p.get("backend", ""), p.get("policyDigest", ""),
                   p.get("principal", ""), p.get("workspace", ""), p.get("sandboxUser", ""))


@dataclass(frozen=True)
class ToolPolicyChecked:
    """The call was admitted: where it runs, as whom, with which mounts."""

    TYPE: ClassVar[str] = ev.POLICY_CHECKED
    backend: str
    image: str
    sandbox_id: str  # named at admission: a crash recovery finds the spooled output by it
    authorization: CheckedAuthorization
    image_digest: str
    uid: int
    gid: int
    workspace: str
    binds: Sequence[Sequence[str]] = ()  # [sandbox path, "ro" | "rw"]
    masks: Sequence[str] = ()
    notes: Sequence[str] = ()
    decision: str = "allowed"
    lease_id: str | None = None  # a leased call's
    command: CommandRecord | None = None  # when the policy records commands

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "decision": self.decision, "backend": self.backend, "image": self.image, "sandboxId": self.sandbox_id,
            "authorization": self.authorization.to_payload(), "imageDigest": self.image_digest,
            "uid": self.uid, "gid": self.gid, "workspace": self.workspace,
            "binds": [list(b) for b in self.binds], "masks": list(self.masks), "notes": list(self.notes),
        }
        _put(payload, "leaseId", self.lease_id)
        if self.command is not None:
            payload["command"] = self.command.to_payload()
        return payload

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        command = p.get("command")
        return cls(p.get("backend", ""), p.get("image", ""), p.get("sandboxId", ""),
                   CheckedAuthorization.from_payload(_mapping(p.get("authorization"))), p.get("imageDigest", ""),
                   p.get("uid", 0), p.get("gid", 0), p.get("workspace", ""), p.get("binds", []),
                   p.get("masks", []), p.get("notes", []), p.get("decision", "allowed"), p.get("leaseId"),
                   CommandRecord.from_payload(command) if isinstance(command, Mapping) else None)


@dataclass(frozen=True)
class ToolSandboxPrepared:
    TYPE: ClassVar[str] = ev.SANDBOX_PREPARED
    sandbox_id: str
    engine_id: str
    backend: str
    spec_digest: str  # of the spec as it ran
    lease_id: str | None = None  # a leased call's

    def to_payload(self) -> dict[str, Any]:
        payload = {"sandboxId": self.sandbox_id, "engineId": self.engine_id, "backend": self.backend,
                   "specDigest": self.spec_digest}
        _put(payload, "leaseId", self.lease_id)
        return payload

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("sandboxId", ""), p.get("engineId", ""), p.get("backend", ""), p.get("specDigest", ""),
                   p.get("leaseId"))


@dataclass(frozen=True)
class ToolCallStarted:
    TYPE: ClassVar[str] = ev.STARTED
    sandbox_id: str
    started_at: str

    def to_payload(self) -> dict[str, Any]:
        return {"sandboxId": self.sandbox_id, "startedAt": self.started_at}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("sandboxId", ""), p.get("startedAt", ""))


@dataclass(frozen=True)
class OutputDigest:
    """One output stream of a finished call: how much it produced, kept, and its hash."""

    produced_bytes: int
    stored_bytes: int
    sha256: str

    def to_payload(self) -> dict[str, Any]:
        return {"producedBytes": self.produced_bytes, "storedBytes": self.stored_bytes, "sha256": self.sha256}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("producedBytes", 0), p.get("storedBytes", 0), p.get("sha256", ""))


@dataclass(frozen=True)
class ToolCallFinished:
    """The command's end. A call a crashed daemon left unfinished ends with only
    `interrupted` and its exit code (-1): every other field is None, and left out."""

    TYPE: ClassVar[str] = ev.FINISHED
    exit_code: int
    signal: str | None = None
    timed_out: bool | None = None
    oom_killed: bool | None = None
    cancelled: bool | None = None
    failure: str | None = None
    usage: Mapping[str, Any] | None = None  # the result's usage
    stdout: OutputDigest | None = None
    stderr: OutputDigest | None = None
    interrupted: bool | None = None

    @classmethod
    def interrupted_call(cls) -> Self:
        return cls(exit_code=-1, interrupted=True)

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"exitCode": self.exit_code}
        _put(payload, "interrupted", self.interrupted)
        _put(payload, "signal", self.signal)
        _put(payload, "timedOut", self.timed_out)
        _put(payload, "oomKilled", self.oom_killed)
        _put(payload, "cancelled", self.cancelled)
        _put(payload, "failure", self.failure)
        _put(payload, "usage", self.usage)
        if self.stdout is not None:
            payload["stdout"] = self.stdout.to_payload()
        if self.stderr is not None:
            payload["stderr"] = self.stderr.to_payload()
        return payload

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        out, err = p.get("stdout"), p.get("stderr")
        return cls(p.get("exitCode", -1), p.get("signal"), p.get("timedOut"), p.get("oomKilled"), p.get("cancelled"),
                   p.get("failure"), p.get("usage"),
                   OutputDigest.from_payload(out) if isinstance(out, Mapping) else None,
                   OutputDigest.from_payload(err) if isinstance(err, Mapping) else None, p.get("interrupted"))


@dataclass(frozen=True)
class ToolResultValidated:
    """The whole result (the ToolResult's proto JSON): the log alone answers for the call."""

    TYPE: ClassVar[str] = ev.RESULT_VALIDATED
    result: Mapping[str, Any]

    def to_payload(self) -> dict[str, Any]:
        return {"result": self.result}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(_mapping(p.get("result")))

    # What the index reads of the result (an edited log may hold anything).
    @property
    def status(self) -> str:
        return str(self.result.get("status", "error"))

    @property
    def exit_code(self) -> Any:
        return self.result.get("exitCode")

    @property
    def error_code(self) -> str:
        return str(_mapping(self.result.get("error")).get("code", ""))


@dataclass(frozen=True)
class ArtifactFacts:
    """An artifact by id, kind, content hash and size: as persisted (ArtifactPersisted)
    and as retention names the ones it removed (RemovedArtifact, in ToolCallExpired).
    A `file` artifact also names its path and what the call did to it (absent for the
    other kinds, whose payloads stay as they were)."""

    artifact_id: str
    kind: str
    content_hash: str
    size_bytes: int
    path: str = ""
    change: str = ""  # created | modified | renamed | deleted
    previous_path: str = ""
    file_mode: str = ""

    def to_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"artifactId": self.artifact_id, "kind": self.kind, "contentHash": self.content_hash,
                               "sizeBytes": self.size_bytes}
        if self.path:
            out |= {"path": self.path, "change": self.change, "fileMode": self.file_mode}
            if self.previous_path:
                out["previousPath"] = self.previous_path
        return out

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("artifactId", ""), p.get("kind", ""), p.get("contentHash", ""), p.get("sizeBytes", 0),
                   p.get("path", ""), p.get("change", ""), p.get("previousPath", ""), p.get("fileMode", ""))


@dataclass(frozen=True)
class ArtifactPersisted(ArtifactFacts):
    TYPE: ClassVar[str] = ev.ARTIFACT_PERSISTED


@dataclass(frozen=True)
class RemovedArtifact(ArtifactFacts):
    """One of the artifacts a ToolCallExpired names as removed."""


@dataclass(frozen=True)
class ToolCallRejected:
    """A refused request: at which stage, the error kind (`code`), the field and reason
    (bounded by the caller), and the id the request asked for ("" when none)."""

    TYPE: ClassVar[str] = ev.REJECTED
    stage: str  # "validation" | "admission" | "verification" | "pool" | "lease" | "explain"
    code: str
    field: str
    reason: str
    requested_tool_call_id: str = ""

    def to_payload(self) -> dict[str, Any]:
        return {"stage": self.stage, "code": self.code, "field": self.field, "reason": self.reason,
                "requestedToolCallId": self.requested_tool_call_id}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("stage", ""), p.get("code", ""), p.get("field", ""), p.get("reason", ""),
                   p.get("requestedToolCallId", ""))


@dataclass(frozen=True)
class ToolCallReplayed:
    """A retry under an accepted idempotency key, answered from the first call."""

    TYPE: ClassVar[str] = ev.REPLAYED
    principal: str
    idempotency_key: str
    attached: bool  # to the still running first call (else its record)

    def to_payload(self) -> dict[str, Any]:
        return {"principal": self.principal, "idempotencyKey": self.idempotency_key, "attached": self.attached}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("principal", ""), p.get("idempotencyKey", ""), p.get("attached", False))


@dataclass(frozen=True)
class ToolCallExpired:
    """Retention's tombstone: the call's artifacts (named here) and index rows are gone."""

    TYPE: ClassVar[str] = ev.EXPIRED
    period_days: float
    ended_at: str
    expired_at: str
    artifacts_removed: Sequence[RemovedArtifact] = ()
    reason: str = "retention"

    def to_payload(self) -> dict[str, Any]:
        return {"reason": self.reason, "periodDays": self.period_days, "endedAt": self.ended_at,
                "expiredAt": self.expired_at, "artifactsRemoved": [a.to_payload() for a in self.artifacts_removed]}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("periodDays", 0), p.get("endedAt", ""), p.get("expiredAt", ""),
                   tuple(RemovedArtifact.from_payload(a) for a in p.get("artifactsRemoved") or []
                         if isinstance(a, Mapping)), p.get("reason", "retention"))
