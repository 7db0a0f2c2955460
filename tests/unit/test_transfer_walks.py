"""A transfer's walks on a real directory, without a daemon: a download's listing and
what it leaves out (bounded), its caps held to what is sent, deep trees walked once, an
upload's names that would land only in part, and read roots the sandbox moved. Runs as
root, as the daemon does."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandboxd.core.as_user import AsUser
from sandboxd.core.errors import (Aborted, BackendUnavailable, FailedPrecondition, InvalidArgument, PermissionDenied,
                                  ResourceExhausted)
from sandboxd.policy.preflight import Bind
from sandboxd.transfer.download import Download
from sandboxd.transfer.rules import MAX_PATH_BYTES, MAX_TRANSFER_PATH_BYTES, Where, place
from sandboxd.transfer.service import _Names
from sandboxd.transfer.tree import SKIPS_SHOWN, Walker
from sandboxd.transfer.upload import UploadStaging

UID = GID = 4321


class CountingUser(AsUser):
    """The sandbox's user, counting what it is asked to do (and failing os.open with
    `fail_open` when set)."""

    def __init__(self, uid: int, gid: int):
        super().__init__(uid, gid)
        self.calls = 0
        self.fail_open: int | None = None

    def run(self, fn, *args, **kwargs):
        self.calls += 1
        if self.fail_open is not None and fn is os.open:
            raise OSError(self.fail_open, os.strerror(self.fail_open))
        return super().run(fn, *args, **kwargs)


def owned(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            os.chown(name, UID, GID, follow_symlinks=False)


def where_of(ws: Path, *extra: Bind) -> Where:
    st = ws.stat()
    binds = (Bind("/workspace", str(ws), False, st.st_dev, st.st_ino), *extra)
    return Where(binds, (), (), "/tmp", UID, GID, str(ws))


@contextmanager
def download(ws: Path, path: str, *, max_bytes: int = 1 << 30, max_entries: int = 10000,
             fs: AsUser | None = None) -> Iterator[tuple[Download, AsUser, Walker]]:
    w = where_of(ws)
    fs = fs or AsUser(UID, GID)
    walker = Walker(fs, w, write=False)
    try:
        yield Download(fs, w, walker, place(w, path, write=False, field="path"), max_bytes, max_entries), fs, walker
    finally:
        walker.close()
        fs.close()


def sent(dl: Download) -> list[tuple[str, object]]:
    return [(kind, value) for kind, value in dl.send(dl.plan()) if kind != "data"]


@pytest.fixture
def ws(tmp_path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


def test_what_a_download_leaves_out_is_said_up_to_a_bound_and_counted_past_it(ws):
    (ws / "links").mkdir()
    for i in range(SKIPS_SHOWN + 5):
        (ws / "links" / f"l{i:03}").symlink_to("/etc/passwd")
    (ws / "links" / "real.txt").write_text("x")
    owned(ws)
    with download(ws, "/workspace/links") as (dl, fs, walker):
        names = [value["path"] for kind, value in sent(dl) if kind == "entry"]
    assert names == ["real.txt"]
    lines = dl.skipped.lines()
    assert len(lines) == SKIPS_SHOWN + 1  # in the directory's order, as read
    assert all(line.startswith("/workspace/links/l") and line.endswith(": a symlink (not followed)")
               for line in lines[:-1])
    assert lines[-1] == "... and 5 more left out"


def test_a_tree_of_more_left_out_than_the_cap_is_refused(ws):
    for i in range(12):
        (ws / f"l{i}").symlink_to("/etc/passwd")
    owned(ws)
    with download(ws, "/workspace", max_entries=10) as (dl, fs, walker):
        with pytest.raises(ResourceExhausted, match="more than 10 entries left out"):
            dl.plan()


def test_a_file_grown_since_it_was_listed_is_not_sent_past_the_cap(ws):
    (ws / "d").mkdir()
    (ws / "d" / "f.bin").write_bytes(b"x" * 100)
    owned(ws)
    with download(ws, "/workspace/d", max_bytes=150) as (dl, fs, walker):
        found = dl.plan()
        with open(ws / "d" / "f.bin", "ab") as grow:
            grow.write(b"y" * 1000)
        with pytest.raises(Aborted, match="changed since it was listed .100 bytes, now 1100"):
            list(dl.send(found))
    assert dl.total == 0


def test_a_deep_tree_is_walked_once_not_from_the_root_for_each_directory(ws):
    depth = 300
    deep = ws.joinpath(*["d"] * depth)
    deep.mkdir(parents=True)
    (deep / "leaf.txt").write_text("leaf")
    for parent in [deep, *deep.parents][:depth]:
        (parent / "f.txt").write_text("f")
    owned(ws)
    fs = CountingUser(UID, GID)
    with download(ws, "/workspace", fs=fs) as (dl, fs, walker):
        entries = [value for kind, value in sent(dl) if kind == "entry"]
    assert len(entries) == 2 * depth + 1
    # Each directory opened and listed once, each file opened once (a walk from the
    # root for each would be depth**2 / 2 = 45000).
    assert fs.calls <= 5 * depth


def test_a_path_longer_than_the_kernels_is_left_out_and_said(ws):
    name = "n" * 250
    parts = [name] * (MAX_PATH_BYTES // 251 + 1)
    longest = ws.joinpath(*parts[:-1])
    os.makedirs(longest)
    fd = os.open(longest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.close(os.open(name, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    with download(ws, "/workspace") as (dl, fs, walker):  # root's, and readable to all
        entries = [value["path"] for kind, value in sent(dl) if kind == "entry"]
    assert len(entries) == len(parts) - 1  # the directories; the file's path is too long
    assert dl.skipped.lines()[0].endswith(f"a path longer than {MAX_PATH_BYTES} bytes")


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_the_daemon_out_of_descriptors_fails_a_download_never_leaves_files_out(ws, code):
    (ws / "d").mkdir()
    (ws / "d" / "f").write_text("x")
    owned(ws)
    fs = CountingUser(UID, GID)
    with download(ws, "/workspace", fs=fs) as (dl, fs, walker):
        walker.root(where_of(ws).binds[0], "path")
        fs.fail_open = code
        with pytest.raises(BackendUnavailable, match="out of descriptors"):
            dl.plan()


# ------------------------------------------------------------------ uploads


@pytest.mark.parametrize("entries, refused", [
    ([("a", "file"), ("b", "file"), ("b/c", "file")], "/w/b/c is below /w/b, a file"),
    ([("x/y/z", "file"), ("x/y", "file")], "/w/x/y is a file of this upload, and other entries are below it"),
    ([("x/y", "dir"), ("x", "file")], "/w/x is a file of this upload"),
    ([("a", "file"), ("a", "dir")], "/w/a is named twice"),
    ([("", "file"), ("k", "file")], "/w/k is below /w, a file"),
])
def test_an_upload_whose_entries_would_land_only_in_part_is_refused_before_staging(entries, refused):
    names = _Names()
    with pytest.raises(InvalidArgument, match=refused):
        for path, kind in entries:
            names.add(f"/w/{path}" if path else "/w", kind, "entries[0].path")


def test_names_beside_each_other_and_dirs_above_files_pass():
    names = _Names()
    for path, kind in [("/w/a", "dir"), ("/w/a/b", "file"), ("/w/a/c/d", "file"), ("/w/a/c", "dir"), ("/w/e", "file")]:
        names.add(path, kind, "f")
    assert len(names.seen) == 5


def test_a_name_taken_by_the_sandbox_before_commit_refuses_the_upload_whole(ws):
    owned(ws)
    w = where_of(ws)
    fs = AsUser(UID, GID)
    walker = Walker(fs, w, write=True)
    staging = UploadStaging(fs, w, walker, "xfer_t")
    try:
        for name in ("a", "b"):
            staging.begin_file(place(w, f"/workspace/{name}", write=True, field="f"), 1, "", 0, "f")
            staging.write(b"x")
            staging.end_file()
        (ws / "b").mkdir()  # the sandbox, meanwhile
        with pytest.raises(Exception, match="/workspace/b is a directory"):
            staging.commit()
        assert staging.landed == []
        staging.rollback()
    finally:
        walker.close()
        fs.close()
    assert sorted(p.name for p in ws.iterdir()) == ["b"]


def test_an_upload_never_lands_in_a_read_root_the_sandbox_moved_under_a_write_root(ws):
    (ws / "a" / "ro").mkdir(parents=True)
    owned(ws)
    st = (ws / "a" / "ro").stat()
    w = where_of(ws, Bind("/workspace/a/ro", str(ws / "a" / "ro"), True, st.st_dev, st.st_ino))
    (ws / "a").rename(ws / "moved")  # what the sandbox can do: rename the read root's parent
    fs = AsUser(UID, GID)
    walker = Walker(fs, w, write=True)
    staging = UploadStaging(fs, w, walker, "xfer_t")
    try:
        with pytest.raises(PermissionDenied, match="/workspace/moved/ro is a read root of the policy"):
            staging.begin_file(place(w, "/workspace/moved/ro/x", write=True, field="f"), 1, "", 0, "f")
        staging.rollback()
    finally:
        walker.close()
        fs.close()
    assert list((ws / "moved" / "ro").iterdir()) == []


# ------------------------------------------------------------------ a lease's tempDir


@pytest.mark.parametrize("init_now, opened", [(lambda pid: pid, True), (lambda pid: 0, False),
                                              (lambda pid: pid + 1, False), (None, False)])
def test_a_leased_sandboxs_root_is_taken_only_if_its_init_still_lives_after_the_open(init_now, opened):
    """/proc/<pid>/root of a pid that another process took meanwhile would be that
    process's root: the init is asked again after the open (here: this process, and
    /dev/shm a mount of its own as a sandbox's tempDir is)."""
    pid = os.getpid()
    w = Where((), (), (), "/dev/shm", UID, GID, "/ws", "lease_1", pid,
              None if init_now is None else (lambda: init_now(pid)))
    fs = AsUser(UID, GID)
    walker = Walker(fs, w, write=False)
    bind = place(w, "/dev/shm", write=False, field="path").bind
    try:
        if opened:
            assert walker.root(bind, "path") >= 0
        else:
            with pytest.raises(FailedPrecondition, match="the leased sandbox is gone"):
                walker.root(bind, "path")
    finally:
        walker.close()
        fs.close()


