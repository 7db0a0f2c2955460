"""What a call leaves behind, for real on both backends: each file it created, modified,
renamed or deleted under its write roots is a `file` artifact (downloadable, its bytes
what the call left), the `diff` artifact shows the text it changed against the content
before the call, `sandboxctl diff` prints it, and the caps leave files out and say so."""

from __future__ import annotations

import hashlib
import io
import json

import pytest

from sandboxd_client import errors

from .conftest import call, sh
from .test_cli import ctl


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def download(client, artifact_id: str) -> bytes:
    sink = io.BytesIO()
    client.download_artifact(artifact_id, sink)
    return sink.getvalue()


EDITS = ("sed -i 's/x = 1/x = 2/' /workspace/src/app.py; printf 'new\\n' > /workspace/new.txt; "
         "rm /workspace/gone.txt; mv /workspace/old.txt /workspace/moved.txt; "
         "printf '\\000\\001' > /workspace/blob.bin; chmod 755 /workspace/blob.bin; echo done")


def test_changed_files_are_artifacts_and_the_diff_shows_the_edit(client, daemon):
    ws = daemon.new_workspace({"src/app.py": "x = 1\ny = 0\n", "gone.txt": "bye\n", "old.txt": "same\n",
                               "untouched.txt": "-\n"})
    out = client.run(call(ws, sh(EDITS), {"filesystem": {"writeRoots": ["/workspace"]}}))
    assert out.result.status == "success", out.stderr
    assert list(out.result.artifacts_omitted) == []
    files = {a.path: a for a in out.result.artifacts if a.kind == "file"}
    assert {p: a.change for p, a in files.items()} == {
        "/workspace/src/app.py": "modified", "/workspace/new.txt": "created", "/workspace/gone.txt": "deleted",
        "/workspace/moved.txt": "renamed", "/workspace/blob.bin": "created"}
    assert download(client, files["/workspace/src/app.py"].artifact_id) == b"x = 2\ny = 0\n"
    assert files["/workspace/src/app.py"].content_hash == sha(b"x = 2\ny = 0\n")
    assert files["/workspace/blob.bin"].file_mode == "0755"
    assert files["/workspace/moved.txt"].previous_path == "/workspace/old.txt"
    with pytest.raises(errors.FailedPrecondition, match="deleted /workspace/gone.txt"):
        download(client, files["/workspace/gone.txt"].artifact_id)
    [diff] = [a for a in out.result.artifacts if a.kind == "diff"]
    text = download(client, diff.artifact_id).decode()
    # sed -i replaces the file with a new inode, and a deleted file's inode is gone: the
    # content they had is not shown (it may have been closed to the sandbox), only named.
    in_place_only = "# sandboxd: not diffed: its content before the call is shown only for a file changed in place\n"
    assert f"diff --git a/workspace/src/app.py b/workspace/src/app.py\n{in_place_only}" in text
    assert f"deleted file mode 100644\n{in_place_only}" in text and "bye" not in text
    assert "rename from workspace/old.txt\nrename to workspace/moved.txt\n" in text
    assert "new file mode 100644\n--- /dev/null\n+++ b/workspace/new.txt\n@@ -0,0 +1 @@\n+new\n" in text
    assert "Binary files /dev/null and b/workspace/blob.bin differ" in text
    # The record says the same: an ArtifactPersisted per artifact, with the path and change.
    persisted = [json.loads(e.payload_json) for e in client.get_trace(out.tool_call_id)
                 if e.type == "ArtifactPersisted"]
    assert {p["path"]: p["change"] for p in persisted if p["kind"] == "file"} == \
        {p: a.change for p, a in files.items()}
    # The listing of the call's artifacts has them too.
    listed = {a.artifact_id: a for a in client.list_artifacts(out.tool_call_id)}
    assert listed[files["/workspace/moved.txt"].artifact_id].previous_path == "/workspace/old.txt"


