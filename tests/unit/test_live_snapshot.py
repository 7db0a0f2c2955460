"""sandboxd.recording.live_snapshot: inotify-kept snapshots of write roots, held entry for entry
against snapshot.take (a full walk) after random and targeted changes to a real tree."""

from __future__ import annotations

import os
import random
import shutil
import stat

import pytest

from sandboxd.recording import live_snapshot as ls
from sandboxd.recording import tree_record
from sandboxd.recording import activity
from sandboxd.recording import snapshot
from sandboxd.recording.live_snapshot import LiveSnapshots
from sandboxd.recording.snapshot import HashCache
from sandboxd_testing import wait_for

SB = "/workspace"


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    for d in range(4):
        (root / f"d{d}" / "sub").mkdir(parents=True)
        for f in range(5):
            (root / f"d{d}" / f"f{f}.txt").write_text(f"{d}-{f}\n")
        (root / f"d{d}" / "sub" / "deep.txt").write_text("deep\n")
    (root / "top.txt").write_text("top\n")
    return root


@pytest.fixture
def live():
    live = LiveSnapshots(HashCache())
    yield live
    live.close()


def walked(root) -> dict:
    return snapshot.take([(SB, str(root))], HashCache()).entries


def kept(live: LiveSnapshots, root) -> dict:
    snap = live.take([(SB, str(root))])
    assert snap.complete, snap.gaps
    return snap.entries


def tracker(live: LiveSnapshots, root) -> ls.RootTracker:
    return live._trackers[(SB, str(root))]


def test_the_first_snapshot_is_the_walk(live, tree):
    assert kept(live, tree) == walked(tree)
    assert tracker(live, tree).full_walks == 1 and live.fallbacks == 0


@pytest.mark.parametrize("change", [
    "create", "write", "append", "truncate", "chmod", "rename_file", "rename_over", "mkdir_tree", "rmtree",
    "rename_dir", "dir_out_and_back", "symlink", "file_to_dir", "dir_to_symlink", "utime", "hardlink_write",
    "outside_link_write", "empty_file", "fifo",
])
def test_each_kind_of_change_is_seen_without_a_walk(live, tree, tmp_path, change):
    kept(live, tree)
    outside = tmp_path / "outside"
    outside.mkdir()
    if change == "create":
        (tree / "d1" / "new.txt").write_text("new\n")
    elif change == "write":
        (tree / "d2" / "f3.txt").write_text("rewritten, longer\n")
    elif change == "append":
        with open(tree / "d0" / "f0.txt", "a") as f:
            f.write("more\n")
    elif change == "truncate":
        os.truncate(tree / "d0" / "f1.txt", 1)  # truncate(2) on a path: no open, no close
    elif change == "chmod":
        os.chmod(tree / "d3" / "f4.txt", 0o600)
    elif change == "rename_file":
        os.rename(tree / "d1" / "f1.txt", tree / "d2" / "moved.txt")
    elif change == "rename_over":
        (tree / "d1" / ".tmp").write_text("replacement\n")
        os.rename(tree / "d1" / ".tmp", tree / "d1" / "f2.txt")
    elif change == "mkdir_tree":
        (tree / "d0" / "a" / "b" / "c").mkdir(parents=True)
        (tree / "d0" / "a" / "b" / "c" / "leaf.txt").write_text("leaf\n")
    elif change == "rmtree":
        shutil.rmtree(tree / "d2")
    elif change == "rename_dir":
        os.rename(tree / "d3", tree / "d0" / "d3-moved")
        (tree / "d0" / "d3-moved" / "sub" / "after-move.txt").write_text("x\n")
    elif change == "dir_out_and_back":
        os.rename(tree / "d1", outside / "d1")
        (outside / "d1" / "while-away.txt").write_text("away\n")
        os.rename(outside / "d1", tree / "d1-back")
    elif change == "symlink":
        os.symlink("/etc/passwd", tree / "d1" / "link")
    elif change == "file_to_dir":
        os.unlink(tree / "top.txt")
        (tree / "top.txt").mkdir()
        (tree / "top.txt" / "inner").write_text("i\n")
    elif change == "dir_to_symlink":
        shutil.rmtree(tree / "d0")
        os.symlink(str(outside), tree / "d0")
    elif change == "utime":
        os.utime(tree / "d2" / "f0.txt", ns=(1, 1))
    elif change == "hardlink_write":
        os.link(tree / "d0" / "f0.txt", tree / "d3" / "twin.txt")
        kept(live, tree)
        with open(tree / "d3" / "twin.txt", "a") as f:
            f.write("through the twin\n")
    elif change == "outside_link_write":
        os.link(tree / "d0" / "f2.txt", outside / "twin.txt")
        (tree / "d0" / "nudge").touch()  # d0 listed again: f2.txt is known to have a twin
        kept(live, tree)
        with open(outside / "twin.txt", "a") as f:  # no event in the tree at all
            f.write("from outside\n")
    elif change == "empty_file":
        (tree / "d1" / "empty").touch()
    elif change == "fifo":
        os.mkfifo(tree / "d1" / "pipe")
    assert kept(live, tree) == walked(tree)
    assert tracker(live, tree).full_walks == 1