# ------------------------------------------------------------------ the review's second look


def test_the_paths_one_transfer_names_are_bounded_in_all(ws):
    """A tree of few entries whose paths are each 4 KB would make a record of hundreds of
    MB: past MAX_TRANSFER_PATH_BYTES the transfer is refused, an upload and a download."""
    deep = ws.joinpath(*["n" * 250] * 15)
    os.makedirs(deep)
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(MAX_TRANSFER_PATH_BYTES // 3800 + 10):
            os.close(os.open(f"{i:05}" + "f" * 60, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    with download(ws, "/workspace") as (dl, fs, walker):  # root's, and readable to all
        with pytest.raises(ResourceExhausted, match="the most one transfer's record names"):
            dl.plan()
    names = _Names()
    with pytest.raises(ResourceExhausted, match="the most one transfer's record names"):
        for i in range(MAX_TRANSFER_PATH_BYTES // 3700 + 10):
            names.add("/w/" + "/".join(["n" * 250] * 15) + f"/{i:05}", "file", "entries[0].path")


def test_a_directory_moved_between_staging_and_commit_refuses_the_upload_whole(ws):
    """The record names where each file landed: a directory the sandbox moved meanwhile
    would put it elsewhere. The staged file goes with the rollback all the same."""
    (ws / "d").mkdir()
    owned(ws)
    w = where_of(ws)
    fs = AsUser(UID, GID)
    walker = Walker(fs, w, write=True)
    staging = UploadStaging(fs, w, walker, "xfer_t")
    try:
        staging.begin_file(place(w, "/workspace/d/a", write=True, field="f"), 1, "", 0, "f")
        staging.write(b"x")
        staging.end_file()
        (ws / "d").rename(ws / "e")  # the sandbox, meanwhile
        with pytest.raises(FailedPrecondition, match="/workspace/d was moved since the upload began"):
            staging.commit()
        staging.rollback()
    finally:
        walker.close()
        fs.close()
    assert [p.name for p in ws.rglob("*")] == ["e"]


def test_no_thread_acts_as_root_for_a_sandbox():
    from sandboxd.core.as_user import IdentityError

    for uid, gid in ((0, 4321), (4321, 0)):
        with pytest.raises(IdentityError):
            AsUser(uid, gid)


def test_root_is_never_the_uid_a_root_owned_workspace_runs_as():
    from pydantic import ValidationError

    from sandboxd.core.settings import DaemonSettings

    for field in ("root_workspace_uid", "root_workspace_gid"):
        with pytest.raises(ValidationError, match=field):
            DaemonSettings(**{field: 0})


def test_a_parent_moved_while_its_child_directory_was_put_back_is_found_too(ws):
    """Only the deepest directories are walked again at commit: each level on the way
    is compared, so a moved parent shows even when the sandbox put the child back."""
    (ws / "a" / "b").mkdir(parents=True)
    owned(ws)
    w = where_of(ws)
    fs = AsUser(UID, GID)
    walker = Walker(fs, w, write=True)
    staging = UploadStaging(fs, w, walker, "xfer_t")
    try:
        for path in ("/workspace/a/x", "/workspace/a/b/y"):
            staging.begin_file(place(w, path, write=True, field="f"), 1, "", 0, "f")
            staging.write(b"x")
            staging.end_file()
        (ws / "a").rename(ws / "c")  # the sandbox: a moved away, a new a, the old b put back in it
        (ws / "a").mkdir()
        (ws / "c" / "b").rename(ws / "a" / "b")
        with pytest.raises(FailedPrecondition, match="/workspace/a/b was moved since the upload began"):
            staging.commit()
        staging.rollback()
    finally:
        walker.close()
        fs.close()
    assert not [p for p in ws.rglob("*") if p.is_file()]