def test_a_file_edited_in_place_is_diffed_and_one_closed_to_the_sandbox_is_not_kept(client, daemon):
    ws = daemon.new_workspace({"src/app.py": "x = 1\ny = 0\n"})
    (ws / "root.key").write_text("ROOTONLY\n")  # root's, 0600: the sandbox cannot read it
    (ws / "root.key").chmod(0o600)
    out = client.run(call(ws, sh("printf 'x = 1\\ny = 1\\n' > /workspace/src/app.py; "
                                 "mv /workspace/root.key /workspace/moved.key"),
                          {"filesystem": {"writeRoots": ["/workspace"]}}))
    assert out.result.status == "success", out.stderr
    files = {a.path for a in out.result.artifacts if a.kind == "file"}
    assert files == {"/workspace/src/app.py"}
    assert list(out.result.artifacts_omitted) == ["/workspace/moved.key: the sandbox's user cannot read it: not kept"]
    [diff] = [a for a in out.result.artifacts if a.kind == "diff"]
    text = download(client, diff.artifact_id).decode()
    assert "@@ -1,2 +1,2 @@\n x = 1\n-y = 0\n+y = 1\n" in text and "ROOTONLY" not in text


def test_with_blocked_paths_a_renamed_parent_leaks_nothing(client, daemon):
    ws = daemon.new_workspace({"conf/secret.env": "TOKEN=abc\n", "conf/app.ini": "a\n"})
    out = client.run(call(ws, sh("mv /workspace/conf /workspace/moved"),
                          {"filesystem": {"writeRoots": ["/workspace"], "blockedPaths": ["conf/secret.env"]}}))
    assert out.result.status == "success", out.stderr
    assert {a.kind for a in out.result.artifacts} <= {"stdout", "stderr"}
    assert list(out.result.artifacts_omitted) == [
        "2 changed files: none is kept or diffed when a blocked path lies below a directory the sandbox could "
        "move"]


def test_a_blocked_path_right_below_a_root_leaves_collection_on(client, daemon):
    """`.env` (the operator's always_blocked) sits in the root itself, a mount the sandbox
    cannot rename: nothing can be carried out from under its mask, so a call's changes
    are still kept and diffed, and the masked file is never among them."""
    ws = daemon.new_workspace({".env": "SECRET=hunter2\n", "app.py": "x = 1\n"})
    out = client.run(call(ws, sh("printf 'x = 2\\n' > /workspace/app.py; cat /workspace/.env; "
                                 "mv /workspace/.env /workspace/stolen 2>&1 || true"),
                          {"filesystem": {"writeRoots": ["/workspace"]}}))
    assert out.result.status == "success", out.stderr
    assert {a.path for a in out.result.artifacts if a.kind == "file"} == {"/workspace/app.py"}
    [diff] = [a for a in out.result.artifacts if a.kind == "diff"]
    text = download(client, diff.artifact_id).decode()
    assert "-x = 1\n+x = 2\n" in text and "hunter2" not in text
    assert b"hunter2" not in out.stdout and (ws / ".env").read_text() == "SECRET=hunter2\n"


def test_a_mask_below_a_read_root_nested_in_a_write_root_is_never_carried_out(client, daemon):
    """The mask of .config/gh/hosts.yml (always_blocked) sits right below a read root, a
    mount the sandbox cannot rename; but that root lies in the write root, and renaming
    its parent carries it, and the file, away on the host: no file is kept or diffed."""
    ws = daemon.new_workspace({".config/gh/hosts.yml": "oauth_token: gho_SECRET123\n", "a.txt": "a\n"})
    out = client.run(call(ws, sh("mv /workspace/.config /workspace/cfg && echo b > /workspace/a.txt"),
                          {"filesystem": {"writeRoots": ["/workspace"], "readRoots": ["/workspace/.config/gh"]}}))
    assert out.result.status == "success", out.stderr
    assert {a.kind for a in out.result.artifacts} <= {"stdout", "stderr"}
    assert any("blocked path" in line for line in out.result.artifacts_omitted)
    assert (ws / "cfg" / "gh" / "hosts.yml").read_text() == "oauth_token: gho_SECRET123\n"


def test_a_call_that_changes_nothing_leaves_no_file_artifact(client, daemon):
    ws = daemon.new_workspace({"a.txt": "a\n"})
    out = client.run(call(ws, ["cat", "/workspace/a.txt"], {"filesystem": {"writeRoots": ["/workspace"]}}))
    assert out.result.status == "success"
    assert {a.kind for a in out.result.artifacts} == {"stdout"}


def test_a_second_call_diffs_against_what_the_first_left(client, daemon):
    ws = daemon.new_workspace({"n.txt": "0\n"})
    writable = {"filesystem": {"writeRoots": ["/workspace"]}}
    first = client.run(call(ws, sh("echo 1 > /workspace/n.txt"), writable))
    second = client.run(call(ws, sh("echo 2 > /workspace/n.txt"), writable))
    texts = []
    for out in (first, second):
        [diff] = [a for a in out.result.artifacts if a.kind == "diff"]
        texts.append(download(client, diff.artifact_id).decode())
    assert "-0\n+1\n" in texts[0] and "-1\n+2\n" in texts[1]


