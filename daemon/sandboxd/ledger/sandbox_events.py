"""The typed events of what a sandbox touched and held: its file and network accesses,
the credentials put into it, and its leases. As in call_events: a builder that writes
exactly the payload the log has always hashed, a reader that keeps values as they are.

File and network records are the large ones (a test run's thousands of reads): their
lists are held and written by reference, never copied."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from sandboxd_contract.canonical import file_accesses

from sandboxd.ledger import events as ev


_FILE_ACCESS_KEYS = ("accesses", "reads", "incomplete")


@dataclass(frozen=True)
class FileAccessObserved:
    """A batch of a call's file accesses: `accesses` (entries: path, operation, digests,
    ...), `reads` ([path, opens] of paths opened and never written), or, with an empty
    `accesses`, why the record is incomplete. Unset parts (None) are left out."""

    TYPE: ClassVar[str] = ev.FILE_ACCESS
    accesses: Sequence[Mapping[str, Any]] | None = None
    reads: Sequence[Sequence[Any]] | None = None
    incomplete: Sequence[str] | None = None
    # Keys no daemon writes any more, kept as read (an early daemon wrote one access per
    # event, the payload being the entry itself).
    older: Mapping[str, Any] | None = None

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = dict(self.older) if self.older is not None else {}
        if self.accesses is not None:
            payload["accesses"] = self.accesses
        if self.reads is not None:
            payload["reads"] = self.reads
        if self.incomplete is not None:
            payload["incomplete"] = self.incomplete
        return payload

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        older = {k: v for k, v in p.items() if k not in _FILE_ACCESS_KEYS}
        return cls(p.get("accesses"), p.get("reads"), p.get("incomplete"), older or None)

    def entries(self) -> list[dict[str, Any]]:
        """Every access as an entry ({"path", "operation", ...}), whichever form it was
        written in; malformed items are skipped (sandboxd_contract.canonical.file_accesses)."""
        return file_accesses(self.to_payload())


@dataclass(frozen=True)
class ConnectionAttempt:
    """One attempt through the egress proxy (egress.records.ConnectionRecord's record)."""

    protocol: str  # "http" | "connect" | "socks5"
    method: str
    host: str
    port: int
    address: str
    decision: str  # "allowed" | "denied"
    rule: str
    reason: str
    error: str
    status: int  # what the proxy answered the sandbox (200 for an established tunnel)
    bytes_up: int  # sandbox -> destination
    bytes_down: int  # destination -> sandbox
    started_at: str
    ended_at: str

    def to_payload(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol, "method": self.method, "host": self.host, "port": self.port,
            "address": self.address, "decision": self.decision, "rule": self.rule, "reason": self.reason,
            "error": self.error, "status": self.status, "bytesUp": self.bytes_up, "bytesDown": self.bytes_down,
            "startedAt": self.started_at, "endedAt": self.ended_at,
        }

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("protocol", ""), p.get("method", ""), p.get("host", ""), p.get("port", 0),
                   p.get("address", ""), p.get("decision", ""), p.get("rule", ""), p.get("reason", ""),
                   p.get("error", ""), p.get("status", 0), p.get("bytesUp", 0), p.get("bytesDown", 0),
                   p.get("startedAt", ""), p.get("endedAt", ""))


@dataclass(frozen=True)
class DestinationCount:
    """The attempts past a call's record to one destination with one decision."""

    host: str
    port: int
    decision: str
    attempts: int
    bytes_up: int
    bytes_down: int

    def to_payload(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "decision": self.decision, "attempts": self.attempts,
                "bytesUp": self.bytes_up, "bytesDown": self.bytes_down}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("host", ""), p.get("port", 0), p.get("decision", ""), p.get("attempts", 0),
                   p.get("bytesUp", 0), p.get("bytesDown", 0))


# Why attempts were counted rather than recorded, as the daemon writes it.
PAST_THE_RECORD = "more attempts than the call's record holds: the rest are counted by destination"


@dataclass(frozen=True)
class CountedAttempts:
    """The attempts a call's record had no room for: how many, why, and (since daemons
    count them) by destination."""

    dropped: int
    reason: str = PAST_THE_RECORD
    by_destination: Sequence[DestinationCount] | None = None

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"dropped": self.dropped, "reason": self.reason}
        if self.by_destination is not None:
            payload["byDestination"] = [d.to_payload() for d in self.by_destination]
        return payload

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        by = p.get("byDestination")
        return cls(p.get("dropped", 0), p.get("reason", ""),
                   None if by is None else tuple(DestinationCount.from_payload(d) for d in by
                                                 if isinstance(d, Mapping) and "host" in d))


