"""The events of a call's admission (ToolCallRequested, ToolArgsValidated,
ToolPolicyChecked, or the refusal), and of its sandbox's preparation and start: every
payload the calls package writes before the result (result.py has the rest)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from sandboxd.calls.prepare import Prepared
from sandboxd.core.errors import SandboxdError
from sandboxd.ledger import events as ev
from sandboxd.ledger.events import EventDraft
from sandboxd.ledger.event_types import (CheckedAuthorization, CommandRecord, CredentialInjected, SandboxLeaseEnded,
                                          ToolArgsValidated, ToolCallRejected, ToolCallReplayed, ToolCallRequested,
                                          ToolCallStarted, ToolPolicyChecked, ToolSandboxPrepared, draft)
from sandboxd.policy.models import PreparedToolCall
from sandboxd_contract.canonical import canonical_json
from sandboxd.sandbox.protocol import Sandbox
from sandboxd.secrets.broker import ResolvedSecret

# What a refusal keeps of a request's strings and lists (a refused request may be as
# large as a gRPC message: kept whole, each refusal grew the log by megabytes, forever).
REFUSAL_STRING_CHARS = 256
REFUSAL_LIST_ITEMS = 64


def bounded(value: Any) -> Any:
    """`value` with each long string cut to a prefix that names its length and digest,
    and each long list cut (the refusal's record of what was sent, not a copy)."""
    if isinstance(value, str):
        if len(value) <= REFUSAL_STRING_CHARS:
            return value
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{value[:REFUSAL_STRING_CHARS]}...[{len(value)} characters, sha256:{digest}]"
    if isinstance(value, Mapping):
        items = list(value.items())
        kept = {bounded(str(k)): bounded(v) for k, v in items[:REFUSAL_LIST_ITEMS]}
        if len(items) > REFUSAL_LIST_ITEMS:
            kept["..."] = f"{len(items) - REFUSAL_LIST_ITEMS} more entries"
        return kept
    if isinstance(value, (list, tuple)):
        kept_list = [bounded(v) for v in value[:REFUSAL_LIST_ITEMS]]
        if len(value) > REFUSAL_LIST_ITEMS:
            kept_list.append(f"...[{len(value) - REFUSAL_LIST_ITEMS} more items]")
        return kept_list
    if isinstance(value, (bytes, bytearray)):
        return f"[{len(value)} bytes, sha256:{hashlib.sha256(value).hexdigest()}]"
    return value


def request_summary(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What the trace keeps of a request: everything but stdin's bytes."""
    summary = {k: v for k, v in raw.items() if k != "stdin"}
    stdin = raw.get("stdin") or b""
    if isinstance(stdin, (bytes, bytearray)):
        summary["stdinBytes"] = len(stdin)
        summary["stdinSha256"] = "sha256:" + hashlib.sha256(stdin).hexdigest()
    return summary


def refusal_drafts(raw: Mapping[str, Any], principal: str, daemon_id: str, stage: str, exc: SandboxdError,
                   requested_id: str) -> list[EventDraft]:
    """ToolCallRequested (bounded) and ToolCallRejected."""
    return [
        draft(ToolCallRequested.of_request(bounded(request_summary(raw)), principal=principal, daemon_id=daemon_id)),
        draft(ToolCallRejected(stage, exc.kind, bounded(exc.field or ""), bounded(exc.reason), requested_id[:256])),
    ]


def requested_event(raw: Mapping[str, Any], call: PreparedToolCall, principal: str, daemon_id: str,
                    digest: str) -> ToolCallRequested:
    """An accepted request; its argv only as a digest when the policy records no commands."""
    argv_sha256 = None if call.policy.audit.record_command else (
        "sha256:" + hashlib.sha256(canonical_json(call.argv)).hexdigest())
    return ToolCallRequested.of_request(request_summary(raw), principal=principal, daemon_id=daemon_id,
                                        request_digest=digest or None, argv_sha256=argv_sha256)


def command_record(prepared: Prepared, principal: str, policy_digest: str) -> CommandRecord:
    """audit.recordCommand: what ran, where, as whom. Environment names only: values
    may be secrets, and the policy digest already pins them."""
    return CommandRecord(list(prepared.call.argv), prepared.policy.cwd, sorted(prepared.policy.env), prepared.image,
                         prepared.image_digest, prepared.backend.name, policy_digest, principal,
                         prepared.plan.workspace, f"{prepared.plan.uid}:{prepared.plan.gid}")


def lease_id(prepared: Prepared) -> str | None:
    """A leased call's events name its lease."""
    return prepared.call.runtime.lease_id if prepared.lease is not None else None


def accepted_drafts(raw: Mapping[str, Any], prepared: Prepared, principal: str, daemon_id: str, digest: str,
                    approved: str) -> list[EventDraft]:
    """ToolCallRequested, ToolArgsValidated and ToolPolicyChecked of an accepted call."""
    call, plan = prepared.call, prepared.plan
    policy_digest = prepared.policy.digest()
    authorization = (CheckedAuthorization.granted(call.authorization.grant_id, approved) if approved
                     else CheckedAuthorization(status=call.authorization.status))
    checked = ToolPolicyChecked(
        backend=prepared.backend.name, image=prepared.image,
        # Named now (ToolSandboxPrepared may commit with the result): a crash recovery
        # finds the call's spooled output by it.
        sandbox_id=prepared.sandbox_id, authorization=authorization, image_digest=prepared.image_digest,
        uid=plan.uid, gid=plan.gid, workspace=plan.workspace,
        binds=[[b.sandbox_path, "ro" if b.read_only else "rw"] for b in plan.binds],
        masks=[m.sandbox_path for m in plan.masks], notes=list(plan.notes), lease_id=lease_id(prepared),
        command=command_record(prepared, principal, policy_digest) if prepared.policy.record_command else None)
    return [draft(requested_event(raw, call, principal, daemon_id, digest)),
            draft(ToolArgsValidated(prepared.policy.to_json_dict(), policy_digest)),
            draft(checked)]


def credential_drafts(secrets: tuple[ResolvedSecret, ...], principal: str) -> list[EventDraft]:
    return [draft(CredentialInjected(s.binding_id, principal, s.target)) for s in secrets]


def sandbox_prepared_draft(prepared: Prepared, sandbox: Sandbox) -> EventDraft:
    # sandbox.spec: as it ran (nsjail on cgroup v2 may keep a spawn slot's cgroup).
    spec_digest = "sha256:" + hashlib.sha256(canonical_json(sandbox.spec.to_json_dict())).hexdigest()
    return draft(ToolSandboxPrepared(prepared.sandbox_id, sandbox.engine_id, prepared.backend.name, spec_digest,
                                     lease_id(prepared)))


def started_draft(sandbox_id: str) -> EventDraft:
    """Its id is fixed now: the stream says "started" before it is committed."""
    return draft(ToolCallStarted(sandbox_id, ev.utc_now()), ev.new_id("ev"))


def replayed_draft(principal: str, key: str, attached: bool) -> EventDraft:
    return draft(ToolCallReplayed(principal, key, attached))


def lease_ended_draft(sandbox_id: str) -> EventDraft:
    """A lease a killed daemon held, ended at the next start."""
    return draft(SandboxLeaseEnded("daemon-restarted", sandbox_id))