@pytest.mark.parametrize("seed", [20261203, 7, 99, 1, 2, 3, 4, 5, 6, 8])
def test_random_changes_agree_with_the_walk(live, tree, tmp_path, seed):
    rng = random.Random(seed)
    outside = tmp_path / "outside"
    outside.mkdir()
    kept(live, tree)
    first = previous = live.take([(SB, str(tree))])
    for step in range(300):
        files = [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()]
        dirs = [tree] + [p for p in tree.rglob("*") if p.is_dir() and not p.is_symlink()]
        op = rng.choice(["create", "create", "write", "delete", "mkdir", "rename", "rmdir", "chmod", "link",
                         "move_dir", "away_and_back"])
        try:
            if op == "create":
                (rng.choice(dirs) / f"n{step}").write_text("x" * rng.randrange(50))
            elif op == "write" and files:
                rng.choice(files).write_text(f"w{step}")
            elif op == "delete" and files:
                rng.choice(files).unlink()
            elif op == "mkdir":
                (rng.choice(dirs) / f"dir{step}").mkdir()
            elif op == "rename" and files:
                os.rename(rng.choice(files), rng.choice(dirs) / f"r{step}")
            elif op == "rmdir" and len(dirs) > 1:
                shutil.rmtree(rng.choice(dirs[1:]))
            elif op == "chmod" and files:
                os.chmod(rng.choice(files), rng.choice([0o600, 0o644, 0o755]))
            elif op == "link" and files:
                os.link(rng.choice(files), rng.choice(dirs) / f"l{step}")
            elif op == "move_dir" and len(dirs) > 1:
                src, dst = rng.choice(dirs[1:]), rng.choice(dirs)
                if not str(dst).startswith(str(src)):
                    os.rename(src, dst / f"m{step}")
            elif op == "away_and_back" and len(dirs) > 1:
                src = rng.choice(dirs[1:])
                os.rename(src, outside / "away")
                (outside / "away" / f"a{step}").write_text("a")
                os.rename(outside / "away", rng.choice([d for d in dirs if not str(d).startswith(str(src))])
                          / f"back{step}")
        except (FileNotFoundError, FileExistsError, OSError):
            pass
        if step % 7 == 0:
            assert kept(live, tree) == walked(tree), f"after step {step} ({op})"
            now = live.take([(SB, str(tree))])
            # The paths the tracker saw change hold every difference: comparing only
            # them gives the whole comparison's answer.
            assert_diff_by_changes_is_the_full_diff(previous, now)
            previous = now
    assert kept(live, tree) == walked(tree)
    assert tracker(live, tree).full_walks == 1
    # Across many generations too (within the history kept).
    assert_diff_by_changes_is_the_full_diff(first, live.take([(SB, str(tree))]))


def assert_diff_by_changes_is_the_full_diff(before, after) -> None:
    changed = LiveSnapshots.changed_between(before, after)
    assert changed is not None
    assert activity.diff(before.entries, after.entries, changed) == activity.diff(before.entries, after.entries)
    assert {p for p, _ in before.entries.items() ^ after.entries.items()} <= changed