@dataclass(frozen=True)
class NetworkAccessObserved:
    """Either one attempt through the egress proxy or the attempts counted past the
    call's record: exactly one of the two is set."""

    TYPE: ClassVar[str] = ev.NETWORK_ACCESS
    attempt: ConnectionAttempt | None = None
    counted: CountedAttempts | None = None

    def to_payload(self) -> dict[str, Any]:
        if self.attempt is not None:
            return self.attempt.to_payload()
        return self.counted.to_payload() if self.counted is not None else {}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        if "host" in p:
            return cls(attempt=ConnectionAttempt.from_payload(p))
        if "dropped" in p or "byDestination" in p:
            return cls(counted=CountedAttempts.from_payload(p))
        return cls()

    def destinations(self) -> Iterator[tuple[str, int, str]]:
        """(host, port, decision) of the attempt, or of each destination counted."""
        if self.attempt is not None:
            yield self.attempt.host, self.attempt.port, self.attempt.decision
        elif self.counted is not None:
            for d in self.counted.by_destination or ():
                yield d.host, d.port, d.decision


@dataclass(frozen=True)
class CredentialInjected:
    """A credential put into a sandbox: binding id, principal and target, never the value."""

    TYPE: ClassVar[str] = ev.CREDENTIAL_INJECTED
    binding_id: str
    principal: str
    target: Mapping[str, str]  # {"env": name} or {"file": path}

    def to_payload(self) -> dict[str, Any]:
        return {"bindingId": self.binding_id, "principal": self.principal, "target": self.target}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("bindingId", ""), p.get("principal", ""), p.get("target", {}))


@dataclass(frozen=True)
class SandboxLeased:
    """A warm sandbox leased to a principal (recorded under the lease id)."""

    TYPE: ClassVar[str] = ev.SANDBOX_LEASED
    principal: str
    sandbox_id: str
    pool_key: str
    backend: str
    workspace: str
    image: str
    image_digest: str
    expires_at: str

    def to_payload(self) -> dict[str, Any]:
        return {"principal": self.principal, "sandboxId": self.sandbox_id, "poolKey": self.pool_key,
                "backend": self.backend, "workspace": self.workspace, "image": self.image,
                "imageDigest": self.image_digest, "expiresAt": self.expires_at}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("principal", ""), p.get("sandboxId", ""), p.get("poolKey", ""), p.get("backend", ""),
                   p.get("workspace", ""), p.get("image", ""), p.get("imageDigest", ""), p.get("expiresAt", ""))


@dataclass(frozen=True)
class SandboxLeaseEnded:
    """The end of a lease: released, expired, drained, daemon-stopping, daemon-restarted."""

    TYPE: ClassVar[str] = ev.SANDBOX_LEASE_ENDED
    reason: str
    sandbox_id: str

    def to_payload(self) -> dict[str, Any]:
        return {"reason": self.reason, "sandboxId": self.sandbox_id}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("reason", ""), p.get("sandboxId", ""))


@dataclass(frozen=True)
class FilesTransferred:
    """A FileService transfer, its whole record (under the transfer's id): who, which way,
    where (the workspace, the lease), the path as the sandbox sees it, how it ended
    ("ok" | "refused" | "failed": then the error's code, field and reason), and each
    entry moved ({path, kind, mode, sizeBytes, sha256}; an upload's only if it landed; a
    download's file cut off or changed on the way: partial, with sentBytes and sentSha256)."""

    TYPE: ClassVar[str] = ev.FILES_TRANSFERRED
    principal: str
    direction: str  # "upload" | "download"
    workspace: str
    lease_id: str
    path: str
    status: str
    entries: Sequence[Mapping[str, Any]] = ()
    total_bytes: int = 0
    code: str = ""
    field: str = ""
    reason: str = ""

    def to_payload(self) -> dict[str, Any]:
        return {"principal": self.principal, "direction": self.direction, "workspace": self.workspace,
                "leaseId": self.lease_id, "path": self.path, "status": self.status,
                "entries": [dict(e) for e in self.entries], "totalBytes": self.total_bytes, "code": self.code,
                "field": self.field, "reason": self.reason}

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Self:
        return cls(p.get("principal", ""), p.get("direction", ""), p.get("workspace", ""), p.get("leaseId", ""),
                   p.get("path", ""), p.get("status", ""),
                   tuple(e for e in p.get("entries") or [] if isinstance(e, Mapping)), p.get("totalBytes", 0),
                   p.get("code", ""), p.get("field", ""), p.get("reason", ""))
