"""sandboxd.ledger.events: the hash-chained event log over a temporary SQLite database."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from sandboxd.ledger.events import GENESIS_HASH, EventDraft, EventLog, new_id, utc_now, verify_chain
from sandboxd.ledger.store import Database
from sandboxd_contract.canonical import canonical_json, event_hash


@pytest.fixture
def db(tmp_path):
    d = Database(tmp_path / "state" / "sandboxd.db")
    yield d
    d.close()


@pytest.fixture
def log(db):
    return EventLog(db)


def drafts(*types: str, **payload) -> list[EventDraft]:
    return [EventDraft(t, {"n": i, **payload}) for i, t in enumerate(types)]


def fill(log: EventLog) -> None:
    """Three calls, interleaved: 7 events."""
    log.record("tc-a", "", drafts("ToolCallRequested", "ToolArgsValidated"))
    log.record("tc-b", "parent-x", drafts("ToolCallRequested"))
    log.record("tc-a", "", drafts("ToolPolicyChecked", "ToolCallStarted"))
    log.record("tc-c", "", drafts("ToolCallRejected", "X", unicode="héllo ✓"))


def tamper(db: Database, sql: str, args: tuple = ()) -> None:
    with db.transaction() as conn:
        conn.execute(sql, args)


# ------------------------------------------------------------------ append


def test_append_chains_parents_within_a_call(log):
    evs = log.record("tc-1", "caller-parent", drafts("ToolCallRequested", "ToolArgsValidated", "ToolPolicyChecked"))
    assert [e.parent_event_id for e in evs] == ["caller-parent", evs[0].event_id, evs[1].event_id]
    assert [e.type for e in evs] == ["ToolCallRequested", "ToolArgsValidated", "ToolPolicyChecked"]
    assert all(e.tool_call_id == "tc-1" for e in evs)


def test_append_links_hashes(log):
    evs = log.record("tc-1", "", drafts("A", "B", "C"))
    assert evs[0].prev_hash == GENESIS_HASH
    assert [e.prev_hash for e in evs[1:]] == [e.hash for e in evs[:-1]]
    more = log.record("tc-2", "", drafts("D"))
    assert more[0].prev_hash == evs[-1].hash


def test_seq_is_contiguous_across_calls(log):
    fill(log)
    assert [e.seq for e in log.range()] == list(range(1, 8))


def test_draft_event_id_is_kept(log):
    [e] = log.record("tc-1", "", [EventDraft("A", {}, event_id="ev_fixed")])
    assert e.event_id == "ev_fixed"


def test_generated_ids_and_time_shape(log):
    [e] = log.record("tc-1", "", drafts("A"))
    assert re.fullmatch(r"ev_[0-9a-f]{24}", e.event_id)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", e.time)
    assert re.fullmatch(r"tc_[0-9a-f]{24}", new_id("tc"))
    assert utc_now().endswith("Z")


def test_payload_is_canonical_json(log):
    [e] = log.record("tc-1", "", [EventDraft("A", {"b": 1, "a": [1, {"y": 2, "x": "é"}]})])
    assert e.payload_json == '{"a":[1,{"x":"é","y":2}],"b":1}'
    assert e.payload == {"a": [1, {"x": "é", "y": 2}], "b": 1}


def test_stored_events_equal_returned_events(log):
    evs = log.record("tc-1", "p", drafts("A", "B"))
    assert log.for_call("tc-1") == evs


def test_for_call_and_has_call(log):
    fill(log)
    a = log.for_call("tc-a")
    assert [e.type for e in a] == ["ToolCallRequested", "ToolArgsValidated", "ToolPolicyChecked", "ToolCallStarted"]
    assert [e.seq for e in a] == [1, 2, 4, 5]
    assert log.has_call("tc-b") and not log.has_call("tc-nope")
    assert log.for_call("tc-nope") == []


def test_range_pages(log):
    fill(log)
    assert [e.seq for e in log.range(2, limit=3)] == [3, 4, 5]
    assert log.range(7) == []


def test_failed_transaction_appends_nothing(db, log):
    log.record("tc-1", "", drafts("A"))
    with pytest.raises(RuntimeError):
        with db.transaction() as conn:
            log.append(conn, "tc-1", "", drafts("B", "C"))
            raise RuntimeError("boom")
    assert [e.type for e in log.range()] == ["A"]
    assert log.record("tc-1", "", drafts("D"))[0].seq == 2
    assert log.verify().ok


def test_duplicate_event_id_is_refused_atomically(log):
    log.record("tc-1", "", [EventDraft("A", {}, "ev_same")])
    with pytest.raises(Exception):
        log.record("tc-1", "", [EventDraft("B", {}), EventDraft("C", {}, "ev_same")])
    assert len(log.range()) == 1


def test_log_survives_reopen(tmp_path):
    path = tmp_path / "db.sqlite"
    d1 = Database(path)
    EventLog(d1).record("tc-1", "", drafts("A", "B"))
    d1.close()
    d2 = Database(path)
    log2 = EventLog(d2)
    assert log2.record("tc-1", "", drafts("C"))[0].seq == 3
    assert log2.verify().ok and log2.verify().events_checked == 3
    d2.close()


# ------------------------------------------------------------------ verification


def test_verify_empty_log(log):
    r = log.verify()
    assert r.ok and r.events_checked == 0 and r.first_bad_seq is None


def test_verify_clean_log(log):
    fill(log)
    r = log.verify()
    assert r.ok and r.events_checked == 7 and r.first_bad_seq is None and r.reason == ""


def test_client_event_hash_agrees_with_stored(log):
    fill(log)
    for e in log.range():
        assert event_hash(e.seq, e.event_id, e.tool_call_id, e.type, e.time, e.parent_event_id,
                          e.payload_json, e.prev_hash) == e.hash


def test_event_hash_definition():
    # Pinned: any change here breaks every stored log and every client.
    body = canonical_json({"seq": 1, "eventId": "e", "toolCallId": "t", "type": "T", "time": "now",
                           "parentEventId": "", "payload": "{}", "prevHash": GENESIS_HASH})
    import hashlib
    assert event_hash(1, "e", "t", "T", "now", "", "{}", GENESIS_HASH) == "sha256:" + hashlib.sha256(body).hexdigest()
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()


def test_edited_payload_is_found(db, log):
    fill(log)
    tamper(db, "UPDATE events SET payload_json = ? WHERE seq = 4", ('{"n":99}',))
    r = log.verify()
    assert not r.ok and r.first_bad_seq == 4
    assert "edited" in r.reason


@pytest.mark.parametrize("column, value", [
    ("type", "ToolCallFinished"), ("time", "2000-01-01T00:00:00.000000Z"), ("tool_call_id", "tc-other"),
    ("parent_event_id", "ev_forged"), ("event_id", "ev_renamed"), ("hash", "sha256:" + "1" * 64),
])
def test_any_edited_column_is_found(db, log, column, value):
    fill(log)
    tamper(db, f"UPDATE events SET {column} = ? WHERE seq = 3", (value,))
    r = log.verify()
    assert not r.ok and r.first_bad_seq == 3


def test_edit_with_recomputed_hash_breaks_the_next_link(db, log):
    fill(log)
    [e] = [e for e in log.range() if e.seq == 3]
    forged = '{"n":1234}'
    h = event_hash(e.seq, e.event_id, e.tool_call_id, e.type, e.time, e.parent_event_id, forged, e.prev_hash)
    tamper(db, "UPDATE events SET payload_json = ?, hash = ? WHERE seq = 3", (forged, h))
    r = log.verify()
    assert not r.ok and r.first_bad_seq == 4
    assert "prev_hash" in r.reason


def test_removed_event_is_found(db, log):
    fill(log)
    tamper(db, "DELETE FROM events WHERE seq = 3")
    r = log.verify()
    assert not r.ok and r.first_bad_seq == 4
    assert "removed" in r.reason


def test_removed_first_event_is_found(db, log):
    fill(log)
    tamper(db, "DELETE FROM events WHERE seq = 1")
    r = log.verify()
    assert not r.ok and r.first_bad_seq == 2


def test_swapped_events_are_found(db, log):
    fill(log)
    tamper(db, "UPDATE events SET seq = -1 WHERE seq = 3")
    tamper(db, "UPDATE events SET seq = 3 WHERE seq = 4")
    tamper(db, "UPDATE events SET seq = 4 WHERE seq = -1")
    r = log.verify()
    assert not r.ok and r.first_bad_seq == 3


def test_changed_prev_hash_is_found(db, log):
    fill(log)
    tamper(db, "UPDATE events SET prev_hash = ? WHERE seq = 5", ("sha256:" + "f" * 64,))
    r = log.verify()
    assert not r.ok and r.first_bad_seq == 5
    assert "prev_hash" in r.reason


def test_verify_chain_on_reordered_list(log):
    fill(log)
    evs = log.range()
    evs[2], evs[3] = evs[3], evs[2]
    r = verify_chain(evs)
    assert not r.ok and r.first_bad_seq == 4 and r.events_checked == 3


def test_verify_chain_continues_from_a_given_point(log):
    fill(log)
    evs = log.range()
    assert verify_chain(evs[3:], prev_hash=evs[2].hash, prev_seq=3).ok
    assert not verify_chain(evs[3:]).ok  # without the anchor it is not the start of the log
    assert not verify_chain(evs[3:], prev_hash=evs[1].hash, prev_seq=3).ok


def test_verify_chain_detects_in_memory_edit(log):
    fill(log)
    evs = log.range()
    evs[5] = replace(evs[5], payload_json=json.dumps({"n": 0, "unicode": "hello"}))
    r = verify_chain(evs)
    assert (r.ok, r.first_bad_seq, r.events_checked) == (False, 6, 6)


def test_verify_spans_batches(db, log):
    # verify() reads the log 10,000 events at a time: the chain must hold across a page.
    n = 10_050
    with db.transaction() as conn:
        log.append(conn, "tc-bulk", "", [EventDraft("E", {"i": i}) for i in range(n)])
    r = log.verify()
    assert r.ok and r.events_checked == n
    tamper(db, "UPDATE events SET payload_json = '{}' WHERE seq = 10001")
    r = log.verify()
    assert not r.ok and r.first_bad_seq == 10_001 and r.events_checked == 10_001


def test_the_chain_holds_across_rolled_back_appends_other_commits_and_appends_in_one_transaction(db, log):
    log.record("tc-a", "", drafts("A"))
    with pytest.raises(RuntimeError):
        with db.transaction() as conn:
            log.append(conn, "tc-b", "", drafts("B", "C"))
            raise RuntimeError("rolled back")
    log.record("tc-c", "", drafts("D"))  # after a rollback: the head is read again
    with db.transaction() as conn:  # a commit that is not an append
        conn.execute("INSERT INTO call_owners (tool_call_id, principal) VALUES ('tc-x', 'p')")
    with db.transaction() as conn:  # two appends in one transaction
        log.append(conn, "tc-d", "", drafts("E"))
        log.append(conn, "tc-e", "", drafts("F"))
    log.record("tc-f", "", drafts("G"))  # the cached head of the transaction just committed
    events = log.range()
    assert [e.type for e in events] == ["A", "D", "E", "F", "G"]
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert verify_chain(events).ok


def test_canonical_json_is_sorted_compact_utf8():
    assert canonical_json({"b": [1, {"z": None, "a": "é"}], "a": True}) == '{"a":true,"b":[1,{"a":"é","z":null}]}'.encode()


def test_a_rolled_back_append_then_a_commit_without_events_leaves_the_chain_whole(db, log):
    log.record("tc-a", "", drafts("A"))
    with pytest.raises(RuntimeError):
        with db.transaction() as conn:
            log.append(conn, "tc-b", "", drafts("B", "C"))
            raise RuntimeError("rolled back")
    with db.transaction() as conn:  # commits, appends nothing (a retention sweep with no rows)
        conn.execute("INSERT INTO call_owners (tool_call_id, principal) VALUES ('tc-y', 'p')")
    log.record("tc-c", "", drafts("D"))
    events = log.range()
    assert [(e.seq, e.type) for e in events] == [(1, "A"), (2, "D")]
    assert log.verify().ok


def test_checkpoints_are_written_at_most_once_an_interval_and_say_when_one_was_skipped(log, tmp_path):
    from sandboxd.ledger.events import CheckpointFile

    path = tmp_path / "checkpoints.jsonl"
    checkpoints = CheckpointFile(path, log, min_interval_s=3600)
    assert checkpoints.checkpoint() is None and not checkpoints.skipped  # an empty log: nothing to write
    log.record("tc-a", "", drafts("ToolCallRequested"))
    first = checkpoints.checkpoint()  # the first is never held back by the interval
    assert first is not None and first.seq == 1 and not checkpoints.skipped
    log.record("tc-a", "", drafts("ToolCallStarted"))
    assert checkpoints.checkpoint() is None and checkpoints.skipped  # within the interval
    forced = checkpoints.checkpoint(force=True)
    assert forced is not None and forced.seq == 2 and not checkpoints.skipped
    assert [c.seq for c in checkpoints.read()] == [1, 2]
    again = CheckpointFile(path, log)  # a new daemon knows what is on disk
    assert again.checkpoint() is None and not again.skipped
