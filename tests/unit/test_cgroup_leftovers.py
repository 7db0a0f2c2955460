"""What is left in cgroups, on the host's real hierarchies under a root of the test's
own: sandbox cgroups of daemons that are gone (removed when empty and old), and a leased
command's processes (found, whatever it did to hide them)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from sandboxd.backends.hostlocks import remove_stale_cgroups

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


def test_what_keep_spares_stays_whatever_its_age(root):
    base = f"{PIDS}/{root}"
    for d in ("sd-running/.slot-a", "sd-gone/.slot-b"):
        os.makedirs(f"{base}/{d}")
    asked = []

    def keep(r: str, name: str) -> bool:
        asked.append((r, name))
        return name == "sd-running"

    assert remove_stale_cgroups((root,), min_age_s=0, keep=keep) == 2  # sd-gone's slot, then itself
    assert os.path.isdir(f"{base}/sd-running/.slot-a") and not os.path.exists(f"{base}/sd-gone")
    assert sorted(set(asked)) == [(root, "sd-gone"), (root, "sd-running")]  # once per name


def test_a_daemon_is_running_while_it_holds_its_lock():
    import fcntl

    from sandboxd.backends.hostlocks import DAEMON_LOCK_DIR
    from sandboxd.backends.hostlocks import daemon_running
    from sandboxd.backends.hostlocks import hold_daemon_lock

    daemon_id = f"sd-test-{secrets.token_hex(6)}"
    assert not daemon_running(daemon_id)  # never started
    fd = hold_daemon_lock(daemon_id)
    try:
        child = subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = {sys.path!r}; "
                                "from sandboxd.backends.hostlocks import daemon_running; "
                                f"print(daemon_running({daemon_id!r}))"], capture_output=True, text=True)
        assert child.stdout.strip() == "True", child.stderr
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert not daemon_running(daemon_id)  # its lock is free: gone
    (DAEMON_LOCK_DIR / f"{daemon_id}.lock").unlink()


def test_a_missing_root_is_nothing_to_do():
    assert remove_stale_cgroups((f"sandboxd-test-none-{secrets.token_hex(4)}",), min_age_s=0) == 0


def test_a_leased_command_cannot_hide_a_process_by_killing_one_the_sandbox_started_with(root):
    """The leftover check trusts the sandbox's task count only while every process it
    started with lives: a command that kills one (the egress forwarder runs as the
    sandbox user) and leaves one of its own behind is found by listing the cgroup, and
    the sandbox is retired. Real processes in a real pids cgroup."""
    from types import SimpleNamespace

    from sandboxd.pools.leftovers import kill_leftovers, sandbox_processes, sandbox_task_count

    cg = f"{PIDS}/{root}/sbx-1"
    os.makedirs(cg)
    procs = []
    pidfds: tuple[int, ...] = ()

    def in_sandbox() -> subprocess.Popen:
        p = subprocess.Popen(["sleep", "60"])
        procs.append(p)
        with open(f"{cg}/cgroup.procs", "w") as f:
            f.write(str(p.pid))
        return p

    try:
        init, forwarder = in_sandbox(), in_sandbox()
        spec = SimpleNamespace(cgroup=f"{root}/sbx-1")
        baseline = sandbox_processes(spec)
        assert baseline == {init.pid, forwarder.pid} and sandbox_task_count(spec) == 2
        pidfds = tuple(os.pidfd_open(p.pid) for p in (init, forwarder))
        clean = kill_leftovers(baseline, pidfds, spec)
        assert clean.clean and clean.intact  # nothing left: the one-file shortcut

        forwarder.kill()
        forwarder.wait()
        hidden = in_sandbox()  # the count is 2 again
        assert sandbox_task_count(spec) == 2
        check = kill_leftovers(baseline, pidfds, spec)
        assert hidden.wait(5) == -9  # found by listing the tree, and killed
        assert not check.clean and not check.intact  # and the sandbox goes
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for fd in pidfds:
            os.close(fd)
