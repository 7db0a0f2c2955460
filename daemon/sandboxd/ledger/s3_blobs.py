"""The S3 artifact store: `S3BlobStore` (boto3; botocore's errors translated here only)
and `SpooledS3BlobStore`, the store the daemon uses when `artifacts.store` is s3.

A put lands in the local store first, durable, and returns: a call never waits for S3 nor
fails because it is down. An uploader thread then copies each blob to S3, retrying while
the store is unreachable, and removes the local copy only once S3 holds the whole blob
(the server checked its MD5, its size read back). Reads take the local copy while there
is one, else S3; both are verified against the sha256. This module is imported only when
the settings name S3 (blobs.open_blob_store): boto3 costs the daemon's start nothing else."""

from __future__ import annotations

import base64
import configparser
import hashlib
import io
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from sandboxd.core.artifact_settings import mask_userinfo, without_userinfo
from sandboxd.core.errors import FailedPrecondition
from sandboxd.core.safe_open import read_setting_file
from sandboxd.core.settings import ArtifactSettings
from sandboxd.ledger.blobs import (READ_CHUNK_BYTES, BlobIntegrityError, BlobStoreUnavailable, LocalBlobStore,
                                   VerifiedReader, blob_key)

log = logging.getLogger("sandboxd.ledger.s3_blobs")

# Between two upload attempts while S3 is down: doubling from the first to the last.
RETRY_FIRST_S = 0.5
# S3's multipart rules: at most 10,000 parts, each (but the last) at least 5 MiB.
MAX_PARTS = 10_000
MIN_PART_BYTES = 5 * 2**20
MAX_PART_IN_MEMORY = 64 * 2**20
RETRY_MAX_S = 5.0
# A credentials file holds a few profiles: anything larger is not one.
MAX_CREDENTIALS_FILE_BYTES = 64 * 1024
_MISSING = ("NoSuchKey", "NotFound", "NoSuchBucket", "404")


class StoreRefused(BlobStoreUnavailable):
    """The store answered, and said no (credentials, permissions, a server error)."""


def read_credentials_file(path: Path) -> dict[str, str]:
    """An AWS-style credentials file's [default] profile as boto3 client arguments. It
    must be the daemon's own and private (like a credentials binding's file): opened once,
    no symlink followed, never blocking, checked and read through that descriptor. What
    is wrong with it is told by line number only, never a line (it may be the secret)."""
    field = "artifacts.credentials_file"
    data = read_setting_file(path, setting=field, max_bytes=MAX_CREDENTIALS_FILE_BYTES, private=True)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise FailedPrecondition(f"{path}: line {line} is not UTF-8 text", field=field) from None
    # No interpolation: a "%" in a secret is the secret's, never a reference (nor an error quoting it).
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text, source=str(path))
    except configparser.Error as exc:
        # Its text quotes the line: only the number is kept.
        errors = getattr(exc, "errors", None)
        lineno = getattr(exc, "lineno", None) or (errors[0][0] if errors else None)
        where = f"line {lineno}" if lineno else "a line"
        raise FailedPrecondition(f"{path}: {where} is not AWS credentials file syntax ([profile] headers, then "
                                 "key = value lines)", field=field) from None
    profile = parser["default"] if parser.has_section("default") else {}
    if not profile.get("aws_access_key_id") or not profile.get("aws_secret_access_key"):
        raise FailedPrecondition(f"{path} has no [default] aws_access_key_id and aws_secret_access_key",
                                 field=field)
    found = {"aws_access_key_id": profile["aws_access_key_id"], "aws_secret_access_key": profile["aws_secret_access_key"]}
    if profile.get("aws_session_token"):
        found["aws_session_token"] = profile["aws_session_token"]
    return found


