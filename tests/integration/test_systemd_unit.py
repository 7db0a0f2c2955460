"""sandboxd as a systemd service on a cgroup v2 host whose dockerd uses systemd's cgroup
driver: the host production runs, which this one is not (hybrid cgroups, no systemd).

So the host is a qemu guest (scripts/cgroup2-vm/run.sh --systemd) that boots systemd on
this host's root filesystem, with cgroup2 alone at /sys/fs/cgroup. In it
(systemd_guest.py) the unit deploy/systemd/sandboxd.service starts the daemon
(Type=notify: `systemctl start` returns once it serves), a Docker call and an nsjail
call run, a memory kill and a pids limit hold on both, and the unit's stop leaves
nothing. The guest emulates its CPU (some 25 times slower than this host), so the whole
story runs in one boot (guests.py), after test_cgroup_v2's guest when both run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxd.backends.nsjail.backend import NsjailBackend
from sandboxd.core.settings import DaemonSettings

from .conftest import BUSYBOX_IMAGE, public_tmpdir
from .guests import REPO, Guest

GUEST_SCRIPT = Path(__file__).with_name("systemd_guest.py")
GUEST_TIMEOUT_S = 1500
UNIT = "/system.slice/sandboxd.service"
# The first test waits for the guest, which may still be queued behind test_cgroup_v2's.
pytestmark = pytest.mark.timeout(2 * GUEST_TIMEOUT_S)


def _prepare() -> tuple[list[str], Path]:
    """On the guests' thread: the guest's dockerd starts empty and has no registry, so
    the image is loaded from a tar made here; nsjail reads the export made here (the
    guest shares this root)."""
    NsjailBackend(DaemonSettings().nsjail.rootfs_dir).image_digest(BUSYBOX_IMAGE)
    exchange = public_tmpdir("sandboxd-systemd-")
    subprocess.run(["docker", "save", "-o", str(exchange / "busybox.tar"), BUSYBOX_IMAGE], check=True, timeout=120)
    os.chmod(exchange / "busybox.tar", 0o644)
    return ["--systemd", str(exchange), "--", sys.executable, str(GUEST_SCRIPT), str(exchange), str(REPO)], exchange


GUEST = Guest("systemd", _prepare, GUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def guest(background_guests) -> dict:
    outcome = background_guests.get("systemd").wait()
    exchange, detail = outcome.exchange, outcome.detail(4000)
    assert outcome.returncode == 0 and (exchange / "result.json").exists(), detail
    result = json.loads((exchange / "result.json").read_text())
    assert "exception" not in result, f"{result['exception']}\n{result.get('journal')}"
    return result


def test_the_unit_starts_the_daemon_in_its_delegated_cgroup(guest):
    assert guest["docker_start"]["rc"] == 0 and guest["docker_driver"] == "systemd 2", guest["docker_driver"]
    assert guest["start"]["rc"] == 0, (guest["start"], guest.get("journal"))
    assert guest["started"]["ActiveState"] == "active" and guest["started"]["SubState"] == "running", guest["started"]
    # systemd delegated the unit's cgroup; the daemon moved itself into its leaf, so the
    # controllers could be enabled for the jails below it, beside it.
    assert guest["delegate"] == "1"
    assert guest["main_cgroup"] == f"0::{UNIT}/daemon"
    assert guest["unit_procs"] == []
    assert {"memory", "pids", "cpu"} <= set(guest["unit_subtree_control"].split())
    assert {"daemon", "sandboxes"} <= set(guest["unit_children"]), guest["unit_children"]
    # The daemon's own level of jails is there (its spawn slots fill in behind the start).
    assert any(re.match(r"/sandboxes/sd-[0-9a-f]+/cgroup\.subtree_control$", p) for p in guest["jails_top"]), guest


@pytest.mark.parametrize("backend", ["docker", "nsjail"])
def test_a_call_runs_on_each_backend_under_the_unit(guest, backend):
    hello = guest[backend]["hello"]
    assert (hello.get("exit_code"), hello.get("stdout"), hello.get("stderr")) == (
        7, "from the workspace\n", "to-stderr\n"), hello


def test_a_docker_sandbox_is_a_slice_of_its_own_under_systemds_driver(guest):
    seen = guest["docker"]["placement"]
    assert re.fullmatch(r"0::/sandboxd\.slice/sandboxd-sbx_[0-9a-f_]+\.slice/docker-[0-9a-f]{64}\.scope",
                        seen["cgroup"]), seen
    assert seen["call"].get("stdout") == "ok\n", seen


def test_a_jail_is_below_the_daemons_delegated_cgroup(guest):
    seen = guest["nsjail"]["placement"]
    assert re.fullmatch(rf"0::{UNIT}/sandboxes/sd-[0-9a-f]+/[.\w-]+", seen["cgroup"]), seen
    assert seen["call"].get("stdout") == "ok\n", seen


@pytest.mark.parametrize("backend", ["docker", "nsjail"])
def test_a_memory_kill_ends_the_whole_call(guest, backend):
    r = guest[backend]["memory"]
    assert r.get("oom_killed") and r.get("exit_code") == 137 and r.get("error_code") == "OOM_KILLED", r
    assert "parent-went-on" not in r.get("stdout", ""), r


@pytest.mark.parametrize("backend", ["docker", "nsjail"])
def test_the_pids_limit_holds(guest, backend):
    r = guest[backend]["pids"]
    started = [int(n) for n in re.findall(r"started (\d+)", r.get("stdout", ""))]
    assert "all-started" not in r.get("stdout", "") and started and max(started) < 8, r
    assert re.search(r"fork|Resource temporarily unavailable", r.get("stderr", ""), re.I), r


def test_stopping_the_unit_leaves_nothing(guest):
    assert guest["stop"]["rc"] == 0 and guest["stopped"]["ActiveState"] == "inactive", guest["stopped"]
    assert guest["stopped"]["Result"] == "success", guest["stopped"]
    after = guest["after_stop"]
    assert not after["unit_cgroup_exists"] and not after["top_level_jails"], after
    assert after["containers"] == "" and after["slices"] == "" and after["slice_dirs"] == [], after