def test_changes_are_not_claimed_across_a_full_walk_a_walked_root_or_a_lost_history(live, tree, tmp_path, monkeypatch):
    before = live.take([(SB, str(tree))])
    limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
    for i in range(limit + 10):  # overflow: the tracker walks again
        os.close(os.open(tree / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644))
    after = live.take([(SB, str(tree))])
    assert tracker(live, tree).full_walks == 2
    assert LiveSnapshots.changed_between(before, after) is None
    assert len(activity.diff(before.entries, after.entries)) == limit + 10
    # A root that is walked (a bind of one file) has no tracker to ask.
    one = tmp_path / "one.txt"
    one.write_text("1")
    binds = [(SB, str(tree)), ("/one.txt", str(one))]
    a = live.take(binds)
    one.write_text("2")
    b = live.take(binds)
    assert a.walked and LiveSnapshots.changed_between(a, b) is None
    # More generations than are kept.
    monkeypatch.setattr(tree_record, "HISTORY", 3)
    old = live.take([(SB, str(tree))])
    for i in range(5):
        (tree / "top.txt").write_text(f"v{i}")
        live.take([(SB, str(tree))])
    assert LiveSnapshots.changed_between(old, live.take([(SB, str(tree))])) is None


def test_a_call_s_before_and_after_compare_only_what_changed(live, tree, monkeypatch):
    before = live.take([(SB, str(tree))])
    (tree / "d1" / "f1.txt").write_text("changed\n")
    (tree / "d3" / "new.txt").write_text("new\n")
    after = live.take([(SB, str(tree))])
    assert LiveSnapshots.changed_between(before, after) == {
        f"{SB}/d1/f1.txt", f"{SB}/d3/new.txt", f"{SB}/d3"}  # d1 itself: a write leaves it as it was
    ops = {(c["path"], c["operation"]) for c in activity.diff(before.entries, after.entries,
                                                              LiveSnapshots.changed_between(before, after))}
    assert ops == {(f"{SB}/d1/f1.txt", "write"), (f"{SB}/d3/new.txt", "create")}


def test_only_changed_directories_are_listed_again(live, tree, monkeypatch):
    for i in range(30):
        (tree / f"extra{i}").mkdir()
    kept(live, tree)
    rescanned = []
    original = ls.RootTracker._rescan
    monkeypatch.setattr(ls.RootTracker, "_rescan", lambda self, fd, path, *a: (rescanned.append(path),
                                                                              original(self, fd, path, *a)))
    assert kept(live, tree) == walked(tree) and rescanned == []
    (tree / "d2" / "sub" / "deep.txt").write_text("changed\n")
    assert kept(live, tree) == walked(tree)
    assert rescanned == [f"{SB}/d2/sub"]


def test_an_overflowed_queue_means_a_full_walk(live, tree):
    many = tree / "many"
    many.mkdir()
    kept(live, tree)  # watched from here on
    limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
    for i in range(limit + 10):  # an event a file (made in a watched directory)
        os.close(os.open(many / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644))
    assert kept(live, tree) == walked(tree)
    assert tracker(live, tree).full_walks == 2


def test_a_replaced_root_is_walked_again(live, tree, tmp_path):
    kept(live, tree)
    os.rename(tree, tmp_path / "old-ws")
    tree.mkdir()
    (tree / "fresh.txt").write_text("fresh\n")
    assert kept(live, tree) == walked(tree) == {f"{SB}/fresh.txt": walked(tree)[f"{SB}/fresh.txt"]}
    (tree / "fresh.txt").write_text("changed\n")
    assert kept(live, tree) == walked(tree)


def test_a_root_that_became_a_symlink_is_refused_like_the_walk_refuses_it(live, tree, tmp_path):
    kept(live, tree)
    os.rename(tree, tmp_path / "old-ws")
    os.symlink(tmp_path / "old-ws", tree)
    snap = live.take([(SB, str(tree))])
    assert snap.entries == {} and snap.gaps and "not walked" in snap.gaps[0]


def test_the_entry_cap_falls_back_to_the_walk_and_its_gap(live, tree):
    snap = live.take([(SB, str(tree))], max_entries=5)
    full = snapshot.take([(SB, str(tree))], HashCache(), max_entries=5)
    assert snap.entries == full.entries and snap.gaps == full.gaps and live.fallbacks == 1


def test_a_bind_of_one_file_is_walked(live, tree):
    one = str(tree / "top.txt")
    assert live.take([("/etc/app.conf", one)]).entries == snapshot.take([("/etc/app.conf", one)], HashCache()).entries


def test_several_roots_in_one_take(live, tree, tmp_path):
    other = tmp_path / "cache"
    other.mkdir()
    (other / "c.bin").write_bytes(b"\0" * 10)
    binds = [(SB, str(tree)), ("/cache", str(other))]
    assert live.take(binds).entries == snapshot.take(binds, HashCache()).entries
    (other / "c.bin").write_bytes(b"\1")
    assert live.take(binds).entries == snapshot.take(binds, HashCache()).entries


