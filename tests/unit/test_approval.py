"""Approval grants: the canonical approval view and digest (sandboxd_contract.approval),
the Ed25519 grant signature, and the daemon's verification of it (sandboxd.policy.approvals)
with ApprovalSettings. Pure: no Docker, no network."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from sandboxd.policy.approvals import verify_authorization
from sandboxd.core.errors import InvalidArgument, PermissionDenied, SandboxdError
from sandboxd.policy.admission import check_admission
from sandboxd.policy.models import parse_call
from sandboxd.api.messages import call_to_json
from sandboxd.core.settings import ApprovalSettings, DaemonSettings
from sandboxd_contract.approval import (
    SIGNATURE_PREFIX,
    approval_body,
    approval_digest,
    approval_view,
    format_signature,
    grant_signing_bytes,
    load_public_key,
    parse_signature,
    public_key_b64,
    sign_grant,
    signature_valid,
)
from sandboxd_contract.canonical import canonical_json
from sandboxd_contract.calls import build_call
from sandboxd_contract.pb import sandboxd_pb2 as pb

EXPIRES = "2099-01-01T00:00:00Z"
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


def make_call(**fields: Any) -> dict[str, Any]:
    """A PreparedToolCall in its JSON (camelCase) form, touching every approved part."""
    call: dict[str, Any] = {
        "toolCallId": "tc-1",
        "sessionId": "sess-1",
        "toolId": "test.shell",
        "toolVersion": "1",
        "argv": ["pytest", "-k", "a"],
        "cwd": "/workspace",
        "workspace": "/srv/ws/a",
        "policy": {
            "filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/tmp"]},
            "network": {"egress": "allowlist", "allowDomains": ["pypi.org"], "denyPrivateNetworks": True},
            "environment": {"inheritedEnv": ["LANG"], "injectedEnv": {"CI": "1"}},
            "process": {"timeoutMs": 5000, "maxMemoryMb": 256},
            "audit": {"recordCommand": True},
        },
        "credentialRefs": [{"bindingId": "b-1", "envName": "TOKEN"}],
        "runtime": {"idempotencyKey": "idem-1"},
        "authorization": {"status": "granted"},
    }
    call.update(fields)
    return call


def digest_of(call: dict[str, Any] | pb.PreparedToolCall) -> str:
    return approval_digest(build_call(call))


def refused(cls: type[SandboxdError], fn, *args, **kwargs) -> SandboxdError:
    with pytest.raises(SandboxdError) as info:
        fn(*args, **kwargs)
    exc = info.value
    assert type(exc) is cls, f"expected {cls.__name__}, got {type(exc).__name__}: {exc}"
    return exc


def verify(raw: dict[str, Any], settings: ApprovalSettings) -> str:
    return verify_authorization(raw, parse_call(raw), settings)


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def other_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def settings(key: Ed25519PrivateKey) -> ApprovalSettings:
    return ApprovalSettings(public_keys={"tm-1": public_key_b64(key)})


@pytest.fixture
def signed(key: Ed25519PrivateKey) -> dict[str, Any]:
    call = make_call()
    sign_grant(call, key, key_id="tm-1", expires_at=EXPIRES, approved_by="alice",
               approved_at="2098-12-31T00:00:00Z", grant_id="grant_1")
    return call


# ------------------------------------------------------------------ approval_view


def test_view_of_an_empty_message_is_empty():
    assert approval_view(pb.PreparedToolCall()) == {}
    assert approval_view(pb.SandboxPolicy()) == {}


def test_view_has_only_the_set_fields_under_their_json_names():
    policy = build_call(make_call(policy={
        "process": {"timeoutMs": 5000, "maxStdoutBytes": 0},  # zero: proto3 cannot tell it from unset
        "network": {"egress": "", "allowDomains": []},
        "environment": {"inheritedEnv": ["LANG"], "injectedEnv": {}, "secretEnvAllowed": False},
    })).policy
    assert approval_view(policy) == {
        "process": {"timeoutMs": 5000},
        "network": {},  # a set sub-message stays, even when empty
        "environment": {"inheritedEnv": ["LANG"]},
    }


def test_view_uses_camel_case_json_names():
    view = approval_view(build_call(make_call()))
    assert {"toolCallId", "sessionId", "toolId", "toolVersion", "credentialRefs"} <= view.keys()
    assert view["policy"]["network"] == {"egress": "allowlist", "allowDomains": ["pypi.org"], "denyPrivateNetworks": True}
    assert view["policy"]["filesystem"] == {"readRoots": ["/workspace"], "writeRoots": ["/tmp"]}
    assert view["policy"]["process"] == {"timeoutMs": 5000, "maxMemoryMb": 256}
    assert view["credentialRefs"] == [{"bindingId": "b-1", "envName": "TOKEN"}]
    assert view["runtime"] == {"idempotencyKey": "idem-1"}
    assert not any("_" in k for k in view["policy"]["process"])


@pytest.mark.parametrize("value", [4294967296, 2**53 + 1, 2**64 - 1])
def test_view_keeps_64_bit_integers_as_json_numbers(value: int):
    policy = build_call(make_call(policy={"process": {"maxStdoutBytes": value}})).policy
    view = approval_view(policy)
    got = view["process"]["maxStdoutBytes"]
    assert type(got) is int and got == value
    # Not the proto3-JSON string form: the canonical bytes hold the bare number.
    assert canonical_json(view) == b'{"process":{"maxStdoutBytes":%d}}' % value


def test_64_bit_integer_given_as_a_string_digests_like_the_number():
    as_number = make_call(policy={"process": {"maxStdoutBytes": 4294967296}})
    as_string = make_call(policy={"process": {"maxStdoutBytes": "4294967296"}})
    assert approval_view(build_call(as_string).policy) == {"process": {"maxStdoutBytes": 4294967296}}
    assert digest_of(as_number) == digest_of(as_string)


@pytest.mark.parametrize("value", [True, False])
def test_view_keeps_an_optional_bool_set_to_any_value(value: bool):
    policy = build_call(make_call(policy={"network": {"denyPrivateNetworks": value},
                                          "audit": {"recordCommand": value}})).policy
    view = approval_view(policy)
    assert view["network"] == {"denyPrivateNetworks": value}
    assert view["audit"] == {"recordCommand": value}


def test_view_omits_an_optional_bool_not_given():
    view = approval_view(build_call(make_call(policy={"network": {"egress": "open"}, "audit": {}})).policy)
    assert view == {"network": {"egress": "open"}, "audit": {}}
    assert "denyPrivateNetworks" not in view["network"]


def test_explicit_default_of_an_optional_bool_changes_the_digest():
    # Presence is part of the canonical form: "true" given and "true" by default differ.
    given = make_call(policy={"network": {"egress": "open", "denyPrivateNetworks": True}})
    absent = make_call(policy={"network": {"egress": "open"}})
    assert digest_of(given) != digest_of(absent)
    # ...even though the daemon's policy model reads both the same way.
    assert parse_call(given).policy == parse_call(absent).policy


def test_view_omits_a_plain_bool_at_its_default():
    off = approval_view(build_call(make_call(policy={"environment": {"secretEnvAllowed": False}})).policy)
    on = approval_view(build_call(make_call(policy={"environment": {"secretEnvAllowed": True}})).policy)
    assert off == {"environment": {}}
    assert on == {"environment": {"secretEnvAllowed": True}}


def test_view_renders_a_map_as_a_dict():
    env = {"B": "2", "A": "1", "EMPTY": ""}
    view = approval_view(build_call(make_call(policy={"environment": {"injectedEnv": env}})).policy)
    assert view == {"environment": {"injectedEnv": env}}
    assert type(view["environment"]["injectedEnv"]) is dict


def test_view_renders_repeated_fields_as_lists_in_order():
    call = make_call(argv=["b", "a", "b"], credentialRefs=[{"bindingId": "y"}, {"bindingId": "x", "filePath": "/run/x"}])
    view = approval_view(build_call(call))
    assert view["argv"] == ["b", "a", "b"] and type(view["argv"]) is list
    assert view["credentialRefs"] == [{"bindingId": "y"}, {"bindingId": "x", "filePath": "/run/x"}]
    assert type(view["policy"]["network"]["allowDomains"]) is list


def test_view_renders_bytes_as_base64():
    view = approval_view(build_call(make_call(stdin=b"\x00\xffabc")))
    assert view["stdin"] == base64.b64encode(b"\x00\xffabc").decode()


def test_set_but_empty_filesystem_is_distinct_from_unset():
    # A set filesystem section is taken literally (nothing visible): it must not
    # digest like the default one.
    unset = make_call(policy={})
    empty = make_call(policy={"filesystem": {}})
    assert approval_view(build_call(unset).policy) == {}
    assert approval_view(build_call(empty).policy) == {"filesystem": {}}
    assert digest_of(unset) != digest_of(empty)


# ------------------------------------------------------------------ approval_body / digest


def test_body_holds_exactly_the_approved_parts():
    body = approval_body(build_call(make_call(stdin=b"data")))
    assert body == {
        "argv": ["pytest", "-k", "a"],
        "stdinSha256": hashlib.sha256(b"data").hexdigest(),
        "cwd": "/workspace",
        "workspace": "/srv/ws/a",
        "image": build_call(make_call()).runtime.image,
        "toolId": "test.shell",
        "toolVersion": "1",
        "policy": approval_view(build_call(make_call()).policy),
        "credentialRefs": [{"bindingId": "b-1", "envName": "TOKEN"}],
    }


def test_body_always_has_every_key_even_when_empty():
    body = approval_body(build_call({"toolId": "t", "argv": ["true"], "workspace": "/w"}))
    assert body == {"argv": ["true"], "stdinSha256": hashlib.sha256(b"").hexdigest(), "cwd": "", "workspace": "/w",
                    "image": "", "toolId": "t", "toolVersion": "", "policy": {}, "credentialRefs": []}


def test_digest_is_sha256_of_the_canonical_body():
    message = build_call(make_call())
    digest = approval_digest(message)
    assert DIGEST_RE.fullmatch(digest)
    assert digest == "sha256:" + hashlib.sha256(canonical_json(approval_body(message))).hexdigest()


def _reversed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reversed(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed(v) for v in value]
    return value


def test_digest_is_stable_and_ignores_key_order():
    call = make_call(policy={**make_call()["policy"],
                             "environment": {"injectedEnv": {"A": "1", "B": "2", "C": "3"}}})
    first = digest_of(call)
    assert digest_of(copy.deepcopy(call)) == first
    assert digest_of(_reversed(call)) == first
    assert list(_reversed(call)) != list(call)  # the reordering did happen


def test_digest_is_the_same_for_the_message_and_its_json_form():
    call = make_call()
    assert approval_digest(build_call(call)) == digest_of(call)
    message = build_call(call)
    assert digest_of(call_to_json(message)) == approval_digest(message)


def test_snake_case_input_digests_like_camel_case():
    camel = make_call()
    snake = {("tool_id" if k == "toolId" else "tool_version" if k == "toolVersion" else k): v
             for k, v in camel.items()}
    assert digest_of(snake) == digest_of(camel)


def _set(path: str, value: Any):
    def mutate(call: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = call
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return mutate


APPROVED_CHANGES = {
    # The command's input and the image it runs in are part of what was approved.
    "stdin": _set("stdin", b"rm -rf /workspace\n"),
    "runtime.image": _set("runtime.image", "sandboxd/other:latest"),
    "argv last word": _set("argv", ["pytest", "-k", "b"]),
    "argv split differently": _set("argv", ["pytest", "-k a"]),
    "argv extra word": _set("argv", ["pytest", "-k", "a", "-x"]),
    "argv order": _set("argv", ["pytest", "a", "-k"]),
    "cwd": _set("cwd", "/workspace/sub"),
    "cwd cleared": _set("cwd", ""),
    "workspace": _set("workspace", "/srv/ws/b"),
    "toolId": _set("toolId", "test.other"),
    "toolVersion": _set("toolVersion", "2"),
    "filesystem.readRoots": _set("policy.filesystem.readRoots", ["/workspace", "/workspace/x"]),
    "filesystem.writeRoots": _set("policy.filesystem.writeRoots", ["/workspace"]),
    "filesystem.blockedPaths": _set("policy.filesystem.blockedPaths", ["/workspace/.git"]),
    "filesystem.tempDir": _set("policy.filesystem.tempDir", "/scratch"),
    "filesystem.cwd": _set("policy.filesystem.cwd", "/workspace/x"),
    "filesystem unset": _set("policy.filesystem", None),
    "network.egress": _set("policy.network.egress", "open"),
    "network.allowDomains entry": _set("policy.network.allowDomains", ["evil.example"]),
    "network.allowDomains added": _set("policy.network.allowDomains", ["pypi.org", "evil.example"]),
    "network.denyPrivateNetworks": _set("policy.network.denyPrivateNetworks", False),
    "environment.inheritedEnv": _set("policy.environment.inheritedEnv", ["LANG", "TZ"]),
    "environment.injectedEnv value": _set("policy.environment.injectedEnv", {"CI": "0"}),
    "environment.injectedEnv name": _set("policy.environment.injectedEnv", {"CJ": "1"}),
    "environment.injectedEnv added": _set("policy.environment.injectedEnv", {"CI": "1", "LD_PRELOAD": "/x.so"}),
    "environment.secretEnvAllowed": _set("policy.environment.secretEnvAllowed", True),
    "process.timeoutMs": _set("policy.process.timeoutMs", 5001),
    "process.maxMemoryMb": _set("policy.process.maxMemoryMb", 8192),
    "process.maxStdoutBytes": _set("policy.process.maxStdoutBytes", 1),
    "process.maxStderrBytes": _set("policy.process.maxStderrBytes", 1),
    "process.maxPids": _set("policy.process.maxPids", 1),
    "process.cpuMillicores": _set("policy.process.cpuMillicores", 1),
    "process.maxFileSizeMb": _set("policy.process.maxFileSizeMb", 1),
    "process.maxTmpSizeMb": _set("policy.process.maxTmpSizeMb", 1),
    "audit.recordCommand": _set("policy.audit.recordCommand", False),
    "audit.recordFileAccess": _set("policy.audit.recordFileAccess", False),
    "audit.recordNetworkAccess": _set("policy.audit.recordNetworkAccess", False),
    "credentialRefs binding": _set("credentialRefs", [{"bindingId": "b-2", "envName": "TOKEN"}]),
    "credentialRefs target": _set("credentialRefs", [{"bindingId": "b-1", "envName": "OTHER"}]),
    "credentialRefs added": _set("credentialRefs", [{"bindingId": "b-1", "envName": "TOKEN"}, {"bindingId": "b-2"}]),
    "credentialRefs removed": _set("credentialRefs", []),
}


@pytest.mark.parametrize("change", list(APPROVED_CHANGES), ids=list(APPROVED_CHANGES))
def test_digest_changes_with_every_approved_part(change: str):
    call = make_call()
    changed = copy.deepcopy(call)
    APPROVED_CHANGES[change](changed)
    assert changed != call
    assert digest_of(changed) != digest_of(call)


UNAPPROVED_CHANGES = {
    # The command's input and the image it runs in are part of what was approved.
    "toolCallId": _set("toolCallId", "tc-2"),
    "sessionId": _set("sessionId", "sess-2"),
    "runId": _set("runId", "run-2"),
    "parentEventId": _set("parentEventId", "ev-2"),
    "intentId": _set("intentId", "intent-2"),
    "proposedBy": _set("proposedBy", "mallory"),
    "authorization": _set("authorization", {"status": "not_required", "grantId": "g"}),
    "runtime.idempotencyKey": _set("runtime.idempotencyKey", "idem-2"),
    "runtime.adapter": _set("runtime.adapter", "nsjail"),
    "runtime.leaseId": _set("runtime.leaseId", "lease-1"),
}


@pytest.mark.parametrize("change", list(UNAPPROVED_CHANGES), ids=list(UNAPPROVED_CHANGES))
def test_digest_ignores_everything_outside_the_approval(change: str):
    # What approval_body leaves out: ids, authorization and the runtime knobs but the image.
    call = make_call()
    changed = copy.deepcopy(call)
    UNAPPROVED_CHANGES[change](changed)
    assert changed != call
    assert digest_of(changed) == digest_of(call)


# ------------------------------------------------------------------ grant signing bytes / signature text


def test_grant_signing_bytes_are_the_canonical_json_of_the_grant_fields():
    got = grant_signing_bytes("g-1", "sha256:ab", "2030-01-01T00:00:00Z", "alice", "2029-01-01T00:00:00Z")
    assert got == (b'{"approvalDigest":"sha256:ab","approvedAt":"2029-01-01T00:00:00Z","approvedBy":"alice",'
                   b'"expiresAt":"2030-01-01T00:00:00Z","grantId":"g-1"}')
    assert json.loads(got) == {"grantId": "g-1", "approvalDigest": "sha256:ab", "expiresAt": "2030-01-01T00:00:00Z",
                               "approvedBy": "alice", "approvedAt": "2029-01-01T00:00:00Z"}


def test_grant_signing_bytes_cover_every_field_and_keep_them_apart():
    base = ("g", "d", "e", "b", "a")
    variants = {base, ("g2", "d", "e", "b", "a"), ("g", "d2", "e", "b", "a"), ("g", "d", "e2", "b", "a"),
                ("g", "d", "e", "b2", "a"), ("g", "d", "e", "b", "a2"), ("g", "d", "e", "", "ba"),
                ("g", "d", "e", "ba", ""), ("gd", "", "e", "b", "a")}
    assert len({grant_signing_bytes(*v) for v in variants}) == len(variants)


def test_grant_signing_bytes_are_utf8_unescaped():
    assert "approvedBy\":\"zoë\"".encode() in grant_signing_bytes("g", "d", "e", "zoë", "")


def test_format_signature_shape_and_round_trip():
    raw = bytes(range(64))
    text = format_signature("tm-1", raw)
    assert text == "ed25519:tm-1:" + base64.b64encode(raw).decode()
    assert SIGNATURE_PREFIX == "ed25519"
    assert parse_signature(text) == ("tm-1", raw)


def test_parse_signature_keeps_colons_in_the_key_id():
    raw = b"\x01" * 64
    assert parse_signature("ed25519:a:b:" + base64.b64encode(raw).decode()) == ("a:b", raw)


GOOD_B64 = base64.b64encode(b"\xfb" * 64).decode()  # has '+' and '/'


@pytest.mark.parametrize("text", [
    "",
    "ed25519",
    "ed25519:",
    f"ed25519:{GOOD_B64}",                       # no key id
    f"ed25519::{GOOD_B64}",                      # empty key id
    f"rsa:tm-1:{GOOD_B64}",                      # wrong scheme
    f"Ed25519:tm-1:{GOOD_B64}",                  # scheme is case-sensitive
    f"tm-1:{GOOD_B64}",
    "ed25519:tm-1:not base64!",
    "ed25519:tm-1:" + GOOD_B64.replace("+", "-").replace("/", "_"),  # urlsafe alphabet
    "ed25519:tm-1:" + GOOD_B64[:-2],             # bad padding
    "ed25519:tm-1: " + GOOD_B64,                 # whitespace
    "ed25519:tm-1:" + base64.b64encode(b"\x00" * 63).decode(),
    "ed25519:tm-1:" + base64.b64encode(b"\x00" * 65).decode(),
    "ed25519:tm-1:",
])
def test_parse_signature_refuses_malformed_text(text: str):
    with pytest.raises(ValueError):
        parse_signature(text)


# ------------------------------------------------------------------ keys


def test_public_key_round_trip(key: Ed25519PrivateKey):
    b64 = public_key_b64(key)
    assert len(base64.b64decode(b64)) == 32
    loaded = load_public_key(b64)
    assert isinstance(loaded, Ed25519PublicKey)
    sig = key.sign(b"msg")
    assert signature_valid(loaded, sig, b"msg")


@pytest.mark.parametrize("b64", ["not base64!", base64.b64encode(b"\x00" * 31).decode(),
                                 base64.b64encode(b"\x00" * 33).decode(), ""])
def test_load_public_key_refuses_bad_keys(b64: str):
    with pytest.raises(ValueError):
        load_public_key(b64)


def test_signature_valid(key: Ed25519PrivateKey, other_key: Ed25519PrivateKey):
    pub = key.public_key()
    sig = key.sign(b"message")
    assert signature_valid(pub, sig, b"message") is True
    assert signature_valid(pub, sig, b"messagE") is False
    assert signature_valid(pub, bytes([sig[0] ^ 1]) + sig[1:], b"message") is False
    assert signature_valid(other_key.public_key(), sig, b"message") is False
    assert signature_valid(pub, other_key.sign(b"message"), b"message") is False


# ------------------------------------------------------------------ sign_grant


def test_sign_grant_fills_a_json_call_in_place(key: Ed25519PrivateKey):
    call = make_call(authorization={"status": "not_required"})
    before = copy.deepcopy(call)
    auth = sign_grant(call, key, key_id="tm-1", expires_at=EXPIRES, approved_by="alice")
    assert call["authorization"] == auth
    assert call["authorization"] is not auth
    assert {k: v for k, v in call.items() if k != "authorization"} == \
        {k: v for k, v in before.items() if k != "authorization"}
    assert set(auth) == {"status", "grantId", "approvalDigest", "expiresAt", "signature", "approvedBy"}
    assert auth["status"] == "granted"
    assert re.fullmatch(r"grant_[0-9a-f]{24}", auth["grantId"])
    assert auth["approvalDigest"] == digest_of(before)
    assert auth["expiresAt"] == EXPIRES and auth["approvedBy"] == "alice"
    key_id, raw = parse_signature(auth["signature"])
    assert key_id == "tm-1"
    assert signature_valid(key.public_key(), raw, grant_signing_bytes(
        auth["grantId"], auth["approvalDigest"], EXPIRES, "alice", ""))


def test_sign_grant_records_approved_at_and_a_given_grant_id(key: Ed25519PrivateKey):
    call = make_call()
    auth = sign_grant(call, key, key_id="k", expires_at=EXPIRES, approved_by="bob",
                      approved_at="2098-01-01T00:00:00Z", grant_id="grant_fixed")
    assert auth["grantId"] == "grant_fixed"
    assert auth["approvedAt"] == "2098-01-01T00:00:00Z"
    _, raw = parse_signature(auth["signature"])
    assert signature_valid(key.public_key(), raw, grant_signing_bytes(
        "grant_fixed", auth["approvalDigest"], EXPIRES, "bob", "2098-01-01T00:00:00Z"))


def test_sign_grant_makes_a_fresh_grant_id_each_time(key: Ed25519PrivateKey):
    a = sign_grant(make_call(), key, key_id="k", expires_at=EXPIRES, approved_by="x")
    b = sign_grant(make_call(), key, key_id="k", expires_at=EXPIRES, approved_by="x")
    assert a["grantId"] != b["grantId"]
    assert a["approvalDigest"] == b["approvalDigest"]


def test_sign_grant_is_deterministic_for_fixed_inputs(key: Ed25519PrivateKey):
    kw = dict(key_id="k", expires_at=EXPIRES, approved_by="x", grant_id="g")
    assert sign_grant(make_call(), key, **kw) == sign_grant(make_call(), key, **kw)


def test_sign_grant_leaves_stdin_of_the_json_call_alone(key: Ed25519PrivateKey):
    call = make_call(stdin=b"input")
    sign_grant(call, key, key_id="k", expires_at=EXPIRES, approved_by="x")
    assert call["stdin"] == b"input"


def test_sign_grant_fills_a_message_in_place(key: Ed25519PrivateKey, settings: ApprovalSettings):
    message = build_call(make_call(authorization={"status": "not_required", "signature": "stale"}))
    auth = sign_grant(message, key, key_id="tm-1", expires_at=EXPIRES, approved_by="alice",
                      approved_at="2098-01-01T00:00:00Z")
    a = message.authorization
    assert (a.status, a.grant_id, a.approval_digest, a.expires_at, a.signature, a.approved_by, a.approved_at) == (
        "granted", auth["grantId"], auth["approvalDigest"], EXPIRES, auth["signature"], "alice",
        "2098-01-01T00:00:00Z")
    assert auth["approvalDigest"] == approval_digest(message)
    # As the daemon receives it over gRPC.
    raw = call_to_json(message)
    assert verify(raw, settings) == auth["approvalDigest"]


def test_sign_grant_on_a_message_without_approved_at(key: Ed25519PrivateKey, settings: ApprovalSettings):
    message = build_call(make_call())
    auth = sign_grant(message, key, key_id="tm-1", expires_at=EXPIRES, approved_by="alice")
    assert "approvedAt" not in auth and message.authorization.approved_at == ""
    assert verify(call_to_json(message), settings) == auth["approvalDigest"]


# ------------------------------------------------------------------ verify_authorization: acceptance


def test_signed_json_call_verifies(signed: dict[str, Any], settings: ApprovalSettings):
    assert verify(signed, settings) == signed["authorization"]["approvalDigest"]
    assert verify(signed, settings) == digest_of(signed)


def test_signed_call_verifies_over_the_grpc_json_form(key: Ed25519PrivateKey, settings: ApprovalSettings):
    # The daemon gets MessageToDict output: 64-bit ints as strings, stdin as bytes.
    call = make_call(stdin=b"x")
    call["policy"]["process"]["maxStdoutBytes"] = 2**40
    auth = sign_grant(call, key, key_id="tm-1", expires_at=EXPIRES, approved_by="a")
    raw = call_to_json(build_call(call))
    assert raw["policy"]["process"]["maxStdoutBytes"] == str(2**40)
    assert raw["stdin"] == b"x"
    assert verify(raw, settings) == auth["approvalDigest"]


def test_unrelated_fields_may_change_after_signing(signed: dict[str, Any], settings: ApprovalSettings):
    for change in UNAPPROVED_CHANGES.values():
        raw = copy.deepcopy(signed)
        auth = raw["authorization"]
        change(raw)
        raw["authorization"] = auth
        assert verify(raw, settings) == auth["approvalDigest"]


def test_key_is_picked_by_its_id(key: Ed25519PrivateKey, other_key: Ed25519PrivateKey):
    settings = ApprovalSettings(public_keys={"tm-1": public_key_b64(other_key), "tm-2": public_key_b64(key)})
    call = make_call()
    sign_grant(call, key, key_id="tm-2", expires_at=EXPIRES, approved_by="alice")
    assert verify(call, settings) == digest_of(call)


def test_grant_without_approved_by_verifies(key: Ed25519PrivateKey, settings: ApprovalSettings):
    call = make_call()
    sign_grant(call, key, key_id="tm-1", expires_at=EXPIRES, approved_by="")
    assert verify(call, settings) == digest_of(call)


def test_verify_leaves_expiry_to_check_admission(key: Ed25519PrivateKey, settings: ApprovalSettings):
    call = make_call(credentialRefs=[])
    past = (datetime.now(timezone.utc) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    sign_grant(call, key, key_id="tm-1", expires_at=past, approved_by="alice")
    parsed = parse_call(call)
    assert verify_authorization(call, parsed, settings) == digest_of(call)
    exc = refused(PermissionDenied, check_admission, parsed)
    assert exc.field == "authorization.expiresAt"


def test_verified_unexpired_grant_passes_admission(key: Ed25519PrivateKey, settings: ApprovalSettings):
    call = make_call(credentialRefs=[])
    sign_grant(call, key, key_id="tm-1", expires_at=EXPIRES, approved_by="alice")
    parsed = parse_call(call)
    assert verify_authorization(call, parsed, settings)
    check_admission(parsed)


@pytest.mark.parametrize("status", ["", "pending", "GRANTED", "denied"])
def test_other_statuses_are_left_to_check_admission(status: str, settings: ApprovalSettings):
    call = make_call(authorization={"status": status}, credentialRefs=[])
    parsed = parse_call(call)
    assert verify_authorization(call, parsed, settings) == ""
    exc = refused(PermissionDenied, check_admission, parsed)
    assert exc.field == "authorization.status"


# ------------------------------------------------------------------ verify_authorization: refusals


@pytest.mark.parametrize("name", ["grantId", "approvalDigest", "expiresAt", "signature"])
@pytest.mark.parametrize("how", ["empty", "absent"])
def test_grant_missing_a_field_is_refused(name: str, how: str, signed: dict[str, Any], settings: ApprovalSettings):
    if how == "empty":
        signed["authorization"][name] = ""
    else:
        del signed["authorization"][name]
    exc = refused(PermissionDenied, verify, signed, settings)
    assert exc.field == f"authorization.{name}"


def test_missing_fields_are_reported_in_order(settings: ApprovalSettings):
    exc = refused(PermissionDenied, verify, make_call(authorization={"status": "granted"}), settings)
    assert exc.field == "authorization.grantId"


@pytest.mark.parametrize("text", [
    f"rsa:tm-1:{GOOD_B64}",
    f"ed25519:{GOOD_B64}",
    f"ed25519::{GOOD_B64}",
    "ed25519:tm-1:not base64!",
    "ed25519:tm-1:" + base64.b64encode(b"\x00" * 63).decode(),
    "ed25519:tm-1:" + base64.b64encode(b"\x00" * 65).decode(),
])
def test_malformed_signature_is_invalid_argument(text: str, signed: dict[str, Any], settings: ApprovalSettings):
    signed["authorization"]["signature"] = text
    exc = refused(InvalidArgument, verify, signed, settings)
    assert exc.field == "authorization.signature"


def test_unknown_key_id_is_refused(signed: dict[str, Any], settings: ApprovalSettings):
    _, raw = parse_signature(signed["authorization"]["signature"])
    signed["authorization"]["signature"] = format_signature("tm-9", raw)
    exc = refused(PermissionDenied, verify, signed, settings)
    assert exc.field == "authorization.signature"
    assert "tm-9" in exc.reason


def test_grant_is_refused_by_a_daemon_without_keys(signed: dict[str, Any]):
    exc = refused(PermissionDenied, verify, signed, ApprovalSettings())
    assert exc.field == "authorization.signature"


def test_signature_by_another_key_is_refused(other_key: Ed25519PrivateKey, settings: ApprovalSettings):
    call = make_call()
    sign_grant(call, other_key, key_id="tm-1", expires_at=EXPIRES, approved_by="mallory")
    exc = refused(PermissionDenied, verify, call, settings)
    assert exc.field == "authorization.signature"


def test_signature_moved_to_another_trusted_key_id_is_refused(key: Ed25519PrivateKey, other_key: Ed25519PrivateKey):
    settings = ApprovalSettings(public_keys={"tm-1": public_key_b64(key), "tm-2": public_key_b64(other_key)})
    call = make_call()
    sign_grant(call, key, key_id="tm-1", expires_at=EXPIRES, approved_by="alice")
    assert verify(call, settings)
    _, raw = parse_signature(call["authorization"]["signature"])
    call["authorization"]["signature"] = format_signature("tm-2", raw)
    exc = refused(PermissionDenied, verify, call, settings)
    assert exc.field == "authorization.signature"


def test_flipped_signature_bit_is_refused(signed: dict[str, Any], settings: ApprovalSettings):
    key_id, raw = parse_signature(signed["authorization"]["signature"])
    signed["authorization"]["signature"] = format_signature(key_id, raw[:-1] + bytes([raw[-1] ^ 0x80]))
    exc = refused(PermissionDenied, verify, signed, settings)
    assert exc.field == "authorization.signature"


GRANT_EDITS = {
    "expiresAt extended": ("expiresAt", "2199-01-01T00:00:00Z"),
    "approvedBy": ("approvedBy", "root"),
    "approvedBy removed": ("approvedBy", None),
    "approvedAt": ("approvedAt", "2098-12-31T00:00:01Z"),
    "approvedAt removed": ("approvedAt", None),
    "grantId": ("grantId", "grant_2"),
    "approvalDigest": ("approvalDigest", "sha256:" + "0" * 64),
}


@pytest.mark.parametrize("edit", list(GRANT_EDITS), ids=list(GRANT_EDITS))
def test_grant_fields_edited_after_signing_break_the_signature(edit: str, signed: dict[str, Any],
                                                               settings: ApprovalSettings):
    assert verify(signed, settings)
    name, value = GRANT_EDITS[edit]
    if value is None:
        del signed["authorization"][name]
    else:
        signed["authorization"][name] = value
    exc = refused(PermissionDenied, verify, signed, settings)
    assert exc.field == "authorization.signature"


@pytest.mark.parametrize("change", list(APPROVED_CHANGES), ids=list(APPROVED_CHANGES))
def test_call_changed_after_signing_fails_on_the_digest(change: str, signed: dict[str, Any],
                                                        settings: ApprovalSettings):
    # The grant itself is intact (its signature verifies), so the refusal is the digest's.
    APPROVED_CHANGES[change](signed)
    exc = refused(PermissionDenied, verify, signed, settings)
    assert exc.field == "authorization.approvalDigest"
    assert digest_of(signed) in exc.reason


def test_call_changed_with_a_recomputed_digest_fails_on_the_signature(signed: dict[str, Any],
                                                                      settings: ApprovalSettings):
    signed["argv"] = ["pytest", "-k", "b"]
    signed["authorization"]["approvalDigest"] = digest_of(signed)  # looks right, was not signed
    exc = refused(PermissionDenied, verify, signed, settings)
    assert exc.field == "authorization.signature"


def test_grant_of_one_call_does_not_verify_another(key: Ed25519PrivateKey, settings: ApprovalSettings):
    a = make_call()
    sign_grant(a, key, key_id="tm-1", expires_at=EXPIRES, approved_by="alice")
    b = make_call(argv=["pytest", "-k", "b"], authorization=dict(a["authorization"]))
    exc = refused(PermissionDenied, verify, b, settings)
    assert exc.field == "authorization.approvalDigest"


def test_digest_is_recomputed_from_raw_not_from_the_parsed_call(signed: dict[str, Any], settings: ApprovalSettings):
    # verify_authorization digests `raw`; the parsed call supplies only the authorization.
    changed = copy.deepcopy(signed)
    changed["argv"] = ["sh", "-c", "evil"]
    exc = refused(PermissionDenied, verify_authorization, changed, parse_call(signed), settings)
    assert exc.field == "authorization.approvalDigest"


def test_call_the_proto_mapping_refuses_is_refused_as_a_sandboxd_error(signed: dict[str, Any],
                                                                        settings: ApprovalSettings):
    signed["policy"]["environment"]["secretEnvAllowed"] = "true"
    parsed = parse_call(signed)  # the daemon's model accepts it
    assert parsed.policy.environment.secret_env_allowed is True
    # parse_call (pydantic, lax) accepts what the proto JSON mapping refuses: a clear
    # refusal, not a protobuf exception reported as INTERNAL.
    with pytest.raises(InvalidArgument):
        verify_authorization(signed, parsed, settings)


# ------------------------------------------------------------------ not_required


def test_not_required_runs_anything_on_a_daemon_without_keys():
    call = make_call(authorization={"status": "not_required"})
    assert verify(call, ApprovalSettings()) == ""


def test_not_required_is_refused_once_a_key_is_configured(settings: ApprovalSettings):
    exc = refused(PermissionDenied, verify, make_call(authorization={"status": "not_required"}), settings)
    assert exc.field == "authorization.status"
    assert "test.shell" in exc.reason


@pytest.mark.parametrize(("tool", "allowed"), [
    ("readonly.ls", True),
    ("readonly.", True),
    ("readonly.fs.cat", True),
    ("lint.ruff", True),
    ("lint.ruf", False),
    ("readonly", False),
    ("Readonly.ls", False),  # case-sensitive
    ("test.shell", False),
    ("xreadonly.ls", False),
])
def test_not_required_follows_the_unsigned_tool_patterns(tool: str, allowed: bool, key: Ed25519PrivateKey):
    settings = ApprovalSettings(public_keys={"tm-1": public_key_b64(key)},
                                unsigned_tools=("readonly.*", "lint.ruf?"))
    call = make_call(toolId=tool, authorization={"status": "not_required"})
    if allowed:
        assert verify(call, settings) == ""
    else:
        exc = refused(PermissionDenied, verify, call, settings)
        assert exc.field == "authorization.status"


def test_not_required_ignores_any_grant_fields_it_carries():
    call = make_call(authorization={"status": "not_required", "signature": "garbage", "grantId": "x"})
    assert verify(call, ApprovalSettings(unsigned_tools=("test.*",))) == ""


def test_empty_unsigned_tools_refuses_not_required_even_without_keys():
    exc = refused(PermissionDenied, verify, make_call(authorization={"status": "not_required"}),
                  ApprovalSettings(unsigned_tools=()))
    assert exc.field == "authorization.status"


def test_granted_call_is_still_verified_for_an_unsigned_tool(other_key: Ed25519PrivateKey, settings: ApprovalSettings):
    lenient = ApprovalSettings(public_keys=settings.public_keys, unsigned_tools=("*",))
    call = make_call()
    sign_grant(call, other_key, key_id="tm-1", expires_at=EXPIRES, approved_by="mallory")
    exc = refused(PermissionDenied, verify, call, lenient)
    assert exc.field == "authorization.signature"


# ------------------------------------------------------------------ ApprovalSettings


def test_tools_without_grant_defaults(key: Ed25519PrivateKey):
    b64 = public_key_b64(key)
    assert ApprovalSettings().tools_without_grant == ("*",)
    assert ApprovalSettings(public_keys={"tm-1": b64}).tools_without_grant == ()
    assert ApprovalSettings(public_keys={"tm-1": b64}, unsigned_tools=("ro.*",)).tools_without_grant == ("ro.*",)
    assert ApprovalSettings(unsigned_tools=()).tools_without_grant == ()
    assert ApprovalSettings(unsigned_tools=["a", "b"]).tools_without_grant == ("a", "b")


@pytest.mark.parametrize("key_id", ["", "tm:1", ":", "tm-1:"])
def test_settings_refuse_bad_key_ids(key_id: str, key: Ed25519PrivateKey):
    with pytest.raises(ValidationError):
        ApprovalSettings(public_keys={key_id: public_key_b64(key)})


@pytest.mark.parametrize("b64", ["", "not base64!", base64.b64encode(b"\x00" * 31).decode(),
                                 base64.b64encode(b"\x00" * 64).decode()])
def test_settings_refuse_bad_keys(b64: str):
    with pytest.raises(ValidationError):
        ApprovalSettings(public_keys={"tm-1": b64})


def test_settings_refuse_one_bad_key_among_good_ones(key: Ed25519PrivateKey):
    with pytest.raises(ValidationError):
        ApprovalSettings(public_keys={"tm-1": public_key_b64(key), "tm-2": "AAAA"})


def test_settings_refuse_unknown_fields():
    with pytest.raises(ValidationError):
        ApprovalSettings(unsigned_tool=("*",))


def test_settings_load_in_the_daemon_config(key: Ed25519PrivateKey):
    s = DaemonSettings.model_validate({"approvals": {"public_keys": {"tm-1": public_key_b64(key)},
                                                     "unsigned_tools": ["readonly.*"]}})
    assert s.approvals.tools_without_grant == ("readonly.*",)
    assert DaemonSettings().approvals.tools_without_grant == ("*",)
    with pytest.raises(ValidationError):
        DaemonSettings.model_validate({"approvals": {"public_keys": {"tm:1": public_key_b64(key)}}})


# ------------------------------------------------------------------ golden

# The canonical form frozen: a fixed key and a fixed call give this digest and this
# signature (Ed25519 is deterministic). If this test fails, the canonical encoding has
# changed and every grant made by other clients breaks: docs/CANONICAL.md must change
# with it (and the values below be recomputed on purpose, never just pasted over).
GOLDEN_SEED = bytes(range(32))
GOLDEN_PUBLIC_KEY = "A6EHv/POEL4dcN0Y50vAmWfk1jCbpQ1fHdyGZBJVMbg="
GOLDEN_CALL: dict[str, Any] = {
    "toolCallId": "tc-golden",
    "toolId": "test.shell",
    "toolVersion": "1",
    "argv": ["pytest", "-k", "naïve and not slow"],
    "cwd": "/workspace/src",
    "workspace": "/srv/ws/a",
    "policy": {
        "filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]},
        "network": {"egress": "allowlist", "allowDomains": ["pypi.org", "*.pythonhosted.org"],
                    "denyPrivateNetworks": True},
        "environment": {"injectedEnv": {"PYTHONHASHSEED": "0", "CI": "1"}},
        "process": {"timeoutMs": 120000, "maxStdoutBytes": 4294967296},
        "audit": {"recordFileAccess": False},
    },
    "credentialRefs": [{"bindingId": "pypi-token", "envName": "PYPI_TOKEN"}],
}
GOLDEN_BODY = (
    '{"argv":["pytest","-k","naïve and not slow"],'
    '"credentialRefs":[{"bindingId":"pypi-token","envName":"PYPI_TOKEN"}],'
    '"cwd":"/workspace/src","image":"",'
    '"policy":{"audit":{"recordFileAccess":false},'
    '"environment":{"injectedEnv":{"CI":"1","PYTHONHASHSEED":"0"}},'
    '"filesystem":{"readRoots":["/workspace"],"writeRoots":["/workspace/out"]},'
    '"network":{"allowDomains":["pypi.org","*.pythonhosted.org"],"denyPrivateNetworks":true,"egress":"allowlist"},'
    '"process":{"maxStdoutBytes":4294967296,"timeoutMs":120000}},'
    '"stdinSha256":"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",'
    '"toolId":"test.shell","toolVersion":"1","workspace":"/srv/ws/a"}'
).encode()
GOLDEN_DIGEST = "sha256:733f96d136d93e736c9b5e32d2964aaa85cab901dcf7b185054e30020010e9ee"
GOLDEN_SIGNATURE = ("ed25519:tm-1:cJyuBhYLru2mVE6LjB/SvTJvwwKvmeVFkW/3ZDR2VlQJJ9OMiDEgAieE+KAPk86m3zNxbkOa33rk25OIuCyRDw==")


def test_golden_digest_and_signature():
    key = Ed25519PrivateKey.from_private_bytes(GOLDEN_SEED)
    assert public_key_b64(key) == GOLDEN_PUBLIC_KEY
    message = build_call(GOLDEN_CALL)
    assert canonical_json(approval_body(message)) == GOLDEN_BODY
    assert "sha256:" + hashlib.sha256(GOLDEN_BODY).hexdigest() == GOLDEN_DIGEST
    assert approval_digest(message) == GOLDEN_DIGEST

    assert grant_signing_bytes("grant_golden", GOLDEN_DIGEST, "2030-01-01T00:00:00Z", "alice",
                               "2029-12-31T23:00:00Z") == (
        b'{"approvalDigest":"' + GOLDEN_DIGEST.encode() + b'","approvedAt":"2029-12-31T23:00:00Z",'
        b'"approvedBy":"alice","expiresAt":"2030-01-01T00:00:00Z","grantId":"grant_golden"}')

    call = copy.deepcopy(GOLDEN_CALL)
    auth = sign_grant(call, key, key_id="tm-1", expires_at="2030-01-01T00:00:00Z", approved_by="alice",
                      approved_at="2029-12-31T23:00:00Z", grant_id="grant_golden")
    assert auth == {
        "status": "granted",
        "grantId": "grant_golden",
        "approvalDigest": GOLDEN_DIGEST,
        "expiresAt": "2030-01-01T00:00:00Z",
        "signature": GOLDEN_SIGNATURE,
        "approvedBy": "alice",
        "approvedAt": "2029-12-31T23:00:00Z",
    }
    settings = ApprovalSettings(public_keys={"tm-1": GOLDEN_PUBLIC_KEY})
    assert verify(call, settings) == GOLDEN_DIGEST
