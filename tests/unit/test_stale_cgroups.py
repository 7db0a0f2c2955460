"""Leftover sandbox cgroups of daemons that are gone: removed when empty and old, on the
host's real cgroup hierarchies, under a root of the test's own."""

from __future__ import annotations

import os
import secrets
import subprocess

import pytest

from sandboxd.backends import remove_stale_cgroups

PIDS = "/sys/fs/cgroup/pids"


@pytest.fixture
def root():
    if not os.path.isdir(PIDS):
        pytest.fail("the host has no cgroup v1 pids hierarchy (this suite needs one)")
    name = f"sandboxd-test-{secrets.token_hex(4)}"
    yield name
    for dirpath, _dirs, _files in os.walk(f"{PIDS}/{name}", topdown=False):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


def test_empty_old_cgroups_go_and_those_with_a_process_stay(root):
    base = f"{PIDS}/{root}"
    for d in ("sd-dead/.slot-a", "sd-dead/sbx-1", "sd-live/.slot-b", "sd-live/.slot-c"):
        os.makedirs(f"{base}/{d}")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with open(f"{base}/sd-live/.slot-b/cgroup.procs", "w") as f:
            f.write(str(sleeper.pid))
        assert remove_stale_cgroups((root,), min_age_s=3600) == 0  # all too young
        assert remove_stale_cgroups((root,), min_age_s=0) == 4  # sd-dead's two and itself, .slot-c
        assert [d for d in os.listdir(base) if os.path.isdir(f"{base}/{d}")] == ["sd-live"]
        assert os.path.isdir(f"{base}/sd-live/.slot-b") and not os.path.exists(f"{base}/sd-live/.slot-c")
        assert not os.path.exists(f"{base}/sd-dead")
        assert os.path.isdir(base)  # the root stays
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale_cgroups((root,), min_age_s=0) == 2  # its process gone: .slot-b, then sd-live
    assert not [d for d in os.listdir(base) if os.path.isdir(f"{base}/{d}")]


def test_a_missing_root_is_nothing_to_do():
    assert remove_stale_cgroups((f"sandboxd-test-none-{secrets.token_hex(4)}",), min_age_s=0) == 0