def test_idle_and_surplus_trackers_are_closed(tree, tmp_path):
    live = LiveSnapshots(HashCache(), max_trackers=2)
    roots = []
    for i in range(3):
        r = tmp_path / f"r{i}"
        r.mkdir()
        roots.append(r)
        kept(live, r)
    assert [k[1] for k in live._trackers] == [str(roots[1]), str(roots[2])]
    live._idle_s = 0
    kept(live, roots[2])  # every other tracker idled out
    assert [k[1] for k in live._trackers] == [str(roots[2])]
    live.close()
    assert not live._trackers


def test_hashes_are_kept_current(live, tree):
    before = kept(live, tree)[f"{SB}/d1/f1.txt"]
    (tree / "d1" / "f1.txt").write_text("new content\n")
    after = kept(live, tree)[f"{SB}/d1/f1.txt"]
    import hashlib
    assert after.sha256 == "sha256:" + hashlib.sha256(b"new content\n").hexdigest() != before.sha256
    assert stat.S_ISREG(after.mode)


def test_files_past_the_hashing_caps_are_counted_like_the_walk_counts_them(live, tree):
    from sandboxd.recording.snapshot import HashBudget

    (tree / "d0" / "big.bin").write_bytes(b"x" * 5000)
    budget = HashBudget(max_file=1000)
    snap = live.take([(SB, str(tree))], budget)
    full = snapshot.take([(SB, str(tree))], HashCache(), HashBudget(max_file=1000))
    assert snap.entries == full.entries and snap.unhashed == full.unhashed == 1
    (tree / "d0" / "big.bin").write_bytes(b"small")
    assert live.take([(SB, str(tree))], HashBudget(max_file=1000)).unhashed == 0


def test_a_file_left_over_one_snapshots_budget_is_hashed_by_the_next(live, tree):
    from sandboxd.recording.snapshot import HashBudget

    (tree / "d1" / "late.bin").write_bytes(b"y" * 3000)
    (tree / "d1" / "late.bin").touch()
    tight = live.take([(SB, str(tree))], HashBudget(bytes_left=100))
    assert tight.entries[f"{SB}/d1/late.bin"].note == "over the snapshot's hashing budget"
    assert kept(live, tree) == walked(tree)
    assert kept(live, tree)[f"{SB}/d1/late.bin"].sha256.startswith("sha256:")


# ------------------------------------------------------------------ cases found in review


def test_a_directory_removed_and_made_again_is_watched_again(live, tree):
    kept(live, tree)
    shutil.rmtree(tree / "d1")
    (tree / "d1").mkdir()  # ext4 hands the old inode number straight back
    (tree / "d1" / "new").write_text("n\n")
    assert kept(live, tree) == walked(tree)
    (tree / "d1" / "later").write_text("l\n")  # seen only if d1 is watched again
    assert kept(live, tree) == walked(tree)


def test_a_write_through_a_link_the_command_made_is_seen_at_the_other_link(live, tree):
    kept(live, tree)
    os.link(tree / "d0" / "f0.txt", tree / "d1" / "g")
    with open(tree / "d1" / "g", "a") as f:
        f.write("through g\n")
    assert kept(live, tree) == walked(tree)


@pytest.mark.parametrize("how", ["write", "chmod", "truncate", "utime"])
def test_a_change_through_a_link_made_and_removed_in_between_is_seen(live, tree, how):
    """A command that links a file elsewhere, changes it there and removes the link
    leaves no event in the file's directory: the watch on the file's inode sees it."""
    before = kept(live, tree)
    os.link(tree / "d0" / "f0.txt", tree / "d1" / "tmp-link")
    if how == "write":
        with open(tree / "d1" / "tmp-link", "a") as f:
            f.write("hidden\n")
    elif how == "chmod":
        os.chmod(tree / "d1" / "tmp-link", 0o600)
    elif how == "truncate":
        os.truncate(tree / "d1" / "tmp-link", 0)
    else:
        os.utime(tree / "d1" / "tmp-link", ns=(5, 5))
    os.unlink(tree / "d1" / "tmp-link")
    after = kept(live, tree)
    assert after == walked(tree)
    assert after[f"{SB}/d0/f0.txt"] != before[f"{SB}/d0/f0.txt"]
    assert activity.diff(before, after) == activity.diff(before, walked(tree))


