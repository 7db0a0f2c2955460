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
from sandboxd.policy.models import PreparedToolCall
from sandboxd_contract.canonical import canonical_json
from sandboxd.sandbox.protocol import SandboxHandle
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
    payload = bounded(request_summary(raw))
    payload["principal"] = principal
    payload["daemonId"] = daemon_id
    return [
        EventDraft(ev.REQUESTED, payload),
        EventDraft(ev.REJECTED, {"stage": stage, "code": exc.kind, "field": bounded(exc.field or ""),
                                 "reason": bounded(exc.reason), "requestedToolCallId": requested_id[:256]}),
    ]


def requested_payload(raw: Mapping[str, Any], call: PreparedToolCall, principal: str, daemon_id: str,
                      digest: str) -> dict[str, Any]:
    payload = request_summary(raw)
    if digest:
        payload["requestDigest"] = digest
    if not call.policy.audit.record_command:
        payload.pop("argv", None)
        payload["argvSha256"] = "sha256:" + hashlib.sha256(canonical_json(call.argv)).hexdigest()
    payload["principal"] = principal
    payload["daemonId"] = daemon_id
    return payload


def command_record(prepared: Prepared, principal: str, policy_digest: str) -> dict[str, Any]:
    """audit.recordCommand: what ran, where, as whom. Environment names only: values
    may be secrets, and the policy digest already pins them."""
    return {
        "argv": list(prepared.call.argv), "cwd": prepared.policy.cwd, "envNames": sorted(prepared.policy.env),
        "image": prepared.image, "imageDigest": prepared.image_digest, "backend": prepared.backend.name,
        "policyDigest": policy_digest, "principal": principal, "workspace": prepared.plan.workspace,
        "sandboxUser": f"{prepared.plan.uid}:{prepared.plan.gid}",
    }


def lease_fields(prepared: Prepared) -> dict[str, Any]:
    """A leased call's events name its lease."""
    return {"leaseId": prepared.call.runtime.lease_id} if prepared.lease is not None else {}


def accepted_drafts(raw: Mapping[str, Any], prepared: Prepared, principal: str, daemon_id: str, digest: str,
                    approved: str) -> list[EventDraft]:
    """ToolCallRequested, ToolArgsValidated and ToolPolicyChecked of an accepted call."""
    call, plan = prepared.call, prepared.plan
    policy_digest = prepared.policy.digest()
    return [
        EventDraft(ev.REQUESTED, requested_payload(raw, call, principal, daemon_id, digest)),
        EventDraft(ev.ARGS_VALIDATED, {
            "effectivePolicy": prepared.policy.to_json_dict(), "policyDigest": policy_digest}),
        EventDraft(ev.POLICY_CHECKED, {
            "decision": "allowed", "backend": prepared.backend.name, "image": prepared.image,
            # Named now (ToolSandboxPrepared may commit with the result): a crash
            # recovery finds the call's spooled output by it.
            "sandboxId": prepared.sandbox_id,
            **lease_fields(prepared),
            "authorization": ({"grantId": call.authorization.grant_id, "approvalDigest": approved,
                               "verified": True} if approved else {"status": call.authorization.status}),
            "imageDigest": prepared.image_digest, "uid": plan.uid, "gid": plan.gid,
            "workspace": plan.workspace,
            "binds": [[b.sandbox_path, "ro" if b.read_only else "rw"] for b in plan.binds],
            "masks": [m.sandbox_path for m in plan.masks], "notes": list(plan.notes),
            **({"command": command_record(prepared, principal, policy_digest)}
               if prepared.policy.record_command else {}),
        }),
    ]


def credential_drafts(secrets: tuple[ResolvedSecret, ...], principal: str) -> list[EventDraft]:
    return [EventDraft(ev.CREDENTIAL_INJECTED, {"bindingId": s.binding_id, "principal": principal,
                                                "target": s.target}) for s in secrets]


def sandbox_prepared_draft(prepared: Prepared, handle: SandboxHandle) -> EventDraft:
    return EventDraft(ev.SANDBOX_PREPARED, {
        "sandboxId": prepared.sandbox_id, "engineId": handle.engine_id, "backend": prepared.backend.name,
        # handle.spec: as it ran (nsjail on cgroup v2 may keep a spawn slot's cgroup).
        "specDigest": "sha256:" + hashlib.sha256(canonical_json(handle.spec.to_json_dict())).hexdigest(),
        **lease_fields(prepared),
    })


def started_draft(sandbox_id: str) -> EventDraft:
    """Its id is fixed now: the stream says "started" before it is committed."""
    return EventDraft(ev.STARTED, {"sandboxId": sandbox_id, "startedAt": ev.utc_now()}, ev.new_id("ev"))


def replayed_draft(principal: str, key: str, attached: bool) -> EventDraft:
    return EventDraft(ev.REPLAYED, {"principal": principal, "idempotencyKey": key, "attached": attached})


def lease_ended_draft(sandbox_id: str) -> EventDraft:
    """A lease a killed daemon held, ended at the next start."""
    return EventDraft(ev.SANDBOX_LEASE_ENDED, {"reason": "daemon-restarted", "sandboxId": sandbox_id})
