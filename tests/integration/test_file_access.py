"""File-access recording for real, on both backends: a fanotify group per call marks
only that call's own mounts, so what a call read and wrote is recorded as its own, with
the content hash it left behind, and the forensic index finds it by path."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from sandboxd_contract.canonical import file_accesses
from sandboxd_client import errors

from .conftest import BACKENDS, call, sh


def accesses(client, tool_call_id: str) -> list[dict]:
    return [a for e in client.get_trace(tool_call_id) if e.type == "FileAccessObserved"
            for a in file_accesses(json.loads(e.payload_json))]


def test_reads_and_writes_are_recorded_with_the_hash_left_behind(client, daemon):
    ws = daemon.new_workspace({"secrets.yaml": "token: x\n", "src/app.py": "print('app')\n", "untouched.txt": "-\n"})
    out = client.run(call(ws, sh("cat /workspace/secrets.yaml >/dev/null; echo built > /workspace/result.txt; "
                                 "cat /workspace/src/app.py > /tmp/copy.py; ls /workspace > /dev/null"),
                          {"filesystem": {"writeRoots": ["/workspace"]}}, ))
    assert out.result.status == "success", out.stderr
    recorded = accesses(client, out.tool_call_id)
    seen = {a["path"]: a for a in recorded if a["operation"] in ("read", "write")}
    assert set(seen) == {"/workspace/secrets.yaml", "/workspace/result.txt", "/workspace/src/app.py"}
    # The new file was also created (from the write root's before/after walk).
    assert {"path": "/workspace/result.txt", "operation": "create",
            "sha256After": "sha256:" + hashlib.sha256(b"built\n").hexdigest()} in recorded
    assert seen["/workspace/secrets.yaml"]["operation"] == "read"
    assert seen["/workspace/src/app.py"]["operation"] == "read"
    # Plain reads are recorded as [path, opens] pairs, in an event of their own.
    payloads = [json.loads(e.payload_json) for e in client.get_trace(out.tool_call_id)
                if e.type == "FileAccessObserved"]
    [reads] = [p["reads"] for p in payloads if "reads" in p]
    assert reads == [["/workspace/secrets.yaml", 1], ["/workspace/src/app.py", 1]]
    assert all(a["operation"] != "read" for p in payloads for a in p.get("accesses", []))
    written = seen["/workspace/result.txt"]
    assert written["operation"] == "write" and written["sha256Before"] == ""  # it did not exist
    assert written["sha256After"] == "sha256:" + hashlib.sha256(b"built\n").hexdigest()
    assert (ws / "result.txt").read_text() == "built\n"
    effects = out.result.effects_observed
    assert sorted(effects.reads) == ["/workspace/secrets.yaml", "/workspace/src/app.py"]
    assert list(effects.writes) == ["/workspace/result.txt"]


def test_concurrent_calls_are_never_attributed_each_others_accesses(client, daemon):
    a = daemon.new_workspace({"mine-a.txt": "a\n"})
    b = daemon.new_workspace({"mine-b.txt": "b\n"})
    results = {}

    def run(name, ws, path):
        results[name] = client.run(call(ws, sh(f"for i in $(seq 50); do cat {path} >/dev/null; sleep 0.01; done")))

    threads = [threading.Thread(target=run, args=("a", a, "/workspace/mine-a.txt")),
               threading.Thread(target=run, args=("b", b, "/workspace/mine-b.txt"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, path in (("a", "/workspace/mine-a.txt"), ("b", "/workspace/mine-b.txt")):
        got = accesses(client, results[name].tool_call_id)
        assert [x["path"] for x in got] == [path], (name, got)
        # The kernel merges repeats still in the queue: a count is a lower bound.
        assert 1 <= got[0]["opens"] <= 50


def test_the_audit_query_for_a_path_finds_the_call_that_touched_it(client, daemon):
    ws = daemon.new_workspace({"vault/key.pem": "k\n", "other.txt": "o\n"})
    touched = client.run(call(ws, ["cat", "/workspace/vault/key.pem"]))
    elsewhere = client.run(call(ws, ["cat", "/workspace/other.txt"]))
    found = [c.tool_call_id for c in client.query_calls(path=str("vault"), path_operation="read").calls]
    assert touched.tool_call_id in found and elsewhere.tool_call_id not in found, (
        found, accesses(client, touched.tool_call_id), touched.stdout, touched.stderr)


def test_record_file_access_false_records_nothing_and_adds_no_gate(client, daemon):
    ws = daemon.new_workspace({"f.txt": "x\n"})
    out = client.run(call(ws, ["cat", "/workspace/f.txt"], {"audit": {"recordFileAccess": False}}))
    assert out.result.status == "success"
    assert accesses(client, out.tool_call_id) == []
    assert list(out.result.effects_observed.reads) == []


def test_creates_deletes_renames_and_chmods_in_write_roots_are_recorded(client, daemon):
    ws = daemon.new_workspace({"old.txt": "o\n", "doomed.txt": "d\n", "script.sh": "echo\n", "keep.txt": "k\n"})
    out = client.run(call(ws, sh("mv /workspace/old.txt /workspace/new.txt; rm /workspace/doomed.txt; "
                                 "chmod 755 /workspace/script.sh; echo fresh > /workspace/fresh.txt"),
                          {"filesystem": {"writeRoots": ["/workspace"]}}))
    assert out.result.status == "success", out.stderr
    got = {(a["path"], a["operation"]) for a in accesses(client, out.tool_call_id)}
    assert ("/workspace/old.txt", "rename") in got
    assert ("/workspace/doomed.txt", "delete") in got
    assert ("/workspace/script.sh", "chmod") in got
    assert ("/workspace/fresh.txt", "create") in got
    assert not any(p == "/workspace/keep.txt" for p, _ in got)
    renamed = [a for a in accesses(client, out.tool_call_id) if a["operation"] == "rename"]
    assert renamed[0]["renamedTo"] == "/workspace/new.txt"
    assert list(out.result.effects_observed.deletes) == ["/workspace/doomed.txt"]
    # The forensic index knows both names of the renamed file.
    for path in ("old.txt", "new.txt"):
        found = [c.tool_call_id for c in client.query_calls(path=path, path_operation="rename").calls]
        assert out.tool_call_id in found, path


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_a_write_records_the_content_it_found_and_the_content_it_left(client, daemon):
    ws = daemon.new_workspace({"notes.txt": "before\n", "cfg.ini": "a=1\n", "log.txt": "0123456789\n"})
    out = client.run(call(ws, sh("echo after >> /workspace/notes.txt; "
                                 "sed -i s/1/2/ /workspace/cfg.ini; "  # a temporary file renamed over it
                                 "truncate -s 4 /workspace/log.txt"),
                          {"filesystem": {"writeRoots": ["/workspace"]}}))
    assert out.result.status == "success", out.stderr
    recorded = accesses(client, out.tool_call_id)
    writes = {a["path"]: a for a in recorded if a["operation"] == "write"}
    assert writes["/workspace/notes.txt"]["sha256Before"] == sha(b"before\n")
    assert writes["/workspace/notes.txt"]["sha256After"] == sha(b"before\nafter\n")
    # sed -i never opens cfg.ini for writing: the walk sees the file replaced.
    assert writes["/workspace/cfg.ini"]["replaced"] is True
    assert writes["/workspace/cfg.ini"]["sha256Before"] == sha(b"a=1\n")
    assert writes["/workspace/cfg.ini"]["sha256After"] == sha(b"a=2\n")
    assert writes["/workspace/log.txt"]["sha256Before"] == sha(b"0123456789\n")
    assert writes["/workspace/log.txt"]["sha256After"] == sha(b"0123")
    deleted = {a["path"] for a in recorded if a["operation"] == "delete"}
    assert not deleted  # the replaced file was not deleted, and sed's temporary is gone without a trace
    assert {"/workspace/notes.txt", "/workspace/cfg.ini", "/workspace/log.txt"} <= set(out.result.effects_observed.writes)
    assert list(out.result.effects_observed.incomplete) == []
    # The forensic index finds the call that rewrote cfg.ini in place through sed.
    found = [c.tool_call_id for c in client.query_calls(path="cfg.ini", path_operation="write").calls]
    assert out.tool_call_id in found


def test_a_deleted_file_is_recorded_with_the_content_it_had(client, daemon):
    ws = daemon.new_workspace({"evidence.txt": "incriminating\n"})
    out = client.run(call(ws, ["rm", "/workspace/evidence.txt"], {"filesystem": {"writeRoots": ["/workspace"]}}))
    assert out.result.status == "success", out.stderr
    assert {"path": "/workspace/evidence.txt", "operation": "delete", "sha256Before": sha(b"incriminating\n")} \
        in accesses(client, out.tool_call_id)


def test_a_record_past_its_caps_says_it_is_incomplete(spare_daemon):
    d = spare_daemon(file_audit={"max_entries": 5, "hash_max_file_mb": 1}).start()
    ws = d.new_workspace({f"f{i}.txt": "x\n" for i in range(8)})
    (ws / "big.bin").write_bytes(b"\0" * (2 * 2**20))
    with d.client() as c:
        out = c.run(call(ws, sh("cat /workspace/f1.txt; echo new > /workspace/g.txt"),
                         {"filesystem": {"writeRoots": ["/workspace"]}}))
        assert out.result.status == "success", out.stderr
        incomplete = list(out.result.effects_observed.incomplete)
        assert any("more than 5 entries" in reason for reason in incomplete), incomplete
        assert any("not compared" in reason for reason in incomplete), incomplete
        # The same reasons are on the log, the source of truth.
        logged = [json.loads(e.payload_json) for e in c.get_trace(out.tool_call_id) if e.type == "FileAccessObserved"]
        assert any(p.get("incomplete") == incomplete for p in logged)
        # What the watch saw is still recorded.
        assert "/workspace/f1.txt" in out.result.effects_observed.reads


def test_a_link_left_in_place_of_a_write_roots_parent_is_never_walked(client, daemon, tmp_path_factory):
    # The command renames the parent of a write root nested in another (allowed: the
    # nested root collapses into the enclosing one, and even as a mount point of its own
    # its parent could be renamed) and leaves a link to a host directory in its place.
    outside = tmp_path_factory.mktemp("outside")
    (outside / "keys").mkdir()
    (outside / "keys" / "host-secret").write_text("not the sandbox's\n")
    ws = daemon.new_workspace({"a/keys/k.txt": "k\n"})
    out = client.run(call(ws, sh(f"mv /workspace/a /workspace/a2 && ln -s {outside} /workspace/a"),
                          {"filesystem": {"writeRoots": ["/workspace", "/workspace/a/keys"]}}))
    assert out.result.status == "success", out.stderr
    recorded = accesses(client, out.tool_call_id)
    assert not [a for a in recorded if "host-secret" in a["path"]], recorded
    # The move and the link are the workspace's own entries.
    assert {("/workspace/a2", "create"), ("/workspace/a", "create")} <= {(a["path"], a["operation"]) for a in recorded}


def test_changes_made_between_calls_are_nobody_s_and_the_next_call_finds_them(client, daemon):
    """The write root's snapshot is kept current between calls (inotify): what the host
    changed in between is in the next call's before, never in its record; a file the
    call then rewrites carries the host's content as its hash before."""
    ws = daemon.new_workspace({"keep.txt": "k\n", "gone.txt": "g\n"})
    writable = {"filesystem": {"writeRoots": ["/workspace"]}}
    first = client.run(call(ws, sh("mkdir -p /workspace/new && echo one > /workspace/new/a.txt"), writable))
    assert first.result.status == "success", first.stderr
    assert {a["path"] for a in accesses(client, first.tool_call_id) if a["operation"] == "create"} == {
        "/workspace/new", "/workspace/new/a.txt"}
    # The host, between calls.
    (ws / "new" / "a.txt").write_text("host edit\n")
    (ws / "new" / "host.txt").write_text("h\n")
    (ws / "gone.txt").unlink()
    (ws / "hostdir").mkdir()
    second = client.run(call(ws, sh("echo two > /workspace/new/b.txt"), writable))
    assert [(a["path"], a["operation"]) for a in accesses(client, second.tool_call_id)] == [
        ("/workspace/new/b.txt", "write"), ("/workspace/new/b.txt", "create")]
    third = client.run(call(ws, sh("echo three > /workspace/new/a.txt"), writable))
    [write] = [a for a in accesses(client, third.tool_call_id) if a["operation"] == "write"]
    assert write["path"] == "/workspace/new/a.txt"
    assert write["sha256Before"] == sha(b"host edit\n") and write["sha256After"] == sha(b"three\n")


