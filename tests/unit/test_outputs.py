"""What a call leaves behind, below the sandbox: the changed files found by comparing
two real snapshots of a directory (recording/changes.py), the baseline that keeps text
files as they were hashed (recording/baseline.py), the diff's text (outputs/diff.py),
and the collector that stores the files and the diff within the caps
(outputs/collect.py). A real call on both backends: tests/integration/test_file_artifacts.py."""

from __future__ import annotations

import hashlib
import os
import struct
import stat
from pathlib import Path

import pytest

from sandboxd.core.artifact_settings import ArtifactSettings
from sandboxd.ledger.artifacts import FileArtifactStore
from sandboxd.ledger.store import Database
from sandboxd.outputs.collect import MAX_OMISSIONS_LISTED, OutputCollector, movable_masks
from sandboxd.outputs.diff import MAX_DIFF_LINES, FileVersions, Pending, file_diff, unified_diff
from sandboxd.outputs.reading import NotReadable, locate, read_chunks
from sandboxd.recording import activity
from sandboxd.recording import snapshot
from sandboxd.recording.baseline import Baseline
from sandboxd.recording.changes import changed_files
from sandboxd.secrets.redact import Redactor

from .test_snapshot import reuse_inode_number

ROOT = "/workspace"
READER = (1000, 1000)  # the sandbox's user: the files below are root's, readable by all


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Workspace:
    """A directory, its hash cache and baseline, and snapshots as a recorded call takes them."""

    def __init__(self, tmp_path: Path, files: dict[str, bytes], baseline_bytes: int = 2**20):
        self.dir = tmp_path / "ws"
        self.dir.mkdir()
        for name, data in files.items():
            (self.dir / name).parent.mkdir(parents=True, exist_ok=True)
            (self.dir / name).write_bytes(data)
        self.baseline = Baseline(tmp_path / "baseline", baseline_bytes, 64 * 1024)
        self.baseline.open()
        self.hashes = snapshot.HashCache(baseline=self.baseline)
        self.roots = [(ROOT, str(self.dir))]
        self.before = self.snap()

    def snap(self) -> snapshot.Snapshot:
        return snapshot.take(self.roots, self.hashes)

    def changed(self):
        after = self.snap()
        return changed_files(activity.diff(self.before.entries, after.entries), self.before.entries, after.entries)


@pytest.fixture
def store(tmp_path):
    return FileArtifactStore(tmp_path / "blobs", Database(tmp_path / "db.sqlite"))


def collect(ws: Workspace, store: FileArtifactStore, redactor=None, **caps):
    collector = OutputCollector(ArtifactSettings(**caps), store, ws.baseline, "call_1", ws.roots, redactor, READER)
    return collector.collect(ws.changed())


def read_blob(store: FileArtifactStore, content_hash: str) -> bytes:
    with store.open_blob(content_hash) as f:
        return f.read()


# ------------------------------------------------------------------ changes

def test_creations_edits_renames_and_deletions_are_told_apart(tmp_path):
    ws = Workspace(tmp_path, {"edit.txt": b"one\n", "gone.txt": b"bye\n", "old.txt": b"moved\n",
                              "sed.txt": b"a\n", "same.txt": b"s\n"})
    (ws.dir / "edit.txt").write_bytes(b"two\n")
    (ws.dir / "gone.txt").unlink()
    os.rename(ws.dir / "old.txt", ws.dir / "new.txt")
    (ws.dir / "tmp").write_bytes(b"b\n")
    os.rename(ws.dir / "tmp", ws.dir / "sed.txt")  # replaced by a rename over it: an edit
    (ws.dir / "made.txt").write_bytes(b"fresh\n")
    (ws.dir / "dir").mkdir()
    os.symlink("edit.txt", ws.dir / "link")
    os.chmod(ws.dir / "same.txt", 0o600)  # a mode alone is no change of content
    got = {c.path: c for c in ws.changed()}
    assert {p: c.change for p, c in got.items()} == {
        "/workspace/edit.txt": "modified", "/workspace/gone.txt": "deleted", "/workspace/new.txt": "renamed",
        "/workspace/sed.txt": "modified", "/workspace/made.txt": "created"}
    assert got["/workspace/new.txt"].previous_path == "/workspace/old.txt"
    assert got["/workspace/edit.txt"].sha256_before == sha(b"one\n")
    assert got["/workspace/edit.txt"].sha256_after == sha(b"two\n")
    assert got["/workspace/gone.txt"].sha256_before == sha(b"bye\n") and got["/workspace/gone.txt"].size == 0
    assert got["/workspace/made.txt"].sha256_before == ""


# ------------------------------------------------------------------ baseline

