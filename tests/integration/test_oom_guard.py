"""OomGuard on the host's real cgroup v1 memory controller: a notification ends the
sandbox only when it is an OOM. v1 signals the same eventfd when the cgroup is removed,
and every sandbox's cgroup is removed when it ends: that must not read as an OOM kill."""

from __future__ import annotations

import os
import subprocess
import threading
import uuid

import pytest

from sandboxd.backends.oom_guard import OomGuard

MEMORY_ROOT = "/sys/fs/cgroup/memory"


@pytest.fixture
def memory_cgroup():
    if not os.path.isfile(f"{MEMORY_ROOT}/cgroup.event_control"):
        pytest.fail("this host has no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    path = f"{MEMORY_ROOT}/sandboxd-test-oom-{uuid.uuid4().hex[:8]}"
    os.mkdir(path)
    with open(f"{path}/memory.limit_in_bytes", "w") as f:
        f.write(str(32 << 20))
    yield path
    if os.path.isdir(path):
        os.rmdir(path)


def _run_in(cgroup: str, script: str) -> None:
    subprocess.run(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs; {script}"], check=False, timeout=60)


def test_an_oom_kill_in_the_cgroup_ends_the_sandbox(memory_cgroup):
    ended = threading.Event()
    unwatch = OomGuard().watch(memory_cgroup, ended.set)
    try:
        _run_in(memory_cgroup, "python3 -c 'a = []\nwhile True: a.append(bytearray(4 << 20))'")
        assert ended.wait(5), "no kill after the OOM kill"
    finally:
        unwatch()


def test_removing_the_cgroup_of_a_sandbox_that_ended_is_no_oom(memory_cgroup):
    ended = threading.Event()
    unwatch = OomGuard().watch(memory_cgroup, ended.set)
    try:
        _run_in(memory_cgroup, "true")
        os.rmdir(memory_cgroup)  # still watched, as when the engine removes it first
        assert not ended.wait(1), "the cgroup's removal was taken for an OOM kill"
    finally:
        unwatch()


def test_an_oom_kill_before_the_watch_is_still_caught(memory_cgroup):
    _run_in(memory_cgroup, "python3 -c 'a = []\nwhile True: a.append(bytearray(4 << 20))'")
    ended = threading.Event()
    unwatch = OomGuard().watch(memory_cgroup, ended.set)
    try:
        assert ended.wait(5)
    finally:
        unwatch()
