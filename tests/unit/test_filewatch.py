"""Pure parts of file-access recording: how accesses are classified and counted, and how
the gate shows up in a spec."""

from __future__ import annotations

import pytest

from sandboxd.sandbox.spec import GATE_PATH, SHIM_PATH, Attachments
from sandboxd.recording.filewatch import FAN_CLOSE_WRITE, FAN_MODIFY, FAN_OPEN, MAX_PATHS, Access, FileWatch


def test_an_access_is_a_write_once_anything_modified_it():
    assert Access("/workspace/a", opens=3).operation == "read"
    assert Access("/workspace/a", opens=1, writes=1).operation == "write"


def test_events_are_counted_per_path_and_capped():
    w = FileWatch(1, ("/workspace",))
    w._note("/workspace/a", FAN_OPEN)
    w._note("/workspace/a", FAN_OPEN)
    w._note("/workspace/b", FAN_OPEN | FAN_MODIFY)
    w._note("/workspace/b", FAN_CLOSE_WRITE)
    assert (w.accesses["/workspace/a"].opens, w.accesses["/workspace/a"].writes) == (2, 0)
    assert (w.accesses["/workspace/b"].opens, w.accesses["/workspace/b"].writes) == (1, 2)
    for i in range(MAX_PATHS):
        w._note(f"/workspace/many/{i}", FAN_OPEN)
    assert len(w.accesses) == MAX_PATHS and w.dropped == 2


def test_the_gate_holds_the_command_until_the_watch_is_on():
    att = Attachments("/rt/sandbox-shim", gate_host_path="/rt/gates/sbx-1")
    assert att.needs_shim
    assert att.wrap(("cat", "f")) == (SHIM_PATH, "--gate", GATE_PATH, "--", "cat", "f")
    assert (GATE_PATH, "/rt/gates/sbx-1") in att.binds()
    assert Attachments().wrap(("cat", "f")) == ("cat", "f")


def test_the_mount_id_of_a_descriptor_is_the_kernel_s(tmp_path):
    import ctypes
    import os

    from sandboxd.recording.fanotify import Statx, fdinfo_mount_id, mount_id

    assert ctypes.sizeof(Statx) == 256 and Statx.stx_mnt_id.offset == 144
    for path in (tmp_path, "/proc/self", "/"):
        fd = os.open(path, os.O_RDONLY)
        try:
            assert mount_id(fd) == fdinfo_mount_id(fd) > 0
        finally:
            os.close(fd)


@pytest.mark.parametrize("fid", [False, True])
def test_a_kept_watch_records_each_command_between_begin_and_collect(tmp_path, fid):
    """A warm sandbox's watch stays on between its commands: begin() drops what came
    before, collect() waits for everything queued so far (a real mount, marked as a
    sandbox's mounts are)."""
    import os
    import subprocess

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    for name in ("a", "b", "c"):
        (src / name).write_text(name)
    subprocess.run(["mount", "--bind", str(src), str(mnt)], check=True)
    w = FileWatch(os.getpid(), (str(mnt),), fid=fid)
    try:
        w.start()
        (mnt / "a").read_text()  # an earlier command's (recording off): dropped by begin()
        w.begin()
        (mnt / "b").read_text()
        (mnt / "c").write_text("c2")
        first = w.collect()
        assert [(path, bool(writes)) for path, _, writes in first] == [(f"{mnt}/b", False), (f"{mnt}/c", True)]
        w.begin()
        assert w.collect() == []
        w.begin()
        for _ in range(200):
            (mnt / "a").read_text()
        [(path, opens, writes)] = w.collect()
        assert path == f"{mnt}/a" and 1 <= opens <= 200 and writes == 0
        w.unrecorded()  # a command that is not recorded runs, then a recorded one
        (mnt / "b").read_text()
        w.begin()
        (mnt / "c").read_text()
        assert [x[0] for x in w.collect()] == [f"{mnt}/c"]
        assert [x[0] for x in w.stop()] == [f"{mnt}/c"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_watch_whose_reader_died_answers_at_once_and_says_so(tmp_path, monkeypatch):
    import os
    import subprocess
    import time

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(mnt)], check=True)
    w = FileWatch(os.getpid(), (str(mnt),))
    try:
        w.start()

        def broken():
            raise RuntimeError("the reader fails")

        monkeypatch.setattr(w, "_drain", broken)
        (src / "f").write_text("x")
        (mnt / "f").read_text()  # an event wakes the reader, which dies
        deadline = time.monotonic() + 5
        while w.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not w.alive
        t = time.monotonic()
        w.begin()
        assert w.collect() == [] and w.overflowed  # incomplete, and said so
        assert time.monotonic() - t < 1
    finally:
        w.stop()
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)  # never left behind, busy or not