def test_the_baseline_keeps_text_as_hashed_and_not_binaries_or_large_files(tmp_path):
    ws = Workspace(tmp_path, {"a.txt": b"text\n", "bin": b"\x00\x01binary", "big.txt": b"x" * (65 * 1024)})
    assert ws.baseline.read(sha(b"text\n")) == b"text\n"
    assert ws.baseline.read(sha(b"\x00\x01binary")) is None
    assert ws.baseline.read(sha(b"x" * (65 * 1024))) is None
    # A kept file altered on disk is not served as what it was.
    kept = tmp_path / "baseline" / hashlib.sha256(b"text\n").hexdigest()
    kept.write_bytes(b"forged\n")
    assert ws.baseline.read(sha(b"text\n")) is None


def test_the_baseline_drops_the_least_recently_used_past_its_cap(tmp_path):
    baseline = Baseline(tmp_path / "b", max_bytes=100, max_file_bytes=100)
    baseline.open()
    for n in range(3):
        baseline.keep(sha(bytes([65 + n]) * 40), bytes([65 + n]) * 40)
    assert baseline.read(sha(b"A" * 40)) is None  # the oldest went
    assert baseline.read(sha(b"C" * 40)) == b"C" * 40 and baseline.kept_bytes == 80
    assert sorted(os.listdir(tmp_path / "b")) == sorted(hashlib.sha256(c * 40).hexdigest() for c in (b"B", b"C"))


def test_a_restart_empties_the_baseline(tmp_path):
    baseline = Baseline(tmp_path / "b", 100, 100)
    baseline.open()
    baseline.keep(sha(b"x"), b"x")
    Baseline(tmp_path / "b", 100, 100).open()
    assert os.listdir(tmp_path / "b") == []


# ------------------------------------------------------------------ what a call with secrets wrote

def holding(directory: Path, needle: bytes) -> list[str]:
    """The files under `directory` (and its siblings named after it: the refused filter,
    the withheld roots) whose bytes hold `needle`."""
    return [str(f) for d in directory.parent.glob(directory.name + "*")
            for f in ([d] if d.is_file() else d.rglob("*")) if f.is_file() and needle in f.read_bytes()]


def test_refused_bytes_go_and_are_never_kept_again_even_after_a_restart(tmp_path):
    baseline = Baseline(tmp_path / "b", 2**20, 2**20)
    baseline.open()
    baseline.keep(sha(b"token=S3CR3T\n"), b"token=S3CR3T\n")
    assert baseline.read(sha(b"token=S3CR3T\n")) == b"token=S3CR3T\n"
    baseline.refuse(sha(b"token=S3CR3T\n"))
    assert baseline.read(sha(b"token=S3CR3T\n")) is None and baseline.kept_bytes == 0
    baseline.keep(sha(b"token=S3CR3T\n"), b"token=S3CR3T\n")
    assert baseline.read(sha(b"token=S3CR3T\n")) is None and holding(tmp_path / "b", b"S3CR3T") == []
    again = Baseline(tmp_path / "b", 2**20, 2**20)  # the daemon restarted: its hash cache is empty
    again.open()
    again.keep(sha(b"token=S3CR3T\n"), b"token=S3CR3T\n")
    assert again.read(sha(b"token=S3CR3T\n")) is None and holding(tmp_path / "b", b"S3CR3T") == []
    again.keep(sha(b"plain\n"), b"plain\n")
    assert again.read(sha(b"plain\n")) == b"plain\n"


def test_a_root_withheld_when_the_daemon_stopped_is_withheld_after_its_start(tmp_path):
    baseline = Baseline(tmp_path / "b", 2**20, 2**20)
    baseline.open()
    baseline.withhold(["/srv/ws/a"])  # the daemon is killed while the call runs
    restarted = Baseline(tmp_path / "b", 2**20, 2**20)
    restarted.open()
    assert restarted.withheld("/srv/ws/a") and not restarted.withheld("/srv/ws/b")
    restarted.settle("/srv/ws", restarted.tick())  # a snapshot of the start that hashed it whole
    assert not restarted.withheld("/srv/ws/a")
    again = Baseline(tmp_path / "b", 2**20, 2**20)
    again.open()
    assert not again.withheld("/srv/ws/a")


