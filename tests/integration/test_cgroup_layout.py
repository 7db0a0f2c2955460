"""The host's real cgroup layout (v1 here; v2 in the guest of test_cgroup_v2.py): a
sandbox cgroup is made and limited, a process is born in it, its limits hold, and
it is killed and removed whole."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys

import pytest

from sandboxd.backends import cgroups
from sandboxd.backends.nsjail.compile import NSJAIL_CGROUP_ROOT


@pytest.fixture
def cgroup():
    layout = cgroups.detect()
    assert layout is not None, "no cgroup hierarchy on this host"
    layout.check(NSJAIL_CGROUP_ROOT)
    parent = f"{NSJAIL_CGROUP_ROOT}/test-{secrets.token_hex(4)}"
    name = f"{parent}/sbx"
    layout.make(name)
    yield layout, name
    layout.kill(name, timeout_s=5)
    assert layout.remove(name, timeout_s=5) == []
    for d in layout.dirs(parent):
        os.rmdir(d)


def start(layout, name, argv, **kw) -> subprocess.Popen:
    return layout.popen_in(name)(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_limits_are_written_as_the_layout_spells_them_and_read_back(cgroup):
    layout, name = cgroup
    limits = layout.limits(64 << 20, 16, 50_000, 100_000)
    layout.write_limits(name, limits, {})
    for key, value in limits.items():
        with open(layout.limit_path(name, key)) as f:
            assert f.read().strip() == value, key


def test_a_joined_process_is_born_in_the_cgroup_and_dies_with_it(cgroup):
    layout, name = cgroup
    proc = start(layout, name, ["sleep", "60"])
    try:
        assert proc.pid in layout.procs(name)
        assert os.getpid() not in layout.procs(name)  # the spawner stays where it was
        assert layout.kill(name, timeout_s=5)
        assert proc.wait(5) == -signal.SIGKILL
        assert layout.procs(name) == set()
    finally:
        proc.kill()
        proc.wait()


def test_the_pids_limit_stops_a_fork_bomb(cgroup):
    layout, name = cgroup
    layout.write_limits(name, layout.limits(256 << 20, 8, 0, 100_000), {})
    proc = start(layout, name, ["sh", "-c", "n=0; for i in $(seq 30); do sleep 3 & n=$((n+1)); done; wait"])
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        layout.kill(name, timeout_s=5)
    assert b"fork" in err.lower() or b"resource temporarily unavailable" in err.lower(), err


def test_the_memory_limit_oom_kills_and_is_counted(cgroup):
    layout, name = cgroup
    layout.write_limits(name, layout.limits(32 << 20, 64, 0, 100_000), {})
    proc = start(layout, name, [sys.executable, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])"])
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert layout.oom_kills(name) >= 1
    usage = layout.usage(name)
    assert 0 < usage.peak_memory_bytes <= 33 << 20