@pytest.mark.parametrize("fid", [False, True])
@pytest.mark.parametrize("marked", [1, 2])
@pytest.mark.parametrize("held", [True, False])
def test_paths_are_the_sandbox_s_even_when_read_after_its_command_ended(tmp_path, monkeypatch, marked, fid, held):
    """A jail's mount namespace ends with its command, usually before the reader has
    read the last events; the watch holds it until it stops, so the kernel still names
    each file as the sandbox did, also one under a directory named like the mount's own
    path (relative to the mount's root, /mnt0/mnt0/t0 would read as /mnt0/t0). Were the
    namespace not held (`held` False), the reader puts a path named relative to its
    mount back under the mount's sandbox path (by mount id when more than one mount is
    marked): right but for such a twin, which is left out then."""
    import os
    import subprocess
    import threading

    sources = [tmp_path / f"src{i}" for i in range(marked)]
    points = [tmp_path / f"mnt{i}" for i in range(marked)]
    for i, (src, point) in enumerate(zip(sources, points)):
        (src / "sub").mkdir(parents=True)
        (src / "sub" / f"f{i}").write_text(str(i))
        twin = src / str(point).lstrip("/")  # in the sandbox: {point}{point}
        twin.mkdir(parents=True)
        (twin / f"t{i}").write_text(str(i))
        point.mkdir()
    binds = " && ".join(f"mount --bind {s} {p}" for s, p in zip(sources, points))
    expected = sorted(path for i, p in enumerate(points) for path in (f"{p}/sub/f{i}", f"{p}{p}/t{i}")
                      if held or "/sub/" in path)
    reads = " ".join(expected)
    child = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                              f"{binds} && echo up && read go && cat {reads} >/dev/null"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"
        w = FileWatch(child.pid, tuple(str(p) for p in points), fid=fid)
        gone = threading.Event()
        read = w._drain
        monkeypatch.setattr(w, "_drain", lambda: (gone.wait(10), read())[1])  # nothing read before
        w.start()
        if not held:
            os.close(w._ns_fd)
            w._ns_fd = -1
        child.communicate("go\n", timeout=10)
        assert child.returncode == 0
        gone.set()  # the namespace went with its last process: now the reader reads
        assert [(path, writes) for path, _, writes in w.stop()] == [(path, 0) for path in expected]
        assert not w.overflowed and w.dropped == 0 and w.unresolved == 0
        assert w.fid == (fid and marked == 1)  # FID mode watches one mount
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    assert not os.path.ismount(points[0])  # the binds were the child's alone


def test_the_gate_s_arrival_is_its_opening_by_the_sandbox(tmp_path):
    """The shim opens its gate without waiting for the daemon's end of the FIFO; that
    open, and nothing else done to the FIFO, is the sandbox's arrival."""
    import os
    import threading
    import time

    from sandboxd.recording.filewatch import GateArrival

    gate = tmp_path / "gate"
    os.mkfifo(gate, 0o600)
    arrival = GateArrival(str(gate))
    try:
        os.chmod(gate, 0o640)  # attributes, not an open
        assert not arrival.wait(0.05)
        opened: list[int] = []
        opener = threading.Timer(0.1, lambda: opened.append(os.open(gate, os.O_RDONLY | os.O_NONBLOCK)))
        opener.start()
        t = time.monotonic()
        assert arrival.wait(5)
        assert time.monotonic() - t < 1
        opener.join(5)  # the event may arrive before os.open has returned to the opener
        assert opened
        assert arrival.wait(0)  # stays arrived
        os.close(opened[0])
    finally:
        arrival.close()


def test_a_missing_reader_library_is_a_clear_error(monkeypatch, tmp_path):
    from sandboxd.core.settings import FileAuditSettings
    from sandboxd.recording import fanotify_reader, filewatch

    monkeypatch.setattr(fanotify_reader, "_reader", None)
    monkeypatch.setattr(fanotify_reader, "_library_path", None)
    assert filewatch.reader_library_path() == FileAuditSettings.model_validate({}).reader_library  # the default
    filewatch.use_reader_library(tmp_path / "missing.so")  # as the daemon names its setting's path
    assert filewatch.reader_library_path() == tmp_path / "missing.so"
    with pytest.raises(filewatch.FileWatchError, match="make native"):
        filewatch.reader_library()
    with pytest.raises(filewatch.FileWatchError):
        FileWatch(1, ("/workspace",))


