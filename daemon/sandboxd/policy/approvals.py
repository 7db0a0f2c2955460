"""Prepared-call verification: a `granted` call must carry a grant signed by a key the
daemon trusts, unexpired, over exactly this call (the approval digest recomputed here);
a `not_required` call must be a tool the daemon lets run without one. The canonical form
and the signature scheme live in sandboxd_contract.approval, shared with the clients that
make grants."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from sandboxd_contract.approval import (approval_digest, grant_signing_bytes, load_public_key, parse_signature,
                                      signature_valid)
from sandboxd_contract.calls import build_call

from sandboxd.core.errors import InvalidArgument, PermissionDenied
from sandboxd.policy.models import PreparedToolCall
from sandboxd.core.settings import ApprovalSettings


def verify_authorization(raw: Mapping[str, Any], call: PreparedToolCall, settings: ApprovalSettings) -> str:
    """Refuses (PermissionDenied naming the field) what was not approved; returns the
    approval digest of a verified grant ("" for a tool that needs none). Status and
    expiry are checked by policy.admission.check_admission."""
    auth = call.authorization
    if auth.status == "not_required":
        if not any(fnmatch.fnmatchcase(call.tool_id, p) for p in settings.tools_without_grant):
            raise PermissionDenied(f"tool {call.tool_id!r} needs a signed grant: the daemon does not let it run "
                                   "without one", field="authorization.status")
        return ""
    if auth.status != "granted":
        return ""  # check_admission refuses it with its own reason
    where = "authorization"
    for name, value in (("grantId", auth.grant_id), ("approvalDigest", auth.approval_digest),
                        ("expiresAt", auth.expires_at), ("signature", auth.signature)):
        if not value:
            raise PermissionDenied("a grant needs it", field=f"{where}.{name}")
    try:
        key_id, signature = parse_signature(auth.signature)
    except ValueError as exc:
        raise InvalidArgument(str(exc), field=f"{where}.signature") from None
    b64 = settings.public_keys.get(key_id)
    if b64 is None:
        raise PermissionDenied(f"no trusted approval key {key_id!r}", field=f"{where}.signature")
    message = grant_signing_bytes(auth.grant_id, auth.approval_digest, auth.expires_at, auth.approved_by,
                                  auth.approved_at)
    if not signature_valid(load_public_key(b64), signature, message):
        raise PermissionDenied(f"the grant's signature does not verify with key {key_id!r}",
                               field=f"{where}.signature")
    try:
        message = build_call(dict(raw))
    except json_format.ParseError as exc:
        # Only JSON handed to the executor directly can get here (gRPC input is typed).
        raise InvalidArgument(f"not a PreparedToolCall: {exc}", field="") from None
    digest = approval_digest(message)
    if digest != auth.approval_digest:
        raise PermissionDenied(f"the call differs from what was approved: its digest is {digest}, the grant's "
                               f"{auth.approval_digest}", field=f"{where}.approvalDigest")
    return digest
