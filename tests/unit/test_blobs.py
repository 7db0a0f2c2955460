"""sandboxd.ledger.blobs and the spooled S3 store over a fake remote: keys, the verified
reader, the local store, uploads behind the call while the remote is down, removal from
both, and the `artifacts` settings. The real S3 server is in
tests/integration/test_s3_artifacts.py."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from sandboxd.core.settings import ArtifactSettings, DaemonSettings
from sandboxd.ledger.artifacts import ArtifactRecord, FileArtifactStore, open_blob_store
from sandboxd.ledger.blobs import BlobIntegrityError, BlobStoreUnavailable, LocalBlobStore, VerifiedReader, blob_key
from sandboxd.ledger.s3_blobs import SpooledS3BlobStore
from sandboxd.ledger.store import Database


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def spool(tmp_path: Path, data: bytes, name: str = "spool") -> tuple[Path, str]:
    path = tmp_path / name
    path.write_bytes(data)
    return path, digest(data)


def test_a_key_is_the_hash_split_and_nothing_else_is_one():
    h = "sha256:" + "ab" + "c" * 62
    assert blob_key(h) == "sha256/ab/ab" + "c" * 62
    for bad in ("sha256:../../etc/passwd", "sha256:" + "A" * 64, "md5:" + "a" * 32, "sha256:" + "a" * 63, ""):
        with pytest.raises(ValueError, match="not a content hash"):
            blob_key(bad)


def test_the_reader_reports_the_end_only_for_bytes_that_match():
    data = b"x" * 100_000
    good = VerifiedReader(io.BytesIO(data), digest(data), "here")
    assert good.read() == data
    bad = io.BufferedReader(VerifiedReader(io.BytesIO(data[:-1] + b"y"), digest(data), "here"))
    assert len(bad.read(1000)) == 1000  # bytes before the end are streamed...
    with pytest.raises(BlobIntegrityError, match="corrupt"):
        while bad.read(4096):  # ...but the end is never reached as if complete
            pass
    with pytest.raises(BlobIntegrityError):
        VerifiedReader(io.BytesIO(b""), digest(b"not empty"), "here").read()


def test_the_local_store_puts_durably_and_reads_verified(tmp_path):
    local = LocalBlobStore(tmp_path / "blobs")
    src, h = spool(tmp_path, b"some output")
    local.put(src, h)
    assert not src.exists() and local.exists(h) and local.hashes() == [h]
    with local.open(h) as f:
        assert f.read() == b"some output"
    local.path(h).write_bytes(b"some 0utput")  # bit rot
    with local.open(h) as f, pytest.raises(BlobIntegrityError):
        f.read()
    local.remove(h)
    local.remove(h)  # already gone: no error
    assert local.stored_at(h) is None
    with pytest.raises(FileNotFoundError):
        local.open(h)


class FakeRemote:
    """An S3BlobStore's surface, in memory, that can be taken down."""

    where = "the fake store"

    def __init__(self):
        self.objects: dict[str, tuple[bytes, float]] = {}
        self.down = False
        self.uploads = 0

    def _check(self):
        if self.down:
            raise BlobStoreUnavailable("the fake store is unreachable")

    def upload(self, path: Path, content_hash: str) -> None:
        self._check()
        self.objects[content_hash] = (path.read_bytes(), time.time())
        self.uploads += 1

    def open(self, content_hash: str):
        self._check()
        if content_hash not in self.objects:
            raise FileNotFoundError(content_hash)
        return io.BufferedReader(VerifiedReader(io.BytesIO(self.objects[content_hash][0]), content_hash, self.where))

    def exists(self, content_hash: str) -> bool:
        return self.stored_at(content_hash) is not None

    def stored_at(self, content_hash: str) -> float | None:
        self._check()
        return self.objects[content_hash][1] if content_hash in self.objects else None

    def remove(self, content_hash: str) -> None:
        self._check()
        self.objects.pop(content_hash, None)

    def close(self) -> None:
        pass


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def spooled(tmp_path):
    remote = FakeRemote()
    store = SpooledS3BlobStore(LocalBlobStore(tmp_path / "blobs"), remote)
    store.start()
    yield store, remote
    store.close()


def test_a_put_lands_locally_then_moves_to_the_remote(tmp_path, spooled):
    store, remote = spooled
    src, h = spool(tmp_path, b"stdout bytes")
    store.put(src, h)
    wait_until(lambda: store.pending() == 0)
    assert remote.objects[h][0] == b"stdout bytes" and not store.local.exists(h)
    with store.open(h) as f:  # from the remote now
        assert f.read() == b"stdout bytes"