def test_a_root_a_call_with_secrets_writes_in_keeps_nothing_until_a_later_snapshot_hashed_it_whole(tmp_path,
                                                                                                   monkeypatch):
    from sandboxd.recording.live_snapshot import LiveSnapshots

    monkeypatch.setattr(snapshot, "RACY_NS", 0)  # hashes cached at once: a later read is the cache's miss
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "old.txt").write_bytes(b"before\n")
    baseline = Baseline(tmp_path / "b", 2**20, 2**20)
    baseline.open()
    live = LiveSnapshots(snapshot.HashCache(baseline=baseline))
    roots = [(ROOT, str(ws))]
    live.take(roots)  # the call's before-snapshot
    assert baseline.read(sha(b"before\n")) == b"before\n"
    release = baseline.withhold([str(ws)])
    assert baseline.withheld(str(ws)) and baseline.withheld(str(ws / "sub")) and baseline.withheld(str(tmp_path))
    assert not baseline.withheld(str(tmp_path / "other"))
    (ws / "out.txt").write_bytes(b"token=S3CR3T\n")  # what the call writes
    (ws / "sub" / "notes.txt").write_bytes(b"S3CR3T again\n")
    after = live.take(roots)  # its after-snapshot
    assert after.entries["/workspace/out.txt"].sha256 == sha(b"token=S3CR3T\n")
    assert holding(tmp_path / "b", b"S3CR3T") == []
    since = baseline.tick()
    release()
    baseline.settle(str(ws), since)  # a snapshot begun before the release settles nothing
    assert baseline.withheld(str(ws))
    live.take([(ROOT + "/sub", str(ws / "sub"))])  # nor one of a part of the root
    assert baseline.withheld(str(ws))
    live.take(roots)  # begun after, it hashed the root whole
    assert not baseline.withheld(str(ws))
    # Read again later (a chmod moves the ctime: the cache misses), its bytes are still refused.
    os.chmod(ws / "out.txt", 0o600)
    (ws / "sub" / "notes.txt").write_bytes(b"S3CR3T again\n")
    live.take(roots)
    assert holding(tmp_path / "b", b"S3CR3T") == []
    (ws / "later.txt").write_bytes(b"plain\n")
    live.take(roots)
    assert baseline.read(sha(b"plain\n")) == b"plain\n"
    live.close()


# ------------------------------------------------------------------ the diff's text

def test_a_modified_text_file_gets_a_unified_diff():
    text = file_diff(FileVersions("/workspace/a.py", "modified", 0o100644, b"x = 1\ny = 2\n", b"x = 1\ny = 3\n"))
    assert text == ("diff --git a/workspace/a.py b/workspace/a.py\n--- a/workspace/a.py\n+++ b/workspace/a.py\n"
                    "@@ -1,2 +1,2 @@\n x = 1\n-y = 2\n+y = 3\n")


def test_created_deleted_renamed_binary_and_unknown_files_are_named():
    created = file_diff(FileVersions("/w/n.txt", "created", 0o100755, b"", b"hi"))
    assert created.splitlines() == ["diff --git a/w/n.txt b/w/n.txt", "new file mode 100755", "--- /dev/null",
                                    "+++ b/w/n.txt", "@@ -0,0 +1 @@", "+hi", "\\ No newline at end of file"]
    deleted = file_diff(FileVersions("/w/d.txt", "deleted", 0o100644, b"bye\n", b""))
    assert "deleted file mode 100644\n--- a/w/d.txt\n+++ /dev/null\n" in deleted and "-bye\n" in deleted
    renamed = file_diff(FileVersions("/w/b", "renamed", 0o100644, b"", b"", previous_path="/w/a"))
    assert renamed == "diff --git a/w/a b/w/b\nrename from w/a\nrename to w/b\n"
    binary = file_diff(FileVersions("/w/x", "modified", 0o100644, b"\x00a", b"\x00b"))
    assert binary.endswith("Binary files a/w/x and b/w/x differ\n")
    unknown = file_diff(FileVersions("/w/u", "modified", 0o100644, None, b"after", why="not kept"))
    assert unknown.endswith("# sandboxd: not diffed: not kept\n")