def test_sandboxctl_diff_prints_the_calls_diff(daemon):
    ws = daemon.new_workspace({"a.txt": "old\n"})
    p = ctl(daemon, "exec", "--json", "--workspace", str(ws), "-w", "/workspace", "--", "sh", "-c",
            "echo new > /workspace/a.txt")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.decode())
    shown = ctl(daemon, "diff", result["toolCallId"])
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.decode() == ("diff --git a/workspace/a.txt b/workspace/a.txt\n--- a/workspace/a.txt\n"
                                     "+++ b/workspace/a.txt\n@@ -1 +1 @@\n-old\n+new\n")
    listed = ctl(daemon, "artifact", "ls", result["toolCallId"])
    assert "\tfile\t4\t" in listed.stdout.decode() and "modified /workspace/a.txt" in listed.stdout.decode()
    read_only = json.loads(ctl(daemon, "exec", "--json", "--workspace", str(ws), "--", "true").stdout)
    none = ctl(daemon, "diff", read_only["toolCallId"])
    assert none.returncode == 1 and b"has no diff" in none.stderr


def test_past_the_caps_files_are_left_out_and_the_result_says_so(spare_daemon):
    d = spare_daemon(artifacts={"max_files_per_call": 2}).start()
    ws = d.new_workspace({})
    with d.client() as client:
        out = client.run(call(ws, sh("for n in 1 2 3; do echo $n > /workspace/f$n; done; "
                                     "head -c 2000000 /dev/zero > /workspace/large"),
                              {"filesystem": {"writeRoots": ["/workspace"]}}))
    assert out.result.status == "success", out.stderr
    kept = sorted(a.path for a in out.result.artifacts if a.kind == "file")
    assert kept == ["/workspace/f1", "/workspace/f2"]
    assert list(out.result.artifacts_omitted) == [
        "/workspace/f3: over the per-call cap of 2 file artifacts",
        "/workspace/large: over the per-call cap of 2 file artifacts"]


KEEP_TMP = {"filesystem": {"readRoots": ["/workspace"], "persistOutputs": True}, "process": {"maxTmpSizeMb": 8}}


def test_persist_outputs_keeps_what_the_call_left_in_its_temp_dir(client, daemon):
    ws = daemon.new_workspace({"in.txt": "x\n"})
    out = client.run(call(ws, sh("mkdir /tmp/sub; echo report > /tmp/report.txt; printf '\\001' > /tmp/sub/data.bin; "
                                 "cp /bin/true /tmp/t; chmod +x /tmp/t; /tmp/t && echo ran || echo noexec; "
                                 "head -c 9000000 /dev/zero > /tmp/fill || echo full"), KEEP_TMP))
    assert out.result.status == "success", out.stderr
    # The daemon's tmpfs is as the engine's: noexec, and its size is the policy's.
    assert out.stdout == b"noexec\nfull\n", out.stderr
    files = {a.path: a for a in out.result.artifacts if a.kind == "file"}
    assert set(files) == {"/tmp/report.txt", "/tmp/sub/data.bin", "/tmp/t", "/tmp/fill"}
    assert all(a.change == "created" for a in files.values())
    assert download(client, files["/tmp/report.txt"].artifact_id) == b"report\n"
    assert download(client, files["/tmp/sub/data.bin"].artifact_id) == b"\x01"
    assert files["/tmp/t"].file_mode == "0755"
    assert not [a for a in out.result.artifacts if a.kind == "diff"]  # the workspace did not change
    # Collected, the tmpfs is gone.
    assert not list((daemon.base / "runtime" / "outputs").iterdir())


def test_without_persist_outputs_the_temp_dir_leaves_nothing(client, daemon):
    ws = daemon.new_workspace({})
    out = client.run(call(ws, sh("echo report > /tmp/report.txt")))
    assert out.result.status == "success", out.stderr
    assert {a.kind for a in out.result.artifacts} == set()


def test_a_lease_cannot_keep_its_temp_dir(daemon):
    ws = daemon.new_workspace({})
    with daemon.client() as client:
        with pytest.raises(errors.FailedPrecondition,
                           match=r"^policy\.filesystem\.persistOutputs: persistOutputs needs a fresh sandbox"):
            client.acquire_sandbox(str(ws), KEEP_TMP)
