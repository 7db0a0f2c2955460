"""`sandboxctl cp`'s reading of SRC and DST, where the files land, and the policy a
workspace transfer names: pure, with this host's answers given by the test. No daemon."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest

from sandboxd_client import cli
from sandboxd_client.cli_exec import FlagConflict
from sandboxd_client.cli_parser import build_parser
from sandboxd_client.cli_transfer import (Copy, CpUsage, HostView, Remote, default_write_root, download_path,
                                          parse_cp, parse_side, plan_copy, summary, upload_path, workspace_policy)
from sandboxd_contract.pb import sandboxd_pb2 as pb

LEASE = "lease_" + "0123456789abcdef01234567"
WS = "/home/u/proj"


def host(dirs: tuple[str, ...] = (WS,), files: tuple[str, ...] = ()) -> HostView:
    """A host with exactly these directories and files."""
    return HostView(is_dir=lambda p: p in dirs, exists=lambda p: p in dirs or p in files)


# ------------------------------------------------------------------ one side


@pytest.mark.parametrize("arg, remote", [
    (f"{LEASE}:/workspace/in", Remote("/workspace/in", lease_id=LEASE)),
    (f"{LEASE}:/tmp/x:y", Remote("/tmp/x:y", lease_id=LEASE)),  # a colon in the sandbox path
    (f"{WS}:/workspace/a.txt", Remote("/workspace/a.txt", workspace=WS)),
    (f"{WS}:/workspace/", Remote("/workspace/", workspace=WS)),
])
def test_a_side_that_names_a_sandbox(arg, remote):
    assert parse_side(arg, host()) == remote


@pytest.mark.parametrize("arg", [
    "file.txt", "/home/u/f.txt", "./a:b",  # no colon followed by '/'
    "/nowhere:/workspace/x",  # not a directory here
    "lease_123:/workspace/x", "LEASE_" + "0" * 24 + ":/x", f"{LEASE}x:/x",  # not a lease id
    f"{WS}:workspace/x",  # the sandbox path must be absolute
    ":/workspace/x",  # nothing before the colon
])
def test_a_side_that_is_a_local_path(arg):
    assert parse_side(arg, host()) is None


def test_a_workspace_directory_with_colons_in_its_name():
    odd = "/data/proj:v2"
    assert parse_side(f"{odd}:/workspace/x", host(dirs=(odd,))) == Remote("/workspace/x", workspace=odd)


def test_a_relative_workspace_directory_is_made_absolute():
    r = parse_side("proj:/workspace/x", host(dirs=("proj",)))
    assert r == Remote("/workspace/x", workspace=os.path.abspath("proj"))


def test_two_readings_are_refused_never_guessed():
    both = ("/a", "/a:/b")  # "/a:/b:/c" is /a's /b:/c or (/a:/b)'s /c
    with pytest.raises(CpUsage, match="can be read as workspace /a with path /b:/c or as workspace /a:/b with path /c"):
        parse_side("/a:/b:/c", host(dirs=both))
    # A directory named like a lease id: ./ makes it the directory.
    with pytest.raises(CpUsage, match="as lease lease_.* or as workspace"):
        parse_side(f"{LEASE}:/workspace", host(dirs=(LEASE,)))
    assert parse_side(f"./{LEASE}:/workspace", host(dirs=(f"./{LEASE}",))).workspace == os.path.abspath(LEASE)


def test_a_local_path_that_also_names_a_sandbox_is_refused():
    # /home/u/proj exists, and so does a local file "/home/u/proj:/x" (in a directory "proj:").
    with pytest.raises(CpUsage, match="is a path on this host and also names"):
        parse_side(f"{WS}:/x", host(files=(f"{WS}:/x",)))


# ------------------------------------------------------------------ both sides


def test_exactly_one_side_is_remote():
    assert parse_cp("f.txt", f"{LEASE}:/workspace/f.txt", host()) == \
        Copy(True, "f.txt", Remote("/workspace/f.txt", lease_id=LEASE))
    assert parse_cp(f"{WS}:/workspace/out", "out", host()) == Copy(False, "out", Remote("/workspace/out", workspace=WS))
    with pytest.raises(CpUsage, match="both SRC and DST"):
        parse_cp(f"{WS}:/workspace/a", f"{LEASE}:/workspace/a", host())
    with pytest.raises(CpUsage, match="neither SRC nor DST"):
        parse_cp("a", "b", host())


def test_a_mistyped_workspace_is_named_in_the_refusal():
    with pytest.raises(CpUsage, match="'/home/u/prj' is neither a lease id nor a directory"):
        parse_cp("f.txt", "/home/u/prj:/workspace/f.txt", host())


# ------------------------------------------------------------------ where it lands


def test_upload_lands_at_the_path_or_under_a_trailing_slash():
    assert upload_path("dir/report.txt", "/workspace/r.txt") == "/workspace/r.txt"
    assert upload_path("dir/report.txt", "/workspace/out/") == "/workspace/out/report.txt"
    assert upload_path("src/", "/workspace/") == "/workspace/src"
    assert upload_path(".", "/workspace/") == "/workspace/" + os.path.basename(os.getcwd())
    with pytest.raises(CpUsage, match="no name"):
        upload_path("/", "/workspace/")


def test_download_lands_at_the_path_or_into_an_existing_directory():
    h = host(dirs=("/tmp/here",))
    assert download_path("/workspace/out", "/tmp/new", h) == "/tmp/new"
    assert download_path("/workspace/out/", "/tmp/here", h) == "/tmp/here/out"
    assert download_path("/workspace/a.txt", "/tmp/later/", h) == "/tmp/later/a.txt"
    with pytest.raises(CpUsage, match="no name"):
        download_path("/", "/tmp/here", h)


# ------------------------------------------------------------------ the policy


def fake_lstat(dirs: set[str], links: set[str] = frozenset()):
    def lstat(path: str):
        if path in links:
            return os.stat_result((stat.S_IFLNK | 0o777,) + (0,) * 9)
        if path in dirs:
            return os.stat_result((stat.S_IFDIR | 0o755,) + (0,) * 9)
        raise FileNotFoundError(path)
    return lstat


def test_the_default_write_root_is_the_deepest_existing_directory():
    lstat = fake_lstat({f"{WS}/out", f"{WS}/out/sub"}, links={f"{WS}/link"})
    root = lambda landing, single: default_write_root(WS, landing, single, lstat)  # noqa: E731
    assert root("/workspace/out/sub/new/tree", False) == "/workspace/out/sub"
    assert root("/workspace/out/sub", False) == "/workspace/out/sub"  # a tree lands in it
    assert root("/workspace/out/sub", True) == "/workspace/out"  # a file replaces it: its parent
    assert root("/workspace/out/f.txt", True) == "/workspace/out"
    assert root("/workspace/f.txt", True) == "/workspace"
    assert root("/workspace/link/f.txt", True) == "/workspace"  # never through a symlink
    assert root("/workspace/out/../../etc/x", True) is None
    assert root("/tmp/x", True) is None
    assert root("/workspacex/y", True) is None


def test_workspace_policy():
    assert workspace_policy(None, (), "/workspace/out") == {"filesystem": {"writeRoots": ["/workspace/out"]}}
    assert workspace_policy(None, (), None) is None  # a download: the default view
    assert workspace_policy(None, ["out"], "/workspace/x") == \
        {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["out"]}}
    given = {"filesystem": {"writeRoots": ["/workspace"]}}
    assert workspace_policy(given, (), "/workspace/x") == given  # the file's roots, exactly
    with pytest.raises(FlagConflict, match="contradicts policy.filesystem.writeRoots"):
        workspace_policy(given, ["out"], None)


def test_plan_of_an_upload_to_a_workspace(tmp_path):
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    (tmp_path / "f.txt").write_text("x")
    copy = parse_cp(str(tmp_path / "f.txt"), f"{ws}:/workspace/out/")
    plan = plan_copy(copy, None, ())
    assert plan.remote_path == "/workspace/out/f.txt" and plan.local == str(tmp_path / "f.txt")
    assert (plan.to.workspace, list(plan.to.policy.filesystem.write_roots)) == (str(ws), ["/workspace/out"])
    assert not plan.to.lease_id


def test_plan_of_a_download_from_a_lease(tmp_path):
    plan = plan_copy(parse_cp(f"{LEASE}:/workspace/out", str(tmp_path)), None, ())
    assert (plan.to.lease_id, plan.to.HasField("policy")) == (LEASE, False)
    assert (plan.remote_path, plan.local) == ("/workspace/out", str(tmp_path / "out"))


def test_flags_that_do_not_apply_are_refused():
    lease = Copy(True, "f", Remote("/workspace/f", lease_id=LEASE))
    with pytest.raises(CpUsage, match="a lease's own policy applies"):
        plan_copy(lease, None, ["out"], host())
    with pytest.raises(CpUsage, match="a lease's own policy applies"):
        plan_copy(lease, {}, (), host())
    down = Copy(False, "f", Remote("/workspace/f", workspace=WS))
    with pytest.raises(CpUsage, match="--write is for an upload"):
        plan_copy(down, None, ["out"], host())


def test_summary_names_counts_bytes_and_the_transfer():
    result = pb.TransferResult(transfer_id="xfer_1", total_bytes=12, skipped=["/workspace/l: a symlink"],
                               entries=[pb.TransferEntry(path="/workspace/d", kind="dir"),
                                        pb.TransferEntry(path="/workspace/d/a", kind="file")])
    copy = Copy(False, "out", Remote("/workspace/d", workspace=WS))
    plan = SimpleNamespace(remote_path="/workspace/d", local="out\x1b[2J")
    assert summary(copy, plan, result) == ("downloaded 1 file, 1 directory, 12 bytes to out\\u001b[2J "
                                           "(transfer xfer_1), 1 skipped")


# ------------------------------------------------------------------ the command line


def test_the_parser_takes_cp_with_its_options():
    args = build_parser().parse_args(["cp", "-w", "out", "--write", "/workspace/x", "--json", "a", f"{LEASE}:/b"])
    assert (args.src, args.dst, args.write, args.json, args.policy) == ("a", f"{LEASE}:/b", ["out", "/workspace/x"],
                                                                          True, None)


@pytest.mark.parametrize("argv, message", [
    (["cp", "a", "b"], "neither SRC nor DST"),
    (["cp", "missing.txt", f"{LEASE}:/workspace/x"], "missing.txt: no such file or directory"),
    (["cp", "-w", "out", f"{LEASE}:/workspace/x", "here"], "a lease's own policy applies"),
    (["cp", "--policy", "/nonexistent.yaml", f"{LEASE}:/workspace/x", "here"], "nonexistent.yaml"),
])
def test_usage_errors_exit_2_before_connecting(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The socket does not exist: a command that tried to connect would fail otherwise.
    assert cli.main(["--socket", str(tmp_path / "none.sock"), *argv]) == 2
    assert message in capsys.readouterr().err
