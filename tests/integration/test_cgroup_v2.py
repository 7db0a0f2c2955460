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
from .guests import REPO, Guest

# The guest emulates its CPU (this host's KVM runs no stock kernel), some 25 times
# slower: it runs what the cgroups decide, every test of the backend and of the real
# layout, the conformance tests of limits and of the process tree's life, and the
# pools' tests on nsjail (warm sandboxes born in slots' cgroups, leftovers found there)
# but two.
SELECTION = [
    "tests/integration/test_cgroup_layout.py", "tests/integration/test_nsjail_backend.py",
    "tests/integration/test_execute.py", "tests/integration/test_lifecycle.py", "tests/integration/test_pools.py",
    "-k", "cgroup_layout or nsjail_backend or (test_pools and nsjail) or (nsjail and (lifecycle or timeout or "
          "background or memory or fork_bomb or cpu_quota or cancel or disconnect or success_result or exit_code or "
          "output_flood))",
    # Exports images with dockerd, which the guest has not.
    "--deselect", "tests/integration/test_nsjail_backend.py::"
                  "test_exports_of_images_the_engine_no_longer_has_are_pruned_unless_mounted",
    "--deselect", "tests/integration/test_nsjail_backend.py::test_an_export_is_indexed_under_the_names_dockerd_gives_it",
    # What these show (a leased command's file record, the supervisor's socket) does
    # not change with the cgroup version, and in the guest they took a minute of the
    # suite's 15; the other pools tests still read leased commands' cgroups there.
    *(a for name in ("test_each_leased_command_records_its_own_file_accesses[nsjail]",
                     "test_a_command_cannot_reach_or_impersonate_its_supervisor[nsjail]")
      for a in ("--deselect", f"tests/integration/test_pools.py::{name}")),
]
GUEST_ENV = {"SANDBOXD_TEST_BACKENDS": "nsjail", "CI": "true", "SANDBOXD_TEST_TIME_SCALE": "4"}
GUEST_TIMEOUT_S = 1200


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
              f"exec {sys.executable} -m pytest -q -p no:cacheprovider --junitxml={junit} " + " ".join(
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
    assert len(expected) > 50, expected[:5]

    # It was a v2-only host: one hierarchy line, the limits' controllers offered, no v1 mounts.
    assert (exchange / "cgroup").read_text().strip() == "0::/", detail
    assert {"memory", "pids", "cpu"} <= set((exchange / "controllers").read_text().split()), detail
    assert not {"memory", "pids", "cpuacct"} & set((exchange / "hierarchy").read_text().split()), detail

    assert outcome.returncode == 0, detail
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