class S3BlobStore:
    """Blobs as objects `<prefix>sha256/<ab>/<hex>` of one bucket."""

    def __init__(self, client: Any, bucket: str, prefix: str, where: str, multipart_bytes: int = 256 * 2**20):
        self._client = client
        self.bucket = bucket
        self.prefix = prefix
        self.where = where
        self.multipart_bytes = multipart_bytes

    def key(self, content_hash: str) -> str:
        return self.prefix + blob_key(content_hash)

    @contextmanager
    def _translated(self, action: str) -> Iterator[None]:
        """botocore's errors, here only: a missing object is FileNotFoundError, anything
        else the store being unavailable (retryable), with what it said."""
        try:
            yield
        except ClientError as exc:
            error = exc.response.get("Error", {})
            if error.get("Code") in _MISSING:
                raise FileNotFoundError(f"{action}: no such object in {self.where}") from None
            raise StoreRefused(mask_userinfo(f"{action}: {self.where} refused it: {error.get('Code')} "
                                             f"{error.get('Message', '')}".rstrip())) from None
        except BotoCoreError as exc:
            # botocore's text may quote the URL it tried.
            raise BlobStoreUnavailable(mask_userinfo(f"{action}: {self.where} is unreachable ({exc})")) from None

    def check_bucket(self) -> None:
        with self._translated(f"bucket {self.bucket}"):
            self._client.head_bucket(Bucket=self.bucket)

    def upload(self, path: Path, content_hash: str) -> None:
        """Copies a local blob to its key. Its bytes are checked against the sha256 on the
        way (a corrupt local copy is never uploaded) and the server against their MD5;
        past `multipart_bytes` in parts (one PUT stops at 5 GB), each part's MD5 checked."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size > self.multipart_bytes:
                found = self._upload_parts(f, content_hash, size)
            else:
                found = self._upload_whole(f, content_hash, size)
        if found != content_hash:
            raise BlobIntegrityError(f"local blob {content_hash} hashes to {found}: it is not uploaded")
        with self._translated(f"upload of {content_hash}"):
            stored = self._client.head_object(Bucket=self.bucket, Key=self.key(content_hash))["ContentLength"]
        if stored != size:
            raise BlobStoreUnavailable(f"upload of {content_hash}: {self.where} holds {stored} of its {size} bytes")

    def _upload_whole(self, f: BinaryIO, content_hash: str, size: int) -> str:
        md5, sha256 = hashlib.md5(usedforsecurity=False), hashlib.sha256()
        while chunk := f.read(READ_CHUNK_BYTES):
            md5.update(chunk)
            sha256.update(chunk)
        if f"sha256:{sha256.hexdigest()}" != content_hash:
            return f"sha256:{sha256.hexdigest()}"  # refused by upload(), before any byte leaves
        f.seek(0)
        with self._translated(f"upload of {content_hash}"):
            self._client.put_object(Bucket=self.bucket, Key=self.key(content_hash), Body=f, ContentLength=size,
                                    ContentMD5=base64.b64encode(md5.digest()).decode())
        return content_hash

    def _upload_parts(self, f: BinaryIO, content_hash: str, size: int) -> str:
        """A multipart upload, completed only once every part's bytes hashed to the blob's
        sha256 (else aborted: the key never holds other bytes)."""
        key, sha256 = self.key(content_hash), hashlib.sha256()
        # Parts held in memory one at a time: at most 64 MB unless 10,000 of them would not hold it.
        part_bytes = max(min(self.multipart_bytes, MAX_PART_IN_MEMORY), MIN_PART_BYTES, -(-size // MAX_PARTS))
        with self._translated(f"upload of {content_hash}"):
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        parts: list[dict[str, Any]] = []
        try:
            while data := f.read(part_bytes):
                sha256.update(data)
                md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
                with self._translated(f"upload of {content_hash}"):
                    etag = self._client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, Body=data,
                                                    PartNumber=len(parts) + 1, ContentMD5=md5)["ETag"]
                parts.append({"PartNumber": len(parts) + 1, "ETag": etag})
            found = f"sha256:{sha256.hexdigest()}"
            if found != content_hash:
                raise BlobIntegrityError(f"local blob {content_hash} hashes to {found}: it is not uploaded")
            with self._translated(f"upload of {content_hash}"):
                self._client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                       MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - the store's own expiry rule takes it then
                log.warning("aborting the multipart upload of %s failed", content_hash)
            raise
        return found

    def open(self, content_hash: str) -> BinaryIO:
        with self._translated(f"read of {content_hash}"):
            body = self._client.get_object(Bucket=self.bucket, Key=self.key(content_hash))["Body"]
        reader = VerifiedReader(_Body(body, self, content_hash), content_hash, self.where)
        return io.BufferedReader(reader, READ_CHUNK_BYTES)

    def exists(self, content_hash: str) -> bool:
        return self.stored_at(content_hash) is not None

    def stored_at(self, content_hash: str) -> float | None:
        try:
            with self._translated(f"lookup of {content_hash}"):
                head = self._client.head_object(Bucket=self.bucket, Key=self.key(content_hash))
        except FileNotFoundError:
            return None
        return float(head["LastModified"].timestamp())

    def remove(self, content_hash: str) -> None:
        with self._translated(f"removal of {content_hash}"):
            self._client.delete_object(Bucket=self.bucket, Key=self.key(content_hash))

    def close(self) -> None:
        self._client.close()


class _Body:
    """An object's streamed body, its read errors translated like every other call's."""

    def __init__(self, body: Any, store: S3BlobStore, content_hash: str):
        self._body = body
        self._store = store
        self._action = f"read of {content_hash}"

    def read(self, size: int = -1) -> bytes:
        with self._store._translated(self._action):
            return bytes(self._body.read(size))

    def close(self) -> None:
        self._body.close()


def s3_store(settings: ArtifactSettings) -> S3BlobStore:
    """The configured bucket's store. A bucket that is missing or refuses the
    credentials stops the start (a configuration error); one that does not answer yet
    does not: blobs wait in the local store until it does."""
    config = Config(region_name=settings.region, s3={"addressing_style": settings.addressing_style},
                    retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=60,
                    max_pool_connections=32,
                    # Only the checksums S3 itself requires: most S3-compatible servers do not
                    # know the newer trailing CRC32 ones (the MD5 and sha256 checks are ours).
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    credentials = read_credentials_file(settings.credentials_file) if settings.credentials_file else {}
    # botocore's debug log quotes every request's URL and headers (a session token among
    # them): never in the daemon's log, whatever its level.
    for name in ("botocore", "boto3", "urllib3"):
        if logging.getLogger(name).getEffectiveLevel() < logging.INFO:
            logging.getLogger(name).setLevel(logging.INFO)
    # A session of its own: boto3's module-level default session is shared state. The
    # endpoint's userinfo is no part of S3's authentication: boto3 never gets it (so
    # neither its errors nor its log can quote it).
    endpoint = without_userinfo(settings.endpoint_url) if settings.endpoint_url else None
    client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config, **credentials)
    where = f"the S3 store {settings.endpoint_shown}/{settings.bucket}/{settings.prefix}"
    store = S3BlobStore(client, settings.bucket, settings.prefix, where, settings.multipart_threshold_mb * 2**20)
    try:
        store.check_bucket()
    except FileNotFoundError:
        raise FailedPrecondition(f"no bucket {settings.bucket} at {settings.endpoint_shown}",
                                 field="artifacts.bucket") from None
    except StoreRefused as exc:
        raise FailedPrecondition(exc.reason, field="artifacts.bucket") from None
    except BlobStoreUnavailable as exc:
        log.warning("%s; blobs are kept locally until it answers", exc.reason)
    return store


class SpooledS3BlobStore:
    """The local store in front of S3 (see the module's doc). One lock orders a put,
    the end of an upload and a removal of the same blob: a put never refreshes a local
    copy the uploader is removing, and an upload that raced a removal is undone."""

    def __init__(self, local: LocalBlobStore, remote: S3BlobStore):
        self.local = local
        self.remote = remote
        self._lock = threading.Lock()
        self._pending: dict[str, None] = {}  # insertion-ordered: the oldest put is uploaded first
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Uploads what an earlier run left in the local store, then every new put."""
        with self._lock:
            self._pending.update(dict.fromkeys(self.local.hashes()))
        self._thread = threading.Thread(target=self._upload_loop, name="s3-uploader", daemon=True)
        self._thread.start()

    def put(self, src: Path, content_hash: str) -> None:
        with self._lock:
            self.local.put(src, content_hash)
            self._pending[content_hash] = None
            self._wake.notify()

    def open(self, content_hash: str) -> BinaryIO:
        try:
            return self.local.open(content_hash)
        except FileNotFoundError:  # uploaded (or never here): S3 has it or nobody does
            return self.remote.open(content_hash)

    def exists(self, content_hash: str) -> bool:
        return self.local.exists(content_hash) or self.remote.exists(content_hash)

    def stored_at(self, content_hash: str) -> float | None:
        local = self.local.stored_at(content_hash)
        return local if local is not None else self.remote.stored_at(content_hash)

    def remove(self, content_hash: str) -> None:
        with self._lock:
            self._pending.pop(content_hash, None)
            self.local.remove(content_hash)
        self.remote.remove(content_hash)  # outside the lock: a slow S3 never holds up a put

    def pending(self) -> int:
        """Blobs not yet in S3."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.remote.close()

    def _next(self) -> str | None:
        with self._lock:
            while not self._pending and not self._stop.is_set():
                self._wake.wait()
            return next(iter(self._pending), None)

    def _upload_loop(self) -> None:
        delay = 0.0
        while (content_hash := self._next()) is not None:
            try:
                self._upload(content_hash)
            except BlobStoreUnavailable as exc:
                if not delay:
                    log.warning("%s; %d blobs wait in the local store, retried", exc.reason, self.pending())
                delay = min(max(delay * 2, RETRY_FIRST_S), RETRY_MAX_S)
                self._stop.wait(delay)
                continue
            except Exception:  # noqa: BLE001 - one blob's failure never stops the others'
                log.exception("upload of %s failed; it stays in the local store", content_hash)
                with self._lock:
                    self._pending.pop(content_hash, None)
                continue
            if delay:
                log.info("%s answers again; uploading the %d blobs kept meanwhile", self.remote.where, self.pending())
                delay = 0.0

    def _upload(self, content_hash: str) -> None:
        path = self.local.path(content_hash)
        try:
            self.remote.upload(path, content_hash)
        except FileNotFoundError:  # removed meanwhile (retention)
            with self._lock:
                self._pending.pop(content_hash, None)
            return
        with self._lock:
            self._pending.pop(content_hash, None)
            removed_meanwhile = not self.local.exists(content_hash)
            self.local.remove(content_hash)
        if removed_meanwhile:  # by retention, while it was uploading: the upload is undone
            self.remote.remove(content_hash)
