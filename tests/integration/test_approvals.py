"""Prepared-call verification and per-principal quotas against a real daemon: a call runs
only as approved (signed grant over exactly its argv, cwd, workspace, policy and tool),
every refusal is in the trace, and one tenant's load never locks out another."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sandboxd_client import errors
from sandboxd_contract.approval import public_key_b64, sign_grant

from .conftest import BACKENDS, call, sh
from .test_tenants import ALICE, BOB, client_as

TOOL_MANAGER = Ed25519PrivateKey.generate()


def later(minutes: int = 10) -> str:
    return (datetime.now(timezone.utc) + timedelta(minutes=minutes)).isoformat(timespec="seconds").replace("+00:00", "Z")


@pytest.fixture
def strict(spare_daemon):
    """A daemon that trusts one Tool Manager key and runs nothing unsigned."""
    return spare_daemon(approvals={"public_keys": {"tm-1": public_key_b64(TOOL_MANAGER)}}).start()


def granted(ws, argv, policy=None, *, expires_at=None, key=TOOL_MANAGER, key_id="tm-1"):
    c = call(ws, argv, policy, tool_id="test.pytest")
    sign_grant(c, key, key_id=key_id, expires_at=expires_at or later(), approved_by="reviewer@example.test")
    return c


def rejection(client, tool_call_id: str) -> dict:
    trace = client.get_trace(tool_call_id)
    assert [e.type for e in trace] == ["ToolCallRequested", "ToolCallRejected"]
    rejected = json.loads(trace[-1].payload_json)
    assert rejected["requestedToolCallId"] == json.loads(trace[0].payload_json).get("toolCallId", "")
    return rejected


def test_a_signed_grant_runs_and_its_verification_is_recorded(strict):
    ws = strict.new_workspace()
    with strict.client() as c:
        out = c.run(granted(ws, sh("echo approved")))
        assert out.result.status == "success" and out.stdout == b"approved\n"
        checked = [json.loads(e.payload_json) for e in c.get_trace(out.tool_call_id) if e.type == "ToolPolicyChecked"][0]
        assert checked["authorization"]["verified"] is True
        assert checked["authorization"]["approvalDigest"].startswith("sha256:")


def test_a_call_approved_for_one_argv_is_refused_with_another(strict):
    ws = strict.new_workspace()
    approved = granted(ws, ["pytest", "-k", "a"])
    tampered = json.loads(json.dumps(approved))
    tampered["argv"] = ["pytest", "-k", "b"]
    tampered["toolCallId"] = "tc_tampered_argv_0001"
    with strict.client() as c:
        with pytest.raises(errors.PermissionDenied) as exc:
            c.run(tampered)
        assert "authorization.approvalDigest" in exc.value.message and "differs from what was approved" in exc.value.message
        refused = rejection(c, exc.value.tool_call_id)  # (never the id asked for: a refusal reserves none)
        assert refused["code"] == "PERMISSION_DENIED" and refused["field"] == "authorization.approvalDigest"


def test_a_wider_policy_than_approved_is_refused(strict):
    ws = strict.new_workspace()
    approved = granted(ws, sh("true"), {"process": {"timeoutMs": 5000}})
    approved["policy"]["process"]["timeoutMs"] = 600000
    with strict.client() as c, pytest.raises(errors.PermissionDenied) as exc:
        c.run(approved)
    assert "authorization.approvalDigest" in exc.value.message


def test_expired_unknown_key_and_forged_grants_are_refused(strict):
    ws = strict.new_workspace()
    forger = Ed25519PrivateKey.generate()
    cases = {
        "expired": (granted(ws, sh("true"), expires_at="2020-01-01T00:00:00Z"), "authorization.expiresAt"),
        "unknown key": (granted(ws, sh("true"), key_id="tm-9"), "authorization.signature"),
        "forged": (granted(ws, sh("true"), key=forger), "authorization.signature"),
    }
    extended = granted(ws, sh("true"))
    extended["authorization"]["expiresAt"] = later(60 * 24 * 365)  # stretched after signing
    cases["stretched expiry"] = (extended, "authorization.signature")
    with strict.client() as c:
        for name, (bad, field) in cases.items():
            bad["toolCallId"] = f"tc_refused_{name.replace(' ', '_')}"
            with pytest.raises(errors.PermissionDenied) as exc:
                c.run(bad)
            assert field in exc.value.message, (name, exc.value.message)
            assert rejection(c, exc.value.tool_call_id)["field"] == field, name


def test_a_grant_runs_one_call(strict):
    ws = strict.new_workspace()
    once = granted(ws, sh("echo once"))
    again = json.loads(json.dumps(once))
    again["toolCallId"] = "tc_grant_replayed_0001"
    with strict.client() as c:
        assert c.run(once).stdout == b"once\n"
        with pytest.raises(errors.PermissionDenied) as exc:
            c.run(again)
        assert "authorization.grantId" in exc.value.message and "already used" in exc.value.message
        assert rejection(c, exc.value.tool_call_id)["field"] == "authorization.grantId"


def test_unsigned_calls_run_only_for_tools_the_daemon_lets(spare_daemon):
    d = spare_daemon(approvals={"public_keys": {"tm-1": public_key_b64(TOOL_MANAGER)},
                                "unsigned_tools": ["readonly.*"]}).start()
    ws = d.new_workspace()
    with d.client() as c:
        ok = c.run(call(ws, ["true"], tool_id="readonly.ls"))
        assert ok.result.status == "success"
        with pytest.raises(errors.PermissionDenied) as exc:
            c.run(call(ws, ["true"], tool_id="shell.exec"))
        assert "authorization.status" in exc.value.message and "needs a signed grant" in exc.value.message


@pytest.mark.parametrize("adapter", BACKENDS)
def test_a_calls_slot_and_workspace_are_free_once_its_result_arrives(spare_daemon, adapter, docker_engine):
    # An agent sends its next call the moment it has a result: with one call allowed
    # and a writable workspace (which a writer holds alone), that call must be admitted.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = spare_daemon(quotas={"concurrent_calls": 8, "per_principal": {"root": 1}},
                     metrics_address=f"127.0.0.1:{port}").start()
    ws = d.new_workspace({"out/.keep": ""})
    writable = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]}}
    with d.client() as c:
        for i in range(12):
            r = c.run(call(ws, sh(f"echo {i} > /workspace/out/n"), writable,
                           runtime={"adapter": adapter, "image": "sandboxd/default:latest"}))
            assert r.result.status == "success", (i, r.result.error)
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert "sandboxd_calls_running 0" in metrics.splitlines(), i
    assert (ws / "out" / "n").read_text() == "11\n"


def test_a_principal_past_its_quota_is_refused_without_hurting_others(spare_daemon):
    d = spare_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, socket_mode=0o666,
                     quotas={"concurrent_calls": 8, "per_principal": {"alice": 1}}).start()
    alice_ws, bob_ws = d.new_workspace(uid=ALICE), d.new_workspace(uid=BOB)
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        first = alice.execute(call(alice_ws, ["sleep", "30"]))
        events = iter(first)
        next(events)  # accepted: it holds alice's one slot
        try:
            with pytest.raises(errors.ResourceExhausted) as exc:
                alice.run(call(alice_ws, ["true"]))
            assert "alice" in exc.value.message and "quota" in exc.value.message
            # Bob's calls run as if alice were idle.
            results = []
            threads = [threading.Thread(target=lambda: results.append(bob.run(call(bob_ws, ["true"]))))
                       for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert [r.result.status for r in results] == ["success"] * 3
        finally:
            first.cancel()
