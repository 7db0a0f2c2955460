"""FileService for real: files put into and taken out of a workspace and a leased sandbox
(both backends), as the sandbox's user, each transfer on the record; and every refusal
the issue names: outside the roots, through a symlink, into a blocked path (also one
the sandbox moved out from under its mask), past a cap, a hash that does not match, a
file that changes while it is sent. A refused upload leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from sandboxd_client import errors
from sandboxd_client.transfer import LocalEntry, local_entries, target, upload_requests
from sandboxd_contract.pb import sandboxd_pb2 as pb

from .conftest import call, public_tmpdir, sh, wait_for

WRITE_ALL = {"filesystem": {"writeRoots": ["/workspace"]}}


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def record(client, transfer_id: str) -> dict:
    [event] = client.get_trace(transfer_id)
    assert event.type == "FilesTransferred"
    return json.loads(event.payload_json)


def leftovers(ws: Path) -> list[str]:
    return sorted(str(p.relative_to(ws)) for p in ws.rglob("*"))


def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "pkg" / "deep" / "data.bin").write_bytes(bytes(range(256)) * 40)
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    return src


def test_a_tree_goes_into_a_workspace_and_comes_back_recorded(daemon, tmp_path):
    ws = daemon.new_workspace({"README.md": "hello\n"})
    c = daemon.client()
    to = target(ws, policy=WRITE_ALL)
    result = c.upload(to, "/workspace/in", tree(tmp_path))
    landed = {e.path: e for e in result.entries}
    assert set(landed) == {"/workspace/in/pkg", "/workspace/in/pkg/deep", "/workspace/in/pkg/mod.py",
                           "/workspace/in/pkg/deep/data.bin", "/workspace/in/run.sh"}
    assert landed["/workspace/in/pkg/mod.py"].sha256 == sha(b"x = 1\n")
    # As the sandbox's user: the workspace owner's, with the modes sent.
    st = (ws / "in" / "run.sh").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1000, 1000, 0o755)
    assert (ws / "in" / "pkg" / "deep" / "data.bin").read_bytes() == bytes(range(256)) * 40
    assert not [p for p in leftovers(ws) if "sandboxd-upload" in p]
    rec = record(c, result.transfer_id)
    assert (rec["direction"], rec["status"], rec["principal"]) == ("upload", "ok", "root")
    assert {e["path"]: e.get("sha256") for e in rec["entries"] if e["kind"] == "file"}["/workspace/in/run.sh"] == \
        sha(b"#!/bin/sh\necho hi\n")
    # Found again by the forensic index, by path and operation.
    found = c.query_calls(path="/workspace/in/pkg/mod.py", path_operation="upload", workspace=str(ws)).calls
    assert [f.tool_call_id for f in found] == [result.transfer_id]

    back = tmp_path / "back"
    down = c.download(target(ws), "/workspace/in", back)
    assert (back / "pkg" / "deep" / "data.bin").read_bytes() == bytes(range(256)) * 40
    assert os.stat(back / "run.sh").st_mode & 0o777 == 0o755
    assert record(c, down.transfer_id)["direction"] == "download"
    # One file, to a file's name.
    one = c.download(target(ws), "/workspace/README.md", tmp_path / "readme")
    assert (tmp_path / "readme").read_text() == "hello\n" and one.total_bytes == 6


def test_an_upload_lands_only_under_a_write_root_and_never_in_a_blocked_path(daemon, tmp_path):
    ws = daemon.new_workspace({"src/a.py": "a\n", "secret/key": "K\n", "out/.keep": ""})
    c = daemon.client()
    src = tmp_path / "f.txt"
    src.write_text("new\n")
    before = leftovers(ws)
    cases = [
        (target(ws), "/workspace/f.txt", "under the read root /workspace"),  # the default: read-only
        (target(ws, policy={"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]}}),
         "/workspace/src/f.txt", "under the read root /workspace"),
        (target(ws, policy={**WRITE_ALL, "filesystem": {**WRITE_ALL["filesystem"],
                                                         "blockedPaths": ["/workspace/secret"]}}),
         "/workspace/secret/f.txt", "is blocked"),
        (target(ws, policy=WRITE_ALL), "/tmp/f.txt", "tempDir"),
        (target(ws, policy=WRITE_ALL), "/etc/f.txt", "not under any write root"),
    ]
    for to, path, why in cases:
        with pytest.raises(errors.PermissionDenied, match=why) as refused:
            c.upload(to, path, src)
        rec = record(c, refused.value.tool_call_id)
        assert (rec["status"], rec["code"], rec["path"]) == ("refused", "PERMISSION_DENIED", path)
    assert leftovers(ws) == before


def test_an_upload_never_goes_through_a_symlink(daemon, tmp_path):
    ws = daemon.new_workspace({"a.txt": "a\n"})
    outside = public_tmpdir("sandboxd-outside-")
    os.chown(outside, 1000, 1000)
    (ws / "link").symlink_to(outside)
    c = daemon.client()
    src = tmp_path / "f.txt"
    src.write_text("escape\n")
    with pytest.raises(errors.FailedPrecondition, match="/workspace/link"):
        c.upload(target(ws, policy=WRITE_ALL), "/workspace/link/f.txt", src)
    # A link at the file's own name is replaced, never written through.
    (ws / "b.txt").symlink_to(outside / "target.txt")
    c.upload(target(ws, policy=WRITE_ALL), "/workspace/b.txt", src)
    assert not (ws / "b.txt").is_symlink() and (ws / "b.txt").read_text() == "escape\n"
    assert list(outside.iterdir()) == []


def entry_requests(to, path: str, entries: list[tuple[pb.TransferEntry, bytes]], commit: bool = True):
    yield pb.UploadRequest(target=to, path=path)
    for entry, data in entries:
        yield pb.UploadRequest(entry=entry)
        if data:
            yield pb.UploadRequest(data=data)
    if commit:
        yield pb.UploadRequest(commit=True)


def test_a_bad_upload_is_refused_whole_and_leaves_nothing(daemon, spare_daemon, tmp_path):
    ws = daemon.new_workspace({"keep.txt": "k\n"})
    c = daemon.client()
    to = target(ws, policy=WRITE_ALL)
    before = leftovers(ws)
    good = (pb.TransferEntry(path="new/dir/a.txt", kind="file", size_bytes=2), b"a\n")
    bad = {
        "hash": (pb.TransferEntry(path="new/b.txt", kind="file", size_bytes=2, sha256=sha(b"x\n")), b"b\n"),
        "short": (pb.TransferEntry(path="new/b.txt", kind="file", size_bytes=10), b"b\n"),
        "dotdot": (pb.TransferEntry(path="../b.txt", kind="file", size_bytes=2), b"b\n"),
        "twice": (pb.TransferEntry(path="new/dir/a.txt", kind="file", size_bytes=2), b"a\n"),
        # Below a file of the same upload: the file would land and this not.
        "below a file": (pb.TransferEntry(path="new/dir/a.txt/c", kind="file", size_bytes=2), b"c\n"),
    }
    for why, entry in bad.items():
        with pytest.raises(errors.InvalidArgument) as refused:
            c.upload_requests(entry_requests(to, "/workspace", [good, entry]))
        assert record(c, refused.value.tool_call_id)["entries"] == [], why
        assert leftovers(ws) == before, why
    # Past the cap: refused at the entry that passes it, before its bytes; the rest undone.
    small = spare_daemon(transfers={"max_upload_mb": 1}).start()
    ws2 = small.new_workspace({})
    big = (pb.TransferEntry(path="big.bin", kind="file", size_bytes=2 * 2**20), b"")
    with pytest.raises(errors.ResourceExhausted, match="max_upload_mb"):
        small.client().upload_requests(entry_requests(target(ws2, policy=WRITE_ALL), "/workspace", [good, big]))
    assert leftovers(ws2) == []


def test_a_download_reads_only_what_the_sandbox_user_may_and_skips_links_and_blocked_paths(daemon, tmp_path):
    ws = daemon.new_workspace({"ok.txt": "ok\n", "secret/key": "K\n"})
    (ws / "root.key").write_text("ROOTONLY\n")  # root's, 0600: closed to the sandbox's user
    (ws / "root.key").chmod(0o600)
    (ws / "link").symlink_to("/etc/hostname")
    c = daemon.client()
    with pytest.raises(errors.PermissionDenied, match="may not"):
        c.download(target(ws), "/workspace/root.key", tmp_path / "k")
    with pytest.raises(errors.FailedPrecondition, match="symlink"):
        c.download(target(ws), "/workspace/link", tmp_path / "l")
    policy = {"filesystem": {"readRoots": ["/workspace"], "blockedPaths": ["/workspace/secret"]}}
    with pytest.raises(errors.PermissionDenied, match="blocked"):
        c.download(target(ws, policy=policy), "/workspace/secret/key", tmp_path / "s")
    with pytest.raises(errors.PermissionDenied, match="not under any read or write root"):
        c.download(target(ws, policy={"filesystem": {"readRoots": ["/workspace/ok.txt"]}}), "/etc/passwd",
                   tmp_path / "p")
    result = c.download(target(ws, policy=policy), "/workspace", tmp_path / "all")
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["ok.txt"]
    assert sorted(s.split(":")[0] for s in result.skipped) == ["/workspace/link", "/workspace/root.key",
                                                             "/workspace/secret"]
    assert not (tmp_path / "k").exists()


def test_a_file_that_changes_while_it_is_sent_ends_the_download(daemon, tmp_path):
    ws = daemon.new_workspace({})
    big = ws / "big.bin"
    big.write_bytes(os.urandom(64 * 2**20))
    c = daemon.client()
    stream = c._files.Download(pb.DownloadRequest(target=target(ws), path="/workspace/big.bin"))
    first = next(stream)
    assert first.entry.kind == "file"
    next(stream)  # the first bytes: the daemon is reading it now
    with open(big, "ab") as f:
        f.write(b"more")
    with pytest.raises(Exception) as ended:
        for _ in stream:
            pass
    assert "changed while it was sent" in str(ended.value)
    # On the record: the file, partial, with what left of it.
    [found] = c.query_calls(path="/workspace/big.bin", path_operation="download", workspace=str(ws)).calls
    rec = record(c, found.tool_call_id)
    [entry] = rec["entries"]
    assert (rec["status"], rec["code"], entry["partial"], entry["sizeBytes"]) == ("failed", "ABORTED", True,
                                                                                    64 * 2**20)
    assert 0 < entry["sentBytes"] <= 64 * 2**20 and entry["sentSha256"].startswith("sha256:")


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_files_go_into_a_leased_sandbox_and_out_of_it(daemon, adapter, tmp_path):
    ws = daemon.new_workspace({})
    c = daemon.client()
    lease = c.acquire_sandbox(str(ws), WRITE_ALL, adapter=adapter)
    try:
        to = target(lease_id=lease.lease_id)
        c.upload(to, "/workspace/in", tree(tmp_path))
        leased = {"runtime": {"adapter": adapter, "leaseId": lease.lease_id}}
        out = c.run(call(ws, sh("cat /workspace/in/pkg/mod.py; id -u; echo made > /workspace/made.txt"), WRITE_ALL,
                         **leased))
        assert out.stdout == b"x = 1\n1000\n", out.stderr
        got = c.download(to, "/workspace/made.txt", tmp_path / "made")
        assert (tmp_path / "made").read_text() == "made\n"
        assert record(c, got.transfer_id)["leaseId"] == lease.lease_id
        # Its tempDir too (a tmpfs only the sandbox has), through its init's root.
        c.upload(to, "/tmp/up.txt", tmp_path / "src" / "pkg" / "mod.py")
        out = c.run(call(ws, sh("cat /tmp/up.txt; stat -c %u /tmp/up.txt; echo temp > /tmp/made.txt"), WRITE_ALL,
                         **leased))
        assert out.stdout == b"x = 1\n1000\n", out.stderr
        c.download(to, "/tmp/made.txt", tmp_path / "temp")
        assert (tmp_path / "temp").read_text() == "temp\n"
        with pytest.raises(errors.PermissionDenied, match="not under any write root"):
            c.upload(to, "/etc/x", tmp_path / "src" / "run.sh")
    finally:
        c.release_sandbox(lease.lease_id)
    with pytest.raises(errors.NotFound):
        c.download(target(lease_id=lease.lease_id), "/workspace/made.txt", tmp_path / "again")


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_a_blocked_file_the_sandbox_moved_out_from_under_its_mask_is_never_sent(daemon, adapter, tmp_path):
    ws = daemon.new_workspace({"d/secret.txt": "SECRET\n", "d/ok.txt": "ok\n"})
    c = daemon.client()
    policy = {"filesystem": {"writeRoots": ["/workspace"], "blockedPaths": ["/workspace/d/secret.txt"]}}
    lease = c.acquire_sandbox(str(ws), policy, adapter=adapter)
    try:
        leased = {"runtime": {"adapter": adapter, "leaseId": lease.lease_id}}
        out = c.run(call(ws, sh("mv /workspace/d /workspace/e && ls /workspace/e"), policy, **leased))
        assert out.result.status == "success", out.stderr
        assert (ws / "e" / "secret.txt").exists()  # on the host, the file moved with its directory
        to = target(lease_id=lease.lease_id)
        with pytest.raises(errors.PermissionDenied, match="blocked"):
            c.download(to, "/workspace/e/secret.txt", tmp_path / "s")
        result = c.download(to, "/workspace", tmp_path / "all")
        assert (tmp_path / "all" / "e" / "ok.txt").read_text() == "ok\n"
        assert not (tmp_path / "all" / "e" / "secret.txt").exists()
        assert any(s.startswith("/workspace/e/secret.txt") for s in result.skipped)
    finally:
        c.release_sandbox(lease.lease_id)


def test_an_upload_cut_off_before_its_end_lands_nothing(daemon, spare_daemon):
    """Whole files sent, then the client breaks off (or goes quiet past the idle timeout):
    the stream never ended, so nothing lands."""
    entries = [(pb.TransferEntry(path="a.txt", kind="file", size_bytes=2), b"a\n"),
               (pb.TransferEntry(path="d/b.txt", kind="file", size_bytes=2), b"b\n")]

    def broken(to):
        yield from entry_requests(to, "/workspace", entries, commit=False)
        raise RuntimeError("the client crashed")

    ws = daemon.new_workspace({})
    with pytest.raises(Exception):
        daemon.client().upload_requests(broken(target(ws, policy=WRITE_ALL)))
    quiet = spare_daemon(rpc_limits={"stream_idle_timeout_s": 1}).start()
    ws2 = quiet.new_workspace({})

    def stalled(to):
        yield from entry_requests(to, "/workspace", entries, commit=False)
        threading.Event().wait(3)  # past the idle timeout, the stream still open

    with pytest.raises(errors.SandboxdClientError):
        quiet.client().upload_requests(stalled(target(ws2, policy=WRITE_ALL)))
    # A stream the client ended without the commit message: nothing lands either.
    ws3 = daemon.new_workspace({})
    with pytest.raises(errors.Aborted, match="without its commit message"):
        daemon.client().upload_requests(entry_requests(target(ws3, policy=WRITE_ALL), "/workspace", entries,
                                                       commit=False))
    # (The client's error comes as the daemon notices; its rollback follows at once.)
    for w in (ws, ws2, ws3):
        assert wait_for(lambda: leftovers(w) == [], timeout_s=5), leftovers(w)


def _fill_as(uid: int, directory: Path) -> None:
    """Writes as `uid` (a child of its own) until the filesystem refuses it more room."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with open(directory / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                        os.fsync(f.fileno())
                except OSError:
                    pass
            os._exit(0)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0


