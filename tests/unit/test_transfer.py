"""File transfer's parts without a daemon: which paths a transfer may touch (rules.py,
pure), the thread that acts as the sandbox's user (core/as_user.py), an upload staged
and committed or rolled back on a real directory (upload.py), and a transfer's record in
the forensic index (audit_projection). Runs as root, as the daemon does."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sandboxd.api.transfer import _parts
from sandboxd.core.as_user import AsUser, thread_capabilities
from sandboxd.core.errors import Aborted, FailedPrecondition, InvalidArgument, PermissionDenied
from sandboxd.ledger import audit
from sandboxd.ledger import events as ev
from sandboxd.ledger.event_types import FilesTransferred, draft, read
from sandboxd.ledger.events import EventLog
from sandboxd.ledger.store import Database
from sandboxd.policy.preflight import Bind, Mask
from sandboxd.transfer.rules import Where, entry_parts, place, temp_bind
from sandboxd.transfer.tree import Walker
from sandboxd.transfer.upload import UploadStaging, entry_mode
from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_testing.harness import wait_for

UID = GID = 4321


def where(binds=(), masks=(), blocked=(), temp_pid=0, lease_id="") -> Where:
    return Where(tuple(binds), tuple(masks), tuple(blocked), "/tmp", UID, GID, "/ws", lease_id, temp_pid)


WS_RW = Bind("/workspace", "/ws", read_only=False)
SRC_RO = Bind("/workspace/src", "/ws/src", read_only=True)


# ------------------------------------------------------------------ rules


def test_the_deepest_root_decides_and_an_upload_needs_a_write_root():
    w = where([WS_RW, SRC_RO])
    assert place(w, "/workspace/a/b.txt", write=True, field="path").parts == ("a", "b.txt")
    assert place(w, "/workspace", write=True, field="path").parts == ()
    with pytest.raises(PermissionDenied, match="under the read root /workspace/src"):
        place(w, "/workspace/src/x.py", write=True, field="path")
    got = place(w, "/workspace/src/x.py", write=False, field="path")
    assert (got.bind, got.parts) == (SRC_RO, ("x.py",))
    with pytest.raises(PermissionDenied, match="not under any read or write root") as refused:
        place(w, "/etc/passwd", write=False, field="entries[3].path")
    assert refused.value.field == "entries[3].path"


def test_blocked_names_and_masks_are_never_placed():
    w = where([WS_RW], masks=[Mask("/workspace/.env", "file", 1, 2)], blocked=["/workspace/secrets"])
    for path in ("/workspace/secrets", "/workspace/secrets/k", "/workspace/.env"):
        with pytest.raises(PermissionDenied, match="is blocked"):
            place(w, path, write=False, field="path")
    assert place(w, "/workspace/secretsX", write=False, field="path").parts == ("secretsX",)


def test_temp_dir_is_reached_only_in_a_leased_sandbox_through_its_init():
    with pytest.raises(PermissionDenied, match="exists only inside a sandbox"):
        place(where([WS_RW]), "/tmp/x", write=True, field="path")
    with pytest.raises(FailedPrecondition, match="init is gone"):
        place(where([WS_RW], lease_id="lease_1"), "/tmp/x", write=True, field="path")
    leased = where([WS_RW], lease_id="lease_1", temp_pid=77)
    got = place(leased, "/tmp/a/b", write=True, field="path")
    assert (got.bind, got.parts) == (temp_bind(leased), ("a", "b"))
    assert got.bind.host_path == "/proc/77/root" and got.bind.sandbox_path == "/tmp"


@pytest.mark.parametrize("raw", ["/abs", "a/../b", "a//b", "./a", "a/.", "..", "a\x00b", "x" * 256, "a/" * 2049])
def test_an_entry_path_names_its_own_place_below_the_transfer(raw):
    with pytest.raises(InvalidArgument):
        entry_parts(raw, "entries[0].path")


def test_entry_paths_and_modes():
    assert entry_parts("", "f") == ()
    assert entry_parts("a/b c/d.txt", "f") == ("a", "b c", "d.txt")
    assert entry_mode(0o4755, "file") == 0o755  # setuid dropped
    assert entry_mode(0, "file") == 0o644 and entry_mode(0, "dir") == 0o755


# ------------------------------------------------------------------ the sandbox user's thread


@pytest.fixture
def public_dir():
    """A directory every user may search (pytest's own are closed to all but root)."""
    d = Path(tempfile.mkdtemp(prefix="sandboxd-as-user-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_the_thread_acts_as_the_sandbox_user_and_no_other_thread_does(public_dir):
    tmp_path = public_dir
    (tmp_path / "open").write_text("anyone\n")
    closed = tmp_path / "closed"
    closed.write_text("root's\n")
    closed.chmod(0o600)
    group_readable = tmp_path / "group"
    group_readable.write_text("root group\n")
    group_readable.chmod(0o640)  # root's group: the thread has no supplementary group
    groups = os.getgroups()
    os.setgroups([0])  # the daemon in root's group: the thread must drop it
    tasks = set(os.listdir("/proc/self/task"))
    try:
        with AsUser(UID, GID) as fs:
            assert fs.run(os.getgroups) == [] and os.getgroups() == [0]
            assert fs.run(group_readable.read_text) == "x"
    except PermissionError:
        pass
    else:
        raise AssertionError("read a file of root's group")
    finally:
        # glibc's setgroups acts on every thread and aborts the process if one of them,
        # holding no capability, refuses: wait until the joined thread has left the kernel.
        wait_for(lambda: set(os.listdir("/proc/self/task")) <= tasks)
        os.setgroups(groups)
    with AsUser(UID, GID) as fs:
        assert fs.run((tmp_path / "open").read_text) == "anyone\n"
        for path in (closed, group_readable):
            with pytest.raises(PermissionError):
                fs.run(path.read_text)
        with pytest.raises(PermissionError):
            fs.run((tmp_path / "new").write_text, "x")  # root's 0755 directory
        assert closed.read_text() == "root's\n"  # this thread is still root
        os.chmod(tmp_path, 0o777)
        fs.run((tmp_path / "mine").write_text, "x")
    st = (tmp_path / "mine").stat()
    assert (st.st_uid, st.st_gid) == (UID, GID)


def test_the_thread_holds_no_capability_and_no_other_thread_loses_one():
    held = thread_capabilities()
    assert held[0]  # the test runs as root
    with AsUser(UID, GID) as fs:
        # CAP_SYS_RESOURCE above all: with it the thread's writes pass quotas and fill
        # the blocks ext4 reserves for root.
        assert fs.run(thread_capabilities) == (0, 0)
    assert thread_capabilities() == held


# ------------------------------------------------------------------ staging


@pytest.fixture
def ws(tmp_path) -> Path:
    root = tmp_path / "ws"
    (root / "keep").mkdir(parents=True)
    (root / "keep" / "old.txt").write_text("old\n")
    for p in (root, root / "keep", root / "keep" / "old.txt"):
        os.chown(p, UID, GID)
    return root


def staging_for(ws: Path, masks=()) -> tuple[AsUser, Walker, UploadStaging, Where]:
    st = ws.stat()
    w = where([Bind("/workspace", str(ws), False, st.st_dev, st.st_ino)], masks=masks)
    fs = AsUser(UID, GID)
    walker = Walker(fs, w, write=True)
    return fs, walker, UploadStaging(fs, w, walker, "xfer_t"), w


def tree_of(ws: Path) -> dict[str, str]:
    return {str(p.relative_to(ws)): (p.read_text() if p.is_file() else "/") for p in sorted(ws.rglob("*"))}


def test_an_upload_lands_on_commit_and_nothing_of_it_before(ws):
    fs, roots, staging, w = staging_for(ws)
    try:
        staging.begin_file(place(w, "/workspace/new/deep/a.txt", write=True, field="f"), 3, "", 0o600, "f")
        staging.write(b"abc")
        staging.end_file()
        staging.begin_file(place(w, "/workspace/keep/old.txt", write=True, field="f"), 4, "", 0, "f")
        staging.write(b"new\n")
        staging.end_file()
        assert (ws / "keep" / "old.txt").read_text() == "old\n"  # staged, not landed
        assert not (ws / "new" / "deep" / "a.txt").exists()
        landed = staging.commit()
    finally:
        roots.close()
        fs.close()
    assert [e["path"] for e in landed] == ["/workspace/new/deep/a.txt", "/workspace/keep/old.txt"]
    assert tree_of(ws) == {"keep": "/", "keep/old.txt": "new\n", "new": "/", "new/deep": "/",
                           "new/deep/a.txt": "abc"}
    st = (ws / "new" / "deep" / "a.txt").stat()
    assert (st.st_uid, st.st_mode & 0o777) == (UID, 0o600)


def test_a_rolled_back_upload_leaves_the_tree_as_it_was(ws):
    before = tree_of(ws)
    fs, roots, staging, w = staging_for(ws)
    try:
        staging.add_dir(place(w, "/workspace/made", write=True, field="f"), 0o700, "f")
        staging.begin_file(place(w, "/workspace/made/sub/a.txt", write=True, field="f"), 3, "", 0, "f")
        staging.write(b"ab")
        with pytest.raises(InvalidArgument, match="2 bytes arrived of its declared 3"):
            staging.end_file()
        staging.rollback()
    finally:
        roots.close()
        fs.close()
    assert tree_of(ws) == before


def test_a_hash_or_size_that_does_not_match_is_refused(ws):
    fs, roots, staging, w = staging_for(ws)
    try:
        staging.begin_file(place(w, "/workspace/a", write=True, field="f"), 1, "sha256:" + "0" * 64, 0, "f")
        with pytest.raises(InvalidArgument, match="more bytes than its declared 1"):
            staging.write(b"ab")
        staging.write(b"a")
        with pytest.raises(InvalidArgument, match="hash to sha256:ca978112"):
            staging.end_file()
        staging.rollback()
    finally:
        roots.close()
        fs.close()
    assert "a" not in tree_of(ws)


def test_an_upload_never_replaces_a_directory_or_a_masked_inode_or_passes_a_link(ws):
    secret = ws / "keep" / "old.txt"
    st = secret.stat()
    (ws / "link").symlink_to("/etc")
    fs, roots, staging, w = staging_for(ws, masks=[Mask("/workspace/elsewhere", "file", st.st_dev, st.st_ino)])
    try:
        with pytest.raises(FailedPrecondition, match="is a directory"):
            staging.begin_file(place(w, "/workspace/keep", write=True, field="f"), 1, "", 0, "f")
        # The masked file, found under another name (its directory renamed by the sandbox).
        with pytest.raises(PermissionDenied, match="blocked path"):
            staging.begin_file(place(w, "/workspace/keep/old.txt", write=True, field="f"), 1, "", 0, "f")
        with pytest.raises(FailedPrecondition, match="/workspace/link"):
            staging.begin_file(place(w, "/workspace/link/passwd", write=True, field="f"), 1, "", 0, "f")
        staging.rollback()
    finally:
        roots.close()
        fs.close()
    assert secret.read_text() == "old\n"


def test_a_root_replaced_since_it_was_checked_is_refused(ws, tmp_path):
    fs, roots, staging, w = staging_for(ws)
    ws.rename(tmp_path / "moved")
    (tmp_path / "ws").mkdir()
    try:
        with pytest.raises(FailedPrecondition, match="replaced on the host"):
            staging.begin_file(place(w, "/workspace/a", write=True, field="f"), 1, "", 0, "f")
    finally:
        roots.close()
        fs.close()


# ------------------------------------------------------------------ the record


def test_a_transfer_is_found_by_path_and_operation_and_reads_back(tmp_path):
    db = Database(tmp_path / "db.sqlite")
    audit.ensure_schema(db)
    log = EventLog(db, on_append=audit.index_events)
    event = FilesTransferred("alice", "upload", "/srv/ws", "", "/workspace/in", "ok",
                             [{"path": "/workspace/in/a.txt", "kind": "file", "mode": 420, "sizeBytes": 2,
                               "sha256": "sha256:ab"}], 2)
    [logged] = log.record("xfer_1", "", [draft(event)])
    assert read(logged).to_payload() == event.to_payload()
    refused = FilesTransferred("bob", "download", "/srv/ws", "", "/workspace/.env", "refused", code="PERMISSION_DENIED")
    log.record("xfer_2", "", [draft(refused)])
    rows, _ = audit.query_calls(db, audit.CallQuery(path="/workspace/in/a.txt", path_operation="upload"))
    assert [(r["tool_call_id"], r["tool_id"], r["status"], r["principal"]) for r in rows] == [
        ("xfer_1", "sandboxd.upload", "success", "alice")]
    rows, _ = audit.query_calls(db, audit.CallQuery(status="rejected"))
    assert [(r["tool_call_id"], r["tool_id"]) for r in rows] == [("xfer_2", "sandboxd.download")]
    assert ev.FILES_TRANSFERRED == "FilesTransferred"
    db.close()


# ------------------------------------------------------------------ the stream's end


class _Context:
    def __init__(self, active: bool):
        self.active = active

    def is_active(self) -> bool:
        return self.active


def test_an_upload_stream_that_ended_only_because_it_was_cut_off_is_no_end():
    """The idle watchdog ends a stream it cancelled as if the client had ended it: the
    upload must see that the RPC is no longer active, and land nothing."""
    requests = [pb.UploadRequest(path="/workspace"), pb.UploadRequest(data=b"x")]
    assert [p.data for p in _parts(iter(requests), _Context(True))] == [b"", b"x"]
    with pytest.raises(Aborted, match="nothing of it landed"):
        list(_parts(iter(requests), _Context(False)))