def test_without_the_fanotify_reader_recorded_calls_are_refused_and_others_run(spare_daemon):
    """A daemon whose file-access reader cannot be loaded refuses each call that asks for
    recording, before any sandbox is made, and says why; a call that does not ask runs."""
    d = spare_daemon(file_audit={"reader_library": "/nonexistent/libsandboxd-fanotify.so"}).start()
    ws = d.new_workspace({"a.txt": "a"})
    with d.client() as c:
        with pytest.raises(errors.FailedPrecondition) as exc:
            c.run(call(ws, ["cat", "a.txt"]))
        assert "policy.audit.recordFileAccess" in exc.value.message and "make native" in exc.value.message
        refused = c.get_trace(exc.value.tool_call_id)
        assert [e.type for e in refused] == ["ToolCallRequested", "ToolCallRejected"]
        plain = c.run(call(ws, ["cat", "a.txt"], {"audit": {"recordFileAccess": False}}))
        assert plain.result.status == "success" and plain.stdout == b"a"
    assert "file-access recording unavailable" in d.log()


def test_names_that_are_not_utf8_are_recorded_with_their_exact_bytes(client, daemon):
    # Linux names are bytes: a repository can hold any. The record stays valid JSON (and
    # the result a valid message): the name printable, its bytes in base64 beside it.
    import base64
    import os

    ws = daemon.new_workspace({"keep.txt": "k\n"})
    odd = os.path.join(os.fsencode(ws), b"caf\xe9.txt")  # Latin-1, not UTF-8
    with open(odd, "wb") as f:
        f.write(b"latin\n")
    os.chown(odd, 1000, 1000)
    writable = {"filesystem": {"writeRoots": ["/workspace"]}}
    out = client.run(call(ws, sh("cat /workspace/caf*.txt"), writable))
    assert out.result.status == "success", (out.result.error, out.stderr)
    assert out.stdout == b"latin\n"
    read = [a for a in accesses(client, out.tool_call_id) if a["operation"] == "read"]
    assert [a["path"] for a in read] == ["/workspace/caf\\xe9.txt"]
    assert base64.b64decode(read[0]["pathBase64"]) == b"/workspace/caf\xe9.txt"
    assert list(out.result.effects_observed.reads) == ["/workspace/caf\\xe9.txt"]
    # (In a second call: a read is named where the file is when its event is read.)
    out = client.run(call(ws, sh("mv /workspace/caf*.txt /workspace/$(printf 'x\\377')"), writable))
    assert out.result.status == "success", (out.result.error, out.stderr)
    [renamed] = [a for a in accesses(client, out.tool_call_id) if a["operation"] == "rename"]
    assert renamed["path"] == "/workspace/caf\\xe9.txt" and renamed["renamedTo"] == "/workspace/x\\xff"
    assert base64.b64decode(renamed["renamedToBase64"]) == b"/workspace/x\xff"
    assert list(out.result.effects_observed.writes) == ["/workspace/x\\xff"]
    assert [r.tool_call_id for r in client.query_calls(path="/workspace/x\\xff", workspace=str(ws)).calls] == [out.tool_call_id]


