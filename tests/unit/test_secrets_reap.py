"""secrets.broker.reap_left_tmpfs, what the daemon's start does first where it mounts its
own secrets tmpfs: each tmpfs a killed run left mounted on the secrets dir is wiped and
unmounted; anything else (a directory on a disk, one inside a tmpfs that is not mounted
on it) is left as it is. Real mounts: as root, as the daemon and CI run."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxd.core.mounts import mount, unmount
from sandboxd.secrets.broker import reap_left_tmpfs


@pytest.fixture
def secrets_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("these tests mount: run them as root, as the daemon and CI do")
    base = Path(tempfile.mkdtemp(prefix="sandboxd-reap-", dir="/var/tmp"))  # on a disk
    path = base / "secrets"
    path.mkdir(mode=0o711)
    yield path
    for _ in range(4):
        unmount(str(path))
    shutil.rmtree(base)


def mounted_on(path: Path) -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4] == str(path))


def left_tmpfs(path: Path, secret: bytes) -> int:
    """A tmpfs as a killed run leaves it: a sandbox's directory, its secret file; and a
    descriptor of that file, as a sandbox's bind holds it."""
    mount("tmpfs", str(path), "tmpfs", 0, "mode=0711,size=1m")
    (path / "sbx-1").mkdir(mode=0o711)
    (path / "sbx-1" / "0").write_bytes(secret)
    return os.open(path / "sbx-1" / "0", os.O_RDONLY)


def test_a_killed_runs_tmpfs_is_wiped_then_unmounted(secrets_dir):
    held = left_tmpfs(secrets_dir, b"the-killed-runs-secret")
    try:
        assert reap_left_tmpfs(secrets_dir) == 1
        assert mounted_on(secrets_dir) == 0 and os.listdir(secrets_dir) == []
        assert os.pread(held, 100, 0) == b""  # the inode a bind still holds is empty
    finally:
        os.close(held)


def test_tmpfs_stacked_by_earlier_runs_all_go(secrets_dir):
    held = [left_tmpfs(secrets_dir, b"first"), left_tmpfs(secrets_dir, b"second")]
    try:
        assert mounted_on(secrets_dir) == 2
        assert reap_left_tmpfs(secrets_dir) == 2
        assert mounted_on(secrets_dir) == 0
        assert [os.pread(fd, 100, 0) for fd in held] == [b"", b""]
    finally:
        for fd in held:
            os.close(fd)


def test_a_dir_on_a_disk_or_a_missing_one_is_left_alone(secrets_dir):
    (secrets_dir / "kept").write_text("not the daemon's to wipe")
    assert reap_left_tmpfs(secrets_dir) == 0
    assert (secrets_dir / "kept").read_text() == "not the daemon's to wipe"
    assert reap_left_tmpfs(secrets_dir / "missing") == 0
    assert not (secrets_dir / "missing").exists()


def test_a_dir_inside_a_tmpfs_that_is_not_mounted_on_it_is_left_alone(secrets_dir):
    # A runtime dir on a tmpfs (/run): the secrets dir is on it, never a mount of its own.
    mount("tmpfs", str(secrets_dir), "tmpfs", 0, "mode=0711,size=1m")
    inner = secrets_dir / "runtime-secrets"
    inner.mkdir(mode=0o711)
    (inner / "kept").write_text("x")
    assert reap_left_tmpfs(inner) == 0
    assert (inner / "kept").read_text() == "x" and mounted_on(secrets_dir) == 1