def test_an_overflow_while_rescanning_is_not_returned_as_a_snapshot(live, tree, monkeypatch):
    kept(live, tree)
    (tree / "d0" / "x").write_text("x")
    original = ls.RootTracker._rescan
    fired = []

    def rescan(self, fd, path, *a):
        original(self, fd, path, *a)
        if path.endswith("/d0") and not fired:  # a burst while rescans run
            fired.append(1)
            limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
            for _ in range(limit + 100):
                os.utime(tree / "d2")
            (tree / "d3" / "lost").write_text("lost")  # its event is dropped

    monkeypatch.setattr(ls.RootTracker, "_rescan", rescan)
    assert kept(live, tree) == walked(tree)


def test_the_entry_cap_holds_for_a_root_that_did_not_change(live, tree, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for name in ("x", "y", "z"):
        (other / name).write_text(name)  # 33 entries in the tree and 3 here: under the cap of 40
    binds = [(SB, str(tree)), ("/other", str(other))]
    full = snapshot.take(binds, HashCache(), max_entries=40)
    assert live.take(binds, max_entries=40).entries == full.entries
    for i in range(5):
        (tree / f"grow{i}").touch()
    snap, full = live.take(binds, max_entries=40), snapshot.take(binds, HashCache(), max_entries=40)
    assert snap.entries == full.entries and snap.gaps == full.gaps and full.gaps


def test_a_tracker_that_gave_up_leaves_the_walk_its_hash_budget(live, tree):
    from sandboxd.recording.snapshot import HashBudget

    (tree / "big.bin").write_bytes(b"z" * 600_000)
    budget = HashBudget(bytes_left=700_000)
    snap = live.take([(SB, str(tree))], budget, max_entries=5)  # the tracker gives up at the cap
    assert snap.gaps and live.fallbacks == 1
    full = snapshot.take([(SB, str(tree))], HashCache(), HashBudget(bytes_left=700_000), max_entries=5)
    assert snap.entries == full.entries


def test_a_root_whose_tracker_gave_up_is_walked_for_a_while_then_tracked_again(live, tree, monkeypatch):
    live.take([(SB, str(tree))], max_entries=5)  # over the cap: given up
    assert (SB, str(tree)) not in live._trackers
    assert kept(live, tree) == walked(tree) and live.fallbacks == 2  # walked, not tracked
    monkeypatch.setattr(ls, "UNTRACKED_S", 0.0)
    live._untracked = {k: 0.0 for k in live._untracked}  # the while is over
    assert kept(live, tree) == walked(tree) and live.fallbacks == 2
    assert tracker(live, tree).full_walks == 1


def test_depth_counts_from_the_write_root_not_the_sandbox_path(live, tmp_path):
    root = tmp_path / "deep"
    root.mkdir()
    binds = [("/a/b/c/d/e/f/workspace", str(root))]
    live.take(binds)
    path = root
    for _ in range(MAX_NEST):
        path = path / "d"
    path.mkdir(parents=True)
    assert live.take(binds).entries == snapshot.take(binds, HashCache()).entries
    assert live.fallbacks == 0


MAX_NEST = snapshot.MAX_DEPTH - 3


def test_an_unchanged_tree_gives_the_same_snapshot_and_a_changed_one_leaves_the_old_alone(live, tree):
    """Two snapshots with nothing changed in between are one dict (nothing copied, the
    diff has nothing to compare); a change makes a new one, and the earlier snapshot
    still says what the tree was then."""
    first = kept(live, tree)
    (tree / "top.txt").read_text()  # a read changes nothing
    second = kept(live, tree)
    assert second is first and activity.diff(first, second) == []
    (tree / "d1" / "f1.txt").write_text("changed\n")
    third = kept(live, tree)
    assert third is not first and third == walked(tree)
    assert first["/workspace/d1/f1.txt"].sha256 != third["/workspace/d1/f1.txt"].sha256
    assert [c["path"] for c in activity.diff(first, third)] == ["/workspace/d1/f1.txt"]
    assert kept(live, tree) is third


def test_several_roots_never_change_a_tracker_s_snapshot(live, tree, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x\n")
    alone = kept(live, tree)
    size = len(alone)
    both = live.take([(SB, str(tree)), ("/workspace/other", str(other))])
    assert "/workspace/other/x.txt" in both.entries and len(alone) == size
    assert kept(live, tree) is alone




def test_a_change_between_calls_is_taken_in_ahead_of_the_next_snapshot(tree, monkeypatch):
    live = LiveSnapshots(HashCache(), refresh_after_s=0.02)
    try:
        first = live.take([(SB, str(tree))])
        (tree / "d1" / "f1.txt").write_text("changed between calls\n")
        (tree / "d2" / "new.txt").write_text("new\n")
        assert wait_for(lambda: live.refreshes >= 1)
        rescanned = []
        original = ls.RootTracker._rescan
        monkeypatch.setattr(ls.RootTracker, "_rescan", lambda self, fd, path, *a: (rescanned.append(path),
                                                                                  original(self, fd, path, *a)))
        now = live.take([(SB, str(tree))])
        assert rescanned == [] and now.entries == walked(tree)
        # The refresh was a generation of its own: what changed since the first is known.
        assert LiveSnapshots.changed_between(first, now) >= {f"{SB}/d1/f1.txt", f"{SB}/d2/new.txt"}
        assert tracker(live, tree).full_walks == 1
    finally:
        live.close()
    assert live._refresher is None


def test_a_root_that_cannot_be_refreshed_is_walked_by_the_next_call(tree, monkeypatch):
    live = LiveSnapshots(HashCache(), refresh_after_s=0.02)
    try:
        live.take([(SB, str(tree))])
        original = ls.RootTracker.snapshot

        def failing(self, budget, max_entries, *, use=True):
            if not use:
                raise ls.Untrackable("the tree changed faster than it could be followed")
            return original(self, budget, max_entries, use=use)

        monkeypatch.setattr(ls.RootTracker, "snapshot", failing)
        (tree / "top.txt").write_text("changed\n")
        assert wait_for(lambda: (SB, str(tree)) not in live._trackers)
        assert live.take([(SB, str(tree))]).entries == walked(tree)
        assert live.fallbacks == 1
    finally:
        live.close()


def test_refreshing_ahead_does_not_keep_an_unused_tracker_alive(tree):
    live = LiveSnapshots(HashCache(), refresh_after_s=0.02)
    try:
        live.take([(SB, str(tree))])
        used = tracker(live, tree).last_used
        (tree / "top.txt").write_text("changed\n")
        assert wait_for(lambda: live.refreshes >= 1)
        assert tracker(live, tree).last_used == used
    finally:
        live.close()


def test_a_root_a_call_changed_unseen_is_refreshed_at_once_when_asked(tree):
    live = LiveSnapshots(HashCache(), refresh_after_s=60)  # never by the timer, in this test
    try:
        live.take([(SB, str(tree))])
        (tree / "top.txt").write_text("changed by a call that recorded nothing\n")
        live.refresh_soon([(SB, str(tree)), ("/other", "/nowhere")])
        assert wait_for(lambda: live.refreshes == 1, timeout_s=10)
        assert live.take([(SB, str(tree))]).entries == walked(tree)
    finally:
        live.close()


def test_refreshing_ahead_hashes_little_backs_off_and_stops_for_an_idle_root(tree, monkeypatch):
    monkeypatch.setattr(ls, "AHEAD_HASH_BYTES", 10)
    live = LiveSnapshots(HashCache(), refresh_after_s=0.02)
    try:
        live.take([(SB, str(tree))])
        (tree / "big.txt").write_text("x" * 100)  # over what a refresh ahead may hash
        assert wait_for(lambda: live.refreshes >= 1)
        assert f"{SB}/big.txt" in tracker(live, tree)._unhashed
        snap = live.take([(SB, str(tree))])  # the call's own snapshot hashes it
        assert snap.entries[f"{SB}/big.txt"].sha256 and snap.entries == walked(tree)
        assert tracker(live, tree).ahead == 0
        # A root that keeps changing with no call between: each refresh waits twice as long.
        for i in range(3):
            before = live.refreshes
            (tree / "top.txt").write_text(f"v{i}")
            assert wait_for(lambda: live.refreshes > before)
        assert tracker(live, tree).ahead == 3
        # Idle past AHEAD_IDLE_S: left for the next call.
        monkeypatch.setattr(ls, "AHEAD_IDLE_S", 0.0)
        before = live.refreshes
        (tree / "top.txt").write_text("idle")
        assert not wait_for(lambda: live.refreshes > before, timeout_s=0.5)
        assert live.take([(SB, str(tree))]).entries == walked(tree)
    finally:
        live.close()