def test_in_fid_mode_names_are_the_current_ones_and_a_removed_directory_is_counted(tmp_path, monkeypatch):
    """FID mode: an event names its directory (a handle) and the file; the directory is
    looked up when the event is read. A file deleted by then is named cleanly; a
    directory renamed by then by its new name; one removed by then cannot be named, and
    is counted so that the record says so."""
    import os
    import subprocess
    import threading

    from sandboxd.recording.filewatch import fid_supported

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    for d in ("kept", "old", "gone"):
        (src / d).mkdir(parents=True)
    mnt.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(mnt)], check=True)
    try:
        assert fid_supported(str(src))
        w = FileWatch(os.getpid(), (str(mnt),), fid=True)
        hold, read = threading.Event(), None
        w.start()
        read = w._drain
        monkeypatch.setattr(w, "_drain", lambda: (hold.wait(10), read())[1])  # nothing read yet
        for d in ("kept", "old", "gone"):
            (mnt / d / "f").write_text(d)
        (mnt / "kept" / "f").unlink()
        (mnt / "old").rename(mnt / "new")
        (mnt / "gone" / "f").unlink()
        (mnt / "gone").rmdir()
        hold.set()
        assert [(path, writes > 0) for path, _, writes in w.stop()] == [
            (f"{mnt}/kept/f", True), (f"{mnt}/new/f", True)]
        assert w.unresolved >= 1  # the open and the close-write in "gone" (merged or not)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_fid_mode_is_probed_once_per_filesystem(tmp_path):
    import subprocess

    from sandboxd.recording import fanotify, filewatch

    fanotify.fid_by_device.clear()
    assert filewatch.fid_supported(str(tmp_path)) is True
    assert list(fanotify.fid_by_device.values()) == [True]
    assert filewatch.fid_supported(str(tmp_path / "missing")) is False  # cannot be looked at: fd mode
    # An overlay without nfs_export cannot report directory handles: fd mode there.
    layers = {name: tmp_path / name for name in ("lower", "upper", "work", "merged")}
    for d in layers.values():
        d.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={layers['lower']},upperdir={layers['upper']},workdir={layers['work']}",
                    str(layers["merged"])], check=True)
    try:
        assert filewatch.fid_supported(str(layers["merged"])) is False
        assert sorted(fanotify.fid_by_device.values()) == [False, True]
    finally:
        subprocess.run(["umount", str(layers["merged"])], check=True)


@pytest.mark.parametrize("fid", [False, True])
def test_an_access_that_cannot_be_named_is_counted_not_lost(tmp_path, fid):
    """A path longer than the system's limit (made one directory at a time) cannot be
    read back from the kernel: the event is counted, and the record says so."""
    import os
    import subprocess

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(mnt)], check=True)
    fds = [os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)]
    w = FileWatch(os.getpid(), (str(mnt),), fid=fid)
    try:
        for _ in range(17):  # 17 levels of 250 characters: over PATH_MAX (4096)
            os.mkdir("d" * 250, dir_fd=fds[-1])
            fds.append(os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        w.start()
        os.close(os.open("deep.txt", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fds[-1]))
        os.close(os.open("short.txt", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fds[0]))
        assert [path for path, _, _ in w.stop()] == [f"{mnt}/short.txt"]
        assert w.unnamed >= 1 and w.unresolved == 0
    finally:
        for fd in fds:
            os.close(fd)
        subprocess.run(["rm", "-rf", str(src / ("d" * 250))], check=False)
        subprocess.run(["umount", str(mnt)], check=True)


def test_importing_the_recorder_starts_no_thread_and_loads_nothing():
    """Nothing happens at import: no closer thread (it starts with the first group that
    is closed), no native library loaded."""
    import subprocess
    import sys

    probe = ("import sys, threading\n"
             "before = threading.active_count()\n"
             "import sandboxd.recording.filewatch, sandboxd.recording.live_snapshot\n"
             "from sandboxd.recording import fanotify_reader, libc\n"
             "print(threading.active_count() - before, fanotify_reader._reader is None, libc.libc.cache_info().currsize)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "True", "0"]


def test_the_closer_thread_starts_with_the_first_descriptor_and_closes_it(tmp_path):
    import os
    import threading
    import time

    from sandboxd.recording.closer import DeferredCloser

    closer = DeferredCloser(name="closer-under-test")
    assert not closer.started and "closer-under-test" not in {t.name for t in threading.enumerate()}
    fd = os.open(tmp_path, os.O_RDONLY)
    closer.close_later(fd)
    assert closer.started and "closer-under-test" in {t.name for t in threading.enumerate()}
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/self/fd/{fd}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/self/fd/{fd}")
