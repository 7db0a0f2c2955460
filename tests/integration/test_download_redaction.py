"""A download from a leased sandbox that was given secrets is redacted as the lease's
output is (issue 32, finding 2): a command that copies its credential to a file, and
names a file after it, gets neither out raw through FileService; the record says what
was sent, redacted, and its sha256 is of those bytes."""

from __future__ import annotations

import hashlib
import json

import pytest

from sandboxd_client.transfer import target
from sandboxd_testing import make_daemon

from .conftest import DAEMON_ENV, call, public_tmpdir, sh, stop_and_clean

FILE_SECRET = "ghp_download_secret_0a1b2c3d4e5f"
ENV_SECRET = "env-download-secret-Qx7-9911"
WRITE_ALL = {"filesystem": {"writeRoots": ["/workspace"]}, "environment": {"secretEnvAllowed": True}}


@pytest.fixture(scope="module")
def secret_daemon(docker_engine):
    base = public_tmpdir("sandboxd-dl-redact-")
    secret_file = base / "token"
    secret_file.write_text(FILE_SECRET + "\n")
    secret_file.chmod(0o600)
    d = make_daemon(base / "d", env={**DAEMON_ENV, "SANDBOXD_DL_TOKEN": ENV_SECRET}, credentials={
        "filetok": {"file": str(secret_file), "principals": ["root"]},
        "envtok": {"env": "SANDBOXD_DL_TOKEN", "principals": ["root"]},
    }).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_what_a_lease_with_secrets_gives_out_is_redacted(secret_daemon, adapter, tmp_path):
    ws = secret_daemon.new_workspace()
    with secret_daemon.client() as c:
        lease = c.acquire_sandbox(str(ws), WRITE_ALL, adapter=adapter)
        try:
            cmd = call(ws, sh('mkdir -p /tmp/out && cp /tmp/creds/f /tmp/out/copy && '
                              'printf "before %s after\\n" "$ENV_TOK" > /tmp/out/env.txt && '
                              'echo plain > "/tmp/out/named-$ENV_TOK" && echo "$ENV_TOK"'), WRITE_ALL,
                       runtime={"adapter": adapter, "leaseId": lease.lease_id})
            cmd["credentialRefs"] = [{"bindingId": "filetok", "filePath": "/tmp/creds/f"},
                                     {"bindingId": "envtok", "envName": "ENV_TOK"}]
            out = c.run(cmd)
            assert out.result.status == "success", out.stderr
            assert out.stdout == b"[REDACTED:envtok]\n"  # the lease's output: redacted

            got = c.download(target(lease_id=lease.lease_id), "/tmp/out", tmp_path / "out")
            sent = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
            assert sent["copy"] == b"[REDACTED:filetok]"  # the value without its file's newline
            assert sent["env.txt"] == b"before [REDACTED:envtok] after\n"
            assert sent["named-[REDACTED:envtok]"] == b"plain\n"
            for data in sent.values():
                assert FILE_SECRET.encode() not in data and ENV_SECRET.encode() not in data
            assert all(e.redacted for e in got.entries if e.kind == "file")

            [event] = c.get_trace(got.transfer_id)
            rec = json.loads(event.payload_json)
            assert FILE_SECRET not in event.payload_json and ENV_SECRET not in event.payload_json
            files = {e["path"]: e for e in rec["entries"] if e["kind"] == "file"}
            copy = files["/tmp/out/copy"]
            assert copy["redacted"] is True and copy["sizeBytes"] == len(sent["copy"])
            assert copy["sha256"] == "sha256:" + hashlib.sha256(sent["copy"]).hexdigest()
            assert "/tmp/out/named-[REDACTED:envtok]" in files

            # A lease given no secret sends its files as they are.
            other = secret_daemon.new_workspace()
            plain = c.acquire_sandbox(str(other), WRITE_ALL, adapter=adapter)
            try:
                made = call(other, sh("printf 'x%.0s' 1 2 3 > /tmp/p"), WRITE_ALL,
                            runtime={"adapter": adapter, "leaseId": plain.lease_id})
                assert c.run(made).result.status == "success"
                untouched = c.download(target(lease_id=plain.lease_id), "/tmp/p", tmp_path / "p")
                assert (tmp_path / "p").read_bytes() == b"xxx" and not untouched.entries[0].redacted
            finally:
                c.release_sandbox(plain.lease_id)
        finally:
            c.release_sandbox(lease.lease_id)
