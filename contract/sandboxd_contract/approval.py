"""Approval grants: the canonical form of what a human (or a Tool Manager) approved, its
digest, and the Ed25519 signature over the grant. The daemon verifies with exactly these
functions, so a grant made here verifies there byte for byte. docs/CANONICAL.md states
the encoding for other languages.

    call = {...}                                   # a PreparedToolCall, JSON form
    key = Ed25519PrivateKey.generate()
    sign_grant(call, key, key_id="tm-1", expires_at="2026-12-31T00:00:00Z", approved_by="alice")
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from sandboxd_contract.canonical import canonical_json
from sandboxd_contract.pb import sandboxd_pb2 as pb

SIGNATURE_PREFIX = "ed25519"


def approval_view(message: Message) -> dict[str, Any]:
    """A message as the approval digest sees it: every field that is set (proto3
    presence: non-zero scalars, non-empty lists and maps, set optional fields and
    sub-messages), keyed by its JSON name; integers as JSON numbers, bytes as base64."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        out[field.json_name] = _value(field, value)
    return out


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return approval_view(value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    if field.type == FieldDescriptor.TYPE_ENUM:
        return int(value)
    return value


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        return {str(k): _scalar(value_field, v) for k, v in value.items()}
    if field.is_repeated:
        return [_scalar(field, v) for v in value]
    return _scalar(field, value)


def approval_body(call: pb.PreparedToolCall) -> dict[str, Any]:
    """What a grant approves: the command and its input, where it runs, in which image,
    under which policy, as which tool, with which credentials. Ids, authorization and
    the other runtime knobs (backend, idempotency key) are not in it."""
    return {
        "argv": list(call.argv),
        "stdinSha256": hashlib.sha256(call.stdin).hexdigest(),
        "cwd": call.cwd,
        "workspace": call.workspace,
        "image": call.runtime.image,
        "toolId": call.tool_id,
        "toolVersion": call.tool_version,
        "policy": approval_view(call.policy),
        "credentialRefs": [approval_view(r) for r in call.credential_refs],
    }


def approval_digest(call: pb.PreparedToolCall) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(approval_body(call))).hexdigest()


def grant_signing_bytes(grant_id: str, approval_digest_: str, expires_at: str, approved_by: str,
                        approved_at: str) -> bytes:
    """The bytes the signature covers: the grant's own fields, so that none of them
    (least of all the expiry) can be changed without breaking it."""
    return canonical_json({"grantId": grant_id, "approvalDigest": approval_digest_, "expiresAt": expires_at,
                           "approvedBy": approved_by, "approvedAt": approved_at})


def format_signature(key_id: str, signature: bytes) -> str:
    return f"{SIGNATURE_PREFIX}:{key_id}:{base64.b64encode(signature).decode()}"


def parse_signature(text: str) -> tuple[str, bytes]:
    """(key id, raw signature) of "ed25519:<key id>:<base64>"; ValueError otherwise."""
    scheme, sep, rest = text.partition(":")
    key_id, sep2, b64 = rest.rpartition(":")
    if scheme != SIGNATURE_PREFIX or not sep or not sep2 or not key_id:
        raise ValueError("not of the form ed25519:<key id>:<base64 signature>")
    try:
        raw = base64.b64decode(b64, validate=True)
    except ValueError:
        raise ValueError("the signature is not base64") from None
    if len(raw) != 64:
        raise ValueError("an Ed25519 signature is 64 bytes")
    return key_id, raw


def load_public_key(b64: str) -> Ed25519PublicKey:
    raw = base64.b64decode(b64, validate=True)
    return Ed25519PublicKey.from_public_bytes(raw)


def public_key_b64(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def signature_valid(public_key: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        public_key.verify(signature, message)
        return True
    except InvalidSignature:
        return False


def sign_grant(call: dict[str, Any] | pb.PreparedToolCall, key: Ed25519PrivateKey, *, key_id: str,
               expires_at: str, approved_by: str, approved_at: str = "", grant_id: str = "") -> dict[str, Any]:
    """Fills `call`'s authorization with a signed grant for exactly this call (a JSON
    call is updated in place; a message too) and returns the authorization's JSON."""
    from sandboxd_contract.calls import build_call  # the JSON form goes through the same proto mapping as the wire

    message = build_call(call)
    digest = approval_digest(message)
    grant_id = grant_id or "grant_" + secrets.token_hex(12)
    signature = key.sign(grant_signing_bytes(grant_id, digest, expires_at, approved_by, approved_at))
    auth = {"status": "granted", "grantId": grant_id, "approvalDigest": digest, "expiresAt": expires_at,
            "signature": format_signature(key_id, signature), "approvedBy": approved_by}
    if approved_at:
        auth["approvedAt"] = approved_at
    if isinstance(call, dict):
        call["authorization"] = dict(auth)
    else:
        a = call.authorization
        a.status, a.grant_id, a.approval_digest, a.expires_at = "granted", grant_id, digest, expires_at
        a.signature, a.approved_by, a.approved_at = auth["signature"], approved_by, approved_at
    return auth
