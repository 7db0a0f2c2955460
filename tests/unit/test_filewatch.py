"""Pure parts of file-access recording: how accesses are classified, how a sandbox path
maps back to the host file, and how the gate shows up in a spec."""

from __future__ import annotations

from sandboxd.compile import GATE_PATH, SHIM_PATH, Attachments
from sandboxd.executor import _host_path
from sandboxd.filewatch import FAN_CLOSE_WRITE, FAN_MODIFY, FAN_OPEN, MAX_PATHS, Access, FileWatch
from sandboxd.preflight import Bind, HostPlan


def test_an_access_is_a_write_once_anything_modified_it():
    assert Access("/workspace/a", opens=3).operation == "read"
    assert Access("/workspace/a", opens=1, writes=1).operation == "write"


def test_events_are_counted_per_path_and_capped():
    w = FileWatch(1, ("/workspace",))
    w._note("/workspace/a", FAN_OPEN)
    w._note("/workspace/a", FAN_OPEN)
    w._note("/workspace/b", FAN_OPEN | FAN_MODIFY)
    w._note("/workspace/b", FAN_CLOSE_WRITE)
    assert (w.accesses["/workspace/a"].opens, w.accesses["/workspace/a"].writes) == (2, 0)
    assert (w.accesses["/workspace/b"].opens, w.accesses["/workspace/b"].writes) == (1, 2)
    for i in range(MAX_PATHS):
        w._note(f"/workspace/many/{i}", FAN_OPEN)
    assert len(w.accesses) == MAX_PATHS and w.dropped == 2


def test_sandbox_paths_map_to_host_files_through_the_deepest_bind():
    plan = HostPlan(workspace="/srv/ws", uid=1000, gid=1000, masks=(),
                    binds=(Bind("/workspace", "/srv/ws", True), Bind("/workspace/out", "/srv/ws/build/out", False)))
    assert _host_path(plan, "/workspace/src/a.py") == "/srv/ws/src/a.py"
    assert _host_path(plan, "/workspace/out/r.txt") == "/srv/ws/build/out/r.txt"
    assert _host_path(plan, "/workspace/output.txt") == "/srv/ws/output.txt"  # not under /workspace/out
    assert _host_path(plan, "/workspace/out") == "/srv/ws/build/out"
    assert _host_path(plan, "/tmp/x") is None


def test_the_gate_holds_the_command_until_the_watch_is_on():
    att = Attachments("/rt/sandbox-shim", gate_host_path="/rt/gates/sbx-1")
    assert att.needs_shim
    assert att.wrap(("cat", "f")) == (SHIM_PATH, "--gate", GATE_PATH, "--", "cat", "f")
    assert (GATE_PATH, "/rt/gates/sbx-1") in att.binds()
    assert Attachments().wrap(("cat", "f")) == ("cat", "f")


def _e(inode, mode=0o100644, size=1, mtime=1):
    from sandboxd.snapshot import Entry

    return Entry(inode, mode, size, mtime)


def test_snapshot_diff_tells_creates_deletes_renames_and_chmods_apart():
    from sandboxd.snapshot import diff

    before = {"/w/a": _e(1), "/w/b": _e(2), "/w/c": _e(3), "/w/d": _e(4, 0o100644)}
    after = {"/w/a2": _e(1), "/w/c": _e(3), "/w/d": _e(4, 0o100755), "/w/new": _e(9)}
    assert diff(before, after) == [
        {"path": "/w/a", "operation": "rename", "renamedTo": "/w/a2"},
        {"path": "/w/b", "operation": "delete"},
        {"path": "/w/d", "operation": "chmod"},
        {"path": "/w/new", "operation": "create"},
    ]


def test_a_file_created_in_a_deleted_ones_inode_is_not_a_rename():
    from sandboxd.snapshot import diff

    before = {"/w/doomed": _e(7, size=2, mtime=10)}
    after = {"/w/fresh": _e(7, size=6, mtime=20)}  # the inode number was reused
    assert diff(before, after) == [{"path": "/w/doomed", "operation": "delete"},
                                   {"path": "/w/fresh", "operation": "create"}]


def test_snapshot_take_walks_the_writable_binds(tmp_path):
    from sandboxd.snapshot import take

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_text("x")
    (tmp_path / "g").write_text("y")
    entries, complete = take([("/workspace", str(tmp_path))])
    assert complete and set(entries) == {"/workspace/sub", "/workspace/sub/f", "/workspace/g"}


def test_the_hash_left_behind_never_follows_what_the_sandbox_left(tmp_path):
    import hashlib as _h
    import os as _os

    from sandboxd.executor import _hash_left_behind

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "real.txt").write_text("data")
    (tmp_path / "outside.txt").write_text("host secret")
    _os.symlink(tmp_path / "outside.txt", ws / "link.txt")
    _os.symlink(tmp_path, ws / "dirlink")
    _os.mkfifo(ws / "fifo")
    plan = HostPlan(workspace=str(ws), uid=1000, gid=1000, masks=(), binds=(Bind("/workspace", str(ws), False),))
    assert _hash_left_behind(plan, "/workspace/real.txt") == "sha256:" + _h.sha256(b"data").hexdigest()
    assert _hash_left_behind(plan, "/workspace/link.txt") == ""
    assert _hash_left_behind(plan, "/workspace/dirlink/outside.txt") == ""
    assert _hash_left_behind(plan, "/workspace/fifo") == ""  # and it did not block
    assert _hash_left_behind(plan, "/workspace/gone.txt") == ""
