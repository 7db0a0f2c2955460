"""sandboxd.ledger.artifacts.FileArtifactStore: content-addressed blobs and their index."""

from __future__ import annotations

import hashlib
import os

import pytest

from sandboxd.ledger.artifacts import ArtifactRecord, FileArtifactStore
from sandboxd.core.errors import NotFound
from sandboxd.ledger.store import Database


@pytest.fixture
def store(tmp_path):
    db = Database(tmp_path / "state" / "sandboxd.db")
    s = FileArtifactStore(tmp_path / "state" / "blobs", db)
    s.db = db
    yield s
    db.close()


def spooled(tmp_path, name: str, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p, "sha256:" + hashlib.sha256(data).hexdigest()


def record(artifact_id: str, tool_call_id: str = "tc-1", content_hash: str = "sha256:" + "a" * 64,
           created_at: str = "2030-01-01T00:00:00.000000Z", kind: str = "stdout") -> ArtifactRecord:
    return ArtifactRecord(artifact_id, tool_call_id, f"ev-{artifact_id}", kind, content_hash, 42, "a summary", created_at)


def test_blob_dir_is_private(tmp_path, store):
    assert os.stat(tmp_path / "state" / "blobs").st_mode & 0o777 == 0o700


def test_blob_path_is_content_addressed(tmp_path, store):
    h = "sha256:" + "ab" + "c" * 62
    assert store.blob_path(h) == tmp_path / "state" / "blobs" / "sha256" / "ab" / ("ab" + "c" * 62)


def test_put_blob_moves_the_file(tmp_path, store):
    src, h = spooled(tmp_path, "stdout.out", b"hello")
    dest = store.put_blob(src, h)
    assert dest == store.blob_path(h)
    assert dest.read_bytes() == b"hello"
    assert not src.exists()
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == h.removeprefix("sha256:")


def test_put_blob_dedups_identical_content(tmp_path, store):
    a, h = spooled(tmp_path, "a.out", b"same bytes")
    b, h2 = spooled(tmp_path, "b.out", b"same bytes")
    assert h == h2
    d1 = store.put_blob(a, h)
    ino = os.stat(d1).st_ino
    d2 = store.put_blob(b, h)
    assert d1 == d2 and os.stat(d2).st_ino == ino
    assert not b.exists()
    assert d2.read_bytes() == b"same bytes"
    assert sum(1 for p in (tmp_path / "state" / "blobs").rglob("*") if p.is_file()) == 1


def test_different_content_different_blobs(tmp_path, store):
    a, ha = spooled(tmp_path, "a", b"one")
    b, hb = spooled(tmp_path, "b", b"two")
    assert store.put_blob(a, ha) != store.put_blob(b, hb)


def test_empty_blob(tmp_path, store):
    src, h = spooled(tmp_path, "empty", b"")
    assert store.put_blob(src, h).read_bytes() == b""


def test_insert_and_get(store):
    r = record("art-1")
    with store.db.transaction() as conn:
        store.insert(conn, r)
    assert store.get("art-1") == r
    assert store.get("art-1").uri == "sandboxd://artifacts/art-1"


def test_get_unknown_is_not_found(store):
    with pytest.raises(NotFound) as info:
        store.get("art-missing")
    assert info.value.field == "artifactId"
    assert info.value.status == "NOT_FOUND"


def test_insert_is_rolled_back_with_its_transaction(store):
    with pytest.raises(RuntimeError):
        with store.db.transaction() as conn:
            store.insert(conn, record("art-1"))
            raise RuntimeError("event append failed")
    with pytest.raises(NotFound):
        store.get("art-1")


def test_duplicate_artifact_id_is_refused(store):
    with store.db.transaction() as conn:
        store.insert(conn, record("art-1"))
    with pytest.raises(Exception):
        with store.db.transaction() as conn:
            store.insert(conn, record("art-1", tool_call_id="tc-2"))
    assert store.get("art-1").tool_call_id == "tc-1"


def test_list_for_call(store):
    with store.db.transaction() as conn:
        store.insert(conn, record("art-b", created_at="2030-01-01T00:00:02.000000Z", kind="stderr"))
        store.insert(conn, record("art-a", created_at="2030-01-01T00:00:02.000000Z"))
        store.insert(conn, record("art-0", created_at="2030-01-01T00:00:01.000000Z"))
        store.insert(conn, record("art-x", tool_call_id="tc-other"))
    assert [r.artifact_id for r in store.list_for_call("tc-1")] == ["art-0", "art-a", "art-b"]
    assert [r.artifact_id for r in store.list_for_call("tc-other")] == ["art-x"]
    assert store.list_for_call("tc-none") == []


def test_open_reads_the_blob(tmp_path, store):
    src, h = spooled(tmp_path, "x", b"payload")
    store.put_blob(src, h)
    with store.open(record("art-1", content_hash=h)) as f:
        assert f.read() == b"payload"


def test_blobs_half_written_when_the_daemon_died_are_removed_at_its_start(tmp_path, store):
    from sandboxd.calls.recovery import clean_incoming

    kept = store.put_blob(*spooled(tmp_path, "kept", b"kept"))
    (store.incoming_dir() / "tc-1.0badc0de").write_bytes(b"half a fi")
    (store.incoming_dir() / "tc-1.0badc0de.diff").write_bytes(b"--- a")
    assert clean_incoming(store) == 2
    assert list(store.incoming_dir().iterdir()) == [] and kept.read_bytes() == b"kept"