def test_while_the_remote_is_down_puts_succeed_reads_are_local_and_uploads_wait(tmp_path, spooled):
    store, remote = spooled
    remote.down = True
    src, h = spool(tmp_path, b"made during the outage")
    store.put(src, h)  # never waits for, nor fails with, the remote
    time.sleep(0.3)
    assert store.pending() == 1 and store.local.exists(h) and h not in remote.objects
    with store.open(h) as f:
        assert f.read() == b"made during the outage"
    remote.down = False
    wait_until(lambda: store.pending() == 0)
    assert h in remote.objects and not store.local.exists(h)


def test_a_blob_only_in_the_remote_is_unavailable_while_it_is_down(tmp_path, spooled):
    store, remote = spooled
    src, h = spool(tmp_path, b"uploaded")
    store.put(src, h)
    wait_until(lambda: store.pending() == 0)
    remote.down = True
    with pytest.raises(BlobStoreUnavailable):
        store.open(h)


def test_a_restarted_store_uploads_what_the_last_run_left(tmp_path):
    local = LocalBlobStore(tmp_path / "blobs")
    src, h = spool(tmp_path, b"left behind")
    local.put(src, h)
    remote = FakeRemote()
    store = SpooledS3BlobStore(local, remote)
    store.start()
    try:
        wait_until(lambda: h in remote.objects)
    finally:
        store.close()


def test_a_corrupt_local_copy_is_not_uploaded(tmp_path, spooled):
    store, remote = spooled
    remote.down = True
    src, h = spool(tmp_path, b"original")
    store.put(src, h)
    store.local.path(h).write_bytes(b"0riginal")
    remote.down = False
    # The real remote's upload hashes the file first; the fake's does not: use the real check.
    from sandboxd.ledger.s3_blobs import S3BlobStore

    with pytest.raises(BlobIntegrityError, match="not uploaded"):
        S3BlobStore(None, "b", "", "nowhere").upload(store.local.path(h), h)


def record(h: str, artifact_id: str = "art-1") -> ArtifactRecord:
    return ArtifactRecord(artifact_id, "tc-1", "ev-1", "stdout", h, 1, "", "2026-01-01T00:00:00Z")


def test_retention_removes_from_both_and_retries_while_the_remote_is_down(tmp_path, spooled):
    store, remote = spooled
    db = Database(tmp_path / "db.sqlite")
    artifacts = FileArtifactStore(tmp_path / "blobs", db, store)
    src, h = spool(tmp_path, b"expired output")
    artifacts.put_blob(src, h)
    wait_until(lambda: store.pending() == 0)
    remote.down = True
    assert artifacts.remove_unreferenced([h], grace_s=0) == []  # not settled: tried again later
    remote.down = False
    assert artifacts.remove_unreferenced([h], grace_s=0) == [h]
    assert h not in remote.objects and not store.exists(h)
    with pytest.raises(FileNotFoundError):
        artifacts.open(record(h))
    db.close()


def test_a_blob_put_within_the_grace_period_is_kept(tmp_path, spooled):
    store, _remote = spooled
    db = Database(tmp_path / "db.sqlite")
    artifacts = FileArtifactStore(tmp_path / "blobs", db, store)
    src, h = spool(tmp_path, b"just put")
    artifacts.put_blob(src, h)
    assert artifacts.remove_unreferenced([h], grace_s=600) == []
    assert store.exists(h)
    db.close()


def test_a_removal_racing_an_upload_leaves_nothing_behind(tmp_path):
    release = threading.Event()

    class SlowRemote(FakeRemote):
        def upload(self, path, content_hash):
            data = path.read_bytes()
            release.wait(5)
            self.objects[content_hash] = (data, time.time())

    remote = SlowRemote()
    store = SpooledS3BlobStore(LocalBlobStore(tmp_path / "blobs"), remote)
    store.start()
    try:
        src, h = spool(tmp_path, b"raced")
        store.put(src, h)
        time.sleep(0.2)  # the upload has begun
        store.remove(h)
        release.set()
        wait_until(lambda: store.pending() == 0)
        time.sleep(0.2)
        assert h not in remote.objects and not store.local.exists(h)
    finally:
        store.close()


