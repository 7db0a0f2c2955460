"""The nsjail backend on a host whose only cgroup hierarchy is v2.

This host is hybrid (its memory, pids and cpu controllers are bound to v1 by the
environment's init), so the v2 host is a qemu guest (scripts/cgroup2-vm/run.sh) that
boots Debian's kernel on this host's own root filesystem, with cgroup2 mounted at
/sys/fs/cgroup and nothing else: no Docker, no v1 hierarchy. In it, the nsjail tests
that depend on the cgroups run (SELECTION); each must pass, none may be skipped. The
guest is launched by guests.py when this test, one of the suite's last, asks for it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sandboxd.backends.nsjail.backend import NsjailBackend
from sandboxd.core.settings import DaemonSettings

from .conftest import BUSYBOX_IMAGE, DEFAULT_IMAGE, public_tmpdir
from .guests import REPO, Guest, progress

# The guest emulates its CPU (this host's KVM runs no stock kernel), some 25 times
# slower, and emulation's speed varies threefold between machines of one kind: it runs
# only what the cgroup version decides. The limits (memory and its OOM kill, pids, CPU
# quota), the end of a process tree (timeout, cancel, a caller gone, background
# children, a shutdown, a crash's orphans), where jails' cgroups go (the layout, the
# spawn slots, concurrent jails, destroy) and leased commands' cgroups. Namespaces,
# mounts, seccomp and output do not change with it: the host runs those.
_NSJAIL_BACKEND = ("test_timeout_kills_background_children", "test_background_children_end_with_the_command",
                   "test_memory_limit_is_an_oom_kill", "test_fork_bomb_hits_the_pids_limit", "test_cpu_quota",
                   "test_reap_orphans_kills_jails_a_dead_daemon_left", "test_destroy_is_idempotent_and_leaves_nothing",
                   "test_concurrent_jails",
                   "test_jails_start_from_an_nsjail_waiting_in_their_slot_and_a_dead_one_fails_cleanly",
                   "test_a_waiting_nsjail_killed_before_its_call_does_not_fail_the_call")
_PARAMETRIZED = {
    "test_execute.py": ("test_timeout_kills_the_whole_tree_within_a_second", "test_background_children_end_with_the_command",
                        "test_memory_bomb_is_reported_as_oom_killed",
                        "test_fork_bomb_hits_the_pids_limit_and_the_daemon_stays_healthy",
                        "test_client_disconnect_mid_stream_leaves_no_container",
                        "test_a_run_whose_caller_goes_away_is_cancelled_and_leaves_no_sandbox",
                        "test_cancel_rpc_stops_a_running_call", "test_cpu_quota_limits_cpu_time"),
    "test_lifecycle.py": ("test_graceful_shutdown_cancels_calls_and_removes_sandboxes",
                          "test_restart_after_a_crash_reaps_orphaned_sandboxes"),
    "test_pools.py": ("test_commands_in_a_lease_are_calls_of_their_own_and_leave_nothing_running",
                      "test_a_warm_sandbox_that_cannot_start_is_refused_at_once_with_its_reason",
                      "test_a_process_hidden_from_the_supervisor_never_reaches_the_next_command",
                      "test_an_oom_kill_in_a_leased_command_leaves_the_lease_usable"),
}
SELECTION = [
    "tests/integration/test_cgroup_layout.py",
    *(f"tests/integration/test_nsjail_backend.py::{name}" for name in _NSJAIL_BACKEND),
    *(f"tests/integration/{module}::{name}[nsjail]" for module, names in _PARAMETRIZED.items() for name in names),
]
GUEST_ENV = {"SANDBOXD_TEST_BACKENDS": "nsjail", "CI": "true", "SANDBOXD_TEST_TIME_SCALE": "4"}
# This selection takes the guest ~225 s here, its 28 tests ~185 s (the whole nsjail suite's
# 57 took 215 s of tests, and ran past 1,200 s on a slower machine of this kind: emulation's
# speed varies threefold and more). Eight times what this machine needs.
GUEST_TIMEOUT_S = 1800


def _prepare() -> tuple[list[str], Path]:
    """On the guests' thread: the exports, the expected test ids, run.sh's arguments."""
    # The guest has no Docker to export images with: the exports the daemons use (the
    # settings' rootfs_dir) are made here, and the guest reads them.
    rootfs_dir = DaemonSettings().nsjail.rootfs_dir
    exporter = NsjailBackend(rootfs_dir)
    for image in (DEFAULT_IMAGE, BUSYBOX_IMAGE):
        exporter.image_digest(image)
    exchange = public_tmpdir("sandboxd-cgroup2-")
    (exchange / "expected.json").write_text(json.dumps(_collected(SELECTION)))
    junit = exchange / "junit.xml"
    script = (f"cat /proc/self/cgroup > {exchange}/cgroup; cat /sys/fs/cgroup/cgroup.controllers > {exchange}/controllers; "
              f"ls /sys/fs/cgroup > {exchange}/hierarchy; "
              f"exec {sys.executable} -m pytest -v -p no:cacheprovider --junitxml={junit} " + " ".join(
                  f"'{a}'" for a in SELECTION))
    env_args = [a for k, v in {**GUEST_ENV, "SANDBOXD_TEST_ROOTFS_DIR": str(rootfs_dir)}.items()
                for a in ("--env", f"{k}={v}")]
    return [*env_args, str(exchange), "--", "sh", "-c", script], exchange


GUEST = Guest("cgroup_v2", _prepare, GUEST_TIMEOUT_S)


@pytest.mark.timeout(GUEST_TIMEOUT_S + 900)
def test_every_nsjail_test_passes_in_a_guest_whose_only_hierarchy_is_cgroup_v2(background_guests):
    outcome = background_guests.get("cgroup_v2").wait()
    exchange, detail = outcome.exchange, outcome.detail()
    expected = json.loads((exchange / "expected.json").read_text())
    assert len(expected) >= 25, expected[:5]

    # It was a v2-only host: one hierarchy line, the limits' controllers offered, no v1 mounts.
    assert (exchange / "cgroup").read_text().strip() == "0::/", detail
    assert {"memory", "pids", "cpu"} <= set((exchange / "controllers").read_text().split()), detail
    assert not {"memory", "pids", "cpuacct"} & set((exchange / "hierarchy").read_text().split()), detail

    assert outcome.returncode == 0, f"{progress(outcome.log, expected)}\n{detail}"
    suite = ET.parse(exchange / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    ran = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")]
    assert int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0, detail
    assert int(suite.get("skipped")) == 0, detail
    assert len(ran) == len(expected), (len(ran), len(expected), detail)


def _collected(selection: list[str]) -> list[str]:
    """The test ids the guest must run: the selection as collected here with the
    guest's backends."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *selection],
                         cwd=REPO, env={**os.environ, **GUEST_ENV}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if re.match(r"tests/.+::", line)]
