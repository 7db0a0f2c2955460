"""The sandboxes' secrets live on a tmpfs the daemon mounts for itself below its runtime
dir. The old default, a name under world-writable /dev/shm, let any local user keep the
daemon from starting by making that name first (the start-up check refused it, rightly),
or fill /dev/shm so that no secret could be written."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from sandboxd_testing import prepared_call

from .conftest import BACKENDS


def mount_of(path: Path) -> dict | None:
    """The mountinfo entry whose mount point is `path`: its type, options and
    propagation tags; None when nothing is mounted there."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(path):
                sep = fields.index("-")
                return {"options": set(fields[5].split(",")), "tags": fields[6:sep], "type": fields[sep + 1],
                        "super": set(fields[sep + 3].split(","))}
    return None


def secrets_of(d) -> Path:
    return d.base / "runtime" / "secrets"


def test_the_default_secrets_dir_is_a_private_tmpfs_that_goes_with_the_daemon(spare_daemon):
    d = spare_daemon(nsjail={"warm_slots": 0}, credentials={
        "tok": {"env": "SANDBOXD_TEST_DAEMON_SECRET", "principals": ["root"]}}).start()
    where = secrets_of(d)
    m = mount_of(where)
    assert m is not None and m["type"] == "tmpfs"
    assert {"nosuid", "nodev", "noexec"} <= m["options"]
    assert not [t for t in m["tags"] if t.startswith(("shared:", "master:"))]  # private: seen nowhere else
    assert "size=65536k" in m["super"] and "mode=711" in m["super"]
    st = where.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711)
    with d.client() as c:
        for backend in BACKENDS:
            ws = d.new_workspace()
            call = prepared_call(ws, ["sh", "-c", 'test -n "$TOK" && echo has-it'],
                                 {"environment": {"secretEnvAllowed": True}}, runtime={"image": "sandboxd/default:latest", "adapter": backend})
            call["credentialRefs"] = [{"bindingId": "tok", "envName": "TOK"}]
            out = c.run(call)
            assert out.result.status == "success" and out.stdout == b"has-it\n", (backend, out.stderr)
    assert os.listdir(where) == []  # released with each call
    assert d.stop() == 0
    assert mount_of(where) is None  # a graceful stop unmounts what the daemon mounted


def mounts_at_or_under(path: Path) -> dict[str, str]:
    """{mount id: mount point} of every mount at `path` or below it."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(path) or fields[4].startswith(f"{path}/"):
                out[fields[0]] = fields[4]
    return out


FILE_SECRET = "the-killed-runs-secret-31337"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_daemons_tmpfs_is_wiped_and_unmounted_at_the_next_start(spare_daemon, tmp_path, backend):
    """A daemon SIGKILLed while a credentialed call runs leaves its secrets tmpfs mounted,
    the call's secret in it (and the call's persistOutputs tmpfs). The next start wipes
    and unmounts what the dead daemon left and mounts a tmpfs of its own, which its clean
    stop then unmounts: kept instead, the dead run's tmpfs was no run's to unmount, and
    stayed mounted past every later clean stop."""
    source = tmp_path / "token"
    source.write_text(FILE_SECRET + "\n")
    source.chmod(0o600)
    d = spare_daemon(nsjail={"warm_slots": 0}, credentials={"tok": {"file": str(source), "principals": ["root"]}})
    d.start()
    where, outputs = secrets_of(d), d.base / "runtime" / "outputs"
    ws = d.new_workspace()
    call = prepared_call(ws, ["sh", "-c", "cat /tmp/creds/tok; echo; sleep 600"],
                         {"filesystem": {"readRoots": ["/workspace"], "persistOutputs": True}},
                         runtime={"image": "sandboxd/default:latest", "adapter": backend})
    call["credentialRefs"] = [{"bindingId": "tok", "filePath": "/tmp/creds/tok"}]
    c = d.client()
    stream = iter(c.execute(call))
    for event in stream:
        if event.WhichOneof("kind") == "output":
            break
    [sandbox] = os.listdir(where)
    held = os.open(where / sandbox / "0", os.O_RDONLY)  # as a sandbox's bind holds it
    try:
        assert os.pread(held, 100, 0) == (FILE_SECRET).encode()
        dead = mounts_at_or_under(where)
        assert list(dead.values()) == [str(where)]
        assert mounts_at_or_under(outputs), "a persistOutputs call runs on the daemon's tmpfs"
        assert d.proc is not None
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        c.close()
        assert mounts_at_or_under(where) == dead  # what the killed run left

        d.start()
        now = mounts_at_or_under(where)
        assert not set(now) & set(dead), "the killed run's tmpfs is still mounted"
        assert list(now.values()) == [str(where)] and mount_of(where)["type"] == "tmpfs"  # the new run's own
        assert os.pread(held, 100, 0) == b"", "the killed run's secret is still readable"
        assert os.listdir(where) == []
        assert not mounts_at_or_under(outputs), "the killed run's persistOutputs tmpfs is still mounted"
    finally:
        os.close(held)
    assert d.stop() == 0
    assert not mounts_at_or_under(where)  # and a clean stop unmounts the new run's


@pytest.mark.parametrize("place", ["on_disk", "planted_in_dev_shm"])
def test_an_operators_secrets_dir_must_be_a_tmpfs_of_its_own(spare_daemon, tmp_path, place):
    if place == "on_disk":
        chosen = tmp_path / "secrets"
    else:  # the old default's place, taken first by another user (uid 1001)
        chosen = Path("/dev/shm") / f"sandboxd-test-secrets-{os.getpid()}-{tmp_path.name}"
        chosen.mkdir(mode=0o777)
        os.chown(chosen, 1001, 1001)
    try:
        d = spare_daemon(secrets_dir=str(chosen), nsjail={"warm_slots": 0})
        with pytest.raises(RuntimeError) as exc:
            d.start(timeout_s=20)
        expected = "is on ext" if place == "on_disk" else "is owned by uid 1001"
        assert "cannot start: secrets_dir: " in str(exc.value) and expected in str(exc.value)
        assert mount_of(chosen) is None  # nothing mounted over an operator's choice
    finally:
        if place != "on_disk":
            os.rmdir(chosen)