@pytest.mark.parametrize("adapter", BACKENDS)
def test_a_daemon_in_fid_mode_records_the_same_accesses(spare_daemon, adapter):
    """settings.file_watch_fid: events name a directory handle and a file, resolved
    through the sandbox's mount; the record is the one the descriptor mode makes, for a
    cold call and for leased commands."""
    d = spare_daemon(file_watch_fid=True, pools={"min_idle": 0, "max_size": 1}).start()
    ws = d.new_workspace({"secrets.yaml": "token: x\n", "src/app.py": "print('app')\n", "old/f.txt": "f\n"})
    writable = {"filesystem": {"writeRoots": ["/workspace"]}}
    script = ("cat /workspace/secrets.yaml /workspace/src/app.py >/dev/null; echo built > /workspace/src/out.txt; "
              "mv /workspace/old /workspace/new; cat /workspace/new/f.txt >/dev/null")
    with d.client() as c:
        runtime = {"adapter": adapter, "image": "sandboxd/default:latest"}
        cold = c.run(call(ws, sh(script), writable, runtime=runtime))
        # One bound file, not a directory: read in descriptor mode (a file's events would
        # name the host's directory around it), and recorded under its sandbox path.
        one = c.run(call(ws, ["cat", "/workspace/secrets.yaml"], {"filesystem": {"readRoots": ["secrets.yaml"]}},
                         runtime=runtime))
        assert one.result.status == "success" and one.stdout == b"token: x\n", (one.result, one.stderr)
        assert list(one.result.effects_observed.reads) == ["/workspace/secrets.yaml"]
        lease = c.acquire_sandbox(str(ws), writable, adapter=adapter)
        warm = c.run(call(ws, sh("cat /workspace/src/out.txt >/dev/null; echo again >> /workspace/src/out.txt"),
                          writable, runtime={**runtime, "leaseId": lease.lease_id}))
        c.release_sandbox(lease.lease_id)
        assert cold.result.status == warm.result.status == "success", (cold.stderr, warm.stderr)
        recorded = accesses(c, cold.tool_call_id)
        assert {(a["path"], a["operation"]) for a in recorded if a["operation"] in ("read", "write")} == {
            ("/workspace/secrets.yaml", "read"), ("/workspace/src/app.py", "read"), ("/workspace/src/out.txt", "write"),
            ("/workspace/new/f.txt", "read")}  # the directory's name when the event was read
        [written] = [a for a in recorded if a["operation"] == "write"]
        assert written["sha256Before"] == "" and written["sha256After"] == sha(b"built\n")
        assert not cold.result.effects_observed.incomplete
        again = [(a["path"], a["operation"]) for a in accesses(c, warm.tool_call_id) if a["operation"] in ("read", "write")]
        assert again == [("/workspace/src/out.txt", "write")]  # read, then written: one entry, a write
