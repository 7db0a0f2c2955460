"""backends/staging.py on the real filesystem (as root): roots reopened and bound, masks
placed on the inode preflight found, refusals when anything changed, nothing left."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxd.backends import staging
from sandboxd.sandbox.spec import StagedBind, StagedMask, Staging
from sandboxd.core.errors import FailedPrecondition


def _inode(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def _mounted_below(directory: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(directory))]


@pytest.fixture
def tree(tmp_path):
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data" / "secret.txt").write_text("BLOCKED\n")
    (ws / "data" / "keys").mkdir()
    (ws / "data" / "keys" / "id").write_text("KEY\n")
    (ws / "data" / "ok.txt").write_text("ok\n")
    mask_file = tmp_path / "mask"
    mask_file.touch(mode=0o000)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o711)
    return ws, mask_file, runtime / "mounts" / "sbx-1"


def _staging(ws: Path, mask_file: Path, directory: Path, **inodes) -> Staging:
    data = ws / "data"
    secret = inodes["secret"] if "secret" in inodes else _inode(data / "secret.txt")
    keys = inodes["keys"] if "keys" in inodes else _inode(data / "keys")
    root = inodes["data"] if "data" in inodes else _inode(data)
    masks = (StagedMask(0, "secret.txt", "file", *secret), StagedMask(0, "keys", "dir", *keys))
    return Staging(str(directory), 1000, str(ws), *_inode(ws), (StagedBind(str(data), *root, f"{directory}/0"),),
                   masks, str(mask_file))


def test_a_staged_root_is_the_checked_directory_with_its_masks_pinned(tree):
    ws, mask_file, directory = tree
    staging.stage(_staging(ws, mask_file, directory))
    try:
        staged = directory / "0"
        assert (staged / "ok.txt").read_text() == "ok\n"
        assert (staged / "secret.txt").read_bytes() == b""  # the mask file
        assert not os.listdir(staged / "keys")  # an empty tmpfs
        with pytest.raises(OSError) as exc:
            (staged / "keys" / "x").write_text("x")
        assert exc.value.errno == errno.EROFS
        # The owner can no longer move the blocked content out from under the mask.
        with pytest.raises(OSError) as exc:
            os.rename(ws / "data" / "secret.txt", ws / "data" / "moved.txt")
        assert exc.value.errno == errno.EBUSY
        # The sandbox user's alone to search (nsjail mounts as it); nobody else's, whatever groups they share.
        assert (os.stat(directory).st_mode & 0o777, os.stat(directory).st_uid) == (0o100, 1000)
    finally:
        staging.release(str(directory))
    assert not directory.exists() and not _mounted_below(directory)
    assert (ws / "data" / "secret.txt").read_text() == "BLOCKED\n", "the workspace itself is untouched"


def test_a_blocked_file_replaced_since_preflight_is_refused_and_nothing_stays_mounted(tree):
    ws, mask_file, directory = tree
    checked = _inode(ws / "data" / "secret.txt")
    os.rename(ws / "data" / "secret.txt", ws / "data" / "moved.txt")  # the content moves away...
    (ws / "data" / "secret.txt").write_text("decoy\n")  # ...and a decoy takes its name
    with pytest.raises(FailedPrecondition) as exc:
        staging.stage(_staging(ws, mask_file, directory, secret=checked))
    assert "changed after it was checked" in exc.value.message
    assert not directory.exists() and not _mounted_below(directory)


def test_a_blocked_file_linked_elsewhere_since_preflight_is_refused(tree):
    ws, mask_file, directory = tree
    os.link(ws / "data" / "secret.txt", ws / "data" / "second-name")
    with pytest.raises(FailedPrecondition) as exc:
        staging.stage(_staging(ws, mask_file, directory))
    assert "linked elsewhere" in exc.value.message and not _mounted_below(directory)


@pytest.mark.parametrize("swap", ["symlink", "other directory"])
def test_a_root_swapped_since_preflight_is_refused(tree, tmp_path, swap):
    ws, mask_file, directory = tree
    checked = _inode(ws / "data")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rename(ws / "data", ws / "data.orig")
    if swap == "symlink":
        os.symlink(elsewhere, ws / "data")
    else:
        os.rename(elsewhere, ws / "data")
    with pytest.raises(FailedPrecondition) as exc:
        staging.stage(_staging(ws, mask_file, directory, data=checked, secret=(0, 0), keys=(0, 0)))
    assert "changed after it was checked" in exc.value.message
    assert not directory.exists() and not _mounted_below(directory)


def test_reap_unmounts_what_a_killed_run_left(tree):
    ws, mask_file, directory = tree
    staging.stage(_staging(ws, mask_file, directory))
    assert _mounted_below(directory)
    assert staging.reap(str(directory.parent)) == 1
    assert not _mounted_below(directory) and not directory.exists()
    assert (ws / "data" / "keys" / "id").read_text() == "KEY\n"


PROPAGATION_PROBE = """
import os, subprocess, sys
sys.path[:0] = sys.argv[4:]
from sandboxd.backends import staging
from sandboxd.sandbox.spec import StagedBind, StagedMask, Staging
ws, mask_file, directory = sys.argv[1:4]
subprocess.run(["mount", "--bind", ws, ws], check=True)
subprocess.run(["mount", "--make-shared", ws], check=True)  # as systemd makes /
st = lambda p: (os.lstat(p).st_dev, os.lstat(p).st_ino)
data = os.path.join(ws, "data")
masks = (StagedMask(0, "secret.txt", "file", *st(os.path.join(data, "secret.txt"))),
         StagedMask(0, "keys", "dir", *st(os.path.join(data, "keys"))))
staging.stage(Staging(directory, 1000, ws, *st(ws), (StagedBind(data, *st(data), directory + "/0"),), masks, mask_file))
print(open(os.path.join(data, "secret.txt")).read().strip(), sorted(os.listdir(os.path.join(data, "keys"))))
"""


def test_masks_never_propagate_back_to_the_owners_workspace(tree):
    """On a shared mount a bind is the source's peer: a mask placed on the staged root
    would cover the owner's own file on the host. Run in a mount namespace of its own."""
    ws, mask_file, directory = tree
    paths = [str(Path(staging.__file__).resolve().parents[2]), *sys.path]
    out = subprocess.run(["unshare", "-m", "--propagation", "unchanged", sys.executable, "-c", PROPAGATION_PROBE,
                          str(ws), str(mask_file), str(directory), *paths], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["BLOCKED", "['id']"], "a mask appeared on the workspace itself"


def test_release_never_follows_what_the_sandbox_user_planted(tree, tmp_path):
    """The staging directory is the sandbox user's once made: a symlink it plants there
    (to a mount point of the host's, say) is removed, never unmounted through."""
    ws, mask_file, directory = tree
    staging.stage(_staging(ws, mask_file, directory))
    elsewhere = tmp_path / "host-mount"
    elsewhere.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(elsewhere)], check=True)
    try:
        os.chmod(directory, 0o700)  # its owner may
        os.symlink(elsewhere, directory / "planted")
        staging.release(str(directory))
        assert _mounted_below(elsewhere), "release unmounted the host's mount through the planted link"
        assert not _mounted_below(directory) and not directory.exists()
    finally:
        subprocess.run(["umount", str(elsewhere)], check=False)
