"""sandboxd.ledger.event_types: one definition per event type. Every payload of the golden
log (written by the daemon before the types existed) read through its type and written
again must give the same canonical bytes; each type's optional keys are left out when
unset and kept when set; the builders write what the daemon has always written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sandboxd_contract.canonical import canonical_json

from sandboxd.egress.records import ConnectionRecord
from sandboxd.ledger import events as ev
from sandboxd.ledger.event_types import (EVENT_TYPES, ArtifactPersisted, CheckedAuthorization, CommandRecord,
                                         ConnectionAttempt, CountedAttempts, CredentialInjected, DestinationCount,
                                         FileAccessObserved, NetworkAccessObserved, OutputDigest, RemovedArtifact,
                                         SandboxLeased, SandboxLeaseEnded, ToolArgsValidated, ToolCallExpired,
                                         ToolCallFinished, ToolCallRejected, ToolCallReplayed, ToolCallRequested,
                                         ToolCallStarted, ToolPolicyChecked, ToolResultValidated,
                                         ToolSandboxPrepared, draft, read, read_payload)
from sandboxd.ledger.events import EventLog
from sandboxd.ledger.store import Database

GOLDEN_LOG = Path(__file__).resolve().parent / "golden" / "events" / "log.jsonl"


def golden_rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in GOLDEN_LOG.read_text().splitlines() if line.strip()]


def rewritten(type_name: str, payload: dict[str, Any]) -> bytes:
    """The payload read through its type and written again, canonical."""
    return canonical_json(read_payload(type_name, payload).to_payload())


# ------------------------------------------------------------------ the golden log


@pytest.mark.parametrize("row", golden_rows(), ids=lambda r: f"{r['seq']}-{r['type']}")
def test_every_golden_payload_reads_and_writes_back_byte_for_byte(row):
    assert rewritten(row["type"], json.loads(row["payload_json"])).decode() == row["payload_json"]


def test_every_registered_type_is_in_the_golden_log_and_no_other():
    assert {r["type"] for r in golden_rows()} == set(EVENT_TYPES)


def test_every_event_name_the_log_module_defines_is_registered():
    names = {v for k, v in vars(ev).items() if k.isupper() and isinstance(v, str) and v[:1].isupper()
             and k != "GENESIS_HASH"}
    assert names == set(EVENT_TYPES)
    assert all(cls.TYPE == name for name, cls in EVENT_TYPES.items())


def test_each_golden_shape_of_a_type_survives_its_type():
    """Each distinct key set a type has in the golden log (its optional keys present and
    absent) is written back with exactly those keys."""
    seen: dict[tuple[str, frozenset[str]], dict[str, Any]] = {}
    for r in golden_rows():
        payload = json.loads(r["payload_json"])
        seen.setdefault((r["type"], frozenset(payload)), payload)
    for (type_name, keys), payload in seen.items():
        assert set(read_payload(type_name, payload).to_payload()) == keys, type_name


def test_a_logged_event_reads_back_as_the_event_drafted(tmp_path):
    db = Database(tmp_path / "db.sqlite")
    try:
        log = EventLog(db)
        sent = [ToolCallStarted("sbx_1", "2024-05-01T10:00:00.000000Z"), SandboxLeaseEnded("released", "sbx_1"),
                ToolCallReplayed("alice", "k-1", True)]
        logged = log.record("tc_1", "", [draft(e) for e in sent])
        assert [read(e) for e in logged] == sent
        assert [e.type for e in logged] == [ev.STARTED, ev.SANDBOX_LEASE_ENDED, ev.REPLAYED]
    finally:
        db.close()


def test_draft_keeps_a_given_event_id_and_otherwise_leaves_it_to_the_log():
    assert draft(ToolCallStarted("s", "t"), "ev_fixed").event_id == "ev_fixed"
    assert draft(ToolCallStarted("s", "t")).event_id == ""


def test_a_type_no_daemon_writes_is_refused():
    with pytest.raises(KeyError):
        read_payload("SomethingElse", {})


@pytest.mark.parametrize("type_name", sorted(EVENT_TYPES))
def test_a_reader_takes_an_empty_payload(type_name):
    """An old or edited log may lack any key: reading never raises."""
    assert isinstance(read_payload(type_name, {}).to_payload(), dict)


# ------------------------------------------------------------------ optional keys, present and absent


def round_trip(event: Any) -> Any:
    payload = json.loads(canonical_json(event.to_payload()))
    again = type(event).from_payload(payload)
    assert canonical_json(again.to_payload()) == canonical_json(payload)
    return payload


SUMMARY = {"toolId": "t", "argv": ["echo", "hi"], "workspace": "/ws", "runtime": {"adapter": "docker"},
           "stdinBytes": 0, "stdinSha256": "sha256:e3"}


def test_requested_keeps_the_request_and_writes_the_daemon_keys_last():
    payload = round_trip(ToolCallRequested.of_request({**SUMMARY, "principal": "spoofed"}, principal="alice",
                                                       daemon_id="sd-1"))
    assert payload == {**SUMMARY, "principal": "alice", "daemonId": "sd-1"}


def test_requested_with_a_digest_and_an_argv_digest_in_place_of_the_argv():
    payload = round_trip(ToolCallRequested.of_request(SUMMARY, principal="alice", daemon_id="sd-1",
                                                      request_digest="sha256:rq", argv_sha256="sha256:av"))
    assert "argv" not in payload
    assert payload["requestDigest"] == "sha256:rq" and payload["argvSha256"] == "sha256:av"


def test_requested_without_stdin_keys_writes_none():
    payload = round_trip(ToolCallRequested.of_request({"toolId": 7}, principal="p", daemon_id="d"))
    assert payload == {"toolId": 7, "principal": "p", "daemonId": "d"}


def test_requested_reads_only_an_argv_of_strings():
    assert ToolCallRequested.from_payload({"argv": ["a", "b"]}).argv == ["a", "b"]
    assert ToolCallRequested.from_payload({"argv": ["a", 1]}).argv is None
    assert ToolCallRequested.from_payload({"argv": "rm -rf /"}).argv is None
    assert ToolCallRequested.from_payload({"toolId": 7}).tool_id == "7"


def policy_checked(**changes: Any) -> ToolPolicyChecked:
    base: dict[str, Any] = dict(backend="docker", image="img", sandbox_id="sbx", image_digest="sha256:i",
                                authorization=CheckedAuthorization(status="not_required"), uid=1000, gid=1001,
                                workspace="/ws", binds=(("/workspace", "ro"),), masks=("/workspace/.env",),
                                notes=("n",))
    return ToolPolicyChecked(**{**base, **changes})


def test_policy_checked_leaves_out_the_lease_and_command_when_unset():
    payload = round_trip(policy_checked())
    assert "leaseId" not in payload and "command" not in payload
    assert payload["binds"] == [["/workspace", "ro"]] and payload["authorization"] == {"status": "not_required"}
    assert payload["decision"] == "allowed"


def test_policy_checked_with_a_lease_a_grant_and_the_command():
    command = CommandRecord(("echo",), "/workspace", ("HOME", "PATH"), "img", "sha256:i", "docker", "sha256:p",
                            "alice", "/ws", "1000:1001")
    payload = round_trip(policy_checked(lease_id="lease_1", command=command,
                                        authorization=CheckedAuthorization.granted("g-1", "sha256:a")))
    assert payload["leaseId"] == "lease_1"
    assert payload["authorization"] == {"grantId": "g-1", "approvalDigest": "sha256:a", "verified": True}
    assert payload["command"] == {"argv": ["echo"], "cwd": "/workspace", "envNames": ["HOME", "PATH"],
                                  "image": "img", "imageDigest": "sha256:i", "backend": "docker",
                                  "policyDigest": "sha256:p", "principal": "alice", "workspace": "/ws",
                                  "sandboxUser": "1000:1001"}
    assert ToolPolicyChecked.from_payload(payload).command == CommandRecord.from_payload(payload["command"])


def test_sandbox_prepared_names_its_lease_only_when_leased():
    assert "leaseId" not in round_trip(ToolSandboxPrepared("sbx", "eng", "docker", "sha256:s"))
    assert round_trip(ToolSandboxPrepared("sbx", "eng", "docker", "sha256:s", "lease_1"))["leaseId"] == "lease_1"


def test_finished_in_full_and_interrupted():
    full = ToolCallFinished(0, "", False, False, False, "", {"latencyMs": 5}, OutputDigest(3, 3, "sha256:o"),
                            OutputDigest(0, 0, "sha256:e"))
    payload = round_trip(full)
    assert set(payload) == {"exitCode", "signal", "timedOut", "oomKilled", "cancelled", "failure", "usage",
                            "stdout", "stderr"}
    assert payload["stdout"] == {"producedBytes": 3, "storedBytes": 3, "sha256": "sha256:o"}
    assert round_trip(ToolCallFinished.interrupted_call()) == {"interrupted": True, "exitCode": -1}


def test_result_validated_reads_status_exit_code_and_error():
    typed = ToolResultValidated({"status": "error", "exitCode": -1, "error": {"code": "TIMEOUT"}})
    assert round_trip(typed) == {"result": {"status": "error", "exitCode": -1, "error": {"code": "TIMEOUT"}}}
    assert (typed.status, typed.exit_code, typed.error_code) == ("error", -1, "TIMEOUT")
    empty = ToolResultValidated.from_payload({"result": None})
    assert (empty.status, empty.exit_code, empty.error_code) == ("error", None, "")


def test_the_fixed_shapes_write_every_key():
    assert round_trip(ToolArgsValidated({"timeoutMs": 1}, "sha256:p")) == {
        "effectivePolicy": {"timeoutMs": 1}, "policyDigest": "sha256:p"}
    assert round_trip(ArtifactPersisted("art_1", "stdout", "sha256:c", 3)) == {
        "artifactId": "art_1", "kind": "stdout", "contentHash": "sha256:c", "sizeBytes": 3}
    assert round_trip(ToolCallRejected("admission", "RESOURCE_EXHAUSTED", "", "quota")) == {
        "stage": "admission", "code": "RESOURCE_EXHAUSTED", "field": "", "reason": "quota",
        "requestedToolCallId": ""}
    assert round_trip(ToolCallReplayed("alice", "k", False)) == {
        "principal": "alice", "idempotencyKey": "k", "attached": False}
    assert round_trip(CredentialInjected("b-1", "alice", {"env": "TOKEN"})) == {
        "bindingId": "b-1", "principal": "alice", "target": {"env": "TOKEN"}}
    assert round_trip(SandboxLeased("alice", "sbx", "pk", "docker", "/ws", "img", "sha256:i", "2024")) == {
        "principal": "alice", "sandboxId": "sbx", "poolKey": "pk", "backend": "docker", "workspace": "/ws",
        "image": "img", "imageDigest": "sha256:i", "expiresAt": "2024"}
    assert round_trip(SandboxLeaseEnded("expired", "sbx")) == {"reason": "expired", "sandboxId": "sbx"}


@pytest.mark.parametrize("period_days", [30, 0.5])
def test_expired_keeps_the_period_as_written_and_names_each_artifact(period_days):
    payload = round_trip(ToolCallExpired(period_days, "t0", "t1", (RemovedArtifact("art_1", "stdout", "sha256:c", 3),)))
    assert payload == {"reason": "retention", "periodDays": period_days, "endedAt": "t0", "expiredAt": "t1",
                       "artifactsRemoved": [{"artifactId": "art_1", "kind": "stdout", "contentHash": "sha256:c",
                                             "sizeBytes": 3}]}
    # 30 stays "30", never "30.0": the bytes are the log's.
    assert canonical_json(ToolCallExpired.from_payload(payload).to_payload()) == canonical_json(payload)
    assert round_trip(ToolCallExpired(1.0, "t0", "t1"))["artifactsRemoved"] == []


@pytest.mark.parametrize("payload", [
    {"accesses": [{"path": "/workspace/a", "operation": "write"}]},
    {"reads": [["/workspace/r", 2]]},
    {"accesses": [], "incomplete": ["the watch overflowed"]},
    {"path": "/workspace/w", "operation": "write"},  # an early daemon's single access
    {"dropped": 12, "reason": "too many"},
])
def test_file_access_writes_back_each_form(payload):
    assert rewritten(ev.FILE_ACCESS, payload) == canonical_json(payload)


def test_file_access_entries_in_every_form():
    typed = FileAccessObserved.from_payload({"accesses": [{"path": "/a", "operation": "create"}, "junk"],
                                             "reads": [["/r", 2], ["bad"]]})
    assert typed.entries() == [{"path": "/a", "operation": "create"}, {"path": "/r", "operation": "read", "opens": 2}]
    assert FileAccessObserved.from_payload({"path": "/w", "operation": "write"}).entries() == [
        {"path": "/w", "operation": "write"}]
    assert FileAccessObserved(reads=[["/r", 1]]).to_payload() == {"reads": [["/r", 1]]}


def test_a_large_record_is_held_by_reference_not_copied():
    reads = [[f"/workspace/f{i}", 1] for i in range(3000)]
    assert FileAccessObserved(reads=reads).to_payload()["reads"] is reads


ATTEMPT = ConnectionAttempt("connect", "CONNECT", "files.test", 443, "192.0.2.1", "allowed", "allowDomains", "",
                            "", 200, 10, 20, "t0", "t1")


def test_network_one_attempt():
    payload = round_trip(NetworkAccessObserved(attempt=ATTEMPT))
    assert payload == {"protocol": "connect", "method": "CONNECT", "host": "files.test", "port": 443,
                       "address": "192.0.2.1", "decision": "allowed", "rule": "allowDomains", "reason": "",
                       "error": "", "status": 200, "bytesUp": 10, "bytesDown": 20, "startedAt": "t0", "endedAt": "t1"}
    assert list(NetworkAccessObserved.from_payload(payload).destinations()) == [("files.test", 443, "allowed")]


def test_network_counted_past_the_record_as_the_daemon_writes_it():
    [golden] = [json.loads(r["payload_json"]) for r in golden_rows()
                if r["type"] == ev.NETWORK_ACCESS and "dropped" in r["payload_json"]]
    by = tuple(DestinationCount(d["host"], d["port"], d["decision"], d["attempts"], d["bytesUp"], d["bytesDown"])
               for d in golden["byDestination"])
    built = NetworkAccessObserved(counted=CountedAttempts(golden["dropped"], by_destination=by))
    assert canonical_json(built.to_payload()) == canonical_json(golden)


def test_network_counted_with_and_without_destinations():
    counted = CountedAttempts(3, "more attempts", (DestinationCount("a.test", 80, "denied", 3, 0, 0),))
    payload = round_trip(NetworkAccessObserved(counted=counted))
    assert payload == {"dropped": 3, "reason": "more attempts", "byDestination": [
        {"host": "a.test", "port": 80, "decision": "denied", "attempts": 3, "bytesUp": 0, "bytesDown": 0}]}
    assert list(NetworkAccessObserved.from_payload(payload).destinations()) == [("a.test", 80, "denied")]
    older = {"dropped": 7, "reason": "counted, not recorded"}  # before destinations were counted
    assert rewritten(ev.NETWORK_ACCESS, older) == canonical_json(older)
    assert list(NetworkAccessObserved.from_payload(older).destinations()) == []


def test_the_proxy_record_builds_its_event_through_the_type():
    record = ConnectionRecord(protocol="connect", method="CONNECT", host="files.test", port=443, address="192.0.2.1",
                              decision="allowed", rule="allowDomains", status=200, bytes_up=10, bytes_down=20,
                              started_at="t0", ended_at="t1")
    assert record.observed() == NetworkAccessObserved(attempt=ATTEMPT)
    assert draft(record.observed()).type == ev.NETWORK_ACCESS


def test_nested_objects_of_another_shape_read_as_empty_never_raise():
    """An edited or early log may hold anything where an object belongs: recovery and
    replay read such events at start (a reader that raised stopped the daemon)."""
    checked = ToolPolicyChecked.from_payload({"sandboxId": "sbx-1", "authorization": "granted"})
    assert (checked.sandbox_id, checked.authorization) == ("sbx-1", CheckedAuthorization())
    validated = ToolResultValidated.from_payload({"result": ["not", "an", "object"]})
    assert (validated.result, validated.status) == ({}, "error")
    assert ToolResultValidated.from_payload({"result": {"error": "text"}}).error_code == ""
