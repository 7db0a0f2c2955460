"""The before/after walk of write roots (snapshot.py): what it lists and hashes, what it
refuses to follow, its caps, and how two walks and the watch's opens become a call's
FileAccessObserved entries."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from sandboxd.recording import snapshot
from sandboxd.recording.filewatch import Access
from sandboxd_contract.canonical import canonical_json
from sandboxd.recording.activity import FileEvents, diff, effects, file_access_events, file_events, printable
from sandboxd.recording.snapshot import Entry, HashBudget, HashCache, take


def h(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def e(inode, mode=0o100644, size=1, mtime=1, ctime=1, sha=""):
    return Entry(inode, mode, size, mtime, ctime, sha)


# -- diff ------------------------------------------------------------------------------

def test_diff_tells_creates_deletes_renames_and_chmods_apart_with_their_hashes():
    before = {"/w/a": e(1, sha="A"), "/w/b": e(2, sha="B"), "/w/c": e(3, sha="C"), "/w/d": e(4, 0o100644, sha="D")}
    after = {"/w/a2": e(1, sha="A"), "/w/c": e(3, sha="C"), "/w/d": e(4, 0o100755, ctime=2, sha="D"),
             "/w/new": e(9, sha="N")}
    assert diff(before, after) == [
        {"path": "/w/a", "operation": "rename", "renamedTo": "/w/a2", "sha256": "A"},
        {"path": "/w/b", "operation": "delete", "sha256Before": "B"},
        {"path": "/w/d", "operation": "chmod", "modeBefore": "0644", "modeAfter": "0755"},
        {"path": "/w/new", "operation": "create", "sha256After": "N"},
    ]


def test_a_file_created_in_a_deleted_ones_inode_is_not_a_rename():
    before = {"/w/doomed": e(7, size=2, mtime=10, sha="D")}
    after = {"/w/fresh": e(7, size=6, mtime=20, sha="F")}  # the inode number was reused
    assert diff(before, after) == [{"path": "/w/doomed", "operation": "delete", "sha256Before": "D"},
                                   {"path": "/w/fresh", "operation": "create", "sha256After": "F"}]


def test_a_file_replaced_by_a_rename_over_it_is_a_write_with_both_hashes():
    # sed -i and editors: write a temporary file, rename it over the original.
    before = {"/w/conf": e(5, size=3, mtime=1, sha="OLD")}
    after = {"/w/conf": e(8, size=4, mtime=2, sha="NEW")}
    assert diff(before, after) == [{"path": "/w/conf", "operation": "write", "replaced": True,
                                    "sha256Before": "OLD", "sha256After": "NEW"}]


def test_a_rename_over_an_existing_file_is_a_rename_and_a_write_of_the_target():
    before = {"/w/a": e(1, size=2, mtime=5, sha="A"), "/w/b": e(2, size=9, mtime=6, sha="B")}
    after = {"/w/b": e(1, size=2, mtime=5, sha="A")}
    assert diff(before, after) == [
        {"path": "/w/a", "operation": "rename", "renamedTo": "/w/b", "sha256": "A"},
        {"path": "/w/b", "operation": "write", "replaced": True, "sha256Before": "B", "sha256After": "A"},
    ]


def test_an_in_place_change_is_a_write_and_an_untouched_file_is_nothing():
    before = {"/w/t": e(3, size=10, mtime=1, sha="T"), "/w/same": e(4, sha="S")}
    after = {"/w/t": e(3, size=0, mtime=2, ctime=2, sha=h(b"")), "/w/same": e(4, sha="S")}  # truncate(2)
    assert diff(before, after) == [{"path": "/w/t", "operation": "write", "sha256Before": "T",
                                    "sha256After": h(b"")}]


def test_a_changed_ctime_with_the_same_content_is_not_a_write():
    before = {"/w/f": e(3, ctime=1, sha="X")}
    after = {"/w/f": e(3, ctime=2, sha="X")}  # a hard link was made, or chown
    assert diff(before, after) == []
    # Unhashed, only size or mtime count.
    assert diff({"/w/f": e(3, ctime=1)}, {"/w/f": e(3, ctime=2)}) == []
    assert diff({"/w/f": e(3, mtime=1)}, {"/w/f": e(3, mtime=2)}) == [{"path": "/w/f", "operation": "write",
                                                                       "sha256Before": "", "sha256After": ""}]


def test_a_file_replaced_by_a_directory_is_a_delete_and_a_create():
    before = {"/w/x": e(3, sha="X")}
    after = {"/w/x": e(4, mode=0o040755)}
    assert diff(before, after) == [{"path": "/w/x", "operation": "create"},
                                   {"path": "/w/x", "operation": "delete", "sha256Before": "X"}]


def born(inode, btime, generation=-1, **kw):
    return e(inode, **kw)._replace(btime_ns=btime, generation=generation)


def test_a_new_file_in_a_freed_inode_number_is_not_the_file_before():
    """rm secret; create files until one gets its inode number; rename it to secret: the
    same path and inode number, another birth. Neither an edit in place nor a rename."""
    before = {"/w/secret": born(7, btime=100, generation=5, size=7, mtime=1, sha="SECRET")}
    after = {"/w/secret": born(7, btime=900, generation=6, size=5, mtime=2, ctime=2, sha="MINE")}
    assert diff(before, after) == [{"path": "/w/secret", "operation": "write", "replaced": True,
                                    "sha256Before": "SECRET", "sha256After": "MINE"}]
    # Either birth differing tells them apart; a rename needs the same birth too.
    assert snapshot.born_apart(born(7, 100, 5), born(7, 100, 6)) and snapshot.born_apart(born(7, 100), born(7, 900))
    gone = {"/w/a": born(7, btime=100, size=1, mtime=1, sha="")}
    assert [c["operation"] for c in diff(gone, {"/w/b": born(7, btime=900, size=1, mtime=1)})] == ["delete", "create"]
    assert [c["operation"] for c in diff(gone, {"/w/b": born(7, btime=100, size=1, mtime=1)})] == ["rename"]


def test_the_same_file_is_known_only_from_a_birth_both_have_that_is_equal():
    same_file = snapshot.same_file
    assert same_file(born(7, 100, 5), born(7, 100, 5))
    assert same_file(born(7, 100), born(7, 100)) and same_file(born(7, 0, 5), born(7, 0, 5))
    assert same_file(born(7, 100, -1), born(7, 100, 5))  # one known on both, equal, none differing
    assert not same_file(born(7, 0, -1), born(7, 0, -1))  # neither known: it may be a new file
    assert not same_file(born(7, 100, -1), born(7, 0, 5))  # nothing known on both sides
    assert not same_file(born(7, 100, 5), born(8, 100, 5))
    assert not same_file(born(7, 100, 5), born(7, 100, 5)._replace(dev=9))
    # Unknown on both, the record still calls it an edit in place (its hashes say what changed).
    assert snapshot.same_inode(born(7, 0), born(7, 0))


def reuse_inode_number(directory, name: str, data: bytes) -> int:
    """What the red-team did: note a file's inode number, remove it, make files until one
    gets the number, rename that one to the name. How many files it took."""
    target = directory / name
    number = target.stat().st_ino
    target.unlink()
    made = []
    for n in range(5000):
        candidate = directory / f".reuse{n}"
        candidate.write_bytes(data)
        made.append(candidate)
        if candidate.stat().st_ino == number:
            os.rename(candidate, target)
            made.pop()
            break
    else:
        pytest.fail("the file system never reused the inode number")
    for f in made:
        f.unlink()
    return len(made) + 1


def test_a_reused_inode_number_on_disk_is_told_by_the_birth_the_hash_cache_reads(tmp_path):
    from sandboxd.recording.changes import changed_files

    (tmp_path / "secret.txt").write_bytes(b"ROOTONLY\n")
    (tmp_path / "edit.txt").write_bytes(b"1\n")
    cache = HashCache()
    before = take([("/w", str(tmp_path))], cache).entries
    was = before["/w/secret.txt"]
    assert was.btime_ns and was.generation >= 0  # ext4 gives both
    reuse_inode_number(tmp_path, "secret.txt", b"mine\n")
    with open(tmp_path / "edit.txt", "ab") as f:
        f.write(b"2\n")
    after = take([("/w", str(tmp_path))], cache).entries
    assert after["/w/secret.txt"].inode == was.inode
    changes = diff(before, after)
    assert {"path": "/w/secret.txt", "operation": "write", "replaced": True, "sha256Before": h(b"ROOTONLY\n"),
            "sha256After": h(b"mine\n")} in changes
    got = {c.path: c for c in changed_files(changes, before, after)}
    assert got["/w/secret.txt"].replaced and not got["/w/secret.txt"].same_file
    assert got["/w/edit.txt"].same_file and not got["/w/edit.txt"].replaced
    # The cache keeps a file's birth with its hash: a walk that reads nothing still has it.
    assert take([("/w", str(tmp_path))], cache).entries["/w/edit.txt"][-2:] == after["/w/edit.txt"][-2:]


# -- take ------------------------------------------------------------------------------

def test_take_walks_and_hashes_the_writable_binds(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_bytes(b"x")
    (tmp_path / "g").write_bytes(b"y")
    snap = take([("/workspace", str(tmp_path))], HashCache())
    assert snap.complete and set(snap.entries) == {"/workspace/sub", "/workspace/sub/f", "/workspace/g"}
    assert snap.entries["/workspace/sub/f"].sha256 == h(b"x")
    assert snap.entries["/workspace/sub"].sha256 == ""  # directories have no content hash
    # Without a cache nothing is read.
    assert take([("/workspace", str(tmp_path))]).entries["/workspace/g"].sha256 == ""


def test_take_never_follows_what_the_sandbox_left(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"host secret")
    os.symlink(outside / "secret", ws / "link")
    os.symlink(outside, ws / "dirlink")
    os.mkfifo(ws / "fifo")
    snap = take([("/workspace", str(ws))], HashCache())
    assert set(snap.entries) == {"/workspace/link", "/workspace/dirlink", "/workspace/fifo"}
    assert all(entry.sha256 == "" for entry in snap.entries.values())  # and the FIFO did not block


def test_a_bind_of_one_file_is_listed_and_a_missing_root_is_a_gap(tmp_path):
    (tmp_path / "one.txt").write_bytes(b"1")
    snap = take([("/workspace/one.txt", str(tmp_path / "one.txt")), ("/workspace/gone", str(tmp_path / "nope"))],
                HashCache())
    assert snap.entries["/workspace/one.txt"].sha256 == h(b"1")
    assert snap.gaps == ["/workspace/gone: not walked (No such file or directory)"]


def test_hashes_are_reused_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "RACY_NS", 0)  # the files below were just written
    for i in range(20):
        (tmp_path / f"f{i}").write_bytes(b"a" * 1000)
    cache = HashCache()
    take([("/w", str(tmp_path))], cache)
    assert cache.hashed_bytes == 20_000
    take([("/w", str(tmp_path))], cache)
    assert cache.hashed_bytes == 20_000  # nothing read again
    (tmp_path / "f3").write_bytes(b"changed")
    snap = take([("/w", str(tmp_path))], cache)
    assert cache.hashed_bytes == 20_007
    assert snap.entries["/w/f3"].sha256 == h(b"changed")


def test_a_file_changed_moments_ago_is_hashed_again_every_time(tmp_path):
    # Its stamp could stay the same through a write in the same timestamp tick.
    (tmp_path / "fresh").write_bytes(b"x" * 100)
    cache = HashCache()
    take([("/w", str(tmp_path))], cache)
    take([("/w", str(tmp_path))], cache)
    assert cache.hashed_bytes == 200


def test_a_rename_needs_the_same_content_when_both_are_known():
    # rm A; write B with A's size; touch -r A B; the freed inode number reused.
    before = {"/w/A": e(7, size=4, mtime=5, sha="AAAA")}
    after = {"/w/B": e(7, size=4, mtime=5, sha="BBBB")}
    assert [c["operation"] for c in diff(before, after)] == ["delete", "create"]
    # On another device the same inode number is another file.
    other = {"/w/B": Entry(7, 0o100644, 4, 5, 1, "AAAA", "", dev=99)}
    assert [c["operation"] for c in diff(before, other)] == ["delete", "create"]


def test_a_symlink_on_the_way_to_a_write_root_is_never_followed(tmp_path):
    # The command renamed a parent of a nested write root and left a link in its place.
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "a2" / "keys").mkdir(parents=True)
    (outside / "keys").mkdir(parents=True)
    (outside / "keys" / "id_rsa").write_bytes(b"host key")
    os.symlink(outside, ws / "a")
    snap = take([("/workspace", str(ws)), ("/workspace/a/keys", str(ws / "a" / "keys"))], HashCache())
    assert not any(p.startswith("/workspace/a/keys/") for p in snap.entries)
    assert snap.gaps == ["/workspace/a/keys: not walked (a symlink or a non-directory is on its way)"]


def test_a_directory_that_cannot_be_opened_is_a_gap_not_silence(tmp_path, monkeypatch):
    import errno

    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "f").write_bytes(b"")
    real_open = os.open

    def failing_open(path, flags, mode=0o777, *, dir_fd=None):
        if path == "locked":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(snapshot.os, "open", failing_open)
    snap = take([("/w", str(tmp_path))])
    assert "/w/locked/f" not in snap.entries
    assert not snap.complete and snap.gaps == ["/w/locked: not walked (Too many open files)"]


def test_the_cache_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "RACY_NS", 0)
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(b"z")
    cache = HashCache(max_entries=3)
    take([("/w", str(tmp_path))], cache)
    assert len(cache._by_inode) == 3


def test_files_over_the_hashing_caps_are_listed_without_a_hash_and_say_why(tmp_path):
    (tmp_path / "big").write_bytes(b"b" * 5000)
    (tmp_path / "small").write_bytes(b"s" * 10)
    snap = take([("/w", str(tmp_path))], HashCache(), HashBudget(bytes_left=10_000, max_file=1000))
    assert snap.entries["/w/big"].sha256 == "" and "hashing cap of 1000 bytes" in snap.entries["/w/big"].note
    assert snap.entries["/w/small"].sha256 == h(b"s" * 10)
    assert snap.unhashed == 1 and snap.complete  # unhashed files are still compared
    budget = HashBudget(bytes_left=15, max_file=1000)
    (tmp_path / "more").write_bytes(b"m" * 10)
    snap = take([("/w", str(tmp_path))], HashCache(), budget)
    assert snap.unhashed == 2  # big, and whichever small file came second
    assert any("hashing budget" in entry.note for entry in snap.entries.values())


def test_past_max_entries_the_walk_stops_and_says_so(tmp_path):
    for i in range(10):
        (tmp_path / f"f{i}").write_bytes(b"")
    snap = take([("/w", str(tmp_path))], max_entries=4)
    assert len(snap.entries) == 4
    assert not snap.complete and "more than 4 entries" in snap.gaps[0]


def test_a_deep_tree_is_walked_to_the_depth_cap_without_recursion(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "MAX_DEPTH", 50)
    d = tmp_path
    for i in range(60):
        d = d / "d"
        d.mkdir()
    (d / "leaf").write_bytes(b"")
    open_before = len(os.listdir("/proc/self/fd"))
    snap = take([("/w", str(tmp_path))])
    assert len(snap.entries) == 51 and not snap.complete and "deeper than 50 levels" in snap.gaps[0]
    assert len(os.listdir("/proc/self/fd")) == open_before  # every directory descriptor closed


def test_a_tree_deeper_than_python_recursion_is_fine_with_a_high_cap(tmp_path, monkeypatch):
    import resource

    monkeypatch.setattr(snapshot, "MAX_DEPTH", 1500)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:  # one descriptor per level while it is walked (the daemon raises its own limit)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    fd = os.open(tmp_path, os.O_RDONLY)
    for _ in range(1200):  # paths longer than PATH_MAX: made relative, one level at a time
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    try:
        snap = take([("/w", str(tmp_path))])
        assert len(snap.entries) == 1200 and snap.complete
    finally:
        _remove_chain(tmp_path, 1200)  # shutil.rmtree (and pytest's cleanup) would recurse


def _remove_chain(root, depth: int) -> None:
    fds = [os.open(root, os.O_RDONLY)]
    for _ in range(depth - 1):
        fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
    while fds:
        fd = fds.pop()
        os.rmdir("d", dir_fd=fd)
        os.close(fd)


# -- a call's entries ------------------------------------------------------------------

def test_watched_writes_carry_the_content_they_found_and_left():
    before = {"/w/edit": e(1, sha="OLD"), "/w/read": e(2, sha="R")}
    after = {"/w/edit": e(1, size=2, mtime=2, sha="NEW"), "/w/read": e(2, sha="R"), "/w/new": e(3, sha="N")}
    accesses = [Access("/w/edit", 1, 1), Access("/w/new", 1, 1), Access("/w/read", 2, 0), Access("/w/tmp", 1, 1)]
    events = file_events(accesses, diff(before, after), before, after)
    assert events.entries == [
        {"path": "/w/edit", "operation": "write", "opens": 1, "writes": 1, "sha256Before": "OLD", "sha256After": "NEW"},
        {"path": "/w/new", "operation": "write", "opens": 1, "writes": 1, "sha256Before": "", "sha256After": "N"},
        # Written and gone again by the end of the call (a temporary file).
        {"path": "/w/tmp", "operation": "write", "opens": 1, "writes": 1, "sha256Before": "", "sha256After": ""},
        # The in-place write of /w/edit is not listed twice; the creation is its own fact.
        {"path": "/w/new", "operation": "create", "sha256After": "N"},
    ]
    assert events.reads == [("/w/read", 2)]  # opened twice, never written: a pair
    assert effects(events) == {"reads": ["/w/read"], "writes": ["/w/edit", "/w/new", "/w/tmp"], "deletes": []}


def test_names_that_are_not_utf8_are_printable_and_exact_in_base64():
    import base64

    odd, other = os.fsdecode(b"/w/caf\xe9"), os.fsdecode(b"/w/x\xff\xfe")
    events = file_events([Access(odd, 1, 0), Access("/w/caf\u00e9-utf8", 1, 0)],
                         [{"path": odd, "operation": "rename", "renamedTo": other}], {}, {})
    assert events.entries == [
        {"path": "/w/caf\\xe9", "pathBase64": base64.b64encode(b"/w/caf\xe9").decode(), "operation": "read",
         "opens": 1, "writes": 0},
        {"path": "/w/caf\\xe9", "pathBase64": base64.b64encode(b"/w/caf\xe9").decode(), "operation": "rename",
         "renamedTo": "/w/x\\xff\\xfe", "renamedToBase64": base64.b64encode(b"/w/x\xff\xfe").decode()},
    ]
    assert events.reads == [("/w/caf\u00e9-utf8", 1)]  # valid UTF-8: as it is, a pair
    assert effects(events)["reads"] == ["/w/caf\\xe9", "/w/caf\u00e9-utf8"]
    for event in file_access_events(events, 500, 2000):
        canonical_json(event.to_payload())  # what the commit does with them: no UnicodeEncodeError
    gap = f"{odd}: not examined (Permission denied)"
    assert printable(gap) == "/w/caf\\xe9: not examined (Permission denied)" and printable("/w/é") == "/w/é"


def test_access_payloads_batch_entries_and_reads_and_read_back_as_entries():
    from sandboxd_contract.canonical import file_accesses

    reads = [(f"/w/r{i:04}", i % 3 + 1) for i in range(4500)]
    entries = [{"path": f"/w/c{i}", "operation": "create", "sha256After": "x"} for i in range(501)]
    payloads = [e.to_payload() for e in file_access_events(FileEvents(entries, reads), 500, 2000)]
    assert [len(p.get("accesses", p.get("reads"))) for p in payloads] == [500, 1, 2000, 2000, 500]
    assert all(len(p) == 1 for p in payloads)  # either form, never both
    back = [a for p in payloads for a in file_accesses(json.loads(canonical_json(p)))]
    assert back[:501] == entries
    assert back[501:] == [{"path": p, "operation": "read", "opens": n} for p, n in reads]
    assert file_access_events(FileEvents([], []), 500, 2000) == []
    # The daemon's own drafts hold tuples; a later daemon may add fields after the two.
    assert file_accesses({"reads": [("/w/t", 2), ["/w/u", 1, "later"], [3, 1]]}) == [
        {"path": "/w/t", "operation": "read", "opens": 2}, {"path": "/w/u", "operation": "read", "opens": 1}]
    # An old log's forms, and what an edited one may hold, read without raising.
    assert file_accesses({"path": "/w/a", "operation": "read"}) == [{"path": "/w/a", "operation": "read"}]
    assert file_accesses({"accesses": [{"path": "/w/b", "operation": "write"}, 7, {"no": "path"}],
                          "reads": [["/w/c", 1], "bad", ["/w/d"]]}) == [
        {"path": "/w/b", "operation": "write"}, {"path": "/w/c", "operation": "read", "opens": 1}]


def test_effects_count_rename_targets_and_chmods_as_writes():
    events = [{"path": "/w/a", "operation": "rename", "renamedTo": "/w/b"}, {"path": "/w/c", "operation": "delete"},
              {"path": "/w/s", "operation": "chmod"}]
    assert effects(FileEvents(events, [("/w/r", 1)])) == {
        "reads": ["/w/r"], "writes": ["/w/b", "/w/s"], "deletes": ["/w/c"]}


def test_a_missing_hash_says_why_in_the_entry():
    before = {"/w/big": Entry(1, 0o100644, 9, 1, 1, "", "larger than the hashing cap of 8 bytes")}
    after = {"/w/big": Entry(1, 0o100644, 10, 2, 2, "", "larger than the hashing cap of 8 bytes")}
    [entry] = file_events([Access("/w/big", 1, 1)], [], before, after).entries
    assert entry["sha256Before"] == "" and entry["sha256BeforeMissing"].startswith("larger than")


@pytest.mark.parametrize("size", [0, 1, 65536 + 3])
def test_hashes_match_hashlib(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert take([("/w", str(tmp_path))], HashCache()).entries["/w/f"].sha256 == h(data)


def test_a_replacement_the_watch_saw_under_the_final_name_is_listed_once_as_replaced():
    # The temporary file's close was read after the rename: the watch names the target.
    before = {"/w/cfg": e(1, size=4, mtime=1, sha="OLD")}
    after = {"/w/cfg": e(2, size=4, mtime=2, sha="NEW")}
    events = file_events([Access("/w/cfg", 1, 1)], diff(before, after), before, after)
    assert events.entries == [{"path": "/w/cfg", "operation": "write", "opens": 1, "writes": 1, "sha256Before": "OLD",
                       "sha256After": "NEW", "replaced": True}]


def test_a_call_s_record_says_why_it_may_be_incomplete():
    from types import SimpleNamespace

    from sandboxd.recording.recorder import file_record as _file_record
    from sandboxd.recording.filewatch import MAX_PATHS

    full = snapshot.Snapshot({"/w/a": e(1, sha="A")})
    watch = SimpleNamespace(overflowed=True, dropped=3, unresolved=2, unnamed=4)
    record = _file_record([Access("/w/a", 1, 0)], watch, full, full)
    assert record.incomplete == ["the kernel's event queue overflowed: some opens were not recorded",
                                 f"more than {MAX_PATHS} paths were opened: 3 opens of further paths are not listed",
                                 "2 events were in directories removed before they were read: their paths are unknown",
                                 "4 events could not be named (a path longer than the system's limit, or an error "
                                 "resolving it)"]
    quiet = SimpleNamespace(overflowed=False, dropped=0, unresolved=0, unnamed=0)
    cut = snapshot.Snapshot({"/w/a": e(1, sha="A")}, gaps=["more than 1 entries in the write roots: ..."])
    record = _file_record([], quiet, full, cut)
    assert record.incomplete == ["more than 1 entries in the write roots: ...",
                                 "creations, deletions and renames were not compared"]
    assert _file_record([], quiet, full, None).incomplete[0].startswith("the write roots could not be walked after")
    unhashed = snapshot.Snapshot({"/w/big": Entry(2, 0o100644, 9, 1, 1, "", "larger than the hashing cap")},
                                 unhashed=1)  # as take() and live snapshots count them
    assert "1 files have no content hash" in _file_record([], quiet, unhashed, unhashed).incomplete[0]
    assert _file_record([], quiet, full, full).incomplete == []
