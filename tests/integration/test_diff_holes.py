"""The diff and the baseline, attacked for real on both backends (issue 32):
- finding 1: a call removes a file closed to it (root's, 0600), makes files until one
  gets its inode number and renames that one over its name: the same path and inode
  number, and the diff showed the content before, as the daemon had read it as root;
- finding 6: what a call with secrets wrote was kept raw under state_dir/baseline."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from sandboxd_testing import make_daemon

from .conftest import BACKENDS, DAEMON_ENV, AdapterClient, call, public_tmpdir, sh, stop_and_clean
from .test_cli import ctl

WRITABLE = {"filesystem": {"writeRoots": ["/workspace"]}}

REUSE_INODE_NUMBER = """
import os
target = "/workspace/secret.txt"
number = os.stat(target).st_ino
os.unlink(target)
made = []
for n in range(2000):
    candidate = f"/workspace/.made{n}"
    with open(candidate, "w") as f:
        f.write("mine\\n")
    if os.stat(candidate).st_ino == number:
        os.rename(candidate, target)
        print("reused after", n + 1)
        break
    made.append(candidate)
else:
    print("not reused")  # another process on the host took the number first
for candidate in made:
    os.unlink(candidate)
with open("/workspace/edit.txt", "a") as f:
    f.write("2\\n")
"""


def download(client, artifact_id: str) -> bytes:
    sink = io.BytesIO()
    client.download_artifact(artifact_id, sink)
    return sink.getvalue()


def test_a_new_file_in_the_inode_number_of_one_closed_to_the_sandbox_shows_nothing_of_it(client, daemon):
    for _ in range(5):  # the freed number may go to another process on the host first: tried again
        ws = daemon.new_workspace({"edit.txt": "1\n"})
        (ws / "secret.txt").write_text("ROOTONLY-c41f9e\n")  # root's, 0600: the sandbox cannot read it
        (ws / "secret.txt").chmod(0o600)
        number = (ws / "secret.txt").stat().st_ino
        out = client.run(call(ws, ["python3", "-c", REUSE_INODE_NUMBER], WRITABLE))
        assert out.result.status == "success", (out.result, out.stdout, out.stderr)
        [diff] = [a for a in out.result.artifacts if a.kind == "diff"]
        text = download(client, diff.artifact_id).decode()
        assert "ROOTONLY" not in text
        assert "@@ -1 +1,2 @@\n 1\n+2\n" in text  # a file changed in place still is diffed
        if out.stdout.startswith(b"reused after"):
            break
    else:
        pytest.fail("the inode number was never reused: the attack did not take place")
    assert (ws / "secret.txt").stat().st_ino == number and (ws / "secret.txt").read_text() == "mine\n"
    assert ("diff --git a/workspace/secret.txt b/workspace/secret.txt\n# sandboxd: not diffed: its content before "
            "the call is shown only for a file changed in place\n") in text
    shown = ctl(daemon, "diff", out.tool_call_id)
    assert shown.returncode == 0, shown.stderr
    assert b"ROOTONLY" not in shown.stdout and b"+2\n" in shown.stdout


SECRET = "tok-5e0a7d19b2c8f346"


@pytest.fixture(scope="module")
def credentialed_daemon(docker_engine):
    base = public_tmpdir("sandboxd-baseline-")
    d = make_daemon(base / "d", env={**DAEMON_ENV, "SANDBOXD_TEST_TOKEN": SECRET}, credentials={
        "tok": {"env": "SANDBOXD_TEST_TOKEN", "principals": ["root"]}}).start()
    yield d
    stop_and_clean(d, docker_engine, base)


def holding(directory: Path, needle: bytes) -> list[str]:
    return [str(f) for f in directory.rglob("*") if f.is_file() and needle in f.read_bytes()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_a_call_with_secrets_wrote_is_not_kept_raw_by_the_daemon(credentialed_daemon, backend):
    d = credentialed_daemon
    ws = d.new_workspace({"notes.txt": "start\n"})
    policy = {**WRITABLE, "environment": {"secretEnvAllowed": True}}
    with AdapterClient(str(d.socket), backend) as c:
        first = call(ws, sh('printf "token=%s\\n" "$TOK" > /workspace/out.txt; '
                            'printf "used %s\\n" "$TOK" >> /workspace/notes.txt'), policy)
        first["credentialRefs"] = [{"bindingId": "tok", "envName": "TOK"}]
        assert c.run(first).result.status == "success"
        assert SECRET in (ws / "out.txt").read_text()  # the workspace holds it: the call wrote it there
        assert holding(d.state_dir, SECRET.encode()) == []
        # Later calls without secrets: the written file's ctime moves (a chmod), so the
        # hash cache reads it again; another file changes.
        later = c.run(call(ws, sh("chmod 600 /workspace/out.txt; echo fresh > /workspace/fresh.txt"), policy))
        assert later.result.status == "success", later.stderr
        time.sleep(1)  # the write roots' refresh ahead of the next call
        again = c.run(call(ws, sh("echo more >> /workspace/fresh.txt"), policy))
        assert again.result.status == "success", again.stderr
        assert holding(d.state_dir, SECRET.encode()) == []
        # What no call with secrets wrote is kept again: the diff shows it.
        [diff] = [a for a in again.result.artifacts if a.kind == "diff"]
        assert b" fresh\n+more\n" in download(c, diff.artifact_id)