def test_the_diff_stops_at_its_cap_and_names_the_rest():
    files = [FileVersions(f"/w/{n}", "created", 0o100644, b"", b"line\n" * 20) for n in range(5)]
    whole, left_out = unified_diff(files, 10**6)
    assert left_out == []
    capped, left_out = unified_diff(files, len(whole) // 2)
    assert left_out == ["/w/2", "/w/3", "/w/4"]
    assert capped.endswith(b"# sandboxd: not diffed (the diff reached its cap of "
                           + str(len(whole) // 2).encode() + b" bytes or 10 s): /w/4\n")
    _, out_of_time = unified_diff(files, 10**6, budget_s=-1)
    assert out_of_time == [f.path for f in files]


def test_a_file_the_diff_only_names_is_never_read():
    read: list[str] = []

    def pending(n: int) -> Pending:
        def load() -> FileVersions:
            read.append(f"/w/{n}")
            return FileVersions(f"/w/{n}", "created", 0o100644, b"", b"line\n" * 20)
        return Pending(f"/w/{n}", load)

    whole, _ = unified_diff([pending(n) for n in range(5)], 10**6)
    read.clear()
    _, left_out = unified_diff([pending(n) for n in range(5)], len(whole) // 2)
    assert left_out == ["/w/2", "/w/3", "/w/4"] and read == ["/w/0", "/w/1", "/w/2"]


def test_a_file_of_too_many_lines_is_named_not_diffed():
    many = b"x\n" * (MAX_DIFF_LINES + 1)
    text = file_diff(FileVersions("/w/big", "modified", 0o100644, many, many + b"y\n"))
    assert text.endswith(f"# sandboxd: not diffed: more than {MAX_DIFF_LINES} lines\n")


def test_bytes_that_are_not_utf8_survive_the_diff():
    text, _ = unified_diff([FileVersions("/w/l", "modified", 0o100644, b"caf\xe9\n", b"caf\xe8\n")], 10**6)
    assert b"-caf\xe9\n+caf\xe8\n" in text


# ------------------------------------------------------------------ reading a changed file

def test_a_file_is_read_beneath_its_root_and_never_through_a_symlink(tmp_path):
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f").write_bytes(b"data")
    (tmp_path / "outside").write_bytes(b"secret")
    roots = [("/workspace", str(ws)), ("/workspace/sub", str(ws / "sub"))]
    where = locate("/workspace/sub/f", roots)
    assert where.host_root == str(ws / "sub") and where.relative == "f"
    assert b"".join(read_chunks(where, 4)) == b"data"
    os.symlink(tmp_path / "outside", ws / "link")
    os.symlink(tmp_path, ws / "dirlink")
    # A link at the end is opened as the link itself (O_PATH), one on the way not at all.
    with pytest.raises(NotReadable, match="no longer a regular file"):
        list(read_chunks(locate("/workspace/link", roots), 6))
    with pytest.raises(NotReadable, match="not readable"):
        list(read_chunks(locate("/workspace/dirlink/outside", roots), 6))
    os.mkfifo(ws / "fifo")
    with pytest.raises(NotReadable, match="no longer a regular file"):
        list(read_chunks(locate("/workspace/fifo", roots), 0))
    with pytest.raises(NotReadable, match="larger than the record"):
        list(read_chunks(where, 3))
    with pytest.raises(NotReadable, match="not in a write root"):
        locate("/etc/passwd", roots)


# ------------------------------------------------------------------ collection

def test_changed_files_become_artifacts_with_a_diff(tmp_path, store):
    ws = Workspace(tmp_path, {"a.py": b"x = 1\n", "gone.txt": b"bye\n", "old": b"same\n"})
    (ws.dir / "a.py").write_bytes(b"x = 2\n")
    (ws.dir / "new.bin").write_bytes(b"\x00\x01")
    os.chmod(ws.dir / "new.bin", 0o755)
    (ws.dir / "gone.txt").unlink()
    os.rename(ws.dir / "old", ws.dir / "moved")
    got = collect(ws, store)
    assert got.omitted == []
    files = {r.path: r for r in got.records if r.kind == "file"}
    assert {p: r.change for p, r in files.items()} == {
        "/workspace/a.py": "modified", "/workspace/new.bin": "created", "/workspace/gone.txt": "deleted",
        "/workspace/moved": "renamed"}
    assert read_blob(store, files["/workspace/a.py"].content_hash) == b"x = 2\n"
    assert files["/workspace/new.bin"].file_mode == "0755" and files["/workspace/new.bin"].size_bytes == 2
    assert files["/workspace/moved"].previous_path == "/workspace/old"
    assert files["/workspace/gone.txt"].size_bytes == 0 and files["/workspace/gone.txt"].file_mode == ""
    assert files["/workspace/gone.txt"].content_hash == sha(b"bye\n")
    [diff] = [r for r in got.records if r.kind == "diff"]
    text = read_blob(store, diff.content_hash).decode()
    assert "-x = 1\n+x = 2\n" in text
    assert "diff --git a/workspace/gone.txt b/workspace/gone.txt\ndeleted file mode 100644\n" in text
    assert "rename from workspace/old\nrename to workspace/moved\n" in text
    assert "Binary files /dev/null and b/workspace/new.bin differ" in text
    assert not list((tmp_path / "blobs" / "incoming").iterdir())  # every spool moved in


def test_past_the_count_and_byte_caps_files_are_left_out_and_said(tmp_path, store):
    ws = Workspace(tmp_path, {})
    for n in range(4):
        (ws.dir / f"f{n}").write_bytes(b"z" * 600_000)
    got = collect(ws, store, max_files_per_call=3, max_collected_mb_per_call=1)
    kept = [r.path for r in got.records if r.kind == "file"]
    assert kept == ["/workspace/f0"]  # the second would pass 1 MB
    assert got.omitted == [f"/workspace/f{n}: 600000 bytes: over the per-call cap of 1 MB of file artifacts"
                           for n in (1, 2, 3)]
    got = collect(ws, store, max_files_per_call=2)
    assert [r.path for r in got.records if r.kind == "file"] == ["/workspace/f0", "/workspace/f1"]
    assert got.omitted == [f"/workspace/f{n}: over the per-call cap of 2 file artifacts" for n in (2, 3)]


def test_omissions_past_the_listed_number_are_counted(tmp_path, store):
    ws = Workspace(tmp_path, {})
    for n in range(MAX_OMISSIONS_LISTED + 5):
        (ws.dir / f"f{n:03}").write_bytes(b"x")
    got = collect(ws, store, max_files_per_call=0, diff=False)
    assert got.records == [] and len(got.omitted) == MAX_OMISSIONS_LISTED + 1
    assert got.omitted[-1] == "... and 5 more files not kept"


def test_a_file_changed_after_the_record_or_swapped_for_a_link_is_not_kept(tmp_path, store):
    ws = Workspace(tmp_path, {})
    (ws.dir / "a").write_bytes(b"recorded")
    (ws.dir / "b").write_bytes(b"recorded")
    (tmp_path / "outside").write_bytes(b"host secret")
    changed = ws.changed()
    (ws.dir / "a").write_bytes(b"RECORDED")  # same size, other content
    (ws.dir / "b").unlink()
    os.symlink(tmp_path / "outside", ws.dir / "b")
    got = OutputCollector(ArtifactSettings(), store, ws.baseline, "call_1", ws.roots).collect(changed)
    assert [r.kind for r in got.records] == ["diff"]
    assert got.omitted == ["/workspace/a: changed after the call ended (not the file the record found there)",
                           "/workspace/b: no longer a regular file"]
    with store.open_blob(got.records[0].content_hash) as f:
        assert b"host secret" not in f.read()


def test_a_file_too_large_to_hash_changed_after_the_record_is_not_kept(tmp_path, store):
    """No hash to check it by: its inode and ctime, as the record found them, are."""
    ws = Workspace(tmp_path, {})
    (ws.dir / "big").write_bytes(b"recorded")
    (ws.dir / "same").write_bytes(b"recorded")
    changed = [c._replace(sha256_after="") for c in ws.changed()]
    assert all(c.found_as for c in changed)
    (ws.dir / "big").write_bytes(b"RECORDED")  # in place, the same size
    got = OutputCollector(ArtifactSettings(diff=False), store, ws.baseline, "call_1", ws.roots).collect(changed)
    assert [r.path for r in got.records] == ["/workspace/same"]
    assert got.omitted == ["/workspace/big: changed after the call ended (not the file the record found there)"]


def test_secrets_are_redacted_from_kept_files_and_the_diff(tmp_path, store):
    ws = Workspace(tmp_path, {"cfg": b"token = none\n"})
    (ws.dir / "cfg").write_bytes(b"token = hunter2-secret-value\n")
    got = collect(ws, store, redactor=lambda: Redactor({"api": b"hunter2-secret-value"}))
    [file] = [r for r in got.records if r.kind == "file"]
    assert read_blob(store, file.content_hash) == b"token = [REDACTED:api]\n"
    assert file.content_hash == sha(b"token = [REDACTED:api]\n") and "secrets redacted" in file.summary
    [diff] = [r for r in got.records if r.kind == "diff"]
    text = read_blob(store, diff.content_hash)
    assert b"hunter2" not in text and b"+token = [REDACTED:api]\n" in text


def test_a_diff_without_the_content_before_says_so(tmp_path, store):
    ws = Workspace(tmp_path, {"a": b"before\n"}, baseline_bytes=0)
    (ws.dir / "a").write_bytes(b"after\n")
    got = collect(ws, store)
    [diff] = [r for r in got.records if r.kind == "diff"]
    assert b"# sandboxd: not diffed: its content before the call was not kept" in read_blob(store, diff.content_hash)


def test_collection_off_keeps_no_file_and_no_diff(tmp_path, store):
    ws = Workspace(tmp_path, {})
    (ws.dir / "a").write_bytes(b"x")
    assert collect(ws, store, collect_files=False, diff=False).records == []
    only_diff = collect(ws, store, collect_files=False)
    assert [r.kind for r in only_diff.records] == ["diff"]
    assert stat.S_ISDIR(os.stat(tmp_path / "blobs").st_mode)


# ------------------------------------------------------------------ what the sandbox could not read

def collect_as(ws: Workspace, store: FileArtifactStore, reader, blocked=()):
    return OutputCollector(ArtifactSettings(), store, ws.baseline, "call_1", ws.roots, None, reader,
                           blocked).collect(ws.changed())


def test_a_file_the_sandboxs_user_could_not_read_is_not_kept(tmp_path, store):
    ws = Workspace(tmp_path, {"mine.txt": b"x\n"})
    os.chown(ws.dir, 1000, 1000)
    (ws.dir / "root.key").write_bytes(b"ROOTONLY\n")
    os.chmod(ws.dir / "root.key", 0o600)  # root's, as the daemon writes it
    (ws.dir / "closed").mkdir(mode=0o700)
    (ws.dir / "closed" / "open.txt").write_bytes(b"behind a closed directory\n")
    os.chmod(ws.dir / "closed" / "open.txt", 0o644)
    # Its mode bits let anyone read it; an ACL entry shuts the sandbox's user out.
    (ws.dir / "acl.txt").write_bytes(b"ACLDENIED\n")
    os.chmod(ws.dir / "acl.txt", 0o644)
    deny_user_by_acl(ws.dir / "acl.txt", 1000)
    (ws.dir / "mine.txt").write_bytes(b"y\n")
    os.chown(ws.dir / "mine.txt", 1000, 1000)
    got = collect_as(ws, store, (1000, 1000))
    assert [r.path for r in got.records if r.kind == "file"] == ["/workspace/mine.txt"]
    assert sorted(got.omitted) == ["/workspace/acl.txt: the sandbox's user cannot read it: not kept",
                                   "/workspace/closed/open.txt: the sandbox's user cannot reach it: not kept",
                                   "/workspace/root.key: the sandbox's user cannot read it: not kept"]
    [diff] = [r for r in got.records if r.kind == "diff"]
    text = read_blob(store, diff.content_hash)
    assert b"ROOTONLY" not in text and b"behind a closed" not in text and b"ACLDENIED" not in text
    assert b"-x\n+y\n" in text


def deny_user_by_acl(path, uid: int) -> None:
    """A POSIX access ACL (the kernel's xattr form, as setfacl writes it): the owner rw,
    `uid` nothing, the group and others r."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, 6, undefined), (0x02, 0, uid), (0x04, 4, undefined), (0x10, 4, undefined),
               (0x20, 4, undefined)]  # user_obj, user, group_obj, mask, other
    os.setxattr(path, "system.posix_acl_access",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))


def test_the_content_before_is_shown_only_for_a_file_changed_in_place(tmp_path, store):
    ws = Workspace(tmp_path, {"gone.txt": b"old secret\n", "sed.txt": b"a\n", "edit.txt": b"1\n"})
    (ws.dir / "gone.txt").unlink()
    (ws.dir / "tmp").write_bytes(b"b\n")
    os.rename(ws.dir / "tmp", ws.dir / "sed.txt")
    with open(ws.dir / "edit.txt", "ab") as f:
        f.write(b"2\n")
    got = collect_as(ws, store, READER)
    [diff] = [r for r in got.records if r.kind == "diff"]
    text = read_blob(store, diff.content_hash).decode()
    assert "old secret" not in text and "-a\n" not in text
    assert " 1\n+2\n" in text
    assert text.count("# sandboxd: not diffed: its content before the call is shown only for a file changed "
                      "in place") == 2


def test_a_new_file_in_the_inode_number_of_one_closed_to_the_sandbox_shows_nothing_of_it(tmp_path, store):
    """The red-team's attack: secret.txt, root's and 0600, hashed as root before the call
    (the baseline keeps it); the call removes it, makes files until one gets its inode
    number and renames that one to secret.txt: the same path and inode number."""
    ws = Workspace(tmp_path, {"edit.txt": b"1\n"})
    os.chown(ws.dir, 1000, 1000)
    (ws.dir / "secret.txt").write_bytes(b"ROOTONLY\n")
    os.chmod(ws.dir / "secret.txt", 0o600)
    ws.before = ws.snap()
    assert ws.baseline.read(sha(b"ROOTONLY\n")) == b"ROOTONLY\n"  # as the hash cache read it
    number = (ws.dir / "secret.txt").stat().st_ino
    reuse_inode_number(ws.dir, "secret.txt", b"mine\n")
    assert (ws.dir / "secret.txt").stat().st_ino == number
    with open(ws.dir / "edit.txt", "ab") as f:
        f.write(b"2\n")
    got = collect_as(ws, store, READER)
    [diff] = [r for r in got.records if r.kind == "diff"]
    text = read_blob(store, diff.content_hash).decode()
    assert "ROOTONLY" not in text
    assert ("diff --git a/workspace/secret.txt b/workspace/secret.txt\n# sandboxd: not diffed: its content before "
            "the call is shown only for a file changed in place\n") in text
    assert " 1\n+2\n" in text  # a file changed in place still is diffed


def test_a_file_whose_birth_is_unknown_is_not_diffed(tmp_path, store):
    """A file system that gives neither a birth time nor a generation cannot tell an edit
    in place from a new file in a freed inode number: the content before is not shown."""
    ws = Workspace(tmp_path, {"a.txt": b"before\n"})
    (ws.dir / "a.txt").write_bytes(b"after\n")
    after = ws.snap()
    unborn = {p: e._replace(btime_ns=0, generation=-1) for p, e in after.entries.items()}
    before = {p: e._replace(btime_ns=0, generation=-1) for p, e in ws.before.entries.items()}
    changed = changed_files(activity.diff(before, unborn), before, unborn)
    assert [(c.change, c.replaced, c.same_file) for c in changed] == [("modified", False, False)]
    got = OutputCollector(ArtifactSettings(), store, ws.baseline, "call_1", ws.roots, None, READER).collect(changed)
    [diff] = [r for r in got.records if r.kind == "diff"]
    assert read_blob(store, diff.content_hash) == (b"diff --git a/workspace/a.txt b/workspace/a.txt\n# sandboxd: not "
                                                   b"diffed: its content before the call is shown only for a file "
                                                   b"changed in place\n")


def test_the_content_before_is_shown_only_if_the_sandboxs_user_could_read_it_then(tmp_path, store):
    """What the sandbox's user owns it may open to itself during the call: the modes
    before the call decide. What it does not own keeps its modes and ACLs through the
    call: the kernel's judgement as that user after the call holds for before it too."""
    ws = Workspace(tmp_path, {"own-closed.txt": b"was closed\n", "shut/inside.txt": b"behind a shut door\n",
                              "own-open.txt": b"mine before\n", "others-rw.txt": b"anyone's\n",
                              "others-w.txt": b"write only\n"})
    os.chown(ws.dir, 1000, 1000)
    for name, mode, owner in (("own-closed.txt", 0o200, 1000), ("shut", 0o000, 1000), ("shut/inside.txt", 0o666, 0),
                              ("own-open.txt", 0o600, 1000), ("others-rw.txt", 0o666, 0), ("others-w.txt", 0o622, 0)):
        os.chown(ws.dir / name, owner, owner)
        os.chmod(ws.dir / name, mode)
    ws.before = ws.snap()
    # The call: its user opens what it owns to itself, and writes to each file in place.
    os.chmod(ws.dir / "own-closed.txt", 0o644)
    os.chmod(ws.dir / "shut", 0o755)
    for name in ("own-closed.txt", "shut/inside.txt", "own-open.txt", "others-rw.txt", "others-w.txt"):
        with open(ws.dir / name, "ab") as f:
            f.write(b"more\n")
    got = collect_as(ws, store, READER)
    [diff] = [r for r in got.records if r.kind == "diff"]
    text = read_blob(store, diff.content_hash).decode()
    assert "was closed" not in text and "behind a shut door" not in text and "write only" not in text
    closed = "# sandboxd: not diffed: the sandbox's user could not read it before the call: its content then is not shown\n"
    assert f"diff --git a/workspace/own-closed.txt b/workspace/own-closed.txt\n{closed}" in text
    assert f"diff --git a/workspace/shut/inside.txt b/workspace/shut/inside.txt\n{closed}" in text
    assert ("diff --git a/workspace/others-w.txt b/workspace/others-w.txt\n# sandboxd: not diffed: the sandbox's "
            "user cannot read it: not kept\n") in text
    assert " mine before\n+more\n" in text and " anyone's\n+more\n" in text


def test_without_the_sandboxs_user_no_content_before_is_shown(tmp_path, store):
    ws = Workspace(tmp_path, {"a.txt": b"before\n"})
    (ws.dir / "a.txt").write_bytes(b"after\n")
    got = OutputCollector(ArtifactSettings(), store, ws.baseline, "call_1", ws.roots).collect(ws.changed())
    [diff] = [r for r in got.records if r.kind == "diff"]
    assert read_blob(store, diff.content_hash) == (b"diff --git a/workspace/a.txt b/workspace/a.txt\n# sandboxd: not "
                                                   b"diffed: its content before the call is shown only for a file read "
                                                   b"as the sandbox's user\n")


def test_with_blocked_paths_no_changed_file_is_kept(tmp_path, store):
    ws = Workspace(tmp_path, {"conf/secret.env": b"TOKEN=abc\n"})
    os.rename(ws.dir / "conf", ws.dir / "moved")  # the mask moves with it in the sandbox, not on the host
    got = collect_as(ws, store, None, blocked=("/workspace/conf/secret.env",))
    assert got.records == []
    assert got.omitted == ["1 changed files: none is kept or diffed when a blocked path lies below a directory "
                           "the sandbox could move"]


def test_only_content_the_diff_shows_is_held_in_memory(tmp_path, store):
    ws = Workspace(tmp_path, {"sed.txt": b"a\n"})
    (ws.dir / "new.txt").write_bytes(b"n\n")
    (ws.dir / "tmp").write_bytes(b"b\n")
    os.rename(ws.dir / "tmp", ws.dir / "sed.txt")  # replaced: its diff shows no content
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept.bin").write_bytes(b"k")
    kept = [snapshot_file for snapshot_file in
            changed_files([{"path": "/tmp/kept.bin", "operation": "create"}], {},
                          snapshot.take([("/tmp", str(tmp_path / "out"))], snapshot.HashCache()).entries)]
    collector = OutputCollector(ArtifactSettings(), store, ws.baseline, "call_1",
                                ws.roots + [("/tmp", str(tmp_path / "out"))])
    got = collector.collect(ws.changed(), kept)
    assert {r.path for r in got.records if r.kind == "file"} == {"/workspace/new.txt", "/workspace/sed.txt",
                                                                "/tmp/kept.bin"}
    assert set(collector._afters) == {"/workspace/new.txt"}


# ------------------------------------------------------------------ persistOutputs' tmpfs

MS_SHARED = 1 << 20

def test_the_outputs_tmpfs_is_a_private_mount_even_under_a_shared_one(tmp_path):
    from sandboxd.core.mounts import MS_BIND, mount, unmount
    from sandboxd.outputs import tempdir

    runtime = tmp_path / "runtime"
    runtime.mkdir()
    mount(str(runtime), str(runtime), None, MS_BIND)  # as systemd leaves /: shared
    try:
        mount(None, str(runtime), None, MS_SHARED)  # (MS_SHARED: not one the daemon uses)
        path = tempdir.outputs_dir(runtime, "sb_1")
        tempdir.make(path, 1 << 20, 1000, 1000)
        try:
            [line] = [ln for ln in open("/proc/self/mountinfo") if ln.split()[4] == path]
            optional = line.split(" - ")[0].split()[6:]
            assert not [tag for tag in optional if tag.startswith(("shared:", "master:"))], line
            st = os.stat(path)
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1000, 1000, 0o700)
        finally:
            tempdir.release(path)
        assert not os.path.exists(path)
    finally:
        unmount(str(runtime))


def test_only_masks_below_a_movable_directory_turn_collection_off():
    masks = ["/workspace/.env", "/workspace/conf/secret.env", "/workspace/sub/.ssh", "/tmp/x/key",
             "/workspace/.config/gh/hosts.yml", "/data/ro/.env"]
    # /workspace/.config/gh is a read root nested in the write root: renaming .config carries it.
    mounts = ["/workspace", "/workspace/sub", "/tmp", "/workspace/.config/gh", "/data/ro"]
    assert movable_masks(masks, mounts, ["/workspace", "/workspace/sub", "/tmp"]) == (
        "/workspace/conf/secret.env", "/tmp/x/key", "/workspace/.config/gh/hosts.yml")


def test_a_write_through_a_shared_mapping_never_reaches_the_baseline(tmp_path, monkeypatch):
    """A write through MAP_SHARED after the descriptor closed tells inotify nothing at the
    write, but the mapping holds the file open: its IN_CLOSE_WRITE comes when the mapping
    ends (with the call's processes), so the tracker that settles the root has hashed, and
    refused, what was written; a later walk keeps nothing of it."""
    import mmap

    from sandboxd.recording.live_snapshot import LiveSnapshots

    monkeypatch.setattr(snapshot, "RACY_NS", 0)
    ws = tmp_path / "ws"
    ws.mkdir()
    target = ws / "mapped.txt"
    target.write_bytes(b"x" * 64 + b"\n")
    baseline = Baseline(tmp_path / "b", 2**20, 2**20)
    baseline.open()
    live = LiveSnapshots(snapshot.HashCache(baseline=baseline))
    roots = [(ROOT, str(ws))]
    live.take(roots)
    live.take(roots)  # tracked from here on
    release = baseline.withhold([str(ws)])
    fd = os.open(target, os.O_RDWR)
    mapped = mmap.mmap(fd, 0)
    os.close(fd)  # the mapping still holds the file open
    live.take(roots)  # the call's after-snapshot, while the mapping is still unwritten
    mapped[:13] = b"token=S3CR3T "
    mapped.flush()
    mapped.close()
    release()
    live.take(roots)  # the next call's before-snapshot settles the root
    assert not baseline.withheld(str(ws))
    live.close()
    fresh = LiveSnapshots(snapshot.HashCache(baseline=baseline))  # a tracker retired, a restart: a walk
    fresh.take(roots)
    assert holding(tmp_path / "b", b"S3CR3T") == []
    fresh.close()
