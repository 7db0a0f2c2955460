"""sandboxd.retention: expiry of calls past the retention period, on a real SQLite
database and a real blob directory (no Docker). A call's artifacts and index rows go,
its events stay with a ToolCallExpired tombstone, and the chain still verifies."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
from pydantic import ValidationError

from sandboxd import audit
from sandboxd import events as ev
from sandboxd.artifacts import ArtifactRecord, FileArtifactStore
from sandboxd.retention import RetentionSweeper, cutoff, expire_calls
from sandboxd.settings import DaemonSettings, RetentionSettings

from .test_audit_index import (T0, accept, call_row, file_access, ids, iso, network, path_rows, network_rows, reject,
                               run_call)
from .test_audit_index import clock, db, log  # noqa: F401 - fixtures

DAY = timedelta(days=1)


@pytest.fixture
def store(tmp_path, db):  # noqa: F811
    return FileArtifactStore(tmp_path / "blobs", db)


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


def sweeper(db, log, store, clock, period_days: float = 30, batch: int = 200, **kw) -> RetentionSweeper:  # noqa: F811
    settings = RetentionSettings(period_days=period_days, batch=batch, **kw)
    return RetentionSweeper(settings, db, log, store, now=lambda: clock.t)


def test_an_expired_call_keeps_its_events_gains_a_tombstone_and_leaves_the_index(db, log, store, clock, tmp_path):  # noqa: F811
    run_call(log, "tc_old", argv=("cat", "secrets.yaml"),
             observed=(file_access("/workspace/secrets.yaml", "read"), network("pypi.test")))
    art = put_artifact(store, db, tmp_path, "tc_old", b"old output\n")
    clock.set(T0 + 20 * DAY)
    run_call(log, "tc_new", argv=("cat", "secrets.yaml"), observed=(file_access("/workspace/secrets.yaml", "read"),))
    before = {e.event_id: e for e in log.for_call("tc_old")}
    clock.set(T0 + 35 * DAY)

    done = sweeper(db, log, store, clock).sweep()

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
    assert ids(db, path="/workspace/secrets.yaml") == ["tc_new"]
    assert ids(db, domain="pypi.test") == [] and network_rows(db, "tc_old") == []
    assert path_rows(db, "tc_old") == [] and call_row(db, "tc_new")["status"] == "success"
    assert not db.query("SELECT * FROM audit_calls WHERE tool_call_id = 'tc_old'")
    assert store.list_for_call("tc_old") == [] and not store.blob_path(art.content_hash).exists()
    assert store.expired(art.artifact_id) == ("tc_old", tomb.payload["expiredAt"])


def test_a_second_sweep_expires_nothing_again(db, log, store, clock):  # noqa: F811
    run_call(log, "tc_a")
    clock.set(T0 + 40 * DAY)
    s = sweeper(db, log, store, clock)
    assert len(s.sweep()) == 1
    n = len(log.range())
    assert s.sweep() == [] and len(log.range()) == n


def test_a_running_call_never_expires_however_old(db, log, store, clock):  # noqa: F811
    accept(log, "tc_running")
    clock.set(T0 + 400 * DAY)
    assert sweeper(db, log, store, clock).sweep() == []
    assert call_row(db, "tc_running")["status"] == "running"


def test_age_counts_from_the_end_of_the_call(db, log, store, clock):  # noqa: F811
    last = accept(log, "tc_long")
    clock.set(T0 + 20 * DAY)  # a call that ran for 20 days (a lease, a long job)
    from .test_audit_index import finish, start
    finish(log, "tc_long", start(log, "tc_long", last))
    clock.set(T0 + 31 * DAY)
    assert sweeper(db, log, store, clock).sweep() == []  # 11 days after its end
    clock.set(T0 + 51 * DAY)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock).sweep()] == ["tc_long"]


def test_refused_calls_expire_too(db, log, store, clock):  # noqa: F811
    reject(log, "tc_refused")
    clock.set(T0 + 31 * DAY)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock).sweep()] == ["tc_refused"]
    assert ids(db, status="rejected") == [] and log.verify().ok


def test_a_blob_another_call_still_names_is_kept(db, log, store, clock, tmp_path):  # noqa: F811
    run_call(log, "tc_first")
    a = put_artifact(store, db, tmp_path, "tc_first", b"same bytes")
    clock.set(T0 + 20 * DAY)
    run_call(log, "tc_second")
    b = put_artifact(store, db, tmp_path, "tc_second", b"same bytes")
    assert a.content_hash == b.content_hash
    clock.set(T0 + 31 * DAY)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock).sweep()] == ["tc_first"]
    assert store.blob_path(a.content_hash).read_bytes() == b"same bytes"
    clock.set(T0 + 51 * DAY)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock).sweep()] == ["tc_second"]
    assert not store.blob_path(a.content_hash).exists()


def test_a_blob_put_moments_ago_is_kept_for_the_call_about_to_name_it(db, log, store, clock, tmp_path):  # noqa: F811
    run_call(log, "tc_old")
    a = put_artifact(store, db, tmp_path, "tc_old", b"shared")
    clock.set(T0 + 31 * DAY)
    # Another call has just put the same content; its row is not committed yet.
    spool = tmp_path / "spool-pending"
    spool.write_bytes(b"shared")
    store.put_blob(spool, a.content_hash)
    assert [c.tool_call_id for c in sweeper(db, log, store, clock).sweep()] == ["tc_old"]
    assert store.blob_path(a.content_hash).exists()
    # Without that put, the same expiry removes it.
    assert store.remove_unreferenced([a.content_hash], grace_s=600) == []
    old = time.time() - 3600
    os.utime(store.blob_path(a.content_hash), (old, old))
    assert store.remove_unreferenced([a.content_hash], grace_s=600) == [a.content_hash]


def test_an_index_rebuilt_from_the_log_leaves_expired_calls_out(db, log, store, clock):  # noqa: F811
    run_call(log, "tc_old", observed=(file_access("/workspace/a.py", "write"),))
    clock.set(T0 + 20 * DAY)
    run_call(log, "tc_new", observed=(file_access("/workspace/a.py", "write"),))
    clock.set(T0 + 31 * DAY)
    sweeper(db, log, store, clock).sweep()
    db.ensure_schema("DELETE FROM audit_calls; DELETE FROM audit_paths; DELETE FROM audit_network;"
                     " DELETE FROM audit_meta;")
    assert audit.catch_up(db) == len(log.range())
    assert ids(db) == ["tc_new"] and ids(db, path="/workspace/a.py") == ["tc_new"]


def test_the_expired_calls_idempotency_key_is_released(db, log, store, clock):  # noqa: F811
    run_call(log, "tc_keyed")
    with db.transaction() as conn:
        conn.execute("INSERT INTO idempotency_keys VALUES ('alice/k1', 'sha256:x', 'tc_keyed')")
    clock.set(T0 + 31 * DAY)
    sweeper(db, log, store, clock).sweep()
    assert db.query("SELECT * FROM idempotency_keys") == []


def test_a_backlog_expires_in_batches_oldest_first_each_once(db, log, store, clock):  # noqa: F811
    for i in range(7):
        run_call(log, f"tc_{i}")
    clock.set(T0 + 31 * DAY)
    done = sweeper(db, log, store, clock, batch=3).sweep()
    assert [c.tool_call_id for c in done] == [f"tc_{i}" for i in range(7)]
    tombs = [e for e in log.range() if e.type == ev.EXPIRED]
    assert sorted(e.tool_call_id for e in tombs) == [f"tc_{i}" for i in range(7)]
    assert ids(db) == [] and log.verify().ok


def test_the_tombstone_is_hashed_into_the_chain(db, log, store, clock):  # noqa: F811
    run_call(log, "tc_x")
    clock.set(T0 + 31 * DAY)
    sweeper(db, log, store, clock).sweep()
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


def test_expire_calls_respects_its_limit(db, log, clock):  # noqa: F811
    for i in range(4):
        run_call(log, f"tc_{i}")
    before = cutoff(T0 + 31 * DAY, 30)
    assert [c.tool_call_id for c in expire_calls(db, log, before, 30, 2)] == ["tc_0", "tc_1"]
    assert [c.tool_call_id for c in expire_calls(db, log, before, 30, 5)] == ["tc_2", "tc_3"]


def test_no_period_means_no_sweeper_thread(db, log, store, clock):  # noqa: F811
    s = sweeper(db, log, store, clock, period_days=0)
    s.start()
    assert not s._thread.is_alive()
    s.stop()


def test_the_sweeper_thread_sweeps_at_start_and_stops(db, log, store, clock):  # noqa: F811
    run_call(log, "tc_a")
    clock.set(T0 + 31 * DAY)
    swept = []
    s = RetentionSweeper(RetentionSettings(period_days=30, sweep_interval_s=0.05), db, log, store,
                         on_swept=lambda: swept.append(1), now=lambda: clock.t)
    s.start()
    deadline = time.monotonic() + 10
    while not swept and time.monotonic() < deadline:
        time.sleep(0.01)
    s.stop()
    assert swept and not s._thread.is_alive()
    assert [e.type for e in log.for_call("tc_a")][-1] == ev.EXPIRED


@pytest.mark.parametrize("bad", [{"period_days": -1}, {"sweep_interval_s": 0}, {"batch": 0}, {"period": 3}])
def test_bad_retention_settings_are_refused(bad):
    with pytest.raises(ValidationError):
        DaemonSettings.model_validate({"retention": bad})
