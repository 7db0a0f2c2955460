"""sandboxd.ledger.retention: expiry of calls past the retention period, on a real SQLite
database and a real blob directory (no Docker). A call's artifacts and index rows go,
its events stay with a ToolCallExpired tombstone, and the chain still verifies."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
from pydantic import ValidationError

from sandboxd.ledger import audit, call_rows, transfer_usage
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import ArtifactRecord, FileArtifactStore
from sandboxd.ledger.event_types import FilesTransferred, draft
from sandboxd.ledger.events import EventLog
from sandboxd.ledger.retention import RetentionSweeper, cutoff, expire_calls
from sandboxd.core.settings import DaemonSettings, RetentionSettings
from sandboxd.ledger.store import Database

from .test_audit_index import T0, accept, file_access, iso, network, reject, run_call
from .test_audit_index import call_row as _call_row, ids as _ids, network_rows as _network_rows, path_rows as _path_rows
from .test_audit_index import clock  # noqa: F401 - fixture

DAY = timedelta(days=1)


# The daemon's wiring: the log in one database, the index in its own, tailing it.
@pytest.fixture
def db(tmp_path):
    d = Database(tmp_path / "sandboxd.db")
    yield d
    d.close()


@pytest.fixture
def index(tmp_path, db):
    i = audit.AuditIndex(db, Database(tmp_path / "audit.db", schema="", durable=False))
    yield i
    i.db.close()


@pytest.fixture
def log(db, index, clock):
    return EventLog(db, on_append=index.notify)


@pytest.fixture
def store(tmp_path, db):
    return FileArtifactStore(tmp_path / "blobs", db)


def synced(index: audit.AuditIndex):
    """The index database, caught up with the log (as a query sees it)."""
    index.sync()
    return index.db


def ids(index, **filters):
    return _ids(synced(index), **filters)


def call_row(index, tcid):
    return _call_row(synced(index), tcid)


def path_rows(index, tcid=None):
    return _path_rows(synced(index), tcid)


def network_rows(index, tcid=None):
    return _network_rows(synced(index), tcid)


def put_artifact(store: FileArtifactStore, db, tmp_path, tcid: str, content: bytes, kind: str = "stdout",
                 age_s: float = 3600.0) -> ArtifactRecord:
    """An artifact as CallRun._finish stores it: the blob, then its row; the blob is
    backdated `age_s` (as if put that long ago)."""
    import hashlib

    spool = tmp_path / f"spool-{tcid}-{kind}"
    spool.write_bytes(content)
    digest = "sha256:" + hashlib.sha256(content).hexdigest()
    path = store.put_blob(spool, digest)
    old = time.time() - age_s
    os.utime(path, (old, old))
    record = ArtifactRecord(ev.new_id("art"), tcid, ev.new_id("ev"), kind, digest, len(content), "s", iso(T0))
    with db.transaction() as conn:
        store.insert(conn, record)
    return record


def sweeper(db, log, store, clock, index, period_days: float = 30, batch: int = 200, **kw) -> RetentionSweeper:
    settings = RetentionSettings(period_days=period_days, batch=batch, **kw)
    return RetentionSweeper(settings, db, log, store, index, now=lambda: clock.t)


def test_an_expired_call_keeps_its_events_gains_a_tombstone_and_leaves_the_index(db, log, store, clock, tmp_path, index):
    run_call(log, "tc_old", argv=("cat", "secrets.yaml"),
             observed=(file_access("/workspace/secrets.yaml", "read"), network("pypi.test")))
    art = put_artifact(store, db, tmp_path, "tc_old", b"old output\n")
    clock.set(T0 + 20 * DAY)
    run_call(log, "tc_new", argv=("cat", "secrets.yaml"), observed=(file_access("/workspace/secrets.yaml", "read"),))
    before = {e.event_id: e for e in log.for_call("tc_old")}
    clock.set(T0 + 35 * DAY)

    done = sweeper(db, log, store, clock, index).sweep()

    assert [c.tool_call_id for c in done] == ["tc_old"]
    events = log.for_call("tc_old")
    assert {e.event_id: e for e in events[:-1]} == before  # nothing of the call was rewritten
    tomb = events[-1]
    assert tomb.type == ev.EXPIRED and tomb.parent_event_id == events[-2].event_id
    assert tomb.payload["artifactsRemoved"] == [
        {"artifactId": art.artifact_id, "kind": "stdout", "contentHash": art.content_hash, "sizeBytes": 11}]
    assert tomb.payload["reason"] == "retention" and tomb.payload["periodDays"] == 30
    assert tomb.payload["endedAt"] == before[events[-2].event_id].time
    assert log.verify().ok
    # Gone from the index and the artifact store; the newer call is untouched.
    assert ids(index, path="/workspace/secrets.yaml") == ["tc_new"]
    assert ids(index, domain="pypi.test") == [] and network_rows(index, "tc_old") == []
    assert path_rows(index, "tc_old") == [] and call_row(index, "tc_new")["status"] == "success"
    assert not synced(index).query("SELECT * FROM audit_calls WHERE tool_call_id = 'tc_old'")
    assert store.list_for_call("tc_old") == [] and not store.blob_path(art.content_hash).exists()
    assert store.expired(art.artifact_id) == ("tc_old", tomb.payload["expiredAt"])


def test_a_second_sweep_expires_nothing_again(db, log, store, clock, index):
    run_call(log, "tc_a")
    clock.set(T0 + 40 * DAY)
    s = sweeper(db, log, store, clock, index)
    assert len(s.sweep()) == 1
    n = len(log.range())
    assert s.sweep() == [] and len(log.range()) == n


def test_a_running_call_never_expires_however_old(db, log, store, clock, index):
    accept(log, "tc_running")
    clock.set(T0 + 400 * DAY)
    assert sweeper(db, log, store, clock, index).sweep() == []
    assert call_row(index, "tc_running")["status"] == "running"


def test_age_counts_from_the_end_of_the_call(db, log, store, clock, index):
    last = accept(log, "tc_long")
    clock.set(T0 + 20 * DAY)  # a call that ran for 20 days (a lease, a long job)
    from .test_audit_index import finish, start
    finish(log, "tc_long", start(log, "tc_long", last))
    clock.set(T0 + 31 * DAY)
    assert sweeper(db, log, store, clock, index).sweep() == []  # 11 days after its end
    clock.set(T0 + 51 * DAY)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock, index).sweep()] == ["tc_long"]


def test_refused_calls_expire_too(db, log, store, clock, index):
    reject(log, "tc_refused")
    clock.set(T0 + 31 * DAY)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock, index).sweep()] == ["tc_refused"]
    assert ids(index, status="rejected") == [] and log.verify().ok


def test_a_blob_another_call_still_names_is_kept(db, log, store, clock, tmp_path, index):
    run_call(log, "tc_first")
    a = put_artifact(store, db, tmp_path, "tc_first", b"same bytes")
    clock.set(T0 + 20 * DAY)
    run_call(log, "tc_second")
    b = put_artifact(store, db, tmp_path, "tc_second", b"same bytes")
    assert a.content_hash == b.content_hash
    clock.set(T0 + 31 * DAY)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock, index).sweep()] == ["tc_first"]
    assert store.blob_path(a.content_hash).read_bytes() == b"same bytes"
    clock.set(T0 + 51 * DAY)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock, index).sweep()] == ["tc_second"]
    assert not store.blob_path(a.content_hash).exists()


def test_a_blob_put_moments_ago_is_kept_for_the_call_about_to_name_it(db, log, store, clock, tmp_path, index):
    run_call(log, "tc_old")
    a = put_artifact(store, db, tmp_path, "tc_old", b"shared")
    clock.set(T0 + 31 * DAY)
    # Another call has just put the same content; its row is not committed yet.
    spool = tmp_path / "spool-pending"
    spool.write_bytes(b"shared")
    store.put_blob(spool, a.content_hash)
    s = sweeper(db, log, store, clock, index)
    assert [c.tool_call_id for c in s.sweep()] == ["tc_old"]
    assert store.blob_path(a.content_hash).read_bytes() == b"shared"
    assert db.query("SELECT blob_pending FROM expired_artifacts") == [{"blob_pending": 1}]
    # That call never named it (it failed before its commit): once the grace is over,
    # a later sweep, with nothing new to expire, removes it.
    old = time.time() - 3600
    os.utime(store.blob_path(a.content_hash), (old, old))
    assert s.sweep() == []
    assert not store.blob_path(a.content_hash).exists()
    assert db.query("SELECT blob_pending FROM expired_artifacts") == [{"blob_pending": 0}]


def test_blobs_left_by_a_crash_after_the_expiry_commit_go_at_the_next_sweep(db, log, store, clock, tmp_path, index):
    run_call(log, "tc_old")
    a = put_artifact(store, db, tmp_path, "tc_old", b"left behind")
    clock.set(T0 + 31 * DAY)
    # The expiry committed, then the daemon died before removing the blob.
    assert [c.tool_call_id for c in expire_calls(db, log, index, cutoff(clock.t, 30), 30, 10)] == ["tc_old"]
    assert store.blob_path(a.content_hash).exists()
    assert sweeper(db, log, store, clock, index).sweep() == []  # the restarted daemon's first sweep
    assert not store.blob_path(a.content_hash).exists()


def test_the_sweep_ends_when_the_index_is_not_hooked_to_the_log(db, store, clock, index):
    quiet = EventLog(db)  # appends do not wake the index: only the sweep's own syncs index
    for i in range(5):
        run_call(quiet, f"tc_{i}")
    clock.set(T0 + 31 * DAY)
    done = sweeper(db, quiet, store, clock, index, batch=2).sweep()
    assert sorted(c.tool_call_id for c in done) == [f"tc_{i}" for i in range(5)]
    assert len([e for e in quiet.range() if e.type == ev.EXPIRED]) == 5


def test_lookups_of_a_sweep_use_indexes(db):
    for sql in ("SELECT 1 FROM artifacts WHERE content_hash = ? LIMIT 1",
                "SELECT artifact_id FROM artifacts WHERE tool_call_id = ?",
                "SELECT DISTINCT content_hash FROM expired_artifacts WHERE blob_pending = 1",
                "SELECT 1 FROM events WHERE tool_call_id = ? AND type = ? LIMIT 1"):
        plan = " ".join(r["detail"] for r in db.query("EXPLAIN QUERY PLAN " + sql, ("x",) * sql.count("?")))
        assert "USING" in plan and "INDEX" in plan, (sql, plan)


def test_an_index_rebuilt_from_the_log_leaves_expired_calls_out(db, log, store, clock, index):
    run_call(log, "tc_old", observed=(file_access("/workspace/a.py", "write"),))
    clock.set(T0 + 20 * DAY)
    run_call(log, "tc_new", observed=(file_access("/workspace/a.py", "write"),))
    clock.set(T0 + 31 * DAY)
    sweeper(db, log, store, clock, index).sweep()
    index.db.ensure_schema("DELETE FROM audit_calls; DELETE FROM audit_paths; DELETE FROM audit_network;"
                           " DELETE FROM audit_meta;")
    assert index.sync() == len(log.range())
    assert ids(index) == ["tc_new"] and ids(index, path="/workspace/a.py") == ["tc_new"]


def test_the_expired_calls_idempotency_key_stays_taken(db, log, store, clock, index):
    run_call(log, "tc_keyed")
    with db.transaction() as conn:
        conn.execute("INSERT INTO idempotency_keys VALUES ('alice/k1', 'sha256:x', 'tc_keyed')")
    clock.set(T0 + 31 * DAY)
    sweeper(db, log, store, clock, index).sweep()
    # A retry under it is refused as expired (CallExecutor._answer_retry), never run again.
    assert db.query("SELECT tool_call_id FROM idempotency_keys") == [{"tool_call_id": "tc_keyed"}]


def test_a_backlog_expires_in_batches_oldest_first_each_once(db, log, store, clock, index):
    for i in range(7):
        run_call(log, f"tc_{i}")
    clock.set(T0 + 31 * DAY)
    s = sweeper(db, log, store, clock, index, batch=3)
    done = s.sweep()
    assert [c.tool_call_id for c in done] == [f"tc_{i}" for i in range(7)] and s.expired_total == 7
    tombs = [e for e in log.range() if e.type == ev.EXPIRED]
    assert sorted(e.tool_call_id for e in tombs) == [f"tc_{i}" for i in range(7)]
    assert ids(index) == [] and log.verify().ok


def test_the_tombstone_is_hashed_into_the_chain(db, log, store, clock, index):
    run_call(log, "tc_x")
    clock.set(T0 + 31 * DAY)
    sweeper(db, log, store, clock, index).sweep()
    tomb = log.range()[-1]
    assert tomb.type == ev.EXPIRED
    payload = json.loads(tomb.payload_json)
    payload["artifactsRemoved"] = [{"artifactId": "art_forged"}]
    db.ensure_schema(f"UPDATE events SET payload_json = '{json.dumps(payload)}' WHERE seq = {tomb.seq}")
    report = log.verify()
    assert not report.ok and report.first_bad_seq == tomb.seq


def test_cutoff_is_spelled_like_stored_times():
    assert cutoff(T0 + 30 * DAY, 30) == iso(T0)
    assert cutoff(T0, 0.5) == iso(T0 - timedelta(hours=12))


def test_expire_calls_respects_its_limit(db, log, clock, index):
    for i in range(4):
        run_call(log, f"tc_{i}")
    before = cutoff(T0 + 31 * DAY, 30)
    assert [c.tool_call_id for c in expire_calls(db, log, index, before, 30, 2)] == ["tc_0", "tc_1"]
    assert [c.tool_call_id for c in expire_calls(db, log, index, before, 30, 5)] == ["tc_2", "tc_3"]


def test_no_period_means_no_sweeper_thread(db, log, store, clock, index):
    s = sweeper(db, log, store, clock, index, period_days=0)
    s.start()
    assert not s._thread.is_alive()
    s.stop()


def test_the_sweeper_thread_sweeps_at_start_and_stops(db, log, store, clock, index):
    run_call(log, "tc_a")
    clock.set(T0 + 31 * DAY)
    swept = []
    s = RetentionSweeper(RetentionSettings(period_days=30, sweep_interval_s=0.05), db, log, store, index,
                         on_swept=lambda: swept.append(1), now=lambda: clock.t)
    s.start()
    deadline = time.monotonic() + 10
    while not swept and time.monotonic() < deadline:
        time.sleep(0.01)
    s.stop()
    assert swept and not s._thread.is_alive()
    assert [e.type for e in log.for_call("tc_a")][-1] == ev.EXPIRED


@pytest.mark.parametrize("bad", [{"period_days": -1}, {"period_days": 1e6}, {"sweep_interval_s": 0}, {"batch": 0},
                                 {"period": 3}])
def test_bad_retention_settings_are_refused(bad):
    with pytest.raises(ValidationError):
        DaemonSettings.model_validate({"retention": bad})


def test_what_a_principals_artifacts_hold_is_counted_as_they_are_stored_and_expired(db, log, store, clock, tmp_path,
                                                                                   index):
    from sandboxd.ledger import artifact_usage, call_rows

    with db.transaction() as conn:
        for tcid, principal in (("tc_a1", "alice"), ("tc_a2", "alice"), ("tc_b", "bob")):
            call_rows.insert_owner(conn, tcid, principal)
    run_call(log, "tc_a1")
    clock.set(T0 + 10 * DAY)
    run_call(log, "tc_a2")
    run_call(log, "tc_b")
    put_artifact(store, db, tmp_path, "tc_a1", b"x" * 100)
    put_artifact(store, db, tmp_path, "tc_a1", b"y" * 20, kind="stderr")
    put_artifact(store, db, tmp_path, "tc_a2", b"z" * 7)
    put_artifact(store, db, tmp_path, "tc_b", b"b" * 5)
    assert [artifact_usage.stored_bytes(db, p) for p in ("alice", "bob", "carol")] == [127, 5, 0]
    # Retention takes tc_a1 (older than 30 days by then): its bytes no longer count.
    clock.set(T0 + 31 * DAY)
    assert [c.tool_call_id for c in expire_calls(db, log, index, cutoff(clock.t, 30), 30, 10)] == ["tc_a1"]
    assert [artifact_usage.stored_bytes(db, p) for p in ("alice", "bob")] == [7, 5]
    # A store an older daemon wrote (no counts yet) is counted once at start.
    with db.transaction() as conn:
        conn.execute("DELETE FROM artifact_usage")
    artifact_usage.count_existing(db)
    assert [artifact_usage.stored_bytes(db, p) for p in ("alice", "bob")] == [7, 5]


def record_transfer(db, log, principal: str, entries: int) -> str:
    """A transfer's record as FileTransfers writes it: its owner, its event, its count."""
    transfer_id = ev.new_id("xfer")
    listed = [{"path": f"/workspace/f{i}", "kind": "file"} for i in range(entries)]
    event = FilesTransferred(principal, "upload", "/ws", "", "/workspace", "ok", listed, 0, "", "", "")
    with db.transaction() as conn:
        call_rows.insert_owner(conn, transfer_id, principal)
        log.append(conn, transfer_id, "", [draft(event)])
        transfer_usage.add(conn, transfer_id, principal, entries)
    return transfer_id


def test_transfer_records_are_counted_per_principal_until_they_expire(db, log, store, clock, index):
    record_transfer(db, log, "alice", 3)
    clock.set(clock.t + DAY * 31)
    record_transfer(db, log, "alice", 2)
    record_transfer(db, log, "bob", 7)
    assert (transfer_usage.recorded_entries(db, "alice"), transfer_usage.recorded_entries(db, "bob")) == (5, 7)
    sweeper(db, log, store, clock, index).sweep()  # the first is past 30 days, the others are not
    assert transfer_usage.recorded_entries(db, "alice") == 2


def test_an_older_store_has_its_unexpired_transfer_records_counted_once(db, log, store, clock, index):
    record_transfer(db, log, "alice", 3)
    clock.set(clock.t + DAY * 31)
    record_transfer(db, log, "alice", 4)
    sweeper(db, log, store, clock, index).sweep()
    with db.transaction() as conn:
        conn.execute("DELETE FROM transfer_usage")  # as an older daemon left it: never counted
    transfer_usage.count_existing(db)
    assert transfer_usage.recorded_entries(db, "alice") == 4
    transfer_usage.count_existing(db)  # not twice
    assert transfer_usage.recorded_entries(db, "alice") == 4