def test_an_upload_takes_only_the_room_the_sandbox_user_has(daemon, tmp_path):
    """ext4 keeps blocks for root (uid and group 0, CAP_SYS_RESOURCE): a sandbox's write
    gets ENOSPC once only they are left, and so must an upload's bytes."""
    image = tmp_path / "small.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "50", str(image), "16M"], check=True)
    ws = daemon.new_workspace()
    subprocess.run(["mount", "-o", "loop", str(image), str(ws)], check=True)
    try:
        os.chown(ws, 1000, 1000)
        os.chmod(ws, 0o750)
        _fill_as(1000, ws)
        src = tmp_path / "two-mib"
        src.write_bytes(os.urandom(2 * 2**20))  # 50% reserved: far more than 2 MiB of root's room is left
        with pytest.raises(errors.ResourceExhausted, match="no room left") as refused:
            daemon.client().upload(target(ws, policy=WRITE_ALL), "/workspace/two-mib", src)
        assert record(daemon.client(), refused.value.tool_call_id)["status"] == "refused"
        assert sorted(os.listdir(ws)) == ["filler", "lost+found"]  # nothing half-written left
    finally:
        subprocess.run(["umount", "-l", str(ws)], check=False)


def test_transfer_records_are_bounded_per_principal_and_retention_frees_them(spare_daemon, tmp_path):
    period_s = 2.0
    d = spare_daemon(quotas={"transfer_entries": 3},
                     retention={"period_days": period_s / 86400, "sweep_interval_s": 0.2}).start()
    ws = d.new_workspace({"a.txt": "a\n"})
    src = tmp_path / "src"
    src.mkdir()
    for name in ("1", "2", "3"):
        (src / name).write_text(name)
    c = d.client()
    first = c.upload(target(ws, policy=WRITE_ALL), "/workspace/in", src)  # its record names 3 entries
    assert len(first.entries) == 3
    with pytest.raises(errors.ResourceExhausted, match="quotas.transfer_entries") as refused:
        c.download(target(ws), "/workspace/a.txt", tmp_path / "a")
    assert record(c, refused.value.tool_call_id)["status"] == "refused"
    assert not (tmp_path / "a").exists()
    # Once retention has expired the first record, there is room again.
    wait_for(lambda: any(e.type == "ToolCallExpired" for e in c.get_trace(first.transfer_id)), timeout_s=30)
    c.download(target(ws), "/workspace/a.txt", tmp_path / "a")
    assert (tmp_path / "a").read_text() == "a\n"


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_a_secret_file_made_after_the_lease_began_is_never_transferred(daemon, adapter, tmp_path):
    """The lease's masks were placed when its sandbox was made: the operator's
    always_blocked is asked by name too, so a `.env` a command makes later stays in."""
    ws = daemon.new_workspace({"a.txt": "a\n"})
    c = daemon.client()
    lease = c.acquire_sandbox(str(ws), WRITE_ALL, adapter=adapter)
    try:
        to = target(lease_id=lease.lease_id)
        made = c.run(call(ws, sh("echo SECRET=hunter2 > /workspace/.env"), WRITE_ALL,
                          runtime={"adapter": adapter, "leaseId": lease.lease_id}))
        assert made.result.status == "success", made.stderr
        with pytest.raises(errors.PermissionDenied, match="always_blocked: .env"):
            c.download(to, "/workspace/.env", tmp_path / "env")
        whole = c.download(to, "/workspace", tmp_path / "ws")
        assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == ["a.txt"]
        assert any("/workspace/.env" in line for line in whole.skipped)
        (tmp_path / "up").write_text("x\n")
        with pytest.raises(errors.PermissionDenied, match="always_blocked: .env"):
            c.upload(to, "/workspace/.env", tmp_path / "up")
        assert (ws / ".env").read_text() == "SECRET=hunter2\n"
    finally:
        c.release_sandbox(lease.lease_id)
