"""A real daemon refuses to start on a secrets dir another local user prepared for it
(red-team finding 3): bob (uid 1001) made /dev/shm/<name> before the daemon started, so
that every tenant's credentials would have passed through his directory."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import pytest

from .conftest import DAEMON_ENV

BOB = 1001


@pytest.fixture
def shm_place():
    """A fresh name under the real, world-writable, sticky /dev/shm."""
    path = Path("/dev/shm") / f"sandboxd-test-planted-{secrets.token_hex(6)}"
    yield path
    if path.is_symlink():
        path.unlink()
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(str(path) + "-bob", ignore_errors=True)


def start_refused(spare_daemon, secrets_dir: Path) -> str:
    d = spare_daemon(secrets_dir=str(secrets_dir), nsjail={"warm_slots": 0}, credentials={
        "tok": {"env": "SANDBOXD_TEST_DAEMON_SECRET", "principals": ["root"]}})
    with pytest.raises(RuntimeError) as exc:
        d.start(timeout_s=20)
    assert d.proc is not None and d.proc.returncode == 1
    return str(exc.value)


@pytest.mark.parametrize("plant", ["owned_by_bob", "symlink_to_bobs_dir"])
def test_a_planted_secrets_dir_refuses_start_up(spare_daemon, shm_place, plant):
    bobs = shm_place if plant == "owned_by_bob" else Path(str(shm_place) + "-bob")
    bobs.mkdir(mode=0o755)
    os.chown(bobs, BOB, BOB)
    os.chmod(bobs, 0o777)
    if plant == "symlink_to_bobs_dir":
        shm_place.symlink_to(bobs)
    log = start_refused(spare_daemon, shm_place)
    assert "cannot start: secrets_dir: " in log
    assert ("uid 1001" if plant == "owned_by_bob" else "symbolic link") in log
    # Nothing taken over, nothing written.
    st = bobs.stat()
    assert (st.st_uid, st.st_mode & 0o7777) == (BOB, 0o777)
    assert os.listdir(bobs) == []


@pytest.mark.parametrize("setting", ["state_dir", "runtime_dir", "egress.socket_dir"])
def test_a_planted_daemon_dir_refuses_start_up(spare_daemon, tmp_path, setting):
    planted = tmp_path / "planted"
    planted.mkdir()
    os.chown(planted, BOB, BOB)
    key, _, sub = setting.partition(".")
    d = spare_daemon(nsjail={"warm_slots": 0}, **({key: {"socket_dir": str(planted)}} if sub else {key: str(planted)}))
    with pytest.raises(RuntimeError) as exc:
        d.start(timeout_s=20)
    assert f"cannot start: {setting}: {planted} is owned by uid 1001" in str(exc.value)
    assert os.listdir(planted) == []