def test_the_artifacts_settings_name_the_field_they_refuse():
    assert DaemonSettings().artifacts.store == "local"
    for section, field in (({"store": "gcs"}, "store"), ({"endpoint_url": "127.0.0.1:8333"}, "endpoint_url"),
                           ({"prefix": "/abs"}, "prefix"), ({"bucket": "x"}, "bucket"), ({"buckt": "y"}, "buckt")):
        with pytest.raises(ValidationError) as exc:
            DaemonSettings.model_validate({"artifacts": section})
        assert exc.value.errors()[0]["loc"] == ("artifacts", field)
    ok = ArtifactSettings(store="s3", endpoint_url="http://127.0.0.1:8333", bucket="artifacts", prefix="a/b/")
    assert ok.addressing_style == "path" and ok.region == "us-east-1"


def test_the_local_store_is_the_default_and_boto3_is_not_imported(tmp_path):
    assert isinstance(open_blob_store(ArtifactSettings(), tmp_path / "blobs"), LocalBlobStore)
    code = "import sys, sandboxd.main; print('boto3' in sys.modules, 'botocore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_credentials_file_must_be_private(tmp_path):
    from sandboxd.core.errors import FailedPrecondition
    from sandboxd.ledger.s3_blobs import read_credentials_file

    path = tmp_path / "credentials"
    path.write_text("[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
    path.chmod(0o644)
    with pytest.raises(FailedPrecondition, match="0600") as exc:
        read_credentials_file(path)
    assert exc.value.field == "artifacts.credentials_file"
    path.chmod(0o600)
    assert read_credentials_file(path) == {"aws_access_key_id": "AK", "aws_secret_access_key": "SK"}
    path.write_text("[other]\naws_access_key_id = AK\n")
    with pytest.raises(FailedPrecondition, match="no \\[default\\]"):
        read_credentials_file(path)


class FakeS3Client:
    """The calls S3BlobStore makes of boto3's client, kept in memory."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.uploads: dict[str, list[bytes]] = {}
        self.aborted: list[str] = []
        self.calls: list[str] = []

    def put_object(self, Bucket, Key, Body, ContentLength, ContentMD5):  # noqa: N803 - boto3's names
        self.calls.append("put_object")
        self.objects[Key] = Body.read()

    def create_multipart_upload(self, Bucket, Key):  # noqa: N803
        upload_id = f"u{len(self.uploads)}"
        self.uploads[upload_id] = []
        return {"UploadId": upload_id}

    def upload_part(self, Bucket, Key, UploadId, Body, PartNumber, ContentMD5):  # noqa: N803
        import base64 as b64

        assert ContentMD5 == b64.b64encode(hashlib.md5(Body).digest()).decode()
        assert PartNumber == len(self.uploads[UploadId]) + 1
        self.uploads[UploadId].append(Body)
        return {"ETag": f'"{PartNumber}"'}

    def complete_multipart_upload(self, Bucket, Key, UploadId, MultipartUpload):  # noqa: N803
        assert [p["PartNumber"] for p in MultipartUpload["Parts"]] == list(range(1, len(self.uploads[UploadId]) + 1))
        self.objects[Key] = b"".join(self.uploads.pop(UploadId))

    def abort_multipart_upload(self, Bucket, Key, UploadId):  # noqa: N803
        self.aborted.append(UploadId)
        self.uploads.pop(UploadId, None)

    def head_object(self, Bucket, Key):  # noqa: N803
        return {"ContentLength": len(self.objects[Key])}


def test_a_blob_past_the_threshold_goes_up_in_parts_each_checked(tmp_path):
    from sandboxd.ledger.s3_blobs import MIN_PART_BYTES, S3BlobStore

    client = FakeS3Client()
    store = S3BlobStore(client, "b", "p/", "fake", multipart_bytes=MIN_PART_BYTES)
    data = os.urandom(MIN_PART_BYTES * 2 + 123)
    path, content_hash = spool(tmp_path, data)
    store.upload(path, content_hash)
    assert client.objects[store.key(content_hash)] == data and "put_object" not in client.calls
    small, small_hash = spool(tmp_path, b"small", "small")
    store.upload(small, small_hash)
    assert client.calls == ["put_object"] and client.objects[store.key(small_hash)] == b"small"


def test_a_corrupt_local_blob_never_completes_a_multipart_upload(tmp_path):
    from sandboxd.ledger.s3_blobs import MIN_PART_BYTES, S3BlobStore

    client = FakeS3Client()
    store = S3BlobStore(client, "b", "", "fake", multipart_bytes=MIN_PART_BYTES)
    data = os.urandom(MIN_PART_BYTES + 10)
    path, content_hash = spool(tmp_path, data)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the local copy rotted after it was hashed
    with pytest.raises(BlobIntegrityError, match="it is not uploaded"):
        store.upload(path, content_hash)
    assert client.objects == {} and client.aborted == ["u0"]
